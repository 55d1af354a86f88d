"""The app on llama.cpp against plain llama.cpp, end to end, in one run: `python -m benchmarks.app_vs_llama [--model
PATH] [--tokens 64] [--rounds 2] [--without-lens]` prints one JSON line.

Each round runs, each in a fresh process and in turn (so a shared machine's drift falls on both):
  app     `python -m benchmarks.gui --model PATH --tokens N --lens`: the window as users run it, every panel on
          screen, the logit lens on (unless --without-lens), and the time per token from the first token to the last
          as the GUI thread received them (every capture, the lens, the events' trip and the panels' work included);
  Llama   plain llama_cpp.Llama on the same file and prompt, greedy, the same thread count (benchmarks.llamacpp's
          worker): its time per token from the first token to the last as its caller received them.
It prints each side's median and the app ÷ Llama ratio of each round. The default model is the 1B-scale Q4_0 file of
benchmarks.llamacpp (built there: `python -m benchmarks.llamacpp --models 1b`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np


def _json(cmd: list[str]) -> dict:
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr.strip().splitlines()[-3:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    from benchmarks.llamacpp import big_path
    from engine.model.kernel_cache import cpu_model
    from engine.model.threads import available_cores

    model = argv[argv.index("--model") + 1] if "--model" in argv else str(big_path("Q4_0"))
    tokens = int(argv[argv.index("--tokens") + 1]) if "--tokens" in argv else 64
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    threads = available_cores()  # what the app's llama.cpp runtime takes at its default, "auto"
    app, plain = [], []
    for _ in range(rounds):
        lens = [] if "--without-lens" in argv else ["--lens"]
        a = _json(["-m", "benchmarks.gui", "--model", model, "--tokens", str(tokens), *lens])
        if a.get("runtime") != "llama.cpp":
            raise SystemExit(f"the app ran {model} on {a.get('runtime')!r}, not llama.cpp")
        app.append(a)
        plain.append(_json(["-m", "benchmarks.llamacpp", "--worker", "Llama", "--model-path", model, "--tokens",
                            str(tokens), "--n-ctx", "1024", "--threads", str(threads)]))
    ratios = [a["wall_ms_per_token_received"] / (p["e2e_s"] * 1e3) for a, p in zip(app, plain, strict=True)]
    print(json.dumps({
        "cpu": cpu_model(), "model": os.path.basename(model), "tokens": tokens, "rounds": rounds, "threads": threads,
        "lens": "--without-lens" not in argv,
        "load_avg": os.getloadavg(),
        "app_ms_per_token": [round(a["wall_ms_per_token_received"], 2) for a in app],
        "app_gui_thread_cpu_ms_per_token": [round(a["gui_thread_cpu_ms_per_token_while_generating"], 2) for a in app],
        "llama_ms_per_token": [round(p["e2e_s"] * 1e3, 2) for p in plain],
        "app_over_llama": [round(r, 3) for r in ratios], "median_app_over_llama": round(float(np.median(ratios)), 3),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
