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


def runtime_of(session, n_seq: int = 1, capacity: int | None = None, page_size: int | None = None) -> Runtime:
    """A runtime of `n_seq` sequences of up to `capacity` positions over the model a session (or a torch
    LoadedModel) holds; the weights are shared, only the cache is new. `page_size`: the cache as one pool that
    sequences draw pages from (the torch engine's pages of that many positions; llama.cpp's unified cache, a cell
    at a time); None: each runtime's default."""
    cls = runtime_class(session)
    if cls.__name__ == "TorchRuntime":
        from engine.runtime.torch import PAGE_SIZE

        return cls(getattr(session, "lm", session), n_seq, capacity, page_size=page_size or PAGE_SIZE)
    return cls(session, n_seq, capacity, pooled=page_size is not None)


__all__ = ["Row", "Runtime", "runtime_class", "runtime_of"]
