"""Runtimes: one model and a KV cache of several sequences behind one interface (engine.runtime.base)."""

from __future__ import annotations

from engine.runtime.base import Row, Runtime


def runtime_of(session, n_seq: int = 1, capacity: int | None = None) -> Runtime:
    """A runtime over the model a session holds: llama.cpp's for a LlamaCppSession, else the torch engine's."""
    if hasattr(session, "llama"):  # engine.backends.llamacpp.LlamaCppSession
        from engine.runtime.llamacpp import LlamaCppRuntime

        return LlamaCppRuntime(session, n_seq, capacity)
    from engine.runtime.torch import TorchRuntime

    return TorchRuntime(getattr(session, "lm", session), n_seq, capacity)


__all__ = ["Row", "Runtime", "runtime_of"]
