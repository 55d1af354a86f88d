"""The kernel modes, like for like: `python -m benchmarks kernel-modes [--model gemma3-270m] [--threads N]`.

On one model file, each configuration in its own process (benchmarks.bench's `bench-one`), in interleaved rounds so
that a burst of load on the machine hits every one alike, the best round of each kept:

- the engine in float32 in each kernel mode (exact, file, fast: engine.model.kernel_cache.KERNEL_MODES);
- Hugging Face transformers in float32 on the same file (dequantized by transformers itself): the same computation
  as exact mode;
- llama.cpp on the same file, as it is: the computation the file mode stands for.

Then the ratios that compare like with like: exact against transformers (decode tokens/s, and whether their greedy
tokens agree), the file and fast modes against exact and against llama.cpp (TPOT), and what each fast mode costs in
numbers: engine.why.compare of the same file, exact against that mode, on the same tokens (KL of the output
distributions, mean and max over the steps, and the steps whose top-1 token differs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.bench import PROMPT, BusyMeter, _child, _machine, llama_cpp_python
from engine.cliargs import threads as threads_arg
from engine.model.kernel_cache import KERNEL_MODES

COMPARE_STEPS = 32


def _configs(model: str | None) -> dict[str, list[str]]:
    m = ["--model", model] if model else []
    out = {f"ours-{k}": ["--impl", "ours", "--dtype", "float32", "--kernels", k, *m] for k in KERNEL_MODES}
    out["hf"] = ["--impl", "hf", "--dtype", "float32", *m]
    if llama_cpp_python() is not None:
        out["llama.cpp"] = ["--impl", "llama.cpp", *m]
    return out


def _kl(model: str | None, mode: str, threads: int | str) -> dict:
    """engine.why.compare of the file in exact mode (a) against `mode` (b) on a's greedy continuation."""
    from engine.loaders import load
    from engine.run.session import Session
    from engine.why.compare import compare

    sides = [Session(load(model, device="cpu", dtype="float32", kernels=k), threads=threads)
             for k in ("exact", mode)]
    out = compare(sides[0], sides[1], PROMPT, COMPARE_STEPS)
    steps = [row[-1] for row in out["kl_by_step"]]
    return {"kl_output_mean": out["kl_output"], "kl_output_max": max(steps), "top1_flips": len(out["top1_flips"]),
            "steps": out["steps"], "labels": out["labels"]}


def cmd_kernel_modes(a: argparse.Namespace) -> int:
    threads = str(a.threads)
    n_new, reps, rounds = (8, 1, 1) if a.smoke else (a.new_tokens, a.repeats, a.rounds)
    base = ["--threads", threads, "--new-tokens", str(n_new), "--repeats", str(reps)]
    configs = _configs(a.model)
    busy = BusyMeter()
    results: dict[str, dict | None] = {k: None for k in configs}
    names = list(configs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each round in a rotated order
            print(f"round {r + 1}/{rounds}: {name} …", file=sys.stderr)
            got = _child([*configs[name], *base])
            old = results[name]
            if got is not None and (old is None or got["tpot_s"]["mean"] < old["tpot_s"]["mean"]):
                results[name] = got
    kl = {}
    if not a.smoke:
        for mode in (k for k in KERNEL_MODES if k != "exact"):
            print(f"comparing exact with {mode} on {COMPARE_STEPS} steps …", file=sys.stderr)
            kl[mode] = _kl(a.model, mode, a.threads)
    report = {"machine": _machine(), "model": a.model or "smollm2", "threads": threads, "new_tokens": n_new,
              "rounds": rounds, "results": results, "kl_vs_exact": kl, "other_processes_cores": busy.cores_used(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    report["ratios"] = _ratios(results)
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if a.json else _text(report))
    return 0 if all(results.values()) else 1


def _tpot(x: dict | None) -> float | None:
    return None if x is None else x["tpot_s"]["mean"]


def _ratios(res: dict[str, dict | None]) -> dict:
    out = {}
    exact, hf, llama = res.get("ours-exact"), res.get("hf"), res.get("llama.cpp")
    if exact and hf:
        out["exact_tokens_per_s_over_hf"] = exact["tokens_per_s"] / hf["tokens_per_s"]
        n = min(len(exact["ids"]), len(hf["ids"]))
        same = next((i for i in range(n) if exact["ids"][i] != hf["ids"][i]), n)
        out["exact_greedy_tokens_equal_hf"] = same  # the count of leading tokens that agree
    for mode in ("file", "fast"):
        x = res.get(f"ours-{mode}")
        if x and exact:
            out[f"{mode}_tpot_over_exact"] = _tpot(x) / _tpot(exact)
        if x and llama:
            out[f"{mode}_tpot_over_llama_cpp"] = _tpot(x) / _tpot(llama)
    if exact and llama:
        out["exact_tpot_over_llama_cpp"] = _tpot(exact) / _tpot(llama)
    return out


def _text(r: dict) -> str:
    m = r["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; model {r['model']}, threads "
             f"{r['threads']}, {r['new_tokens']} new tokens, best of {r['rounds']} interleaved rounds; {r['date']}",
             f"{'configuration':<16}{'TTFT':>10}{'TPOT':>10}{'tok/s':>8}"]
    for name, x in r["results"].items():
        if x is None:
            lines.append(f"{name:<16} failed")
            continue
        lines.append(f"{name:<16}{x['ttft_s'] * 1e3:>8.1f}ms{x['tpot_s']['mean'] * 1e3:>8.1f}ms"
                     f"{x['tokens_per_s']:>8.1f}")
    for mode, k in r["kl_vs_exact"].items():
        lines.append(f"exact against {mode}: output KL mean {k['kl_output_mean']:.2e} nats, max "
                     f"{k['kl_output_max']:.2e}; top-1 differs at {k['top1_flips']} of {k['steps']} steps")
    lines.extend(f"{k:<34}{v:>9.3f}" for k, v in r["ratios"].items())
    busy = r["other_processes_cores"]
    lines.append(f"other processes used {busy:.2f} cores during the run"
                 + ("" if busy < 0.15 else " — NOT a quiet machine: compare within this run only"))
    return "\n".join(lines)


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernel-modes", help="each kernel mode against transformers and llama.cpp on the same file")
    p.add_argument("--model", default=None, help="a GGUF file or a known model (default: SmolLM2-135M)")
    p.add_argument("--threads", type=threads_arg, default=1, help="a fixed count (default 1), the same for all")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the best of them is kept)")
    p.add_argument("--smoke", action="store_true", help="one short round, no comparison: the script works")
    p.add_argument("--json", action="store_true")
    p.add_argument("--output", default=None, help="also write the raw results as JSON to this file")
    p.set_defaults(func=cmd_kernel_modes)
