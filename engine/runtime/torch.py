"""The torch runtime: this engine's own model (engine.model.transformer) over a paged KV cache.

Rows of one forward pass may sit at different positions: the model takes a start per row and the paged cache
(engine.runtime.paged) writes and returns each row's own keys. Rows with different token counts run as one pass per
count (a batch tensor is rectangular); a decode step of many sequences is one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.loaders import LoadedModel
from engine.model.transformer import ROPE_ROWS
from engine.runtime.base import Row, Runtime
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
            starts = self.cache.bind([rows[i].seq for i in group], n)
            tokens = torch.tensor([list(rows[i].tokens) for i in group], dtype=torch.long, device=self.lm.device)
            logits = self.lm.model(tokens, starts, self.cache, all_logits=every)  # (B, V) or (B, n, V)
            for j, i in enumerate(group):
                out[i] = logits[j] if rows[i].all_logits or not every else logits[j, -1]
        return out

    @torch.inference_mode()
    def exit_logits(self, seq: int, token: int, n_layers: int) -> torch.Tensor:
        """Logits (V,) of `token` at `seq`'s next position from its first n_layers layers through the final norm
        and the output head (early-exit drafting); those layers' keys and values are written and the position is
        taken, so the next call drafts the token after it. `remove` gives the positions back."""
        self.check_fits([Row(seq, [token])])
        model = self.lm.model
        start = self.cache.bind([seq], 1)  # (1,)
        end = int(start[0]) + 1
        if model.rope is None or model.rope.shape[0] < end:  # as Transformer.forward grows it
            model.init_rope(max(end, 2 * (0 if model.rope is None else model.rope.shape[0]), ROPE_ROWS))
        ropes = (model.rope[start[:, None]][:, None], model.rope_local[start[:, None]][:, None])  # (1, 1, 1, hd/2)
        x = model.tok_embeddings(torch.tensor([[token]], device=self.lm.device))  # (1, 1, d)
        if self.cfg.embedding_scale != 1.0:
            x = x * self.cfg.embedding_scale
        for layer in model.layers[:n_layers]:
            x = layer(x, start, ropes, self.cache, None)
        self.cache.advance(1)
        return model.head(x[:, -1])[0]

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
