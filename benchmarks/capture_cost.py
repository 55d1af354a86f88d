"""What the app's captures cost the engine's decode, in one run: `python -m benchmarks.capture_cost [--models
smollm2,1b] [--tokens 128] [--rounds 3]` prints one JSON line per model.

Three captures, each a generation of the same greedy tokens on one loaded session, interleaved round by round (none,
shown, record, then again) so a shared machine's drift falls on all three:
  none    nothing captured (the CLI's run);
  shown   what the app's panels show by default: the last layer's attention, the residual norms, the funnel and the
          raw logits (app.panels.generation.capture_for with a long prompt);
  record  `shown` plus every layer's attention while the context is under 512 positions, the record a short run's
          session keeps (Capture.every_layer_below; the engine process holds the layers no panel shows:
          engine.server.ForTheRecord).
For each: the median TPOT over rounds, and its ratio to `none` within each round (the median of those). Models:
`smollm2` the default model at the app's dtype on the torch engine, `smollm2-lcpp` its Q4_1 GGUF on llama.cpp, `1b`
the 1B-scale Q4_0 file of benchmarks.llamacpp on llama.cpp (built there first). Threads: the engine's `auto`.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

PROMPT = "Explain what a KV cache is in two sentences."


def _session(model: str):
    from engine.loaders import default_model_path, load, preferred_dtype

    if model == "smollm2":
        from engine.run.session import Session

        return Session(load(default_model_path(), device="cpu", dtype=preferred_dtype("cpu")))
    from engine.backends.llamacpp import LlamaCppSession

    if model == "1b":
        from benchmarks.llamacpp import big_path

        path = big_path("Q4_0")
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `python -m benchmarks.llamacpp --models 1b` once to build it")
    else:
        path = default_model_path()
    return LlamaCppSession(str(path), n_ctx=1024)


def measure(model: str, tokens: int, rounds: int) -> dict:
    from engine.events import Finished
    from engine.protocol import FUNNEL_TOP, Capture, SamplingParams

    s = _session(model)
    last = s.cfg.n_layers - 1
    shown = Capture(attention_layers=frozenset({last}), residual_norms=True, funnel_top=FUNNEL_TOP, logits=True)
    captures = {"none": Capture(), "shown": shown, "record": Capture(
        attention_layers=shown.attention_layers, residual_norms=True, funnel_top=FUNNEL_TOP, logits=True,
        every_layer_below=512)}
    try:
        prompt = s.tokenize(PROMPT, True)
    except ValueError:  # a base model without a chat template
        prompt = s.tokenize(PROMPT, False)
    tpot: dict[str, list[float]] = {k: [] for k in captures}
    for _ in range(rounds):
        for name, capture in captures.items():
            fin = [e for e in s.generate(prompt, SamplingParams.greedy_params(), tokens, capture=capture,
                                         ignore_eos=True) if isinstance(e, Finished)][0]
            tpot[name].append(fin.tpot_s * 1e3)
    none = np.asarray(tpot["none"])
    return {"model": model, "tokens": tokens, "rounds": rounds, "load_avg": os.getloadavg(),
            **{f"tpot_ms_{k}": round(float(np.median(v)), 2) for k, v in tpot.items()},
            **{f"{k}_over_none": round(float(np.median(np.asarray(v) / none)), 3)
               for k, v in tpot.items() if k != "none"}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    models = argv[argv.index("--models") + 1].split(",") if "--models" in argv else ["smollm2"]
    tokens = int(argv[argv.index("--tokens") + 1]) if "--tokens" in argv else 128
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    from engine.model.kernel_cache import cpu_model

    for model in models:
        print(json.dumps({"cpu": cpu_model(), **measure(model, tokens, rounds)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
