"""What a lab will hold in memory before it runs: the loaded weights plus the KV cache of its sequences, for the
runtime that runs it, and whether that fits in the memory available now.

The weights are ModelInfo.weight_bytes: the file's own bytes on llama.cpp (it holds the file as it is), n_params ×
the dtype's bytes on the torch engine. They are already held once the model is loaded; a lab adds its own cache:
    KV bytes = cells reserved × 2 · n_layers · n_kv_heads · head_dim · bytes per value (formulas.kv_bytes_per_token)
at the cache's own dtype (formulas.kv_cache_dtype: float16 on llama.cpp whatever the weights). llama.cpp gives each
sequence its own stream rounded up to STREAM_GRANULE cells; the torch engine reserves exactly the positions asked.
A lab may take LAB_MEMORY_SHARE of the memory available now (the rest is left to the app, the OS and the compute
buffers), the one rule the batching and scheduling labs apply in the engine too.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.costs import formulas
from engine.events import ModelInfo
from engine.model.config import ModelConfig

STREAM_GRANULE = 256  # llama.cpp rounds each sequence's stream up to this many cells (GGML_PAD(n_ctx_seq, 256))
LAB_MEMORY_SHARE = 0.5  # of the memory available now, what a lab's KV cache may take


def cells_reserved(runtime: str, n_seq: int, capacity: int, pooled: bool = False, page_size: int = 1) -> int:
    """Positions a runtime allocates for n_seq sequences of `capacity` positions (llama.cpp: a stream per sequence
    rounded up to STREAM_GRANULE cells, or one pooled cache of single cells; the torch engine: n_seq × capacity,
    in whole pages of `page_size` positions when pooled)."""
    if runtime == "llama.cpp":
        return n_seq * (capacity if pooled else -(-capacity // STREAM_GRANULE) * STREAM_GRANULE)
    page = page_size if pooled else 1
    return n_seq * -(-capacity // page) * page


def size(n: float) -> str:
    """Bytes for a line: GiB, MiB or KiB, two decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


@dataclass(frozen=True)
class LabMemory:
    """The memory a lab of n_seq sequences × positions holds on a runtime, in bytes."""

    runtime: str
    weights_bytes: int
    kv_dtype: str
    kv_bytes_per_position: float
    n_seq: int
    positions: int
    cells: int

    @property
    def kv_bytes(self) -> float:
        return self.kv_bytes_per_position * self.cells

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes

    def line(self) -> str:
        """One line: weights + KV cache = total, with the formula's numbers."""
        asked = self.n_seq * self.positions
        rounded = f", {self.cells:,} cells as llama.cpp rounds them" if self.cells != asked else ""
        return (f"memory on {self.runtime}: weights {size(self.weights_bytes)} + KV cache {size(self.kv_bytes)} "
                f"({self.n_seq} × {self.positions:,} positions × {self.kv_bytes_per_position:,.0f} B in "
                f"{self.kv_dtype}{rounded}) = {size(self.total_bytes)}")

    def refusal(self, available: int, what: str = "") -> str | None:
        """One line when the KV cache would not fit in LAB_MEMORY_SHARE of `available` bytes (None: it fits; the
        weights are already held). `what` names the run ("batch 8" unless given)."""
        budget = LAB_MEMORY_SHARE * available
        if available <= 0 or self.kv_bytes <= budget:
            return None
        return (f"{what or f'batch {self.n_seq}'} would not fit: its KV cache needs {size(self.kv_bytes)} "
                f"({self.n_seq} × {self.positions:,} positions in {self.kv_dtype}), more than half of the "
                f"{size(available)} of memory available now")


def lab_memory(info: ModelInfo, cfg: ModelConfig, runtime: str, n_seq: int, positions: int,
               pooled: bool = False, page_size: int = 1) -> LabMemory:
    """The memory a lab of `n_seq` sequences of `positions` positions holds on `runtime` ("torch" or "llama.cpp");
    `pooled`: one cache the sequences draw pages of `page_size` positions from (the scheduling lab's)."""
    kv_dtype = formulas.kv_cache_dtype(info)
    return LabMemory(runtime=runtime, weights_bytes=int(info.weight_bytes), kv_dtype=kv_dtype,
                     kv_bytes_per_position=formulas.kv_bytes_per_token(cfg, kv_dtype), n_seq=n_seq,
                     positions=positions, cells=cells_reserved(runtime, n_seq, positions, pooled, page_size))


def file_memory(path: str, runtime: str, weights_bytes: int, dtype: str) -> str:
    """One line for a model not yet loaded: weights + the KV cache one sequence holds on `runtime`, from a GGUF
    header (llama.cpp: the float16 cache it allocates whole for DEFAULT_CONTEXT positions at load, the file's bytes
    counted in `weights_bytes` as engine.formats.runtime_rule.llamacpp_bytes does; the torch engine: per position at
    `dtype`, since its cache grows with the run). A folder or an unreadable header: the weights alone."""
    from engine.formats.gguf_meta import BULK_KEYS, read_metadata
    from engine.formats.runtime_rule import DEFAULT_CONTEXT, llamacpp_bytes

    try:
        meta = read_metadata(path, skip=BULK_KEYS)
    except (OSError, ValueError):
        return f"{runtime}: weights {size(weights_bytes)}, KV cache not known"
    arch = meta.get("general.architecture")
    context = min(int(meta.get(f"{arch}.context_length", 0) or DEFAULT_CONTEXT), DEFAULT_CONTEXT)
    kv16 = llamacpp_bytes(meta, 0)  # the float16 cache of `context` positions, every layer
    if runtime == "llama.cpp":
        return (f"llama.cpp: file {size(weights_bytes - kv16)} + KV cache {size(kv16)} (float16, {context:,} "
                f"positions) = {size(weights_bytes)}")
    per_position = kv16 / context * formulas.bytes_per_value(dtype) / 2
    return (f"torch: weights {size(weights_bytes)} at {dtype} + KV cache {size(per_position)} a position "
            f"({size(per_position * context)} at {context:,})")
