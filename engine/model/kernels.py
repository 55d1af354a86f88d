"""Decode's matrix–vector products, chosen by measuring this machine: the candidates, the autotuner, the dispatch.

A decode step multiplies one row by every weight once, so its speed is how fast a kernel streams the weights from
memory, and which kernel does that best depends on the CPU, its instruction set, torch's build, the dtype, the
thread count and the shape. One rule measured on one machine was the slowest choice on another, so the engine
times every candidate that applies, for each of the model's weight shapes at each thread count it decodes with,
once: at the model's first load on a machine, streaming the model's own weights of that shape one after another as
a decode step does (cache-cold, as in decode). The fastest is used; engine.model.kernel_cache keeps the result
keyed by CPU, cores, torch version and kernel set, dtype, threads and shape, so later loads only read it, and
anything in the key changing measures again (BENCHMARKS.md, "Decode kernels chosen by measuring the machine").

How a shape's candidates are timed: `choose`. `python -m engine kernels --remeasure` measures again (a choice made
while another program held the cores can be wrong on a quiet machine); $INFERENCE_LAB_KERNEL or `--kernel NAME`
forces one candidate wherever it applies. Only decode products are tuned (engine.model.transformer.linear).

Every float candidate computes the model's weights in the run's dtype: they differ only in the order of a sum. The
kernel modes the user may pick add candidates on quantized forms of a GGUF's weights (engine.model.quant), which
change the computation: a shape measured with them is a different key from the same shape without them.

Threads: the step's whole chain of products is then timed at each count `--threads auto` may use (measure_chain),
which caps `auto` (engine.model.threads, its module docstring says why).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.model import kernel_cache, quant
from engine.model import threads as thread_count
from engine.model.kernel_cache import KERNEL_ENV, Entry, Machine
from engine.model.threads import decode_thread_counts

ROUNDS = 5  # interleaved rounds after the warm-up (the median of these)
# A shape the model has once (the LM head) gives one sample per round where a layer's shape averages over every layer,
# so it runs up to this many rounds within the budget: with a few rounds its candidates' medians moved by more than
# their differences between measurements a minute apart (BENCHMARKS.md, "AMD EPYC with AVX-512 and avx512_bf16")
SINGLE_ROUNDS = 15
MIN_ROUNDS = 3
BUDGET_S = 0.12  # measuring time per shape and thread count, past which fewer rounds are run (at least MIN_ROUNDS)
CHAIN_ROUNDS = 5  # interleaved rounds of the whole chain at each thread count
CHAIN_MAX_ROUNDS = 15
CHAIN_BUDGET_S = 1.0  # measuring time for the chain, past which fewer rounds are run (at least MIN_ROUNDS)
PRUNE = 2.0  # a candidate this many times slower than the fastest in both the warm-up and the first round is not
# run again (its first round is its time): with another program on a core, the multi-threaded candidates ran many
# times slower, and measuring them every round made a first load several times longer (BENCHMARKS.md, "Decode
# kernels chosen by measuring the machine")

# (weight (out, in), bias, packed: oneDNN's bf16 layout, quantized forms)
Product = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, quant.QuantForms | None]
Kernel = Callable[..., torch.Tensor]  # (x, w, b, packed, quant=None) -> x·Wᵀ + b


def _onednn_linear() -> object | None:
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


ONEDNN_LINEAR = _onednn_linear()


# ---- the candidates: y = x·Wᵀ + b for x (…, in), each exact to its dtype's rounding -----------------------------
def plain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None,
          q: quant.QuantForms | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def split(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None,
          q: quant.QuantForms | None = None) -> torch.Tensor:
    """(n, out/n, in) @ (n, in, M): a block of W's rows per thread (F.linear's gemv used one thread on some CPUs)."""
    out_f, in_f = w.shape
    n = torch.get_num_threads()
    if out_f % n:
        return F.linear(x, w, b)
    rows = x.numel() // in_f
    xs = x.reshape(1, rows, in_f).expand(n, rows, in_f).contiguous().transpose(1, 2)  # (n, in, M)
    y = torch.bmm(w.view(n, out_f // n, in_f), xs)  # (n, out/n, M)
    y = y.permute(2, 0, 1).reshape(rows, out_f).contiguous().view(*x.shape[:-1], out_f)  # (…, out)
    return y if b is None else y + b


def onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None,
           q: quant.QuantForms | None = None) -> torch.Tensor:
    out_f, in_f = w.shape
    y = ONEDNN_LINEAR(x.reshape(-1, in_f), w, b, "none", [], "")  # (M, out)
    return y.view(*x.shape[:-1], out_f)


def onednn_packed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None,
                  q: quant.QuantForms | None = None) -> torch.Tensor:
    """oneDNN on the weight in its own blocked layout (engine.model.transformer.pack_for_decode)."""
    if packed is None:
        return F.linear(x, w, b)
    out_f, in_f = w.shape
    y = ONEDNN_LINEAR(x.reshape(-1, in_f), packed, b, "none", [], "")  # (M, out)
    return y.view(*x.shape[:-1], out_f)


def int4(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None,
         q: quant.QuantForms | None = None) -> torch.Tensor:
    """torch's CPU int4 weight-only kernel on the file's Q4_0/Q4_1/Q4_K blocks (engine.model.quant), bf16
    activations."""
    if q is None or q.int4 is None:
        return F.linear(x, w, b)
    out_f, in_f = w.shape
    xs = x.reshape(-1, in_f).to(quant.ACT_DTYPE).contiguous()  # (M, in)
    y = torch._weight_int4pack_mm_for_cpu(xs, q.int4[0], quant.GROUP, q.int4[1])  # (M, out)
    y = y.to(x.dtype).view(*x.shape[:-1], out_f)
    return y if b is None else y + b


def int8(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None,
         q: quant.QuantForms | None = None) -> torch.Tensor:
    """torch's CPU int8 weight-only kernel on a per-row requantized weight (engine.model.quant), bf16 activations."""
    if q is None or q.int8 is None:
        return F.linear(x, w, b)
    out_f, in_f = w.shape
    xs = x.reshape(-1, in_f).to(quant.ACT_DTYPE).contiguous()  # (M, in)
    y = torch._weight_int8pack_mm(xs, q.int8[0], q.int8[1])  # (M, out)
    y = y.to(x.dtype).view(*x.shape[:-1], out_f)
    return y if b is None else y + b


KERNELS: dict[str, Kernel] = {"linear": plain, "split": split, "onednn": onednn, "packed": onednn_packed,
                              "int4": int4, "int8": int8}
QUANTIZED = ("int4", "int8")  # candidates that multiply by a quantized form, not the float weight
assert tuple(KERNELS) == kernel_cache.NAMES


def applicable(name: str, weight: torch.Tensor, packed: torch.Tensor | None, threads: int,
               q: quant.QuantForms | None = None) -> bool:
    """Whether candidate `name` is a product of its own for this weight at this thread count (not a fallback)."""
    if weight.device.type != "cpu":
        return name == "linear"
    if name == "split":
        return weight.shape[0] % threads == 0
    if name == "onednn":
        return ONEDNN_LINEAR is not None and weight.dtype in (torch.float32, torch.bfloat16)
    if name == "packed":
        return packed is not None
    if name in QUANTIZED:
        return q is not None and getattr(q, name) is not None
    return name == "linear"


# ---- dispatch -----------------------------------------------------------------------------------------------------
# (out, in, dtype, threads, weights: kernel_cache.WEIGHTS) -> the measured fastest
_CHOSEN: dict[tuple[int, int, torch.dtype, int, str], Kernel] = {}
_MEASURED_AT: dict[tuple[int, int, torch.dtype, str], dict[int, str]] = {}  # the measured counts' choices
_TOP: list[int] = [1]  # the most threads any choice was measured at: more threads run that count's choice
_FORCED: list[Kernel] = []  # at most one: the kernel every decode product runs (for comparisons)


def decode_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, packed: torch.Tensor | None,
                   q: quant.QuantForms | None = None) -> torch.Tensor:
    """x·Wᵀ + b by the kernel measured fastest for this shape, dtype, thread count and weights (the forms' kernel
    mode, or float) (F.linear where none was measured)."""
    if _FORCED:
        return _FORCED[0](x, w, b, packed, q)
    out_f, in_f = w.shape
    n = min(torch.get_num_threads(), _TOP[0])
    return _CHOSEN.get((out_f, in_f, w.dtype, n, weights_of(q)), plain)(x, w, b, packed, q)


def weights_of(q: quant.QuantForms | None) -> str:
    """The weights kind (kernel_cache.WEIGHTS) of a product whose quantized forms are `q`."""
    if q is None:
        return kernel_cache.FLOAT
    return kernel_cache.Q4_FILE if q.mode == quant.FILE else kernel_cache.Q4


def _name(f: Kernel) -> str:
    return next(k for k, g in KERNELS.items() if g is f)


def chosen(shape: tuple[int, int], dtype: torch.dtype, threads: int, weights: str = kernel_cache.FLOAT) -> str | None:
    """The name of the kernel a decode product of this shape runs at `threads` (None: not measured: F.linear);
    weights: kernel_cache.WEIGHTS, the kind of weight (float, or with which quantized forms)."""
    if _FORCED:
        return _name(_FORCED[0])
    f = _CHOSEN.get((*shape, dtype, min(threads, _TOP[0]), weights))
    return None if f is None else _name(f)


def runs_form(w: torch.Tensor, q: quant.QuantForms | None) -> bool:
    """Whether a decode product by weight `w` with forms `q` multiplies by one of those forms now (at this thread
    count, or forced), not by the float weight."""
    if q is None:
        return False
    name = chosen(tuple(w.shape), w.dtype, torch.get_num_threads(), weights_of(q))
    return name in QUANTIZED and getattr(q, name) is not None


def forced_name() -> str | None:
    """The candidate every decode product is forced through, if any."""
    return _name(_FORCED[0]) if _FORCED else None


def force(name: str | None) -> None:
    """Run every decode product through candidate `name` (where it does not apply: F.linear), or stop forcing."""
    _FORCED.clear()
    if name:
        _FORCED.append(KERNELS[kernel_cache.kernel_name(name)])


@contextlib.contextmanager
def forced(name: str | None) -> Iterator[None]:
    """force(name) for the duration of a block (nothing when name is None)."""
    if not name:
        yield
        return
    before = list(_FORCED)
    force(name)
    try:
        yield
    finally:
        _FORCED[:] = before


KEEP_FORMS: list[bool] = []  # non-empty: models keep every quantized form after tuning (see keeping_forms)


@contextlib.contextmanager
def keeping_forms() -> Iterator[None]:
    """Models built in this block keep the quantized forms the tuner did not choose (to measure them again)."""
    KEEP_FORMS.append(True)
    try:
        yield
    finally:
        KEEP_FORMS.pop()


def _force_from_environment() -> None:
    value = os.environ.get(KERNEL_ENV, "").strip()
    if value:
        with contextlib.suppress(ValueError):  # `python -m engine kernels` names a bad value; the measured choice runs
            force(value)


_force_from_environment()


# ---- measuring ------------------------------------------------------------------------------------------------------
def this_machine() -> Machine:
    cpu, cores = kernel_cache.this_cpu()
    return Machine(cpu, cores, torch.__version__, torch.backends.cpu.get_cpu_capability())


def choose(names: Sequence[str], time_once: Callable[[str], float], rounds: int = ROUNDS,
           budget_s: float | None = BUDGET_S, prune: float | None = PRUNE) -> tuple[dict[str, float], int]:
    """Each candidate's median seconds over interleaved rounds, and the number of rounds run.

    time_once(name) runs candidate `name` once and returns its seconds (injected: tests give known costs). Every
    candidate runs once as a warm-up, then in round 0; one whose better run of those two is slower than `prune` ×
    the fastest's stops there (None: none stops), so one burst of load cannot drop a candidate. Round r runs the
    rest starting from the r-th, so none always runs first or last. Fewer rounds (not below MIN_ROUNDS) when one
    round would take more than budget_s / rounds (None: always `rounds`).
    """
    warm = {k: time_once(k) for k in names}
    times = {k: [time_once(k)] for k in names}  # round 0
    seen = {k: min(warm[k], times[k][0]) for k in names}
    kept = [k for k in names if prune is None or seen[k] <= prune * min(seen.values())]
    if budget_s is not None:
        rounds = max(MIN_ROUNDS, min(rounds, int(budget_s / max(sum(seen[k] for k in kept), 1e-9))))
    for r in range(1, rounds):
        for k in [*kept[r % len(kept):], *kept[: r % len(kept)]]:
            times[k].append(time_once(k))
    return {k: statistics.median(v) for k, v in times.items()}, rounds


def _timer(products: list[Product]) -> Callable[[str], float]:
    """time_once for real: candidate `name` over every weight of the group, one row, seconds per product."""
    in_f = products[0][0].shape[1]
    x = torch.randn(1, in_f, generator=torch.Generator().manual_seed(in_f)).to(products[0][0].dtype)

    def time_once(name: str) -> float:
        f = KERNELS[name]
        t = time.perf_counter()
        for w, b, p, q in products:
            f(x, w, b, p, q)
        return (time.perf_counter() - t) / len(products)

    return time_once


def _works(name: str, products: list[Product]) -> bool:
    """Some candidates exist in a build but refuse a dtype on some CPUs (oneDNN's bf16 without native bf16)."""
    w, b, p, q = products[0]
    try:
        KERNELS[name](torch.zeros(1, w.shape[1], dtype=w.dtype), w, b, p, q)
    except RuntimeError:
        return False
    return True


def tune(groups: dict[tuple[int, int], list[Product]], *, remeasure: bool = False,
         counts: Sequence[int] | None = None, time_once: Callable[[list[Product], str], float] | None = None,
         path: os.PathLike | None = None, others_cores: Callable[[], float | None] | None = None,
         chain_path: os.PathLike | None = None) -> list[Entry]:
    """Measure (or read from the cache) the fastest candidate for every shape group at every thread count, and use
    it from now on; then the whole chain at each count (measure_chain), which caps `--threads auto`.
    groups: (out, in, weights) -> the model's products of that weight shape, all one dtype on the CPU, all with the
    quantized forms of one kernel mode or none (kernel_cache.WEIGHTS; engine.model.transformer.Transformer.
    decode_products).

    remeasure: measure even what the caches hold. time_once(products, name): replaces the clock (tests); the chain
    at a count is then the sum of its chosen products' times. others_cores(): other processes' cores while the
    chain was measured (tests; default engine.model.threads.CpuMeter). path, chain_path: the caches' files.
    Returns the entries, measured or read, one per shape and thread count.
    """
    if not groups:
        return []
    machine = this_machine()
    cached = {} if remeasure else kernel_cache.read(path)
    counts = list(counts or decode_thread_counts())
    load = Load(others_cores)
    before = torch.get_num_threads()
    entries, measured = [], []
    try:
        with torch.inference_mode():
            for (*shape, weights), products in groups.items():
                shape = tuple(shape)
                dtype = str(products[0][0].dtype).removeprefix("torch.")
                quantized = weights != kernel_cache.FLOAT
                for n in counts:
                    key = kernel_cache.entry_key(machine, dtype, n, shape, weights)
                    e = cached.get(key)
                    if e is not None and spoiled(e.others_cores, n) and load.quiet_now(n):
                        e = None  # chosen while another program held a core: measured again now it is quiet
                    if e is None:
                        torch.set_num_threads(n)
                        names = [k for k in KERNELS if applicable(k, products[0][0], products[0][2], n,
                                                                  products[0][3]) and _works(k, products)]
                        clock = _timer(products) if time_once is None else lambda k, p=products: time_once(p, k)
                        seconds, rounds = choose(names, clock, ROUNDS if len(products) > 1 else SINGLE_ROUNDS)
                        e = Entry(machine, dtype, n, shape, seconds, len(products), rounds, time.time(), weights)
                        if not (quantized and any(p[3] is not None and p[3].dropped for p in products)):
                            measured.append(e)  # without forms dropped after tuning: used now, never cached
                    entries.append(e)
    finally:
        torch.set_num_threads(before)
    entries = load.record(measured, entries, path, Entry)
    use(entries)
    thread_count.use_chain(measure_chain(groups, counts, machine, remeasure=remeasure, time_once=time_once,
                                         others_cores=others_cores, path=chain_path, load=load))
    return entries


def spoiled(others_cores: float | None, threads: int) -> bool:
    """A timing known to be made under load at more than one thread (unknown load: trusted, as before)."""
    return others_cores is not None and not thread_count.measured_quiet(others_cores, threads)


class Load:
    """Other processes' CPU use, for the tuner: over its whole measurement (since_start), and whether the machine
    is quiet now, asked once per tuning (quiet_now: waits out the meter's shortest window, a quarter second, only
    when a cached timing made under load would otherwise be reused)."""

    def __init__(self, others_cores: Callable[[], float | None] | None) -> None:
        self._injected = others_cores
        # two windows from the start: quiet_now's reading restarts its meter's window, the whole one must not
        self._whole, self._meter = (None, None) if others_cores is not None else (thread_count.CpuMeter(),
                                                                                   thread_count.CpuMeter())
        self._now: bool | None = None

    def since_start(self) -> float | None:
        return self._injected() if self._injected is not None else self._whole.others_cores()

    def record(self, measured: list, entries: list, path: os.PathLike | None, kind: type) -> list:
        """`entries` with the `measured` ones stamped with the load since the start, which are written to the cache."""
        if not measured:
            return entries
        others = self.since_start()
        measured = [replace(e, others_cores=others) for e in measured]
        kernel_cache.write(measured, path, kind)
        return [next((m for m in measured if m.key == e.key), e) for e in entries]

    def quiet_now(self, threads: int) -> bool:
        if self._now is None:
            if self._injected is not None:
                others = self._injected()
            else:
                time.sleep(max(0.0, 1.05 * thread_count.MIN_WINDOW_S - self._meter.elapsed()))
                others = self._meter.others_cores()
            self._now = others is not None and thread_count.measured_quiet(others, threads)
        return self._now


def chain_key(groups: dict[tuple[int, int, str], list[Product]], counts: Sequence[int], machine: Machine) -> str:
    """What a chain's time depends on: the machine, the dtype, OpenMP's spin between parallel regions, and for every
    shape its count of weights and the kernel each thread count dispatches it to now (a different choice or a forced
    kernel is another chain). A chain timed with another spin says nothing of this process's threads: with none,
    two threads timed slower than one."""
    dtype = str(next(iter(groups.values()))[0][0].dtype).removeprefix("torch.")
    parts = []
    for (out_f, in_f, weights), products in sorted(groups.items()):
        names = [chosen((out_f, in_f), products[0][0].dtype, n, weights) or "linear" for n in counts]
        kind = "" if weights == kernel_cache.FLOAT else f" {weights}"
        parts.append(f"{out_f}x{in_f}{kind}*{len(products)}:{'/'.join(names)}")
    spin = os.environ.get("GOMP_SPINCOUNT", "default")
    return machine.key(dtype) + f"|spin {spin}|threads {'/'.join(map(str, counts))}|{' '.join(parts)}"


def measure_chain(groups: dict[tuple[int, int, str], list[Product]], counts: Sequence[int], machine: Machine, *,
                  remeasure: bool = False, time_once: Callable[[list[Product], str], float] | None = None,
                  others_cores: Callable[[], float | None] | None = None,
                  path: os.PathLike | None = None, load: Load | None = None) -> thread_count.ChainTiming | None:
    """The decode step's chain of products, each by the kernel dispatched at that count, timed at each count in
    interleaved rounds (choose), or read from the cache; None off the CPU or with no groups."""
    if not groups or next(iter(groups.values()))[0][0].device.type != "cpu":
        return None
    counts = sorted(set(counts))
    key = chain_key(groups, counts, machine)
    cached = None if remeasure else thread_count.read_chains(path).get(key)
    if cached is not None and not (spoiled(cached.others_cores, max(cached.seconds))
                                   and (load or Load(others_cores)).quiet_now(max(cached.seconds))):
        return cached  # (one timed under load is measured again once a load finds the machine quiet)
    meter = None if others_cores is not None else thread_count.CpuMeter()
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            clock = _chain_timer(groups) if time_once is None else _chain_sum(groups, time_once)
            once = clock(str(counts[0]))  # also a first warm-up (at one thread, which no other process slows)
            # rounds enough for the CPU meter's shortest window (it cannot tell load from idle in less), within
            # the budget; a tiny model's chain stays too short for it (unknown load: no cap)
            rounds = max(CHAIN_ROUNDS, min(CHAIN_MAX_ROUNDS, math.ceil(
                1.2 * thread_count.MIN_WINDOW_S / (len(counts) * max(once, 1e-9)))))
            seconds, rounds = choose([str(n) for n in counts], clock, rounds=rounds, budget_s=CHAIN_BUDGET_S)
    finally:
        torch.set_num_threads(before)
    others = others_cores() if others_cores is not None else meter.others_cores()
    dtype = str(next(iter(groups.values()))[0][0].dtype).removeprefix("torch.")
    t = thread_count.ChainTiming(key, machine.cpu, machine.cores, dtype, {int(n): s for n, s in seconds.items()},
                                 others, rounds, time.time())
    thread_count.write_chain(t, path)
    return t


def _chain_timer(groups: dict[tuple[int, int, str], list[Product]]) -> Callable[[str], float]:
    """time_once for the chain: every product of a step (decode_product: the dispatched kernel) at a count."""
    xs = {in_f: torch.randn(1, in_f, generator=torch.Generator().manual_seed(in_f)).to(ps[0][0].dtype)
          for (_, in_f, _), ps in groups.items()}
    chain = [(xs[p[0].shape[1]], *p) for ps in groups.values() for p in ps]

    def time_once(count: str) -> float:
        torch.set_num_threads(int(count))
        t = time.perf_counter()
        for x, w, b, p, q in chain:
            decode_product(x, w, b, p, q)
        return time.perf_counter() - t

    return time_once


def _chain_sum(groups: dict[tuple[int, int, str], list[Product]],
               time_once: Callable[[list[Product], str], float]) -> Callable[[str], float]:
    """The chain at a count from an injected per-product clock: Σ count × the dispatched kernel's time."""
    def chain(count: str) -> float:
        n = int(count)
        torch.set_num_threads(n)
        total = 0.0
        for (out_f, in_f, weights), products in groups.items():
            name = chosen((out_f, in_f), products[0][0].dtype, n, weights) or "linear"
            total += time_once(products, name) * len(products)
        return total

    return chain


def use(entries: list[Entry]) -> None:
    """Dispatch each entry's shape and dtype to its fastest kernel, at its thread count and (for counts between
    or above the measured ones, as a fixed --threads N may set) at the nearest measured count below."""
    for e in entries:
        at = _MEASURED_AT.setdefault((*e.shape, getattr(torch, e.dtype), e.weights), {})
        at[e.threads] = e.choice
    if not _MEASURED_AT:
        return
    _TOP[0] = max(n for at in _MEASURED_AT.values() for n in at)
    _CHOSEN.clear()
    for (out_f, in_f, dtype, weights), at in _MEASURED_AT.items():
        for n in range(1, _TOP[0] + 1):
            below = [c for c in at if c <= n]
            if below:
                _CHOSEN[(out_f, in_f, dtype, n, weights)] = KERNELS[at[max(below)]]
