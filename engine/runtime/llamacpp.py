"""The llama.cpp runtime: a GGUF model run by llama.cpp, several sequences in one batch.

It shares the model a LlamaCppSession loaded (weights are held once) and makes its own llama.cpp context: a cache
of `n_seq` sequences of `capacity` positions. By default each sequence has its own stream (`kv_unified` off: a
sequence's attention reads only its own cells, and a batch of B different prompts costs what B sequences cost);
`pooled` makes one unified pool of n_seq × capacity cells that sequences take a cell (a page of one position) at a
time, as the scheduling lab's paged cache does. A forward pass is one `llama_batch`; the KV verbs are llama.cpp's
own sequence operations. No graph callback is set: the labs that run here ask for no captures.

A generation's runtime (`LlamaCppRuntime.of_session`) is instead the session's own context of one sequence, whose
graph callback (the session's `_Tap`) records what a row's Capture asks for; `captured` reads it out. The seam's runs
(engine.backends.llamacpp_seam) make a runtime with a graph callback of their own (`callback`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from engine.costs import formulas as costs
from engine.costs.memory import STREAM_GRANULE, cells_reserved
from engine.events import KVCacheGrew
from engine.model.seam import Reads
from engine.runtime.base import Captured, Row, Runtime


def free_context(owner: object) -> None:
    """Free an owner's llama.cpp batch and context (`_batch`, `_ctx`, both None until made; `llama` set before
    either), once; nothing made, nothing freed."""
    if owner._batch is not None:
        owner.llama.llama_batch_free(owner._batch)
        owner._batch = None
    if owner._ctx:
        owner.llama.llama_free(owner._ctx)
        owner._ctx = None


class LlamaCppRuntime(Runtime):
    """`session`'s model (engine.backends.llamacpp.LlamaCppSession) with a context of `n_seq` sequences."""

    _ctx = _batch = None  # until made (free_context)

    def __init__(self, session, n_seq: int = 1, capacity: int | None = None, pooled: bool = False,
                 callback=None) -> None:
        capacity = session.cfg.context_length if capacity is None else capacity
        if n_seq < 1 or not 1 <= capacity <= session.cfg.context_length:
            raise ValueError(f"a runtime needs at least one sequence of 1…{session.cfg.context_length} positions, "
                             f"got {n_seq} of {capacity}")
        self._share(session)
        self.n_seq, self.capacity, L = n_seq, capacity, self.llama
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
        if callback is not None:  # a graph callback of its own (engine.backends.llamacpp_seam): kept alive with it
            cp.cb_eval, self._callback = callback, callback
        self._ctx = L.llama_init_from_model(session._model, cp)
        if not self._ctx:
            raise ValueError(f"llama.cpp could not make a context of {n_seq} sequences × {per_seq} positions")
        self.n_ubatch = cp.n_ubatch
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self.n_cells = cp.n_ctx
        self.tap, self._owned = None, True

    def _share(self, session) -> None:
        """What every runtime over `session`'s model takes from it (the model itself: its weights are held once)."""
        self.session, self.info, self.cfg, self.tokenizer = session, session.info, session.cfg, session.tokenizer
        self.device, self.page_size, self.llama = torch.device("cpu"), 1, session.llama
        self.weight_dtype, self.kv_dtype, self.dtype_name = session.info.dtype, session.kv_dtype, session.info.file_type
        self._ids: dict[int, list[int]] = {}  # the tokens each sequence holds: its length is the one count
        self._asked = None

    @classmethod
    def of_session(cls, session) -> LlamaCppRuntime:
        """One sequence over the session's own context (freed with the session, not here): a generation's runtime,
        whose steps the session's graph callback can watch."""
        rt = cls.__new__(cls)
        rt._share(session)
        rt.n_seq, rt.capacity, rt.n_cells, rt.cannot = 1, session.cfg.context_length, session.n_ctx, session.cannot
        rt._ctx, rt._mem, rt._batch, rt.n_batch = session._ctx, session._mem, session._batch, session._batch_size
        rt.tap, rt._owned = session.tap, False
        return rt

    def close(self) -> None:
        if self._owned:
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
            t, start = len(r.tokens), self.length(r.seq)
            tokens[i:i + t] = r.tokens
            pos[i:i + t] = np.arange(start, start + t)
            wants[i:i + t] = 1 if r.all_logits else 0
            wants[i + t - 1] = 1
            for j in range(i, i + t):
                b.seq_id[j][0] = r.seq
            spans.append((i, t))
            i += t
        b.n_tokens = n
        if self.tap is not None:  # the session's own context: one sequence, whose positions the seam's edits name
            self.tap.step(self.length(rows[0].seq), n)
        asked = [r for r in rows if r.capture is not None]
        self._asked = None
        if asked:
            self._begin_tap(asked, len(rows))
        try:
            rc = L.llama_decode(self._ctx, b)
        finally:
            if asked:
                self.tap.end()
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(rows)} sequences ({n} tokens)")
        out = []
        for r, (i, t) in zip(rows, spans, strict=True):
            self._ids.setdefault(r.seq, []).extend(int(x) for x in r.tokens)
            if r.all_logits and len(rows) == 1:  # one sequence: its outputs are the whole buffer, in order
                out.append(torch.from_numpy(np.ctypeslib.as_array(L.llama_get_logits(self._ctx), shape=(t, V)).copy()))
            elif r.all_logits:
                out.append(torch.from_numpy(np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, j),
                                                                             shape=(V,)) for j in range(i, i + t)])))
            else:  # a copy: the buffer is reused by the next call
                out.append(torch.from_numpy(np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, i + t - 1),
                                                                  shape=(V,)).copy()))
        return out

    # ---- captures: the session's graph callback ------------------------------------------------------------------
    def _begin_tap(self, asked: list[Row], n_rows: int) -> None:
        if self.tap is None:
            raise ValueError("this llama.cpp context has no graph callback: only a session's own runtime captures")
        if n_rows != 1:
            raise ValueError("captures need a forward pass of one sequence")
        (row,) = asked
        c, n, start = row.capture, len(row.tokens), self.length(row.seq)
        layers = frozenset() if "attention" in self.cannot else frozenset(c.attention_layers)
        residual = c.residual_norms or c.lens_top > 0
        keep = Reads(max_attention_bytes=c.attention_max_bytes).attention_rows(self.cfg.n_heads, n, start + n)
        self.tap.begin(layers, residual, n, keep)
        self._asked = (row.seq, c, start, n)

    def captured(self, seq: int = 0) -> Captured:
        """What the graph callback recorded for `seq`'s row: attention rows as (H, rows, keys) over the keys the
        step saw (a prefill in micro-batches arrives in pieces, each over the keys cached when it ran), the
        residual stream of the newest position (L + 1, d) and its norms."""
        if self._asked is None or self._asked[0] != seq:
            return Captured(attention={})
        tap, (_, c, start, n_queries) = self.tap, self._asked
        if tap.error is not None:
            raise RuntimeError(f"reading llama.cpp's tensor {tap.error}")
        n_keys = start + n_queries
        attention = {}
        for layer in sorted(c.attention_layers):
            parts = tap.attn.get(layer)
            if not parts:
                continue
            rows = sum(p.shape[1] for p in parts)
            w = np.zeros((self.cfg.n_heads, rows, n_keys), dtype=np.float32)  # (H, n, S)
            r = 0
            for p in parts:  # a piece holds the keys cached when it ran: a real prefix of n_keys, padded beyond
                k = min(n_keys, p.shape[2])
                w[:, r:r + p.shape[1], :k] = p[:, :, :k]
                r += p.shape[1]
            attention[layer] = (w, n_queries - rows)
        L = self.cfg.n_layers
        stream = None
        if len(tap.resid) == L + 1:
            stream = np.stack([tap.resid[i] for i in range(L + 1)])  # (L + 1, d)
        norms = np.linalg.norm(stream, axis=-1).astype(np.float32) if stream is not None else None
        return Captured(attention=attention, norms=norms if c.residual_norms else None,
                        stream=stream if c.lens_top else None)

    def lens_head(self) -> torch.nn.Module:
        return self.session.lens_head()

    def kv_event(self, step: int, seq: int = 0) -> KVCacheGrew:
        per_position = self.kv_bytes_per_position()  # llama.cpp's own cache type (float16 by default)
        n = self.length(seq)
        return KVCacheGrew(step=step, n_tokens=n, bytes_used=round(per_position * n),
                           bytes_allocated=round(per_position * self.n_cells))

    # ---- positions and the KV verbs ------------------------------------------------------------------------------
    def length(self, seq: int) -> int:
        return len(self._ids.get(seq, ()))

    def held(self, seq: int) -> list[int]:
        return self._ids.setdefault(seq, [])

    def remove(self, seq: int, start: int = 0) -> None:
        start = max(0, start)
        if start >= self.length(seq):
            return
        if not self.llama.llama_memory_seq_rm(self._mem, seq, start, -1):
            raise RuntimeError(f"llama.cpp could not forget positions {start}… of sequence {seq}")
        if start:
            del self._ids[seq][start:]
        else:
            self._ids.pop(seq, None)

    def clear(self) -> None:
        """Forget every sequence, the cache's data included (after a failed step nothing in it is trusted)."""
        self.llama.llama_memory_clear(self._mem, True)
        self._ids = {}

    def copy(self, src: int, dst: int, n: int) -> None:
        n = min(n, self.length(src))
        self.remove(dst)
        if n:
            # between two sequences' own streams llama.cpp copies only a whole sequence (it aborts on a range)
            self.llama.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
            self._ids[dst] = list(self._ids[src])
            self.remove(dst, n)

    def pages_in_use(self) -> int:
        return sum(len(v) for v in self._ids.values())  # a cell per position held

    def keep(self, seq: int) -> None:
        self.llama.llama_memory_seq_keep(self._mem, seq)
        self._ids = {seq: self._ids[seq]} if seq in self._ids else {}
