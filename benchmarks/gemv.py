"""The decode step's matrix–vector products, and decode end to end: `python -m benchmarks bench-gemv`.

Part 1, the kernels the engine chose (engine.model.kernels): the default model is loaded in each dtype (which reads
or makes the engine's choice for every weight shape and thread count), then every candidate is measured again for
every shape, interleaved, over more rounds than at load, streaming the model's own weights of that shape one after
another as a decode step does. Each shape's chosen kernel is set against the fastest one measured in this run
(target: within 10 %), and the whole step's chain of products run the chosen way against each candidate run
everywhere. int8 weights with bf16 activations (`torch._weight_int8pack_mm`, per-row scales, random weights of the
same shapes) stand beside them as what a quantised path could reach; the engine does not run it.

Part 2, decode end to end in the same dtype (each a fresh `benchmarks bench-one` process, the 41-token chat prompt,
128 greedy tokens, best of the repeats): the engine at `auto` threads (twice: before and after the others), at one
and at all threads, and Hugging Face transformers at all threads (its default) and at one. Prints the engine's
decode tokens/s (1 / mean TPOT) against HF's (target ≥ 1.4 ×): `auto` against HF at all threads and at its faster
count (which a busy machine makes one), and each fixed count against HF at the same; and two threads against one
(target: never slower). `--decode-rounds R` runs the configurations R times in rotated order and keeps each one's
best (on a shared machine a change of load then hits each alike); `--no-kernels` skips part 1. It also prints the
CPU's flags, the load average at the start and the end, and the engine's own measurement of the step's products at
each thread count, which caps `--threads auto` (engine.model.threads.ChainTiming).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def measure_choices(dtype: str, counts: list[int], rounds: int, remeasure: bool, kernels_mode: str = "exact") -> dict:
    """Every shape's chosen kernel against every candidate, measured again now; and the chains they make."""
    import torch

    from engine.loaders import load
    from engine.model import kernels

    with kernels.keeping_forms():  # every quantized form stays, to be measured against the choice
        lm = load(None, device="cpu", dtype=dtype, kernels=kernels_mode)  # tunes: its own choice, cached or measured
    if remeasure:
        lm.model.tune_kernels(remeasure=True)
    groups = lm.model.decode_products()
    tdtype = getattr(torch, dtype)
    before, out = torch.get_num_threads(), {}
    try:
        with torch.inference_mode():
            for n in counts:
                torch.set_num_threads(n)
                shapes = []
                for (*shape, weights), products in groups.items():
                    shape = tuple(shape)
                    names = [k for k in kernels.KERNELS if kernels.applicable(k, products[0][0], products[0][2], n,
                                                                              products[0][3])
                             and kernels._works(k, products)]
                    seconds, _ = kernels.choose(names, kernels._timer(products), rounds=rounds, budget_s=None,
                                                prune=None)  # every candidate, every round
                    chosen = kernels.chosen(shape, tdtype, n, weights) or "linear"
                    fastest = min(seconds, key=seconds.get)
                    shapes.append({"shape": list(shape), "weights": weights, "count": len(products),
                                   "chosen": chosen,
                                   "fastest": fastest, "seconds": seconds,
                                   "chosen_over_fastest": seconds[chosen] / seconds[fastest]})
                chain = {"chosen": sum(s["seconds"][s["chosen"]] * s["count"] for s in shapes)}
                for k in kernels.KERNELS:
                    if all(k in s["seconds"] for s in shapes):
                        chain[f"{k} everywhere"] = sum(s["seconds"][k] * s["count"] for s in shapes)
                if dtype == "bfloat16":
                    chain["int8 weights (_weight_int8pack_mm)"] = _int8_chain(groups, rounds)
                out[str(n)] = {"threads": n, "shapes": shapes, "chain_s": chain,
                               "weight_bytes": sum(p[0][0].numel() * p[0][0].element_size() * len(p)
                                                   for p in groups.values()),
                               "bytes_read_chosen": lm.model.decode_weight_bytes_read(n)}  # quantized forms: fewer
    finally:
        torch.set_num_threads(before)
    return out


def _int8_chain(groups: dict, rounds: int) -> float | None:
    """Seconds for the step's products as int8 weights (per-row symmetric scales) times a bf16 row."""
    import torch

    if not hasattr(torch, "_weight_int8pack_mm"):
        return None
    total = 0.0
    for (out_f, in_f, _), products in groups.items():
        q = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8)
        weights = [q.clone() for _ in products]  # distinct copies: streamed from memory, as in decode
        scale = torch.rand(out_f).bfloat16()
        x = torch.randn(1, in_f).bfloat16()
        times = []
        for _ in range(rounds + 1):
            t = time.perf_counter()
            for w in weights:
                torch._weight_int8pack_mm(x, w, scale)
            times.append(time.perf_counter() - t)
        total += statistics.median(times[1:])
    return total


def decode_end_to_end(dtype: str, new_tokens: int, repeats: int, rounds: int = 1) -> dict:
    """The engine at auto / 1 / all threads and HF at all threads and at one, each in a fresh process (benchmarks
    bench-one). `rounds` > 1 runs the configurations again in rotated order (a change of load on a shared machine
    then hits each alike) and keeps each one's best run."""
    from benchmarks.bench import _child
    from engine.model.threads import available_cores

    base = ["--dtype", dtype, "--new-tokens", str(new_tokens), "--repeats", str(repeats)]
    cores = str(available_cores())
    configs = [("ours auto", ["--impl", "ours", "--threads", "auto"]),
               ("ours 1 thread", ["--impl", "ours", "--threads", "1"]),
               (f"ours {cores} threads", ["--impl", "ours", "--threads", cores]),
               (f"hf {cores} threads", ["--impl", "hf", "--threads", cores]),
               ("hf 1 thread", ["--impl", "hf", "--threads", "1"])]
    if rounds == 1:
        configs.append(("ours auto, again", ["--impl", "ours", "--threads", "auto"]))
    runs: dict[str, dict | None] = {name: None for name, _ in configs}
    every: dict[str, list[float]] = {name: [] for name, _ in configs}
    for r in range(rounds):
        for name, args in [*configs[r % len(configs):], *configs[: r % len(configs)]]:
            print(f"  decode: {name} (round {r + 1} of {rounds}, load average {os.getloadavg()[0]:.1f}) …",
                  file=sys.stderr)
            got = _child([*args, *base])
            if got is None:
                continue
            every[name].append(got["tpot_s"]["mean"])
            if runs[name] is None or got["tpot_s"]["mean"] < runs[name]["tpot_s"]:
                runs[name] = {"tpot_s": got["tpot_s"]["mean"], "ttft_s": got["ttft_s"],
                              "threads_at_end": got.get("threads_at_end"), "text": got.get("text")}
    ratios = {}
    auto = [runs[k]["tpot_s"] for k in ("ours auto", "ours auto, again") if runs.get(k)]
    hf, one, many = runs[f"hf {cores} threads"], runs["ours 1 thread"], runs[f"ours {cores} threads"]
    if auto and hf:
        ratios["decode_tokens_per_s_vs_hf"] = hf["tpot_s"] / statistics.mean(auto)
    hf_best = min((r["tpot_s"] for k, r in runs.items() if k.startswith("hf") and r), default=None)
    if auto and hf_best:
        ratios["decode_tokens_per_s_vs_hf_faster_threads"] = hf_best / statistics.mean(auto)
    if many and hf:
        ratios["decode_tokens_per_s_vs_hf_same_threads"] = hf["tpot_s"] / many["tpot_s"]
    hf_one = runs["hf 1 thread"]
    if one and hf_one:
        ratios["decode_tokens_per_s_vs_hf_one_thread"] = hf_one["tpot_s"] / one["tpot_s"]
    if one and many:
        ratios["tpot_all_threads_over_one"] = many["tpot_s"] / one["tpot_s"]
    if one and auto:
        ratios["tpot_auto_over_one"] = statistics.mean(auto) / one["tpot_s"]
    return {"dtype": dtype, "new_tokens": new_tokens, "rounds": rounds, "runs": runs, "every_tpot_s": every,
            "ratios": ratios, "threads": _thread_choice(dtype)}


def _thread_choice(dtype: str) -> str | None:
    """The engine's own measurement of the step's products at each thread count (what caps `auto`), as its children
    made or read it at load: the newest on this CPU in this dtype (engine.model.threads.ChainTiming)."""
    from engine.model import threads
    from engine.model.kernel_cache import this_cpu

    cpu, cores = this_cpu()
    counts = set(threads.decode_thread_counts())  # not a chain of a process that had fewer threads
    mine = [t for t in threads.read_chains().values()
            if t.cpu == cpu and t.cores == cores and t.dtype == dtype and set(t.seconds) == counts]
    return max(mine, key=lambda t: t.measured_at).summary() if mine else None


def _machine_line() -> str:
    """The CPU, its vector flags (benchmarks.llamacpp.cpu_flags), cores and the load average."""
    from benchmarks.llamacpp import cpu_flags
    from engine.model.kernel_cache import this_cpu
    from engine.model.threads import available_cores

    one, five, _ = os.getloadavg()
    return (f"CPU: {this_cpu()[0]}; flags: {cpu_flags()}; {available_cores()} cores; load average {one:.1f} (1 min), "
            f"{five:.1f} (5 min)")


def _print(res: dict) -> None:
    m = res["machine"]
    print(f"bench-gemv on {m['cpu']} ({m['cores']} cores, {m['capability']} kernels), torch {m['torch']}")
    print(res["machine_at_start"])
    for dtype, by_threads in res["kernels"].items():
        for r in by_threads.values():
            names = [k for k in res["candidates"] if any(k in s["seconds"] for s in r["shapes"])]
            print(f"\n{dtype}, {r['threads']} thread(s): µs per product, median of {res['rounds']} interleaved rounds")
            print(f"  {'weight (out × in)':<18}{'count':>6}  {'chosen':<8}{'fastest':<9}{'chosen ÷ fastest':>17}"
                  + "".join(f"{n:>10}" for n in names))
            for s in r["shapes"]:
                shape = f"{s['shape'][0]} × {s['shape'][1]}" + ("" if s["weights"] == "float" else f" {s['weights']}")
                mark = "" if s["chosen_over_fastest"] <= 1.10 else "  over 10 %"
                ratio = s["chosen_over_fastest"]
                print(f"  {shape:<18}{s['count']:>6}  {s['chosen']:<8}{s['fastest']:<9}{ratio:>16.2f}×"
                      + "".join(f"{s['seconds'][n] * 1e6:>10.0f}" if n in s["seconds"] else f"{'—':>10}"
                                for n in names) + mark)
            chosen = r["chain_s"]["chosen"]
            read = r.get("bytes_read_chosen", r["weight_bytes"])
            print(f"  the step's chain of products ({r['weight_bytes'] / 1e6:.0f} MB of float weights): chosen "
                  f"{chosen * 1e3:.1f} ms, reading {read / 1e6:.0f} MB ({read / chosen / 1e9:.1f} GB/s); " + "; ".join(
                      f"{k} {v * 1e3:.1f} ms ({v / chosen:.2f}×)" for k, v in r["chain_s"].items()
                      if k != "chosen" and v is not None))
    worst = max((s["chosen_over_fastest"] for d in res["kernels"].values() for r in d.values() for s in r["shapes"]),
                default=None)
    if worst is not None:
        print(f"\nworst chosen ÷ fastest over every shape: {worst:.2f}× (target ≤ 1.10×)")
    e = res.get("decode")
    if e:
        print(f"\ndecode end to end, {e['dtype']}, {e['new_tokens']} greedy tokens, {e.get('rounds', 1)} round(s) "
              "(mean TPOT of the best run):")
        for name, r in e["runs"].items():
            every = ", ".join(f"{t * 1e3:.0f}" for t in e.get("every_tpot_s", {}).get(name, []))
            print(f"  {name:<22}" + ("failed" if r is None else
                                      f"TPOT {r['tpot_s'] * 1e3:6.1f} ms  ({1 / r['tpot_s']:5.1f} tokens/s)"
                                      f"  ended on {r['threads_at_end']} thread(s); every run: {every} ms"))
        if e.get("threads"):
            print(f"  the engine's thread measurement: {e['threads']}")
        for k, v in e["ratios"].items():
            print(f"  {k:<40}{v:6.2f}")
        print("  targets: decode_tokens_per_s_vs_hf… ≥ 1.4; tpot_all_threads_over_one ≤ 1.0")
    print(res["machine_at_end"])
    print(f"other processes used {res['other_processes_cores']:.2f} cores during the run", file=sys.stderr)


def cmd_bench_gemv(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from benchmarks.bench import BusyMeter
    from engine.loaders import preferred_dtype
    from engine.model import kernels
    from engine.model.threads import decode_thread_counts

    busy = BusyMeter()
    rounds = 3 if a.smoke else a.rounds
    dtypes = [a.dtype] if a.dtype else ["float32", "bfloat16"]
    res = {"machine": asdict(kernels.this_machine()), "machine_at_start": _machine_line(), "rounds": rounds,
           "candidates": list(kernels.KERNELS),
           "kernel_mode": a.kernels,
           "kernels": {} if a.no_kernels else {
               dt: measure_choices(dt, decode_thread_counts(), rounds, a.remeasure, a.kernels) for dt in dtypes}}
    if not a.smoke and not a.no_decode:
        res["decode"] = decode_end_to_end(a.decode_dtype or preferred_dtype("cpu"), a.new_tokens, a.repeats,
                                          a.decode_rounds)
    res["other_processes_cores"] = busy.cores_used()
    res["machine_at_end"] = _machine_line()
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        _print(res)
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench-gemv", help="each weight shape's chosen decode kernel against the fastest measured now; "
                                          "decode against Hugging Face transformers")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds per shape (after one warm-up)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="kernels: default both")
    p.add_argument("--remeasure", action="store_true", help="let the engine measure its choice again first")
    p.add_argument("--kernels", default="exact", choices=["exact", "file", "fast"],
                   help="the kernel mode whose candidates are measured (fast: the int4 and int8 forms too)")
    p.add_argument("--no-decode", action="store_true", help="skip the end-to-end decode comparison")
    p.add_argument("--no-kernels", action="store_true", help="skip the per-shape kernels (part 1): decode only")
    p.add_argument("--decode-rounds", type=int, default=1,
                   help="end to end: run every configuration this many times in rotated order, keep each one's best")
    p.add_argument("--decode-dtype", default=None, choices=["float32", "bfloat16"],
                   help="end to end: default the app's dtype on this CPU")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench_gemv)
