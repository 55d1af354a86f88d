"""Runtimes: one model and a KV cache of several sequences behind one interface (engine.runtime.base).

A session makes the runtimes of its model (`new_runtime`): the torch engine's (engine.runtime.torch) or llama.cpp's
(engine.runtime.llamacpp), the weights shared and only the cache new.
"""

from __future__ import annotations

from engine.runtime.base import Row, Runtime


def runtime_of(session, n_seq: int = 1, capacity: int | None = None, page_size: int | None = None) -> Runtime:
    """The session's `new_runtime`: `n_seq` sequences of up to `capacity` positions; `page_size`: the cache as one
    pool that sequences draw pages from (None: each runtime's default)."""
    return session.new_runtime(n_seq, capacity, page_size)


__all__ = ["Row", "Runtime", "runtime_of"]
