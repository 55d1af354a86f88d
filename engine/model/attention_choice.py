"""A decode query's attention over the KV cache, run the way measured fastest on this machine for its key count.

One query row reads every key and value of the cache, so a long decode step's time is mostly this read, and which
way of computing it reads fastest depends on the CPU, the dtype, the thread count, the heads' shape and the context
length: on the Intel AMX machine torch's fused kernel was the fastest bfloat16 way at every length and the slowest
float32 way past a few thousand keys, where a rule from another machine had it the other way round (BENCHMARKS.md,
"Decode attention chosen by measuring the machine"). The ways are named in kernel_cache.ATTENTION_DESCRIPTIONS
(engine.model.transformer.decode_ways); `explicit` is a float32 way only, since a low-precision product of a new
shape every step costs oneDNN a kernel it keeps; `sdpa` never forms the weights, so a captured layer runs another.

At a model's first load on a machine (with the kernel tuner, engine.model.kernels), each way is timed at the key
counts in KEY_COUNTS up to the model's context, at each thread count decode may use, over the model's own head shape
and a few layers' worth of cache views (cache-cold, as decode reads them), in interleaved rounds (kernels.choose).
The times are kept in `attention.json` beside the kernels' cache (engine.model.kernel_cache.AttentionEntry); a step
runs the fastest way measured at the nearest key count (on a log scale). Where nothing was measured (another
device, a model not tuned) the rule that came before stands: float32 copies up to UPCAST_MAX_KEYS, then blocks.
$INFERENCE_LAB_ATTENTION or `force()` runs one way wherever it applies (for comparisons).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from engine.model import kernel_cache
from engine.model.kernel_cache import ATTENTION_ENV, WEIGHT_WAYS, AttentionEntry
from engine.model.kernels import Load, choose, spoiled, this_machine

KEY_COUNTS = (512, 1024, 2048, 4096, 8192)  # measured key counts (those up to the model's context)
BUFFER_BYTES = 48 << 20  # cache views timed per round: enough layers to leave the CPU's caches, at most the model's
ROUNDS, BUDGET_S = 5, 0.1  # interleaved rounds per key count and thread count, fewer (≥ 3) past the budget
UPCAST_MAX_KEYS = 3072  # the rule where nothing was measured: float32 copies up to this many keys, then blocks

Way = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # (q, k, v, group_size, scale, mask) -> (y, weights)
# (dtype, (KV, G, hd), threads) -> [(keys, {way: seconds})], by keys
_TIMES: dict[tuple[torch.dtype, tuple[int, int, int], int], list[tuple[int, dict[str, float]]]] = {}
_TOP: list[int] = [1]  # the most threads measured: more threads use that count's times
_FORCED: list[str] = []


def full_precision(dtype: torch.dtype) -> bool:
    """float32 or wider: the products run in the cache's own dtype (no upcast, no blocks)."""
    return torch.finfo(dtype).bits >= 32


def ways_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The candidate ways for a decode query in this dtype."""
    return ("explicit", "sdpa") if full_precision(dtype) else ("upcast", "blocked", "sdpa")


def choice(dtype: torch.dtype, heads: tuple[int, int, int], keys: int, weights: bool) -> str:
    """The way a CPU decode query of this dtype and head shape (KV, G, hd) over `keys` keys runs now (at this thread
    count); weights: a panel captures this layer, so the way must form them."""
    allowed = [w for w in ways_for(dtype) if not weights or w in WEIGHT_WAYS]
    if _FORCED and _FORCED[0] in allowed:
        return _FORCED[0]
    table = _TIMES.get((dtype, heads, min(torch.get_num_threads(), _TOP[0])))
    if table:
        _, seconds = min(table, key=lambda e: abs(math.log(e[0] / max(keys, 1))))
        timed = {w: s for w, s in seconds.items() if w in allowed}
        if timed:
            return min(timed, key=timed.__getitem__)
    if full_precision(dtype):
        return "explicit" if weights else "sdpa"
    return "upcast" if keys <= UPCAST_MAX_KEYS else "blocked"


def force(name: str | None) -> None:
    """Run every decode query the way `name` where it applies (to the dtype, and to a captured layer), or stop."""
    _FORCED.clear()
    if name:
        _FORCED.append(kernel_cache.attention_way(name))


@contextlib.contextmanager
def forced(name: str | None) -> Iterator[None]:
    before = list(_FORCED)
    force(name)
    try:
        yield
    finally:
        _FORCED[:] = before


def _force_from_environment() -> None:
    value = os.environ.get(ATTENTION_ENV, "").strip()
    if value:
        with contextlib.suppress(ValueError):  # `python -m engine kernels` names a bad value
            force(value)


_force_from_environment()


def use(entries: Sequence[AttentionEntry]) -> None:
    """Run decode queries by these measurements from now on (other head shapes and dtypes keep theirs)."""
    for e in entries:
        key = (getattr(torch, e.dtype), e.heads, e.threads)
        table = [row for row in _TIMES.get(key, []) if row[0] != e.keys] + [(e.keys, dict(e.seconds))]
        _TIMES[key] = sorted(table)
    if _TIMES:
        _TOP[0] = max(n for _, _, n in _TIMES)


def key_counts(context_length: int) -> list[int]:
    """The key counts measured for a model of this context length."""
    return [k for k in KEY_COUNTS if k <= context_length] or [max(1, context_length)]


def _timer(ways: dict[str, Way], heads: tuple[int, int, int], keys: int, dtype: torch.dtype,
           n_layers: int) -> Callable[[str], float]:
    """time_once for real: one decode query through way `name` over each of a few layers' cache views (the first
    `keys` rows of buffers with room for more, as the KV cache hands them out), seconds per layer."""
    kv, g, hd = heads
    per_layer = 2 * kv * (keys + 256) * hd * torch.empty((), dtype=dtype).element_size()
    layers = max(1, min(n_layers, BUFFER_BYTES // per_layer))
    gen = torch.Generator().manual_seed(keys)
    caches = [tuple(torch.randn(1, kv, keys + 256, hd, generator=gen).to(dtype)[:, :, :keys] for _ in "kv")
              for _ in range(layers)]
    q = torch.randn(1, kv * g, 1, hd, generator=gen).to(dtype)

    def time_once(name: str) -> float:
        way = ways[name]
        t = time.perf_counter()
        for k, v in caches:
            way(q, k, v, g, hd ** -0.5, None)
        return (time.perf_counter() - t) / layers

    return time_once


def tune(ways: dict[str, Way], heads: tuple[int, int, int], dtype: torch.dtype, context_length: int,
         n_layers: int, counts: Sequence[int], *, remeasure: bool = False,
         time_once: Callable[[int, str], float] | None = None, path: os.PathLike | None = None,
         others_cores: Callable[[], float | None] | None = None) -> list[AttentionEntry]:
    """Measure (or read from the cache) every way at each key count and thread count, and use the result; a
    multi-thread timing made while another program held a core is measured again by the first load that finds the
    machine quiet (as the products', engine.model.kernels.tune).

    ways: name -> the way (engine.model.transformer.decode_ways). time_once(keys, name): replaces the clock (tests).
    others_cores(): other processes' cores while measuring (tests; default engine.model.threads.CpuMeter).
    Returns the entries, measured or read.
    """
    machine = this_machine()
    cached = {} if remeasure else kernel_cache.read(path, AttentionEntry)
    load = Load(others_cores)
    name = str(dtype).removeprefix("torch.")
    names = [w for w in ways_for(dtype) if w in ways]
    entries, measured = [], []
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for keys in key_counts(context_length):
                clock = None
                for n in sorted(set(counts)):
                    key = kernel_cache.attention_key(machine, name, n, heads, keys)
                    e = cached.get(key)
                    if e is not None and spoiled(e.others_cores, n) and load.quiet_now(n):
                        e = None  # timed while another program held a core: measured again now it is quiet
                    if e is None or set(e.seconds) != set(names):
                        torch.set_num_threads(n)
                        if time_once is not None:
                            clock = (lambda k: lambda w: time_once(k, w))(keys)
                        elif clock is None:
                            clock = _timer(ways, heads, keys, dtype, n_layers)
                        seconds, rounds = choose(names, clock, budget_s=BUDGET_S)
                        e = AttentionEntry(machine, name, n, heads, keys, seconds, rounds, time.time())
                        measured.append(e)
                    entries.append(e)
    finally:
        torch.set_num_threads(before)
    entries = load.record(measured, entries, path, AttentionEntry)
    use(entries)
    return entries
