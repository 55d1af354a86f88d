"""Local runtimes besides the readable torch engine, and the rule that picks one per model.

The torch engine (engine.run) is the reference every test holds the rest to; it dequantizes a GGUF's weights to
float32 (or bfloat16), which a 1B–8B model's memory cannot afford. llama.cpp (engine.backends.llamacpp) runs the file
as it is, instrumented through its graph callback, and yields the same events. `choose` decides: the torch engine
for models whose float32 weights stay small, llama.cpp for larger GGUF files when it is installed; a flag overrides.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from engine.formats.runtime_rule import (  # noqa: F401 — the rule's names, re-exported where callers look for them
    DEFAULT_CONTEXT,
    LLAMACPP_ABOVE_PARAMS,
    auto_backend,
    llamacpp_available,
    llamacpp_bytes,
)

if TYPE_CHECKING:
    from engine.run.session import Engine

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


# ---- the command line: a session as the arguments name it -------------------------------------------------
def lab_model_from_args(a: argparse.Namespace) -> Engine:
    """What a lab runs on: the session the arguments choose (either runtime), with --threads fixed when a count is
    given (a lab's batched products get no per-step adaptation); CliError with one sentence when the model cannot
    load."""
    if a.threads != "auto":
        import torch

        torch.set_num_threads(a.threads)
    return session_from_args(a)


def session_from_args(a: argparse.Namespace) -> Engine:
    """A Session on the model the arguments name, run by the backend they choose (CliError with one sentence when
    it cannot load)."""
    from engine.cliargs import CliError
    from engine.loaders import ModelLoadError, load
    from engine.run.session import Session

    try:
        if choose(a.model, getattr(a, "backend", "auto")) == "llama.cpp":
            from engine.backends.llamacpp import LlamaCppSession

            return LlamaCppSession(a.model, threads=a.threads)
        return Session(load(a.model, device=a.device, dtype=a.dtype, kernels=a.kernels), threads=a.threads)
    except (ModelLoadError, ValueError) as e:
        raise CliError(str(e)) from None
