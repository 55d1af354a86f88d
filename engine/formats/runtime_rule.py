"""The rule that picks a local runtime per model, and what llama.cpp needs in memory: facts only, no engine imports,
so the model list (engine.formats.discover) and the chooser (engine.backends) both read it without a circle."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

# Above this many parameters a GGUF goes to llama.cpp: its float32 copy (4 bytes a weight) would pass 4 GB, which a
# 16–24 GB machine feels, while llama.cpp keeps about the file's own size (BENCHMARKS.md, "llama.cpp backend").
LLAMACPP_ABOVE_PARAMS = 1_000_000_000
DEFAULT_CONTEXT = 4096  # positions llama.cpp's KV cache holds when the caller names none (capped by the model's own)


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def auto_backend(is_gguf: bool, n_params: int | None) -> str:
    """What "auto" runs a model on, from its format and parameter count."""
    return "llama.cpp" if is_gguf and (n_params or 0) >= LLAMACPP_ABOVE_PARAMS and llamacpp_available() else "torch"


def llamacpp_bytes(meta: Mapping[str, Any], file_bytes: int) -> int:
    """Memory llama.cpp needs for a GGUF, from its header: the file (read once into llama.cpp's buffers, repacked or
    as it is; the backend does not map it, so it is not held twice) plus the float16 KV cache, allocated whole at
    load for DEFAULT_CONTEXT positions in every layer (sliding-window layers too: the backend keeps their cache full
    size)."""
    arch = meta.get("general.architecture")

    def number(key: str, default: int = 0) -> int:
        v = meta.get(f"{arch}.{key}", default)
        return int(max(v)) if hasattr(v, "__len__") and len(v) else int(v)  # a per-layer array: its largest

    n_layers, n_heads = number("block_count"), max(number("attention.head_count", 1), 1)
    n_kv = number("attention.head_count_kv") or n_heads
    k_dim = number("attention.key_length") or number("embedding_length") // n_heads
    v_dim = number("attention.value_length") or k_dim
    context = min(number("context_length") or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    return file_bytes + n_layers * n_kv * (k_dim + v_dim) * 2 * context
