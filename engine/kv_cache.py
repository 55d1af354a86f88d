"""A static, preallocated KV cache: keys and values of every past position, for every layer.

Layout per layer: (batch, n_kv_heads, capacity, head_dim). Prefill writes the whole prompt at once; each decode
step writes one position. Nothing is allocated per step: `update` copies into the preallocated buffers and
returns views of the filled part.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class KVCache:
    """Keys and values for `n_layers` layers, with `pos` positions filled (the same for every sequence of the batch)."""

    def __init__(
        self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        if capacity <= 0 or batch <= 0:
            raise ValueError(f"KV cache needs a positive batch and capacity, got {batch} and {capacity}")
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.batch, self.capacity, self.pos = batch, capacity, 0
        self._bytes_per_position = 2 * cfg.n_layers * batch * cfg.n_kv_heads * cfg.head_dim * self.k.element_size()

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv, T, hd) at positions start..start+T-1; return all keys/values up to there."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; position {end - 1} does not fit")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, n_kv, end, hd) views

    def advance(self, n: int) -> None:
        """Mark n more positions as filled (after every layer has written them)."""
        self.pos += n

    def truncate(self, pos: int) -> None:
        """Forget everything from position `pos` on (keeps a shared prefix for prefix caching)."""
        self.pos = min(self.pos, pos)

    def reset(self) -> None:
        self.pos = 0

    def fits(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str) -> bool:
        want, have = torch.device(device), self.k.device
        same_device = want.type == have.type and (want.index or 0) == (have.index or 0)  # "cuda" is "cuda:0"
        return self.batch == batch and self.capacity >= capacity and self.k.dtype == dtype and same_device

    def bytes_used(self) -> int:
        """Bytes holding real keys/values: 2 · layers · batch · kv_heads · head_dim · bytes per value · pos."""
        return self._bytes_per_position * self.pos

    def bytes_allocated(self) -> int:
        """Bytes reserved by the preallocated buffers."""
        return self._bytes_per_position * self.capacity
