"""A static, preallocated KV cache: keys and values of past positions, for every layer.

Layout per layer: (batch, n_kv_heads, slots, head_dim). Prefill writes the whole prompt at once; each decode
step writes one position. Nothing is allocated per step in the common case: `update` copies into the
preallocated buffers and returns views of the part the new queries may read.

Global layers keep every position (slots = capacity). Local (sliding-window) layers need only the last
`window` positions, so their buffers hold `min(capacity, 2 · window)` slots: positions base..base+slots-1 — or every
position, when keeping them all costs at most `keep_all_bytes` more (a generation's cache: then any step of the run
can be run again for any layer, engine.run.recompute).
When a write would run past the end, the newest `window - 1` positions (and the ones being written) move to the
front, once every ~window tokens, so memory stays bounded at any context. Keeping up to twice the window also
lets prefix caching step back up to `window` positions without losing anything the next query needs.
"""

from __future__ import annotations

import itertools

import torch

from engine.model.config import ModelConfig

_EPOCHS = itertools.count(1)  # KVCache.epoch: unique across caches, so a new one never matches an old record


class KVCache:
    """Keys and values for `n_layers` layers, with `pos` positions filled (the same for every sequence of the batch)."""

    def __init__(
        self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu",
        keep_all_bytes: int = 0,
    ) -> None:
        if capacity <= 0 or batch <= 0:
            raise ValueError(f"KV cache needs a positive batch and capacity, got {batch} and {capacity}")
        self.window = cfg.sliding_window
        self.local_slots = min(capacity, 2 * self.window) if self.window else capacity
        self._bytes_per_slot = 2 * batch * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
        if cfg.n_local_layers * (capacity - self.local_slots) * self._bytes_per_slot <= keep_all_bytes:
            self.local_slots = capacity  # no ring: every position stays where it was written
        self.slots = [self.local_slots if cfg.is_local(i) else capacity for i in range(cfg.n_layers)]
        self.k = [torch.empty((batch, cfg.n_kv_heads, n, cfg.head_dim), dtype=dtype, device=device)
                  for n in self.slots]
        self.v = [torch.empty_like(k) for k in self.k]
        self.base = [0] * cfg.n_layers  # absolute position held in slot 0
        self.first = [0] * cfg.n_layers  # absolute position of the first key the last update returned
        self.local = [cfg.is_local(i) for i in range(cfg.n_layers)]
        self.batch, self.capacity, self.pos = batch, capacity, 0
        self.dtype, self.device = dtype, self.k[0].device
        self.epoch = next(_EPOCHS)  # new whenever a position it holds may be written again (a truncate, a new cache)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hd) at positions start..start+T-1; return the keys/values the new queries read.

        A global layer returns positions 0..start+T-1. A local layer returns positions from
        max(0, start - window + 1) on (`first_position(layer)` tells where they begin); the caller masks the band.
        """
        T = k.shape[2]
        end = start + T
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; position {end - 1} does not fit")
        if not self.local[layer]:
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v
            self.first[layer] = 0
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # (B, n_kv, end, hd) views
        kb, vb, base = self.k[layer], self.v[layer], self.base[layer]
        need = max(0, start - self.window + 1)  # the oldest key the first new query reads
        if need < base:
            raise ValueError(f"the cache of local layer {layer} no longer holds position {need}")
        self.first[layer] = need
        if end - base <= self.slots[layer]:  # fits where it is
            kb[:, :, start - base:end - base] = k
            vb[:, :, start - base:end - base] = v
            return kb[:, :, need - base:end - base], vb[:, :, need - base:end - base]
        # Past the end: read the band from a fresh tensor, then keep the newest positions at the front.
        k_all = torch.cat([kb[:, :, need - base:start - base], k], dim=2)  # (B, n_kv, end - need, hd)
        v_all = torch.cat([vb[:, :, need - base:start - base], v], dim=2)
        new_base = max(need, end - self.slots[layer])
        kb[:, :, : end - new_base] = k_all[:, :, new_base - need:].clone()
        vb[:, :, : end - new_base] = v_all[:, :, new_base - need:].clone()
        self.base[layer] = new_base
        return k_all, v_all

    def first_position(self, layer: int) -> int:
        """Absolute position of the first key `update` returned for this layer (0 for global layers)."""
        return self.first[layer]

    @property
    def start(self) -> int:
        """Where the next forward pass's tokens go: the one count of positions."""
        return self.pos

    def advance(self, n: int) -> None:
        """Mark n more positions as filled (after every layer has written them)."""
        self.pos += n

    def truncate(self, pos: int) -> int:
        """Forget everything from position `pos` on (prefix caching); returns the position actually kept.

        A local layer that has already dropped the window before `pos` cannot resume there; then nothing is kept.
        """
        pos = min(self.pos, pos)
        need = max(0, pos - self.window + 1) if self.window else 0
        if any(local and need < base for local, base in zip(self.local, self.base, strict=True)):
            pos = 0
        if pos == 0:
            self.base = [0] * len(self.base)
        self.pos = pos
        self.epoch = next(_EPOCHS)
        return pos

    def fits(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str) -> bool:
        want, have = torch.device(device), self.device
        same_device = want.type == have.type and (want.index or 0) == (have.index or 0)  # "cuda" is "cuda:0"
        return self.batch == batch and self.capacity >= capacity and self.dtype == dtype and same_device

    def reads_back(self, p: int) -> bool:
        """Whether every layer still holds the keys a query at position p < pos read (a sliding-window layer keeps
        only its newest positions)."""
        first = max(0, p - self.window + 1) if self.window else 0
        return p < self.pos and not any(local and first < base for local, base in zip(self.local, self.base,
                                                                                        strict=True))

    def positions_held(self, layer: int) -> int:
        """Positions whose keys/values this layer still holds: pos, or at most its slots for a local layer."""
        return self.pos - self.base[layer] if self.local[layer] else self.pos

    def bytes_used(self) -> int:
        """Bytes holding real keys/values: 2 · batch · kv_heads · head_dim · bytes per value · Σ positions held."""
        return self._bytes_per_slot * sum(self.positions_held(i) for i in range(len(self.slots)))

    def bytes_allocated(self) -> int:
        """Bytes reserved by the preallocated buffers (local layers reserve their `local_slots`)."""
        return self._bytes_per_slot * sum(self.slots)


class ReadOnlyCache:
    """The KV cache as a one-token forward pass at position p reads it: views of the keys and values the step read,
    nothing written, nothing advanced (the interface Attention and Transformer use: update, first_position,
    advance)."""

    def __init__(self, cache: KVCache, p: int) -> None:
        self.cache, self.p, self.start = cache, p, p
        self.first = [0] * len(cache.k)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, p = self.cache, self.p
        if start != p or k.shape[2] != 1:
            raise ValueError(f"a read-only cache serves one query at position {p}, not {k.shape[2]} at {start}")
        base = c.base[layer] if c.local[layer] else 0
        first = max(0, p - c.window + 1) if c.local[layer] else 0  # the band a sliding-window query reads
        self.first[layer] = first
        held = slice(first - base, p + 1 - base)  # positions first…p in this layer's slots
        return c.k[layer][:, :, held], c.v[layer][:, :, held]  # (1, KV, S, hd) views

    def first_position(self, layer: int) -> int:
        return self.first[layer]

    def advance(self, n: int) -> None:
        pass
