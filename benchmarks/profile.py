"""Where a decode step's time goes: `python -m benchmarks bench-profile` runs decode steps of the default model and
splits the wall time of a step into the matrix products, attention, and the rest (norms, RoPE, cache writes,
activations, residual adds, sampling, and the Python and dispatch between all of them), per dtype and thread count.

The products and attention are timed where the model calls them (engine.model.transformer.linear, explicit_attention,
sdpa_attention), with a clock read before and after each call (~0.1 µs; torch's profiler was tried and adds tens
of µs per operator, more than many operators take). torch's profiler only counts the operators a step runs.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager


@contextmanager
def _timed(spent: dict[str, float]):
    """Accumulate the seconds spent in the model's products and attention calls while the block runs."""
    from engine.model import transformer as m

    originals = {"linear": m.linear, "explicit_attention": m.explicit_attention, "sdpa_attention": m.sdpa_attention}

    def wrap(fn, key):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0
        return inner

    m.linear = wrap(originals["linear"], "products")
    m.explicit_attention = wrap(originals["explicit_attention"], "attention")
    m.sdpa_attention = wrap(originals["sdpa_attention"], "attention")
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(m, name, fn)


def profile(dtype: str, threads: int, steps: int, prompt: str) -> dict:
    import torch

    from engine.events import Finished, TokenSampled
    from engine.loaders import load
    from engine.run.sampling import SamplingParams
    from engine.run.session import Capture, Session

    lm = load(None, device="cpu", dtype=dtype)
    session = Session(lm, threads=threads)
    greedy = SamplingParams.greedy_params()

    def decode(spent: dict[str, float] | None = None) -> float:
        """One generation; TPOT over its decode steps (the prefill's products and attention left out of `spent`)."""
        session.forget_cache()
        fin = None
        for ev in session.generate(prompt, greedy, steps + 1, Capture(), chat=True, ignore_eos=True):
            if isinstance(ev, TokenSampled) and ev.step == 0 and spent is not None:
                spent.update(dict.fromkeys(spent, 0.0))  # from here on: decode steps only
            if isinstance(ev, Finished):
                fin = ev
        return float(sum(fin.step_seconds) / len(fin.step_seconds))

    decode()
    tpot = min(decode() for _ in range(2))
    spent = {"products": 0.0, "attention": 0.0}
    with _timed(spent):
        timed_tpot = decode(spent)
    n_steps = steps  # decode steps after the prefill
    parts = {k: v / n_steps * 1e3 for k, v in spent.items()}
    parts["everything else"] = max(0.0, timed_tpot * 1e3 - sum(parts.values()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode()
    n_ops = sum(1 for e in prof.events() if e.cpu_parent is None) / (steps + 1)
    return {"dtype": dtype, "threads": threads, "steps": steps, "tpot_ms": tpot * 1e3,
            "tpot_timed_ms": timed_tpot * 1e3, "ms_per_step": parts, "operators_per_step": n_ops}


def decode_attention(threads: int = 1, keys: tuple[int, ...] = (50, 1000, 4000), repeats: int = 200) -> dict:
    """µs per layer of one bfloat16 decode query's attention, three ways, on the default model's head shapes:
    torch's fused kernel, two bf16 products, and two float32 products on upcast copies (what the engine runs)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _time_attention(keys, repeats)
    finally:
        torch.set_num_threads(saved)


def _time_attention(keys: tuple[int, ...], repeats: int) -> dict:
    import torch

    from engine.model.transformer import explicit_attention, sdpa_attention

    H, KV, hd = 9, 3, 64  # SmolLM2-135M: 9 query heads share 3 KV heads of width 64
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    for S in keys:
        q = torch.randn(1, 1, H, hd, generator=g).bfloat16().transpose(1, 2)  # a transposed view, as in the model
        cache_k = torch.randn(1, KV, max(keys), hd, generator=g).bfloat16()  # a static cache, read as a slice
        cache_v = torch.randn(1, KV, max(keys), hd, generator=g).bfloat16()
        k, v = cache_k[:, :, :S], cache_v[:, :, :S]
        ways = {
            "fused kernel (bf16)": lambda q=q, k=k, v=v: sdpa_attention(q, k, v, hd**-0.5, None),
            "two bf16 products": lambda q=q, k=k, v=v: explicit_attention(q, k, v, H // KV, hd**-0.5, None),
            "two float32 products on upcast copies": lambda q=q, k=k, v=v: explicit_attention(
                q.float(), k.float(), v.float(), H // KV, hd**-0.5, None)[0].bfloat16(),
        }
        for name, f in ways.items():
            for _ in range(10):
                f()
            t0 = time.perf_counter()
            for _ in range(repeats):
                f()
            out.setdefault(name, {})[S] = (time.perf_counter() - t0) / repeats * 1e6
    return out


def cmd_bench_profile(a: argparse.Namespace) -> int:
    from benchmarks.bench import PROMPT

    out = []
    for dtype in a.dtypes.split(","):
        for threads in (int(t) for t in a.threads.split(",")):
            r = profile(dtype, threads, a.steps, PROMPT)
            out.append(r)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["ms_per_step"].items())
            print(f"{dtype} {threads} thread(s): TPOT {r['tpot_ms']:.1f} ms; timed {r['tpot_timed_ms']:.1f} ms = "
                  f"{parts} ({r['operators_per_step']:.0f} operators a step)", flush=True)
    att = decode_attention()
    print("bfloat16 decode attention per layer, 1 thread (µs at " + ", ".join(map(str, next(iter(att.values()))))
          + " keys):")
    for name, row in att.items():
        print(f"  {name:<40}" + "".join(f"{us:>9.1f}" for us in row.values()))
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"steps": out, "decode_attention_us_per_layer": att}, f, indent=1)
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench-profile", help="split a decode step's time: products, attention, everything else")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--output", default=None, help="write the results as JSON")
    p.set_defaults(func=cmd_bench_profile)
