"""How long a step's attention takes to recompute from the KV cache late in a long run (issue 26: "selecting step
7,000 of the live run shows its attention for any layer and head within 200 ms").

`python -m benchmarks.recompute [--tokens N] [--model M] [--dtype D] [--layers 0,15,29] [--repeats R] [--threads T]
[--json]` fills the KV cache with an N-token context (a prefill of N − 1 tokens and one decode step, as a run
leaves it), then times engine.run.recompute for the last position: each layer alone, every layer, every layer
with the logit lens, and layer 0 and the lens answered from the pass through the last layer just before (a layer
switch; the Logit lens panel's request after the Attention panel's); the median of R tries each, in ms, beside the
load average before and after (the machine's other work shows in these times).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

from engine.cliargs import CliError, Parser, add_threads_arg, int_in, int_list

TEXT = ("The lighthouse keeper climbed the stairs each evening, counting the steps, trimming the wick and watching "
        "the ships pass far out on the grey water while the gulls argued on the rocks below. ")


def parser() -> Parser:
    p = Parser(prog="python -m benchmarks.recompute", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int_in(2, 1 << 20), default=7000, help="positions in the cache (default 7000)")
    p.add_argument("--model", default=None, help="a model file, folder or known name; default: SmolLM2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int_list(0, 1 << 10), default=None,
                   help="layers timed alone, comma-separated (default: first, middle, last)")
    p.add_argument("--repeats", type=int_in(1, 1000), default=5)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    add_threads_arg(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(args) -> int:
    import torch

    from engine.loaders import ModelLoadError, load
    from engine.protocol import SamplingParams
    from engine.run.recompute import recompute
    from engine.run.session import Session

    load_before = os.getloadavg()
    try:
        lm = load(args.model, device="cpu", dtype=args.dtype)
    except ModelLoadError as e:
        raise CliError(str(e)) from None
    cfg = lm.cfg
    n = args.tokens
    if n >= cfg.context_length:
        raise CliError(f"--tokens {n} does not fit {lm.info.name}'s context of {cfg.context_length:,} positions")
    layers = args.layers if args.layers is not None else sorted({0, cfg.n_layers // 2, cfg.n_layers - 1})
    if any(i >= cfg.n_layers for i in layers):
        raise CliError(f"--layers: {lm.info.name} has layers 0…{cfg.n_layers - 1}")
    ids = lm.tokenizer.encode(TEXT * (n // 20 + 1)).ids[:n - 1]
    s = Session(lm, threads=args.threads)
    t0 = time.perf_counter()
    out = [e for e in s.generate(ids, SamplingParams(temperature=0.0), 2, ignore_eos=True)]  # prefill, one decode
    fill_s = time.perf_counter() - t0
    ctx = s.cached_ids[:]  # positions 0…n − 1: the last one is the decode step's query
    assert len(ctx) == n, (len(ctx), n, out[-1])
    step = len(ctx) - len(ids)

    def timed(which: Sequence[int], lens_top: int = 0, kept: bool = False) -> float:
        """The median ms of a recompute of `which`: a pass of its own, or (kept) one answered from the pass just
        before it, as a switch to another layer of the step is."""
        times = []
        for _ in range(args.repeats):
            s.recomputed = None
            if kept:
                recompute(s, ctx, step, [cfg.n_layers - 1])
            t = time.perf_counter()
            recompute(s, ctx, step, which, lens_top=lens_top)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    recompute(s, ctx, step, [0])  # first-call costs (the RoPE table, allocations) are not a selection's
    rows = {f"layer {i}": timed([i]) for i in layers}
    rows[f"all {cfg.n_layers} layers"] = timed(range(cfg.n_layers))
    rows[f"all {cfg.n_layers} layers + lens"] = timed(range(cfg.n_layers), lens_top=5)
    rows["layer 0 after the last one"] = timed([0], kept=True)
    rows["the lens after the last layer"] = timed([], lens_top=5, kept=True)
    result = {
        "model": lm.info.name, "dtype": args.dtype, "positions": n, "query_position": n - 1,
        "threads": torch.get_num_threads() if s.threads is None else s.threads.current,
        "fill_s": round(fill_s, 2), "repeats": args.repeats, "median_ms": {k: round(v, 3) for k, v in rows.items()},
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{lm.info.name} ({args.dtype}), KV cache of {n:,} positions (filled in {fill_s:.1f} s), "
          f"query position {n - 1:,}, {result['threads']} thread(s); median of {args.repeats}:")
    for k, v in rows.items():
        print(f"  {k:<30} {v:8.1f} ms")
    print(f"load average before {load_before[0]:.2f}, after {result['loadavg_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
