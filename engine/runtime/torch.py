"""The torch runtimes: this engine's own model (engine.model.transformer) over a paged KV cache (TorchRuntime, the
labs' sequences), or over the contiguous one of a single sequence (ContiguousRuntime, a generation's).

Rows of one forward pass may sit at different positions: the model takes a start per row and the paged cache
(engine.runtime.paged) writes and returns each row's own keys. Rows with different token counts run as one pass per
count (a batch tensor is rectangular); a decode step of many sequences is one pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.events import KVCacheGrew
from engine.loaders import LoadedModel
from engine.model.kv_cache import KVCache
from engine.model.seam import Reads
from engine.runtime.base import Captured, Row, Runtime
from engine.runtime.paged import PagedKVCache

PAGE_SIZE = 16


class TorchRuntime(Runtime):
    """`lm` with a paged cache for `n_seq` sequences of up to `capacity` positions each."""

    def __init__(self, lm: LoadedModel, n_seq: int = 1, capacity: int | None = None,
                 page_size: int = PAGE_SIZE) -> None:
        capacity = lm.cfg.context_length if capacity is None else capacity
        if n_seq < 1 or not 1 <= capacity <= lm.cfg.context_length:
            raise ValueError(f"a runtime needs at least one sequence of 1…{lm.cfg.context_length} positions, "
                             f"got {n_seq} of {capacity}")
        self.lm, self.info, self.cfg, self.tokenizer = lm, lm.info, lm.cfg, lm.tokenizer
        self.n_seq, self.capacity, self.device, self.page_size = n_seq, capacity, lm.device, page_size
        self.weight_dtype = self.kv_dtype = self.dtype_name = str(lm.dtype).removeprefix("torch.")
        with torch.inference_mode():
            self.cache = PagedKVCache(lm.cfg, n_seq * -(-capacity // page_size), page_size, lm.dtype, lm.device)

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        self.check_fits(rows)
        out: list[torch.Tensor | None] = [None] * len(rows)
        for n in sorted({len(r.tokens) for r in rows}):
            group = [i for i, r in enumerate(rows) if len(r.tokens) == n]
            every = any(rows[i].all_logits for i in group)
            self.cache.bind([rows[i].seq for i in group], n)
            tokens = torch.tensor([list(rows[i].tokens) for i in group], dtype=torch.long, device=self.lm.device)
            logits = self.lm.model(tokens, self.cache, all_logits=every)  # (B, V) or (B, n, V)
            for j, i in enumerate(group):
                out[i] = logits[j] if rows[i].all_logits or not every else logits[j, -1]
        return out

    @torch.inference_mode()
    def exit_logits(self, seq: int, token: int, n_layers: int) -> torch.Tensor:
        """Logits (V,) of `token` at `seq`'s next position from its first n_layers layers through the final norm
        and the output head (early-exit drafting); those layers' keys and values are written and the position is
        taken, so the next call drafts the token after it. `remove` gives the positions back."""
        self.check_fits([Row(seq, [token])])
        self.cache.bind([seq], 1)
        return self.lm.model(torch.tensor([[token]], device=self.lm.device), self.cache, layers=n_layers)[0]

    def length(self, seq: int) -> int:
        return self.cache.lengths.get(seq, 0)

    def remove(self, seq: int, start: int = 0) -> None:
        if start <= 0:
            self.cache.release(seq)
        else:
            self.cache.truncate(seq, start)

    def copy(self, src: int, dst: int, n: int) -> None:
        with torch.inference_mode():
            self.cache.copy(src, dst, n)

    def pages_in_use(self) -> int:
        return self.cache.pages_in_use()

    def keep(self, seq: int) -> None:
        for other in [s for s in self.cache.tables if s != seq]:
            self.cache.release(other)


# What a generation's sliding-window layers may reserve beyond their ring to keep every position, so that any step of
# a long run can be recomputed for any layer (the Attention panel's rows not held); a model whose full windows cost
# more keeps the ring, and a step it let go is refused in one sentence (BENCHMARKS.md, "Long runs (issue 26)").
KEEP_ALL_WINDOW_BYTES = 256 << 20


class ContiguousRuntime(Runtime):
    """`lm` with one sequence (0) of up to `capacity` positions in the contiguous KVCache: a generation's runtime.

    A paged step gathers every layer's keys into a new tensor each step; the contiguous cache hands the model views
    of one preallocated buffer, and its decode step is the faster (BENCHMARKS.md, "One runtime"), so the one
    sequence a generation runs keeps it. `cache.pos` is the one count of positions: a step's tokens go there, and
    the tokens held are recorded only once the model has written them (a failed step leaves both as they were).
    `decode_weight_bytes`: what one decode step streams with the kernels in use (the session's figure).
    """

    def __init__(self, lm: LoadedModel, capacity: int,
                 decode_weight_bytes: Callable[[], float] | None = None) -> None:
        if not 1 <= capacity <= lm.cfg.context_length:
            raise ValueError(f"a runtime needs 1…{lm.cfg.context_length} positions, got {capacity}")
        self.lm, self.info, self.cfg, self.tokenizer = lm, lm.info, lm.cfg, lm.tokenizer
        self.n_seq, self.capacity, self.device, self.page_size = 1, capacity, lm.device, capacity
        self.weight_dtype = self.kv_dtype = self.dtype_name = str(lm.dtype).removeprefix("torch.")
        self._decode_bytes = decode_weight_bytes
        self.cache = KVCache(lm.cfg, 1, capacity, lm.dtype, lm.device, keep_all_bytes=KEEP_ALL_WINDOW_BYTES)
        self.ids: list[int] = []  # the tokens at positions 0…cache.pos − 1
        self.threads_at = bytearray()  # the thread count each position's step ran at (each count has its kernels)
        self._reads: Reads | None = None  # the last forward's, with its row's length
        self._n_fed = 0

    def fits(self, capacity: int) -> bool:
        """Whether this runtime's cache holds `capacity` positions of the model's dtype and device as it is."""
        return self.cache.fits(1, capacity, self.lm.dtype, self.lm.device)

    @torch.inference_mode()
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        self.check_fits(rows)
        (row,) = rows  # check_fits: one sequence, once
        reads = Reads.for_request(row.capture) if row.capture is not None else None
        self._reads, self._n_fed = reads, len(row.tokens)
        x = torch.tensor([list(row.tokens)], dtype=torch.long, device=self.lm.device)  # (1, T)
        logits = self.lm.model(x, self.cache, reads, all_logits=row.all_logits)[0]
        self.ids.extend(int(i) for i in row.tokens)
        self.threads_at.extend(bytes([min(torch.get_num_threads(), 255)]) * len(row.tokens))
        return [logits]

    def captured(self, seq: int = 0) -> Captured:
        r, n = self._reads, self._n_fed
        if r is None:
            return Captured(attention={})
        # batch row 0: (H, rows, S); a long prefill keeps its last rows (engine.model.seam.Reads)
        attention = {layer: (w[0], n - w.shape[2]) for layer, w in sorted(r.pattern.items())}
        return Captured(attention=attention, norms=None if r.norms is None else r.norms[0],
                        stream=None if r.stream is None else r.stream[0])

    def lens_head(self) -> torch.nn.Module:
        return self.lm.model

    def step_weight_bytes(self, rows: int) -> float:
        if rows == 1 and self._decode_bytes is not None:  # a decode step: its kernels' own bytes
            return self._decode_bytes()
        return super().step_weight_bytes(rows)

    def kv_event(self, step: int, seq: int = 0) -> KVCacheGrew:
        kv = self.cache  # local layers hold their ring or every position: the cache's own count, not the formula's
        return KVCacheGrew(step=step, n_tokens=kv.pos, bytes_used=kv.bytes_used(), bytes_allocated=kv.bytes_allocated(),
                           local_slots=kv.local_slots if kv.window else 0)

    def length(self, seq: int = 0) -> int:
        return self.cache.pos

    def held(self, seq: int = 0) -> list[int]:
        return self.ids

    def remove(self, seq: int = 0, start: int = 0) -> None:
        self.cache.truncate(max(0, start))  # a sliding-window layer may keep less than asked: pos says
        del self.ids[self.cache.pos:]
        del self.threads_at[self.cache.pos:]

    def copy(self, src: int, dst: int, n: int) -> None:
        raise ValueError("a generation's runtime holds one sequence: there is none to copy to")

    def keep(self, seq: int) -> None:
        return None  # it holds one sequence

    def pages_in_use(self) -> int:
        return 1
