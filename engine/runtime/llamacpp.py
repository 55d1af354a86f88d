"""The llama.cpp runtime: a GGUF model run by llama.cpp, several sequences in one batch.

It shares the model a LlamaCppSession loaded (weights are held once) and makes its own llama.cpp context: a cache
of `n_seq` sequences of `capacity` positions. By default each sequence has its own stream (`kv_unified` off: a
sequence's attention reads only its own cells, and a batch of B different prompts costs what B sequences cost);
`pooled` makes one unified pool of n_seq × capacity cells that sequences take a cell (a page of one position) at a
time, as the scheduling lab's paged cache does. A forward
pass is one `llama_batch` whose tokens carry their sequence id and position; each row's logits are read with
`llama_get_logits_ith`. The KV verbs are llama.cpp's own sequence operations (llama_memory_seq_rm / seq_cp /
seq_keep). No graph callback is set: the labs that run here ask for no captures.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from engine.costs import formulas as costs
from engine.costs.memory import STREAM_GRANULE, cells_reserved
from engine.runtime.base import Row, Runtime


def free_context(owner: object) -> None:
    """Free an owner's llama.cpp batch and context (`llama`, `_batch`, `_ctx`), once; nothing made, nothing freed."""
    L = getattr(owner, "llama", None)
    if L is None:  # refused before anything was made
        return
    if getattr(owner, "_batch", None) is not None:
        L.llama_batch_free(owner._batch)
        owner._batch = None
    if getattr(owner, "_ctx", None):
        L.llama_free(owner._ctx)
        owner._ctx = None


class LlamaCppRuntime(Runtime):
    """`session`'s model (engine.backends.llamacpp.LlamaCppSession) with a context of `n_seq` sequences."""

    def __init__(self, session, n_seq: int = 1, capacity: int | None = None, pooled: bool = False) -> None:
        capacity = session.cfg.context_length if capacity is None else capacity
        if n_seq < 1 or not 1 <= capacity <= session.cfg.context_length:
            raise ValueError(f"a runtime needs at least one sequence of 1…{session.cfg.context_length} positions, "
                             f"got {n_seq} of {capacity}")
        self.session = session
        self.info, self.cfg, self.tokenizer = session.info, session.cfg, session.tokenizer
        self.n_seq, self.capacity, self.device, self.page_size = n_seq, capacity, torch.device("cpu"), 1
        self.weight_dtype, self.kv_dtype, self.dtype_name = session.info.dtype, session.kv_dtype, session.info.file_type
        L = self.llama = session.llama
        per_seq = capacity if pooled else -(-capacity // STREAM_GRANULE) * STREAM_GRANULE
        cp = L.llama_context_default_params()
        cp.n_seq_max, cp.kv_unified = n_seq, pooled
        cp.n_ctx = n_seq * per_seq
        self.n_batch = cp.n_batch = min(cp.n_ctx, max(512, n_seq))  # a longer batch is sent in several calls
        cp.n_ubatch = min(cp.n_batch, 512)
        cp.n_outputs_max_per_seq = 0  # a verify pass reads every position's logits
        cp.n_threads = cp.n_threads_batch = session.n_threads
        cp.flash_attn_type = 1 if session.flash_attn else 0  # as the session's generations run
        cp.swa_full = True  # a cell keeps its position's keys, so `remove` can cut anywhere
        cp.no_perf = True
        self._ctx = L.llama_init_from_model(session._model, cp)
        if not self._ctx:
            raise ValueError(f"llama.cpp could not make a context of {n_seq} sequences × {per_seq} positions")
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._lengths: dict[int, int] = {}

    def close(self) -> None:
        free_context(self)

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at exit the module's globals (free_context) may be gone; the OS frees it
            self.close()

    def set_threads(self, n: int) -> None:
        self.llama.llama_set_n_threads(self._ctx, n, n)

    def cells_reserved(self, n_seq: int, capacity: int) -> int:
        return cells_reserved("llama.cpp", n_seq, capacity)  # a stream per sequence, rounded up

    def step_weight_bytes(self, rows: int) -> float:
        s = self.session  # the file's own bytes: what llama.cpp streams
        return costs.step_weight_bytes_file(self.cfg, s.file_bytes, s.embedding_file_bytes, rows=rows)

    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        self.check_fits(rows)
        out: list[torch.Tensor] = []
        chunk: list[Row] = []
        for r in rows:  # as few llama_decode calls as the batch's size allows
            if len(r.tokens) > self.n_batch:
                raise ValueError(f"{len(r.tokens)} tokens of one sequence exceed this runtime's batch of "
                                 f"{self.n_batch}")
            if chunk and sum(len(c.tokens) for c in chunk) + len(r.tokens) > self.n_batch:
                out += self._decode(chunk)
                chunk = []
            chunk.append(r)
        return out + self._decode(chunk)

    def _decode(self, rows: list[Row]) -> list[torch.Tensor]:
        L, b, V = self.llama, self._batch, self.cfg.vocab_size
        n = sum(len(r.tokens) for r in rows)
        tokens = np.ctypeslib.as_array(b.token, shape=(n,))
        pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        wants = np.ctypeslib.as_array(b.logits, shape=(n,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        spans, i = [], 0
        for r in rows:
            t, start = len(r.tokens), self._lengths.get(r.seq, 0)
            tokens[i:i + t] = r.tokens
            pos[i:i + t] = np.arange(start, start + t)
            wants[i:i + t] = 1 if r.all_logits else 0
            wants[i + t - 1] = 1
            for j in range(i, i + t):
                b.seq_id[j][0] = r.seq
            spans.append((i, t))
            i += t
        b.n_tokens = n
        rc = L.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(rows)} sequences ({n} tokens)")
        out = []
        for r, (i, t) in zip(rows, spans, strict=True):
            self._lengths[r.seq] = self._lengths.get(r.seq, 0) + t
            first = i if r.all_logits else i + t - 1
            logits = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, j), shape=(V,))
                               for j in range(first, i + t)])  # copies: the buffer is reused by the next call
            out.append(torch.from_numpy(logits if r.all_logits else logits[0]))
        return out

    def length(self, seq: int) -> int:
        return self._lengths.get(seq, 0)

    def remove(self, seq: int, start: int = 0) -> None:
        start = max(0, start)
        if start >= self.length(seq):
            return
        if not self.llama.llama_memory_seq_rm(self._mem, seq, start, -1):
            raise RuntimeError(f"llama.cpp could not forget positions {start}… of sequence {seq}")
        if start:
            self._lengths[seq] = start
        else:
            self._lengths.pop(seq, None)

    def copy(self, src: int, dst: int, n: int) -> None:
        n = min(n, self.length(src))
        self.remove(dst)
        if n:
            # between two sequences' own streams llama.cpp copies only a whole sequence (it aborts on a range)
            self.llama.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
            self._lengths[dst] = self.length(src)
            self.remove(dst, n)

    def pages_in_use(self) -> int:
        return sum(self._lengths.values())  # a cell per position held

    def keep(self, seq: int) -> None:
        self.llama.llama_memory_seq_keep(self._mem, seq)
        self._lengths = {seq: self._lengths[seq]} if seq in self._lengths else {}
