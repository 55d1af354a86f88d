"""Local runtimes besides the readable torch engine, and the rule that picks one per model.

The torch engine (engine.run) is the reference every test holds the rest to; it dequantizes a GGUF's weights to
float32 (or bfloat16), which a 1B–8B model's memory cannot afford. llama.cpp (engine.backends.llamacpp) runs the file
as it is, instrumented through its graph callback, and yields the same events. `choose` decides: the torch engine
for models whose float32 weights stay small, llama.cpp for larger GGUF files when it is installed; a flag overrides.
"""

from __future__ import annotations

import os

from engine.backends.rule import (  # noqa: F401 — the rule's names, re-exported where callers look for them
    DEFAULT_CONTEXT,
    LLAMACPP_ABOVE_PARAMS,
    auto_backend,
    llamacpp_available,
    llamacpp_bytes,
)

BACKENDS = ("auto", "torch", "llama.cpp")


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
