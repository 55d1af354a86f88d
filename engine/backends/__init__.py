"""Local runtimes besides the readable torch engine, and the rule that picks one per model.

The torch engine (engine.run) is the reference every test holds the rest to; it dequantizes a GGUF's weights to
float32 (or bfloat16), which a 1B–8B model's memory cannot afford. llama.cpp (engine.backends.llamacpp) runs the file
as it is, instrumented through its graph callback, and yields the same events. `choose` decides: the torch engine
for models whose float32 weights stay small, llama.cpp for larger GGUF files when it is installed; a flag overrides.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

BACKENDS = ("auto", "torch", "llama.cpp")
# Above this many parameters a GGUF goes to llama.cpp: its float32 copy (4 bytes a weight) would pass 4 GB, which a
# 16–24 GB machine feels, while llama.cpp keeps about the file's own size (BENCHMARKS.md, "llama.cpp backend").
LLAMACPP_ABOVE_PARAMS = 1_000_000_000
DEFAULT_CONTEXT = 4096  # positions llama.cpp's KV cache holds when the caller names none (capped by the model's own)


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def choose(model: str | os.PathLike | None, requested: str = "auto") -> str:
    """"torch" or "llama.cpp" for `model` (ValueError with one sentence for a choice that cannot be made)."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}: choose {', '.join(BACKENDS)}")
    if requested == "llama.cpp" and not llamacpp_available():
        raise ValueError("the llama.cpp backend needs llama-cpp-python: pip install '.[llama]' (make test installs it)")
    if requested != "auto":
        return requested
    from engine.formats.discover import read_model_facts
    from engine.formats.locate import resolve_model_path

    try:
        path = resolve_model_path(model)
    except Exception:  # noqa: BLE001 — the loader says what is wrong with it, in one sentence
        return "torch"
    if path.suffix.lower() != ".gguf" or not llamacpp_available():
        return "torch"
    return auto_backend(True, read_model_facts(path, path.name, "file").n_params)


def auto_backend(is_gguf: bool, n_params: int | None) -> str:
    """What "auto" runs a model on, from its format and parameter count."""
    return "llama.cpp" if is_gguf and (n_params or 0) >= LLAMACPP_ABOVE_PARAMS and llamacpp_available() else "torch"


def llamacpp_bytes(meta: Mapping[str, Any], file_bytes: int) -> int:
    """Memory llama.cpp needs for a GGUF, from its header: the file (mapped as it is: its weights are never copied)
    plus the float16 KV cache, allocated whole at load for DEFAULT_CONTEXT positions in every layer (sliding-window
    layers too: the backend keeps their cache full size)."""
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
