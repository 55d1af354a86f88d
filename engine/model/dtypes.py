"""Number formats, stated once: each dtype's short name, its accepted spellings, its bytes per value and where the
roofline looks for its peak FLOP/s when a chip lists none for it.

engine.costs: formulas (bytes), catalog (names and peaks), hardware (what can be timed), the estimator; and the
app's panels all read this one table, so a dtype cannot be known to one of them and unknown to another.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One number format as the cost model sees it."""

    name: str  # the short, canonical name: a key of Hardware.peak_flops
    bytes_per_value: float  # storage of one value, in bytes (fractions for packed formats)
    spellings: tuple[str, ...]  # other accepted names (torch's, numpy's, …)
    peak_fallback: tuple[str, ...]  # where to look, in order, when a chip lists no peak for this dtype
    torch_name: str | None = None  # the torch dtype a matmul of this format is timed in (None: cannot be timed)


# Weight-only quantised formats (q4_1, q8_0, int4) are usually multiplied on the integer units when present, else
# after dequantising to 16-bit floats. GGUF block formats hold 32 weights per block plus per-block constants in fp16.
TABLE: tuple[DType, ...] = (
    DType("fp32", 4.0, ("float32",), ("fp32",), "float32"),
    DType("tf32", 4.0, (), ("tf32", "fp32"), "float32"),  # stored as fp32; multiplied with a 10-bit mantissa
    DType("fp16", 2.0, ("float16", "half"), ("fp16", "bf16", "fp32"), "float16"),
    DType("bf16", 2.0, ("bfloat16",), ("bf16", "fp16", "fp32"), "bfloat16"),
    DType("fp8", 1.0, ("float8",), ("fp8", "fp16", "bf16", "fp32")),
    DType("int8", 1.0, (), ("int8", "fp16", "bf16", "fp32")),
    DType("int4", 0.5, (), ("int4", "int8", "fp16", "bf16", "fp32")),
    # 32 × 8 bits = 32 bytes, + an fp16 scale = 34 bytes per 32 weights
    DType("q8_0", 34 / 32, (), ("int8", "fp16", "bf16", "fp32")),
    # 32 × 4 bits = 16 bytes, + an fp16 scale and an fp16 minimum = 20 bytes per 32 weights
    DType("q4_1", 20 / 32, (), ("int8", "fp16", "bf16", "fp32")),
)

_LOOKUP: dict[str, DType] = {s: d for d in TABLE for s in (*d.spellings, d.name)}
ACCEPTED: tuple[str, ...] = tuple(_LOOKUP)  # every accepted spelling ("float32" before "fp32")
MEASURABLE: tuple[str, ...] = tuple(d.name for d in TABLE if d.torch_name is not None)


def lookup(dtype: str) -> DType:
    """The table entry for any accepted spelling ("float16", "torch.bfloat16", "FP32", …)."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    try:
        return _LOOKUP[key]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(ACCEPTED)}") from None


def canonical(dtype: str) -> str:
    """The short name ("fp16", "bf16", "int8", …) for any accepted spelling of a dtype."""
    return lookup(dtype).name


def bytes_per_value(dtype: str) -> float:
    """Storage of one value in `dtype`, in bytes (fractions for packed 4-bit formats)."""
    return lookup(dtype).bytes_per_value
