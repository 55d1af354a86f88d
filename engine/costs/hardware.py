"""Measure "this machine" so the roofline has real numbers for it: memory bandwidth and matmul FLOP/s.

Bandwidth: a buffer much larger than any CPU cache (256 MB by default) is summed, which reads every byte
once, and its first half is copied onto its second half, which reads and writes half the buffer each. Bytes
moved over the fastest of several repeats gives the bandwidth; the better of the two kernels is reported.
Compute: a square matmul of n×n matrices costs 2·n³ FLOPs; n grows until one product takes long enough to
time well, then the fastest of several repeats gives the FLOP/s. Both are what PyTorch attains on this
device and dtype, so they sit somewhat below the vendor's peak figures; that is the honest roof for the
engine, which runs on the same PyTorch.

Results are cached as JSON in hardware.json under the engine's cache folder (engine.formats.locate.cache_root),
keyed by device, dtype, processor and thread count, because measuring takes a couple of seconds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.costs.catalog import Hardware, canonical_dtype
from engine.formats.locate import cache_root
from engine.model import dtypes
from engine.model.threads import cpu_model

MAX_AGE_S = 7 * 24 * 3600.0
CACHE_FILE = "hardware.json"


class MeasurementCancelled(RuntimeError):
    """should_stop() returned True while measuring."""


def _processor_name(device: str) -> str:
    kind = str(device).split(":", 1)[0].lower()
    if kind == "cuda":
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    if kind == "mps":
        return f"Apple GPU ({cpu_model()})"
    return cpu_model()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def cache_key(device: str, dtype: str) -> str:
    """Identity of a measurement: device, dtype, processor model and thread count."""
    return f"{device}|{canonical_dtype(dtype)}|{_processor_name(device)}|{_threads()} threads"


def measure_this_machine(
    device: str = "cpu",
    dtype: str = "float32",
    progress: Callable[[float, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    *,
    size_mb: float | None = None,
    matmul_n: int | None = None,
    repeats: int = 5,
    quick: bool = False,
) -> Hardware:
    """Measure bandwidth (bytes/s) and matmul throughput (FLOP/s) of `device` at `dtype`; it takes seconds, which is
    why cached_this_machine keeps the result.

    size_mb: bandwidth buffer (default 256 MB on a CPU, 2048 MB on a GPU); matmul_n: largest matmul side
    (default 2048 on a CPU, 8192 on a GPU); quick=True uses a 32 MB buffer and n ≤ 256 (for tests).
    Raises MeasurementCancelled if should_stop() becomes true, ValueError for a dtype that cannot be timed.
    """
    import psutil
    import torch

    key = canonical_dtype(dtype)
    torch_name = dtypes.lookup(key).torch_name
    if torch_name is None:
        raise ValueError(f"can only time float matmuls, not {dtype!r}; valid: {', '.join(dtypes.MEASURABLE)}")
    torch_dtype = getattr(torch, torch_name)
    dev = torch.device(device)
    kind = dev.type
    on_gpu = kind in ("cuda", "mps")
    if size_mb is None:
        size_mb = 32 if quick else (2048 if on_gpu else 256)
    if matmul_n is None:
        matmul_n = 256 if quick else (8192 if on_gpu else 2048)
    repeats = max(1, 2 if quick else repeats)

    def report(fraction: float, message: str) -> None:
        if should_stop is not None and should_stop():
            raise MeasurementCancelled("measurement stopped")
        if progress is not None:
            progress(fraction, message)

    def sync() -> None:
        if kind == "cuda":
            torch.cuda.synchronize(dev)
        elif kind == "mps":
            torch.mps.synchronize()

    def best_time(fn: Callable[[], object], n: int, fraction: float, what: str) -> float:
        fn()  # warm-up: first touch, kernel selection
        sync()
        best = math.inf
        for i in range(n):
            report(fraction, f"{what} ({i + 1}/{n})")
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return max(best, 1e-9)

    started = time.perf_counter()
    report(0.0, "allocating the bandwidth buffer")
    n_values = max(2, int(size_mb * 2**20) // 4) // 2 * 2
    buf = torch.empty(n_values, dtype=torch.float32, device=dev)
    buf.fill_(1.0)
    half = n_values // 2
    nbytes = n_values * 4

    low, high = buf[:half], buf[half:]
    t_sum = best_time(buf.sum, repeats, 0.1, "memory bandwidth: reading")
    t_copy = best_time(lambda: high.copy_(low), repeats, 0.3, "memory bandwidth: copying")
    read_bw = nbytes / t_sum  # every byte read once
    copy_bw = nbytes / t_copy  # half the buffer read, the other half written
    buf = low = high = None  # free the buffer before the matmuls

    old_tf32 = torch.backends.cuda.matmul.allow_tf32 if kind == "cuda" else None
    if kind == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
    try:
        report(0.5, "matmul throughput: choosing a size")
        n = min(256, matmul_n)
        while True:
            a = torch.randn(n, n, device=dev).to(torch_dtype)
            b = torch.randn(n, n, device=dev).to(torch_dtype)
            one = best_time(lambda a=a, b=b: a @ b, 1, 0.55, f"matmul throughput: {n}×{n}")
            # Grow while one product is too short to time well and the next size (8× the work) stays quick.
            if n * 2 > matmul_n or one > 0.02 or one * 8 > 0.5:
                break
            n *= 2
        reps = max(1, min(repeats, int(1.0 / max(one, 1e-6))))
        t_mm = best_time(lambda: a @ b, reps, 0.7, f"matmul throughput: {n}×{n}")
        flops = 2.0 * n**3 / t_mm
    finally:
        if old_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = old_tf32

    if kind == "cuda":
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
    else:
        memory = float(psutil.virtual_memory().total)
    processor = _processor_name(device)
    threads = torch.get_num_threads()
    elapsed = time.perf_counter() - started
    report(1.0, "done")
    where = f"{processor}" if on_gpu else f"{processor}, {threads} threads"
    return Hardware(
        name="this-machine",
        label=f"This machine ({where}, {kind})",
        peak_flops={key: flops},
        bandwidth_bytes_per_s=max(read_bw, copy_bw),
        memory_bytes=memory,
        source=(
            f"measured with PyTorch {torch.__version__}: sum and copy of {size_mb:g} MB (best of {repeats}), "
            f"{n}×{n} {torch_name} matmul (best of {reps})"
        ),
        measured=True,
        details={
            "device": str(device),
            "dtype": key,
            "processor": processor,
            "threads": threads,
            "buffer_mb": float(size_mb),
            "read_bandwidth_bytes_per_s": read_bw,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "matmul_n": n,
            "seconds": elapsed,
            "measured_at": time.time(),
        },
    )


def _cache_path(cache_dir: str | Path | None) -> Path:
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / CACHE_FILE


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_cached(
    device: str = "cpu",
    dtype: str = "float32",
    cache_dir: str | Path | None = None,
    max_age_s: float = MAX_AGE_S,
) -> Hardware | None:
    """The cached measurement for this device, dtype, processor and threads if fresh; never measures."""
    entry = _read_cache(_cache_path(cache_dir)).get(cache_key(device, dtype))
    if not isinstance(entry, dict):
        return None
    age = time.time() - float(entry.get("measured_at", 0.0))
    if not 0 <= age <= max_age_s:
        return None
    try:
        return Hardware.from_dict(entry["hardware"])
    except (KeyError, TypeError, ValueError):
        return None


def this_machine(
    device: str = "cpu",
    dtype: str = "float32",
    cache_dir: str | Path | None = None,
) -> Hardware | None:
    """This machine's roofs for `dtype`, the one policy every panel follows; never measures.

    The cached measurement at `dtype` when that dtype can be timed and was measured, else the cached float32 one
    (whose peak_for() then answers for the dtype, as a catalogue chip's does), else None.
    """
    key = canonical_dtype(dtype)
    if key in dtypes.MEASURABLE:
        hw = load_cached(device, key, cache_dir)
        if hw is not None or key == "fp32":
            return hw
    return load_cached(device, "fp32", cache_dir)


def store_cached(hw: Hardware, device: str, dtype: str, cache_dir: str | Path | None = None) -> Path:
    """Write one measurement into the cache file (atomically) and return the file's path."""
    path = _cache_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read_cache(path)
    data[cache_key(device, dtype)] = {"measured_at": time.time(), "hardware": hw.to_dict()}
    fd, tmp = tempfile.mkstemp(prefix=".hardware-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def cached_this_machine(
    device: str = "cpu",
    dtype: str = "float32",
    cache_dir: str | Path | None = None,
    *,
    refresh: bool = False,
    progress: Callable[[float, str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    **measure_kwargs: Any,
) -> Hardware:
    """The cached measurement if fresh, else measure now and cache it (refresh=True always measures)."""
    if not refresh:
        hw = load_cached(device, dtype, cache_dir)
        if hw is not None:
            return hw
    hw = measure_this_machine(device, dtype, progress, should_stop, **measure_kwargs)
    with contextlib.suppress(OSError):  # a read-only home still gets its measurement, just not cached
        store_cached(hw, device, dtype, cache_dir)
    return hw
