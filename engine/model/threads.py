"""How many threads decode uses, chosen at run time from what the engine observes.

Why: a decode step runs ~150 small parallel regions (one per matrix–vector product and per small op). OpenMP's
threads spin at the end of each region until every thread has arrived; when another process holds one of the cores,
each region waits for a thread the kernel has descheduled. On a 2-core machine two threads are then slower than one
(beside a single busy loop, over twice one thread's time), while on a quiet one they are nearly twice as fast
(BENCHMARKS.md, "Decode under load"). One thread never waits for anyone, so under load it is the faster choice. No
fixed setting is right, so `AdaptiveThreads` decides per step, from the seconds per byte (weights + KV cache, so
steps at different context lengths compare) each count's recent steps took, and from other processes' CPU time
(/proc/stat) while one thread ran; the constants below say when it switches and probes.

`torch.set_num_threads` changes the count between regions, so switching costs microseconds; OMP_WAIT_POLICY
cannot change after OpenMP starts, which is why the count is the knob.

Some machines are slower with more threads even when nobody else runs (an Intel Xeon with AVX-512 and 2 cores was,
in issue 27's measurement). So at a model's first load the kernel tuner (engine.model.kernels)
also times the decode step's whole chain of products, each by the kernel chosen for that thread count, at every
count `auto` may use: a `ChainTiming`, cached in `threads.json` beside the kernels' cache and keyed by the machine,
the dtype and the chain itself (its shapes and the kernel each runs at each count). Where that was measured while
the other cores were idle, `auto` never goes above the fastest measured count (`ChainTiming.fastest`); measured
under other processes' load, it says nothing about the machine and `auto` adapts as above. A fixed `--threads N` is
always N.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from engine.model import kernel_cache
from engine.model.kernel_cache import available_cores, cpu_model  # noqa: F401 — the machine's words, read here too

SLOWER_THAN_ONE = 0.9  # many threads must beat this fraction of one thread's time per byte, or one thread wins
SUDDEN_SLOWDOWN = 1.5  # a many-thread step this much slower than the best recent ones → probe one thread
CLEAR_LOSS = 1.5  # a many-thread step this much slower than one thread's estimate switches at once; a step between
# SLOWER_THAN_ONE and this switches only when the next step is slow too (on a quiet machine single steps jitter
# above the one-thread time, and switching on each of them cost more one-thread steps than it saved)
REFRESH = 256  # steps after which the one-thread estimate is stale and probed again (~0.5 % of quiet time)
PROBE_STEPS = 2  # one-thread steps per probe
# /proc/stat and os.times() count 10 ms ticks, sampled at different instants: over one decode step the difference
# is off by a tick or two (a phantom load of a large part of a core), which kept `auto` at one thread on an idle
# machine; a quarter second bounds that error to a small share of a core
MIN_WINDOW_S = 0.25
IDLE_SHARE = 0.25  # many threads are tried again only if others used at most this share of the other cores
# (a higher share let the app's own GUI, which takes about a third of a core while it paints, send the engine back
# to two threads, which were slower in the app than one: BENCHMARKS.md, "The app against the CLI"; measured while the
# app's engine set GOMP_SPINCOUNT=0, which it no longer does, and not measured again since)
BACKOFF_MIN, BACKOFF_MAX = 4, 256  # steps before one thread tries many again, doubled after each failed try


def measured_quiet(others_cores: float | None, threads: int) -> bool:
    """Whether a timing at `threads` threads, made while other processes used `others_cores` cores (None: unknown),
    says what this machine does: one thread always (another program rarely takes its core from it), more only where
    the others left the cores the timing needed mostly idle (at most IDLE_SHARE of each, the test `auto` uses)."""
    return threads == 1 or (others_cores is not None and others_cores <= IDLE_SHARE * (threads - 1))


class CpuMeter:
    """CPU time other processes used since the last `others_cores()` call, in cores (0 = idle, 1 = one core busy).

    The machine's busy time (/proc/stat) minus this process's own (os.times). None where /proc/stat is absent.
    """

    def __init__(self, since: tuple[float, float | None, float] | None = None) -> None:
        self._last = since or self._sample()

    @staticmethod
    def _machine_busy_s() -> float | None:
        try:
            with open("/proc/stat", "rb") as f:
                fields = f.readline().split()[1:]
        except OSError:
            return None
        v = [int(x) for x in fields[:8]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    def _sample(self) -> tuple[float, float | None, float]:
        t = os.times()
        return time.perf_counter(), self._machine_busy_s(), t.user + t.system

    def others_cores(self) -> float | None:
        """None while the window is shorter than MIN_WINDOW_S (it then keeps growing) or /proc/stat is absent."""
        now = self._sample()
        (w0, m0, o0), (w1, m1, o1) = self._last, now
        if m0 is None or m1 is None or w1 - w0 < MIN_WINDOW_S:
            return None
        self._last = now
        return max(0.0, (m1 - m0 - (o1 - o0)) / (w1 - w0))

    def restart(self) -> None:
        """Start a new window now."""
        self._last = self._sample()

    def elapsed(self) -> float:
        return time.perf_counter() - self._last[0]


_IMPORTED = CpuMeter()._last  # a window that covers the model's load: the first decision has something to go by


_CONFIGURED: list[int] = []


def _configured_threads(torch) -> int:
    """torch's thread count before any controller changed it (torch's count is process-wide: a session that ended on
    one thread would otherwise make every later session's 'all threads' one thread)."""
    if not _CONFIGURED:
        _CONFIGURED.append(torch.get_num_threads())
    return _CONFIGURED[0]


def decode_thread_counts() -> list[int]:
    """The thread counts an `auto` controller switches between: one, and all the cores torch may use."""
    import torch

    return sorted({1, max(1, min(_configured_threads(torch), available_cores()))})


# ---- the measured chain: the cap on `auto` ---------------------------------------------------------------------
MAX_CHAINS = 100  # the oldest go first


@dataclass(frozen=True)
class ChainTiming:
    """A decode step's chain of products timed at each thread count, with the kernels chosen for that count."""

    FILE: ClassVar[str] = "threads.json"  # beside the kernels' cache (engine.model.kernel_cache)

    key: str  # machine, dtype and chain (engine.model.kernels.chain_key): anything changing measures again
    cpu: str
    cores: int
    dtype: str
    seconds: dict[int, float]  # thread count -> median seconds of the whole chain
    others_cores: float | None  # other processes' CPU use while it was measured (None: unknown)
    rounds: int
    measured_at: float  # time.time()

    @property
    def quiet(self) -> bool:
        """Measured while other processes left the other cores mostly idle (the same test `auto` uses at run time):
        only then do the times say what this machine does with more threads."""
        return measured_quiet(self.others_cores, max(self.seconds))

    def fastest(self) -> int:
        """The count to decode with: more threads only where they beat SLOWER_THAN_ONE × the best fewer threads'
        time (the margin `auto` asks at run time; a near tie goes to fewer threads, which no other process slows)."""
        best = min(self.seconds)
        for n in sorted(self.seconds):
            if self.seconds[n] < SLOWER_THAN_ONE * self.seconds[best]:
                best = n
        return best

    def cap(self) -> int | None:
        """The most threads `auto` may use by this measurement (None: measured under load, no cap)."""
        return self.fastest() if self.quiet else None

    def summary(self) -> str:
        """One line for `python -m engine kernels` and Engine → Decode kernels."""
        times = ", ".join(f"{n} thread{'s' * (n > 1)} {s * 1e3:.1f} ms" for n, s in sorted(self.seconds.items()))
        others = "unknown" if self.others_cores is None else f"{self.others_cores:.2f} cores"
        head = (f"{self.dtype}, the decode step's products: {times} (median of up to {self.rounds} rounds; other "
                f"processes {others})")
        if len(self.seconds) == 1:
            return f"{head}: one thread count only, nothing to choose"
        if self.cap() is None:
            return f"{head}: measured under load, so --threads auto adapts at run time without a cap"
        n = self.fastest()
        return f"{head}: --threads auto uses at most {n} thread{'s' * (n > 1)}"

    def to_json(self) -> dict:
        d = asdict(self)
        d["seconds"] = {str(n): s for n, s in self.seconds.items()}
        return d

    @classmethod
    def from_json(cls, d: object) -> ChainTiming | None:
        """The record, or None where `d` is not one this code wrote."""
        try:
            seconds = {int(n): float(s) for n, s in d["seconds"].items()}
            others = d["others_cores"]
            t = cls(str(d["key"]), str(d["cpu"]), int(d["cores"]), str(d["dtype"]), seconds,
                    None if others is None else float(others), int(d["rounds"]), float(d["measured_at"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        ok = seconds and all(n >= 1 and 0 < s < float("inf") for n, s in seconds.items())
        return t if ok and (t.others_cores is None or t.others_cores >= 0) else None


def read_chains(path: Path | None = None) -> dict[str, ChainTiming]:
    """Every valid record of the file by key; {} when it is missing, unreadable or not this format."""
    return kernel_cache.read(path, ChainTiming, "chains")


def write_chain(t: ChainTiming, path: Path | None = None) -> None:
    """Merge `t` into the file, atomically; a read-only disk only costs the next start a measurement."""
    kernel_cache.write([t], path, ChainTiming, "chains", MAX_CHAINS)


_MEASURED: list[ChainTiming] = []  # the loaded model's (the last tuned): what `auto` controllers made now obey


def use_chain(t: ChainTiming | None) -> None:
    """From now on, `auto` controllers are capped by `t` (None: by nothing)."""
    _MEASURED[:] = [] if t is None else [t]


def measured_chain() -> ChainTiming | None:
    """The chain timing in use (engine.model.kernels.tune sets it at each model's load)."""
    return _MEASURED[0] if _MEASURED else None


def _median(xs) -> float | None:
    s = sorted(xs)
    return s[len(s) // 2] if s else None


class AdaptiveThreads:
    """Chooses torch's thread count before each step (`begin_step`) from the step times it is shown (`end_step`).

    `setting` is "auto" or a fixed count; a fixed count is set once and never changed.
    """

    def __init__(self, setting: int | str = "auto", max_threads: int | None = None) -> None:
        import torch  # here, not at the top: the CLI parses --threads (threads_arg) without importing torch

        self._torch = torch
        if setting != "auto" and (isinstance(setting, bool) or not isinstance(setting, int) or setting < 1):
            raise ValueError(f"threads must be 'auto' or a positive integer, got {setting!r}")
        self.auto = setting == "auto"
        configured = _configured_threads(torch)  # read before this or any controller sets a count
        chain = measured_chain()
        self.cap = None if chain is None else chain.cap()  # the fastest count measured quiet, if any
        if self.auto:
            limits = [max_threads or configured, available_cores()] + ([self.cap] if self.cap else [])
            self.max = max(1, min(limits))
        else:
            self.max = int(setting)
            torch.set_num_threads(self.max)
        self.current = self.max
        self.switches = 0
        self._one: deque[float] = deque(maxlen=3)  # seconds per byte at one thread, newest last
        self._many: deque[float] = deque(maxlen=16)  # the same at self.max threads
        self._one_age = 10**9  # steps since one thread was last observed
        self._probe_left = 0  # one-thread probe steps still to run (then choose)
        self._wait = 0  # steps at one thread before many threads may be tried again
        self._backoff = BACKOFF_MIN
        self._since_switch = 0
        self._slow_streak = 0  # consecutive many-thread steps slower than SLOWER_THAN_ONE × one thread
        recent = time.perf_counter() - _IMPORTED[0] < 5.0  # else the window would describe the distant past
        self._meter = CpuMeter(since=_IMPORTED if recent else None)
        self._started = False

    def describe(self) -> str:
        if not self.auto:
            return str(self.max)
        capped = self.cap is not None and self.cap == self.max < available_cores()
        return f"auto ({self.current} of {self.max}{': more measured slower' if capped else ''})"

    def begin_step(self) -> int:
        """Set and return the thread count for the next step (prefill or decode)."""
        if self.auto and not self._started:
            self._started = True  # others busy since the engine started (the load) or since we were made: one thread
            if self.max > 1 and not self._others_leave_room(default=True):
                self._switch(1)
                self._wait = self._backoff
        if self._torch.get_num_threads() != self.current:
            self._torch.set_num_threads(self.current)
        return self.current

    def _switch(self, n: int) -> None:
        if n != self.current:
            self.current, self.switches, self._since_switch, self._slow_streak = n, self.switches + 1, 0, 0
        self._meter.restart()  # the idle window starts at the switch

    def _others_leave_room(self, default: bool) -> bool:
        """Did other processes leave the other cores mostly idle since the last look? (unknown → `default`)"""
        others = self._meter.others_cores()
        return default if others is None else others <= IDLE_SHARE * (self.max - 1)

    def end_step(self, seconds: float, work_bytes: float) -> None:
        """Record a decode step that ran at `self.current` threads, moved `work_bytes` and took `seconds`."""
        if not self.auto or self.max == 1 or work_bytes <= 0:
            return
        per_byte = seconds / work_bytes
        self._since_switch += 1
        if self.current == self.max:
            self._many.append(per_byte)
            self._one_age += 1
            self._after_many(per_byte)
        else:
            self._one.append(per_byte)
            self._one_age = 0
            self._after_one()

    def _after_many(self, per_byte: float) -> None:
        one = _median(self._one)
        best = min(self._many)
        slow = one is not None and per_byte > SLOWER_THAN_ONE * one
        sudden = self._since_switch >= 16 and per_byte > SUDDEN_SLOWDOWN * best
        # one odd step is jitter (a quiet machine has them); the second in a row, or a clear loss, is load
        self._slow_streak = self._slow_streak + 1 if (slow or sudden) else 0
        confirmed = self._slow_streak >= 2
        if slow and (confirmed or per_byte > CLEAR_LOSS * one):  # a loss: one thread now
            if self._since_switch <= 2:  # the try right after one thread failed: wait longer next time
                self._backoff = min(BACKOFF_MAX, self._backoff * 2)
            self._wait = self._backoff
            self._switch(1)
            return
        if self._since_switch >= 8:
            self._backoff = BACKOFF_MIN  # many threads held: a later failure starts from a short wait again
        if one is None or self._one_age > REFRESH or (sudden and confirmed):
            self._probe_left = PROBE_STEPS
            self._one.clear()  # the probe measures one thread under today's conditions
            self._switch(1)

    def _after_one(self) -> None:
        if self._probe_left:
            self._probe_left -= 1
            if self._probe_left == 0:
                recent_many = _median(list(self._many)[-3:])
                if recent_many is not None and recent_many < SLOWER_THAN_ONE * _median(self._one):
                    self._switch(self.max)
                else:
                    self._wait = self._backoff
            return
        self._wait -= 1
        if self._wait <= 0 and self._meter.elapsed() >= MIN_WINDOW_S and self._others_leave_room(default=True):
            self._switch(self.max)
