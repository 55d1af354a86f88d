"""TPOT of the CLI's greedy decode with each kernel choice, in interleaved rounds: the float path (`--kernel linear`;
`--kernel onednn`, the other float candidate that applies to every shape), the tuner's choice, and the int4 and int8
paths forced (issue 27: the tied LM head's quantized form).

    flock /tmp/bench.lock nice -n 0 .venv/bin/python -m benchmarks.quant_head --model gemma3-270m --threads 1

Each run is `python -m engine generate ... --temperature 0 --ignore-eos --json` in its own process (load included,
TPOT taken from the run's own Finished event); a round runs every choice once, the order rotated each round, so a
burst of load on the machine falls on every choice alike. Appends one record (the runs, the load average before and
after, each choice's median and its ratio to the float path's median) to benchmarks/quant-head.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).with_name("quant-head.json")
CHOICES = ("linear", "onednn", "tuned", "int4", "int8")  # tuned: no --kernel (the measured choice)
PROMPT = "The capital of France is"


def run_once(model: str, threads: str, choice: str, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "engine", "generate", "--model", model, "--device", "cpu", "--prompt", PROMPT,
           "--temperature", "0", "--max-new-tokens", str(tokens), "--ignore-eos", "--threads", threads, "--json"]
    if choice != "tuned":
        cmd += ["--kernel", choice]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    return {"choice": choice, "tpot_s": doc["tpot_s"], "ttft_s": doc["ttft_s"], "ids": doc["ids"]}


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", default="1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    before, started = loadavg(), time.time()
    runs = []
    for r in range(a.rounds):
        for choice in CHOICES[r % len(CHOICES):] + CHOICES[: r % len(CHOICES)]:
            runs.append({"round": r, **run_once(a.model, a.threads, choice, a.tokens)})
            print(f"round {r} {choice:>6}: TPOT {runs[-1]['tpot_s'] * 1e3:.1f} ms", file=sys.stderr)
    median = {c: statistics.median(x["tpot_s"] for x in runs if x["choice"] == c) for c in CHOICES}
    ids = {c: next(x["ids"] for x in runs if x["choice"] == c) for c in CHOICES}
    record = {
        "command": f"python -m benchmarks.quant_head --model {a.model} --threads {a.threads} --rounds {a.rounds} "
                   f"--tokens {a.tokens}",
        "model": a.model, "threads": a.threads, "tokens": a.tokens, "prompt": PROMPT,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "loadavg_before": before, "loadavg_after": loadavg(),
        "median_tpot_s": median, "vs_linear": {c: median[c] / median["linear"] for c in CHOICES},
        # per round, each choice against the float run of the same round (the interleaved pairs)
        "pair_ratios": {c: [x["tpot_s"] / next(y["tpot_s"] for y in runs if y["round"] == x["round"]
                                                and y["choice"] == "linear")
                            for x in runs if x["choice"] == c] for c in CHOICES if c != "linear"},
        "greedy_equal_to_linear": {c: ids[c] == ids["linear"] for c in CHOICES},
        "runs": [{k: v for k, v in x.items() if k != "ids"} for x in runs],
    }
    doc = json.loads(OUT.read_text()) if OUT.exists() else []
    OUT.write_text(json.dumps([*doc, record], indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("command", "loadavg_before", "loadavg_after", "vs_linear",
                                             "pair_ratios", "greedy_equal_to_linear")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
