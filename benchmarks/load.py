"""Decode speed under load: `python -m benchmarks bench-load` prints TPOT with 1 thread, all threads and `auto`, on a
quiet machine, next to one busy loop, and next to a niced multi-threaded Python process — ratios from one run.

The model is loaded once in this process; each configuration is a fresh Session (so `auto` starts from nothing,
as a CLI run does) on the chat prompt, greedy, EOS ignored. Configurations are interleaved (1, N, auto, then
auto, N, 1, …) so slow drifts of the shared machine fall on all of them. Every competitor is started for one
condition only, stopped afterwards, and also ends by itself after `--limit` seconds. The CPU time other processes
(not this one, not the competitor) used during each condition is measured and printed: on a shared machine
"quiet" is only as quiet as that figure says.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from benchmarks.bench import PROMPT, _machine, prompt_ids

COMPETITOR_MT = """
import sys, time, torch
torch.set_num_threads({threads})
a = torch.randn(384, 384)
end = time.time() + {limit}
print("ready", flush=True)
while time.time() < end:
    a = torch.tanh(a @ a)
"""


class Competitor:
    """A load that runs for one condition: None, a `yes` busy loop, or a niced multi-threaded torch loop."""

    def __init__(self, kind: str, limit: float) -> None:
        self.kind, self.proc = kind, None
        if kind == "busy":
            self.proc = subprocess.Popen(["timeout", str(int(limit)), "yes"], stdout=subprocess.DEVNULL)
        elif kind == "multithreaded":
            from engine.model.threads import available_cores

            code = COMPETITOR_MT.format(threads=available_cores(), limit=limit)
            self.proc = subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", code], stdout=subprocess.PIPE,
                                         text=True)
            if self.proc.stdout.readline().strip() != "ready":
                self.stop()
                raise RuntimeError("the multi-threaded competitor did not start")
        time.sleep(0.3 if self.proc else 0.0)  # let the scheduler see it

    def cpu_s(self) -> float:
        """CPU seconds the competitor (with its children) used so far."""
        if self.proc is None:
            return 0.0
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
            return sum(sum(p.cpu_times()[:2]) for p in procs)
        except psutil.Error:
            return 0.0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure(session, threads: str, new_tokens: int, time_limit: float) -> dict:
    """One greedy generation; TPOT over the decode steps (stopped early past `time_limit` seconds)."""
    from engine.events import Finished
    from engine.run.sampling import SamplingParams

    session.forget_cache()
    chat = prompt_ids(session.tokenizer)[1]  # a base model (Gemma 3 270M) has no chat template: plain text
    gen = session.generate(PROMPT, SamplingParams.greedy_params(), new_tokens, chat=chat, ignore_eos=True)
    t0, fin = time.perf_counter(), None
    for ev in gen:
        if time.perf_counter() - t0 > time_limit:
            gen.stop()
        if isinstance(ev, Finished):
            fin = ev
    steps = np.asarray(fin.step_seconds)
    th = session.threads
    return {"threads": threads, "tpot_s": float(steps.mean()), "tpot_p50_s": float(np.median(steps)),
            "steps": len(steps), "ttft_s": fin.ttft_s, "switches": th.switches if th else 0,
            "ended_at_threads": th.current if th else None}


def run(conditions: list[str], new_tokens: int, rounds: int, limit: float, dtype: str, also: str | None = None,
        model: str | None = None) -> dict:
    from engine.loaders import load
    from engine.model.threads import (  # torch: imported when a bench runs, not for every command
        CpuMeter,
        available_cores,
    )
    from engine.run.session import Session

    lms = {None: load(model, device="cpu", dtype=dtype)}
    n_max = available_cores()
    configs = ["1", str(n_max), "auto"]
    if also:  # a second dtype, at one thread and auto, interleaved with the first: "bfloat16:1", "bfloat16:auto"
        lms[also] = load(model, device="cpu", dtype=also)
        configs += [f"{also}:1", f"{also}:auto"]
    lm = lms[None]
    warm = Session(lm, threads=n_max)
    measure(warm, str(n_max), 8, limit)  # first-call costs
    if also:
        measure(Session(lms[also], threads=n_max), str(n_max), 8, limit)
    out: dict = {"machine": _machine(), "model": lm.info.name, "dtype": dtype, "also": also,
                 "new_tokens": new_tokens, "conditions": {}}
    for cond in conditions:
        print(f"condition {cond} …", file=sys.stderr)
        comp = Competitor(cond, limit * len(configs) * rounds + 30)
        try:
            meter, c0 = CpuMeter(), comp.cpu_s()
            wall0 = time.perf_counter()
            runs: dict[str, list[dict]] = {c: [] for c in configs}
            for r in range(rounds):
                for c in configs if r % 2 == 0 else configs[::-1]:
                    dt, _, th = c.rpartition(":")
                    s = Session(lms[dt or None], threads="auto" if th == "auto" else int(th))
                    time.sleep(0.25)  # what a CLI run spends loading: `auto` looks at the machine meanwhile
                    runs[c].append(measure(s, c, new_tokens, limit))
                    print(f"  {c:>14} threads: TPOT {runs[c][-1]['tpot_s'] * 1e3:7.1f} ms", file=sys.stderr)
            wall = time.perf_counter() - wall0
            comp_cores = (comp.cpu_s() - c0) / wall
            others = meter.others_cores()
        finally:
            comp.stop()
        background = None if others is None else max(0.0, others - comp_cores)
        out["conditions"][cond] = {
            "runs": runs, "tpot_s": {c: float(np.mean([x["tpot_s"] for x in v])) for c, v in runs.items()},
            "competitor_cores": comp_cores, "background_cores": background,
        }
    out["ratios"] = ratios(out, n_max)
    return out


def ratios(out: dict, n_max: int) -> dict:
    cond = out["conditions"]
    quiet = cond.get("quiet")
    r = {}
    for name, c in cond.items():  # what auto can control: never slower than the better fixed setting
        t = c["tpot_s"]
        r[f"{name}: auto / best fixed count, same condition"] = t["auto"] / min(t["1"], t[str(n_max)])
        if out.get("also"):
            for th in ("1", "auto"):
                r[f"{name}: {out['also']} / {out['dtype']} at {th} thread(s)"] = t[f"{out['also']}:{th}"] / t[th]
    if quiet:
        one = quiet["tpot_s"]["1"]
        r["quiet: auto / all threads (target ≤ 1.05)"] = quiet["tpot_s"]["auto"] / quiet["tpot_s"][str(n_max)]
        for name, target in (("busy", 1.15), ("multithreaded", 1.5)):
            if name in cond:
                t = cond[name]["tpot_s"]
                r[f"{name}: auto / quiet 1 thread (target ≤ {target})"] = t["auto"] / one
                r[f"{name}: all threads / quiet 1 thread (no adaptation)"] = t[str(n_max)] / one
    return r


def print_report(out: dict) -> None:
    m = out["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; {out.get('model', '')}, {out['dtype']}, "
          f"{out['new_tokens']} new tokens, TPOT mean over interleaved runs")
    for name, c in out["conditions"].items():
        bg = "?" if c["background_cores"] is None else f"{c['background_cores']:.2f}"
        tp = "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in c["tpot_s"].items())
        sw = sum(x["switches"] for x in c["runs"]["auto"])
        print(f"{name:<14}{tp}   (auto switched {sw}×; competitor {c['competitor_cores']:.2f} cores, "
              f"other processes {bg} cores)")
    for k, v in out["ratios"].items():
        print(f"{k:<60}{v:8.2f}")


def cmd_bench_load(a: argparse.Namespace) -> int:
    conditions = [c.strip() for c in a.conditions.split(",") if c.strip()]
    bad = [c for c in conditions if c not in ("quiet", "busy", "multithreaded")]
    if bad or not conditions:
        print(f"error: --conditions takes quiet,busy,multithreaded; got {a.conditions!r}", file=sys.stderr)
        return 2
    new_tokens, rounds = (6, 1) if a.smoke else (a.new_tokens, a.rounds)
    if a.also in ("none", a.dtype):
        a.also = None
    out = run(conditions, new_tokens, rounds, a.limit, a.dtype, a.also, a.model)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print_report(out)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench-load", help="decode TPOT with 1, all and auto threads, quiet and under two loads")
    p.add_argument("--conditions", default="quiet,busy,multithreaded")
    p.add_argument("--model", default=None, help="another model (default: SmolLM2-135M), e.g. gemma3-270m")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of each configuration")
    p.add_argument("--limit", type=float, default=20.0, help="seconds one generation may take before it is cut")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--also", default="bfloat16", choices=["bfloat16", "float32", "none"],
                   help="a second dtype measured at 1 and auto threads in the same run (none: skip)")
    p.add_argument("--smoke", action="store_true", help="6 tokens, one round: only checks that it works")
    p.add_argument("--json", action="store_true")
    p.add_argument("--output", default=None, help="also write the raw results as JSON to this file")
    p.set_defaults(func=cmd_bench_load)
