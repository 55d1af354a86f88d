"""`python -m engine kernels`: which decode product the engine chose for each of the model's weight shapes on this
machine, with every candidate's measured time (engine.model.kernels), the step's chain of products at each thread
count with the most threads `--threads auto` may use by it (engine.model.threads.ChainTiming), and `--remeasure` to
measure again.

Also `forcing`, which `--kernel NAME` on the commands that run the model goes through. Kept apart from
engine.model.kernels so that building the CLI's parser does not import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

from engine.model import kernel_cache


def forcing(name: str | None) -> contextlib.AbstractContextManager:
    """Every decode product through candidate `name` for the duration of a block (nothing when None)."""
    if not name:
        return contextlib.nullcontext()
    from engine.model import kernels

    return kernels.forced(name)


def add_kernel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel", choices=kernel_cache.NAMES, default=None,
                   help="run every decode product through this kernel where it applies, instead of the one "
                        "measured fastest here (for comparisons; see `python -m engine kernels`)")


def _text(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['capability']} kernels); "
             f"measured once, kept in {doc['cache']}"]
    if doc["forced"]:
        lines.append(f"forced: every decode product runs {doc['forced']} where it applies")
    names = [n for n in kernel_cache.NAMES if any(n in r["seconds"] for r in doc["rows"])]
    lines.append(f"{'dtype':<9}{'threads':>8}  {'weight (out × in)':<18}{'count':>6}  {'chosen':<8}"
                 + "".join(f"{n:>16}" for n in names))
    for r in doc["rows"]:
        cells = "".join(
            f"{r['seconds'][n] * 1e6:>8.0f} µs {r['vs_fastest'][n]:4.2f}" if n in r["seconds"] else f"{'—':>16}"
            for n in names)
        kind = "" if r["weights"] == kernel_cache.FLOAT else f" {r['weights']}"
        shape = f"{r['shape'][0]} × {r['shape'][1]}{kind}"
        lines.append(f"{r['dtype']:<9}{r['threads']:>8}  {shape:<18}{r['count']:>6}  {r['choice']:<8}{cells}")
    lines.append("times: median µs for one product of one row (its weight streamed from memory), and ÷ the "
                 "fastest (over 2 ×: its first round only, not measured further); count: the model's weights of that "
                 "shape; q4 (q4-file): weights the file stores quantized, which the int4 (Q4_0/Q4_1/Q4_K) and int8 "
                 "(int4 only) candidates use in the fast (file) kernel mode")
    lines.extend(f"  {n}: {kernel_cache.DESCRIPTIONS[n]}" for n in names)
    lines.extend(t["summary"] for t in doc["threads"])
    ways = [n for n in kernel_cache.ATTENTION_DESCRIPTIONS if any(n in r["seconds"] for r in doc["attention"])]
    if ways:
        lines.append("a decode query's attention, µs per layer at each key count (a step runs the fastest way measured "
                     "at the nearest count; a layer a panel shows, the fastest that forms the weights):")
        lines.append(f"{'dtype':<9}{'threads':>8}  {'heads':<10}{'keys':>6}  {'fastest':<9}{'weights':<9}"
                     + "".join(f"{n:>16}" for n in ways))
        for r in doc["attention"]:
            cells = "".join(f"{r['seconds'][n] * 1e6:>8.0f} µs {r['vs_fastest'][n]:4.2f}" if n in r["seconds"]
                            else f"{'—':>16}" for n in ways)
            heads = "×".join(map(str, r["heads"]))
            lines.append(f"{r['dtype']:<9}{r['threads']:>8}  {heads:<10}{r['keys']:>6}  {r['fastest']:<9}"
                         f"{r['fastest_with_weights']:<9}{cells}")
        lines.extend(f"  {n}: {kernel_cache.ATTENTION_DESCRIPTIONS[n]}" for n in ways)
    return "\n".join(lines)


def cmd_kernels(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.cliargs import CliError
    from engine.loaders import ModelLoadError, load
    from engine.model import kernels, threads

    forced = os.environ.get(kernel_cache.KERNEL_ENV, "").strip()
    if forced and forced.lower() not in kernel_cache.NAMES:
        raise CliError(f"{kernel_cache.KERNEL_ENV}={forced} is not a kernel (valid: {', '.join(kernel_cache.NAMES)}); "
                       "the engine ignores it and runs the measured choice")
    entries, chains, attention = [], [], []
    for dtype in [a.dtype] if a.dtype else ["float32", "bfloat16"]:
        try:
            with kernels.keeping_forms():  # --remeasure measures the quantized candidates again
                lm = load(a.model, device="cpu", dtype=dtype, kernels=a.kernels)  # tunes: reads the cache, or measures
        except ModelLoadError as e:
            raise CliError(str(e)) from None
        entries += lm.model.tune_kernels(remeasure=a.remeasure)
        attention += lm.model.tune_attention()  # (tune_kernels measured it again where asked)
        chain = threads.measured_chain()  # the step's products at each thread count, as tune_kernels measured them
        if chain is not None:
            chains.append({"dtype": chain.dtype, "seconds": {str(n): s for n, s in sorted(chain.seconds.items())},
                           "others_cores": chain.others_cores, "quiet": chain.quiet, "fastest": chain.fastest(),
                           "auto_cap": chain.cap(), "rounds": chain.rounds, "summary": chain.summary()})
        del lm
    doc = {"machine": asdict(kernels.this_machine()), "cache": str(kernel_cache.cache_path()),
           "forced": kernels.forced_name(), "kernels": a.kernels,
           "rows": kernel_cache.rows(entries), "threads": chains,
           "attention": kernel_cache.attention_rows(attention)}
    print(json.dumps(doc, indent=2) if a.json else _text(doc))
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `kernels` to the engine CLI's subparsers."""
    q = sub.add_parser("kernels", help="the decode kernel chosen for each weight shape, with every candidate's time",
                       description="Each decode product runs the kernel measured fastest for its shape, dtype and "
                       "thread count on this machine (measured once at the first load, then read from the cache).")
    q.add_argument("--model", default=None, help="a .gguf file, a Hugging Face model directory or a known model")
    q.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: both")
    from engine.cliargs import add_kernels_arg

    add_kernels_arg(q)
    q.add_argument("--remeasure", action="store_true",
                   help="measure again even where the cache has a result (quiet the machine first)")
    q.add_argument("--json", action="store_true", help="print JSON instead of text")
    q.set_defaults(func=cmd_kernels)
