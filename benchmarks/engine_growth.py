"""The engine alone over a long greedy run, headless: `python -m benchmarks.engine_growth MODE N [DTYPE]` prints one
JSON line with the process's RSS growth and the mean TPOT of the last 50 steps at eight points of the run, and the
TPOT of the first and the last tenth.

MODE `app` captures what the app asks for on every step (the last layer's attention, residual norms, the funnel,
the full logits, the logit lens, every layer while the context is under 512 positions); `none` captures nothing (the
CLI's run). DTYPE: float32, bfloat16 or auto (default; float32 on a CPU). The default model, the long-run prompt of
benchmarks.longrun. Run it on a quiet machine: the times are wall-clock.
"""

from __future__ import annotations

import json
import sys

import psutil

from engine.events import TokenSampled
from engine.loaders import load
from engine.protocol import Capture, SamplingParams
from engine.run.session import Session

PROMPT = "Write a long story about a lighthouse keeper."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in ("app", "none"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, n = argv[0], int(argv[1])
    lm = load(None, dtype=argv[2] if len(argv) > 2 else "auto")
    last = lm.cfg.n_layers - 1
    cap = Capture() if mode == "none" else Capture(attention_layers=frozenset({last}), residual_norms=True,
                                                    funnel_top=20, logits=True, lens_top=5, every_layer_below=512)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t: list[float] = []
    rows = []
    for ev in Session(lm).generate(PROMPT, SamplingParams(temperature=0.0), n, cap, chat=True, ignore_eos=True):
        if isinstance(ev, TokenSampled):
            t.append(ev.seconds)
            if len(t) % max(1, n // 8) == 0:
                rows.append({"step": len(t), "rss_growth_mib": round((proc.memory_info().rss - rss0) / 2**20, 1),
                             "tpot_ms_last_50": round(1e3 * sum(t[-50:]) / len(t[-50:]), 1)})
    k = max(2, len(t) // 10)
    print(json.dumps({"mode": mode, "dtype": str(lm.dtype), "tokens": len(t), "points": rows,
                      "tpot_ms_first_tenth": 1e3 * sum(t[1:k]) / (k - 1),  # step 0 is the prefill
                      "tpot_ms_last_tenth": 1e3 * sum(t[-k:]) / k}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
