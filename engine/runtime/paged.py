"""A paged KV cache: the torch runtime's memory for several sequences, each at its own length.

Keys and values live in pages of `page_size` positions drawn from one pool; each sequence owns a page table, so a
sequence holds memory for the positions it has (rounded up to a page), not a reservation for the longest it could
become. `lengths` is the one count of positions each sequence holds; the model places new tokens after it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.config import ModelConfig


class PagedKVCache:
    """Keys and values in pages of `page_size` positions drawn from one pool; each request owns a page table.

    Pool per layer: (n_pages, KV, page_size, hd). Position p of a request lives in page table[p // page_size] at
    offset p % page_size. `bind` fixes the rows of the next forward step; the model then calls `update`, which
    writes each row's new keys at its own positions and returns every row's keys gathered into (B, KV, S, hd),
    S = the longest row's length; the model's mask hides each row's keys past its own last query.
    """

    def __init__(self, cfg: ModelConfig, n_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"a paged cache needs at least one page of one position, got {n_pages} × {page_size}")
        shape = (n_pages, cfg.n_kv_heads, page_size, cfg.head_dim)
        # zeros, not empty: a row's masked keys still meet a 0 weight in weights @ v, and 0 · NaN would be NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.page_size, self.n_pages, self.device = page_size, n_pages, self.k[0].device
        self.free = list(range(n_pages - 1, -1, -1))  # popped from the end: page 0 first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # positions written per request
        self.start = torch.zeros(0, dtype=torch.long, device=device)  # the bound rows' starts (bind)
        self._rows: list[int] = []
        self._table = torch.zeros((1, 1), dtype=torch.long)
        self._end = 0

    def pages_in_use(self) -> int:
        return self.n_pages - len(self.free)

    def pages_of(self, request_id: int) -> int:
        return len(self.tables.get(request_id, ()))

    def bind(self, request_ids: Sequence[int], n_new: int) -> torch.Tensor:
        """Rows of the next step: allocate pages for n_new more positions of each; returns their starts (B,), which
        the next forward pass reads as `start`."""
        starts = []
        for rid in request_ids:
            table = self.tables.setdefault(rid, [])
            length = self.lengths.setdefault(rid, 0)
            self._grow(table, length + n_new)
            starts.append(length)
        self._rows = list(request_ids)
        width = max(len(self.tables[r]) for r in request_ids)
        self._table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in request_ids],
                                   dtype=torch.long, device=self.device)  # (B, pages); padding reads page 0
        self._end = max(starts) + n_new
        self.start = torch.tensor(starts, dtype=torch.long, device=self.device)
        return self.start

    def _grow(self, table: list[int], n_positions: int) -> None:
        need = -(-n_positions // self.page_size)  # ceil
        while len(table) < need:
            if not self.free:
                raise RuntimeError("the KV page pool is exhausted")  # sized so that it cannot be
            table.append(self.free.pop())

    def release(self, request_id: int) -> None:
        """The request ended: its pages go back to the pool."""
        self.free.extend(reversed(self.tables.pop(request_id, [])))
        self.lengths.pop(request_id, None)

    def truncate(self, request_id: int, n: int) -> None:
        """Keep the first n positions of a request; pages past them go back to the pool."""
        table = self.tables.get(request_id, [])
        n = min(n, self.lengths.get(request_id, 0))
        keep = -(-n // self.page_size)
        self.free.extend(reversed(table[keep:]))
        del table[keep:]
        self.lengths[request_id] = n

    def copy(self, src: int, dst: int, n: int) -> None:
        """Give request `dst` the first n positions of `src` (its own pages, copied: later writes stay apart)."""
        n = min(n, self.lengths.get(src, 0))
        self.release(dst)
        table = self.tables.setdefault(dst, [])
        self._grow(table, n)
        pages = -(-n // self.page_size)
        from_pages = torch.tensor(self.tables[src][:pages], dtype=torch.long, device=self.device)
        to_pages = torch.tensor(table, dtype=torch.long, device=self.device)
        for k, v in zip(self.k, self.v, strict=True):
            k[to_pages] = k[from_pages]
            v[to_pages] = v[from_pages]
        self.lengths[dst] = n

    def update(self, layer: int, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, KV, T, hd) at each row's positions start[b]..start[b]+T-1; return (B, KV, S, hd) each."""
        B, KV, T, hd = k.shape
        P = self.page_size
        pos = start[:, None] + torch.arange(T, device=start.device)  # (B, T)
        page = self._table.gather(1, pos // P)  # (B, T) physical page of each new position
        self.k[layer][page, :, pos % P] = k.transpose(1, 2)  # (B, T, KV, hd) into (pages, KV, P, hd)
        self.v[layer][page, :, pos % P] = v.transpose(1, 2)
        n = -(-self._end // P)
        table = self._table[:, :n].reshape(-1)  # (B·n,)
        # gathered (B, n, KV, P, hd) → (B, KV, n·P, hd): one copy per layer and step, what a paged-attention
        # kernel avoids by reading the pages in place. index_select, not pool[table]: advanced indexing made the
        # paged step several times the contiguous one on a CPU (BENCHMARKS.md, "One runtime").
        k_all = self.k[layer].index_select(0, table).view(B, n, KV, P, hd).transpose(1, 2)
        v_all = self.v[layer].index_select(0, table).view(B, n, KV, P, hd).transpose(1, 2)
        return (k_all.reshape(B, KV, n * P, hd)[:, :, : self._end],
                v_all.reshape(B, KV, n * P, hd)[:, :, : self._end])

    def first_position(self, layer: int) -> int:
        return 0  # every layer returns positions from 0 (a local layer's window is in the mask)

    def advance(self, n: int) -> None:
        for rid in self._rows:
            self.lengths[rid] += n
