"""Runtimes: one model and a KV cache of several sequences behind one interface (engine.runtime.base)."""

from __future__ import annotations

from engine.runtime.base import Row, Runtime


def runtime_class(session) -> type[Runtime]:
    """Which runtime runs a session's model: llama.cpp's for a LlamaCppSession, else the torch engine's."""
    if hasattr(session, "llama"):  # engine.backends.llamacpp.LlamaCppSession
        from engine.runtime.llamacpp import LlamaCppRuntime

        return LlamaCppRuntime
    from engine.runtime.torch import TorchRuntime

    return TorchRuntime


def runtime_of(session, n_seq: int = 1, capacity: int | None = None) -> Runtime:
    """A runtime of `n_seq` sequences of up to `capacity` positions over the model a session (or a torch
    LoadedModel) holds; the weights are shared, only the cache is new."""
    cls = runtime_class(session)
    return cls(getattr(session, "lm", session) if cls.__name__ == "TorchRuntime" else session, n_seq, capacity)


__all__ = ["Row", "Runtime", "runtime_class", "runtime_of"]
