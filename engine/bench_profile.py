"""Where a decode step's time goes: `python -m engine bench-profile` runs decode steps of the default model under
torch's profiler and splits the wall time of a step into the matrix products, the rest of torch's operators
(attention, norms, RoPE, cache writes, activations, residual adds, sampling), and what no operator accounts for
(Python, module calls and torch's dispatch between the operators), per dtype and thread count.

Operators are grouped by name: the products are oneDNN's linear (`mkldnn::_linear_pointwise`), `aten::linear`,
`aten::bmm` outside attention and the int8 kernels; attention is what runs inside `explicit_attention` /
`scaled_dot_product_attention` (its own record_function region). The profiler adds a few µs per operator, so the
operators' times are scaled by (TPOT without the profiler) / (TPOT under it), and the remainder of the unprofiled TPOT
is the Python and dispatch share.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

PRODUCTS = {"mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "aten::_weight_int8pack_mm"}
ATTENTION = "attention"  # the record_function region around a layer's attention (see _attention_regions)


@contextmanager
def _attention_regions():
    """Label each layer's attention call for the profiler, without touching engine.model's code path."""
    import torch

    from engine import model as m

    originals = m.explicit_attention, m.sdpa_attention

    def wrap(fn):
        def inner(*a, **k):
            with torch.profiler.record_function(ATTENTION):
                return fn(*a, **k)
        return inner

    m.explicit_attention, m.sdpa_attention = wrap(originals[0]), wrap(originals[1])
    try:
        yield
    finally:
        m.explicit_attention, m.sdpa_attention = originals


def split(events, steps: int) -> dict:
    """ms per step: products, attention, other operators, from the profiler's top-level operator events."""
    products = attention = other = 0.0
    for e in events:
        if e.cpu_parent is not None:  # only top-level events: a parent's time includes its children's
            continue
        us = e.cpu_time_total
        if e.name == ATTENTION:
            attention += us
        elif e.name in PRODUCTS or e.name == "aten::bmm":
            products += us
        else:
            other += us
    return {k: v / steps / 1e3 for k, v in (("products", products), ("attention", attention), ("other ops", other))}


def profile(dtype: str, threads: int, steps: int, prompt: str) -> dict:
    import torch

    from engine.events import Finished, TokenSampled
    from engine.loaders import load
    from engine.sampling import SamplingParams
    from engine.session import Capture, Session

    lm = load(None, device="cpu", dtype=dtype)
    session = Session(lm, threads=threads)
    greedy = SamplingParams.greedy_params()

    def run() -> float:
        session.forget_cache()
        fin = [e for e in session.generate(prompt, greedy, steps + 1, Capture(), chat=True, ignore_eos=True)][-1]
        assert isinstance(fin, Finished)
        return float(sum(fin.step_seconds) / len(fin.step_seconds))

    run()
    plain = min(run() for _ in range(2))  # TPOT without the profiler
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    stamps: list[float] = []
    with _attention_regions():
        session.forget_cache()
        for ev in session.generate(prompt, greedy, steps + 1, Capture(), chat=True, ignore_eos=True):
            if isinstance(ev, TokenSampled):  # step 0 is the prefill: profile the decode steps after it
                stamps.append(time.perf_counter())
                if ev.step == 0:
                    prof.start()
        prof.stop()
    wall = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3  # ms per decode step under the profiler
    events = prof.events()
    ops = split(events, len(stamps) - 1)
    scale = plain * 1e3 / wall  # the profiler's own cost, spread evenly over what it timed
    parts = {k: v * scale for k, v in ops.items()}
    parts["Python and dispatch between operators"] = max(0.0, plain * 1e3 - sum(parts.values()))
    n_ops = sum(1 for e in events if e.cpu_parent is None) / (len(stamps) - 1)
    return {"dtype": dtype, "threads": threads, "steps": steps, "tpot_ms": plain * 1e3, "tpot_profiled_ms": wall,
            "ms_per_step": parts, "top_level_ops_per_step": n_ops, "ops_ms_unscaled": sum(ops.values())}


def cmd_bench_profile(a: argparse.Namespace) -> int:
    from engine.bench import PROMPT

    out = []
    for dtype in a.dtypes.split(","):
        for threads in (int(t) for t in a.threads.split(",")):
            r = profile(dtype, threads, a.steps, PROMPT)
            out.append(r)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["ms_per_step"].items())
            print(f"{dtype} {threads} thread(s): TPOT {r['tpot_ms']:.1f} ms = {parts} "
                  f"({r['top_level_ops_per_step']:.0f} operators a step)", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench-profile", help="split a decode step's time: products, attention, other operators, "
                                             "Python and dispatch")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--output", default=None, help="write the results as JSON")
    p.set_defaults(func=cmd_bench_profile)
