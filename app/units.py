"""Numbers as the panels print them: decimal units (as memory and bandwidth are sold), one place for all panels."""

from __future__ import annotations


def fmt_bytes(n: float, digits: int = 1) -> str:
    """Decimal units: 1 kB = 1,000 bytes, 1 GB = 10⁹ bytes."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.{digits}f} {unit}"
    return f"{n:,.0f} B"


def fmt_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    return f"{s * 1e6:,.1f} µs"


def fmt_rate(x: float) -> str:
    """Tokens per second with sensible precision."""
    return f"{x:,.0f} tok/s" if x >= 100 else f"{x:,.1f} tok/s" if x >= 1 else f"{x:.3g} tok/s"


def fmt_flops(x: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if x >= scale:
            return f"{x / scale:,.3g} {unit}"
    return f"{x:.3g} FLOP/s"


def fmt_bandwidth(x: float) -> str:
    return f"{x / 1e12:,.3g} TB/s" if x >= 1e12 else f"{x / 1e9:,.3g} GB/s"


def fmt_fraction(f: float) -> str:
    """A share of a roof: 41%, 0.26%, 0.0004%."""
    return f"{f:.0%}" if f >= 0.01 else f"{f:.2%}" if f >= 1e-4 else f"{f * 100:.1g}%"


def si(x: float, sep: str = "") -> str:
    """1500 -> '1.5k', 1e9 -> '1G', 0.2 -> '0.2' (tick labels of log axes)."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:g}{sep}{unit}"
    return f"{x:g}"


def fmt_amount(x: float, unit: str) -> str:
    """Three significant digits and an SI prefix: 161792 FLOP -> '162 kFLOP', 2.7e8 -> '270 MFLOP'."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def fmt_kernels(mode: object) -> str:
    """The kernel mode a model ran in, as every panel names it: 'exact kernels', 'fast kernels'; a session saved
    before the mode was recorded (engine.session_file.KERNELS_NOT_RECORDED) says so rather than guessing."""
    from engine.model.kernel_cache import KERNEL_MODES

    return f"{mode} kernels" if isinstance(mode, str) and mode in KERNEL_MODES else "kernels: not recorded"
