"""Rotary position embeddings (RoPE), one convention for the whole engine.

Convention: **adjacent pairs**. Each head vector x of size head_dim is read as head_dim/2 pairs
(x[2i], x[2i+1]); pair i at position p is rotated by the angle p · base^(-2i/head_dim).

This is the layout llama.cpp's converter writes into GGUF files for Llama models (it permutes the rows of attn_q
and attn_k). Hugging Face checkpoints use the "rotate halves" layout instead (pairs (x[i], x[i + head_dim/2])),
so loaders reorder the rows of q/k weights with `halves_to_pairs` and the same rotation code serves both.
"""

from __future__ import annotations

import torch


def rope_table(head_dim: int, max_pos: int, base: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """cos/sin table as complex numbers e^{i·p·θ_j}: shape (max_pos, head_dim // 2), complex64."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)  # (max_pos, hd/2)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x (B, H, T, hd) by table rows (T, hd/2); returns x's dtype."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, H, T, hd/2)
    return torch.view_as_real(xc * table).flatten(-2).to(x.dtype)  # (B, H, T, hd)


def halves_to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows (or biases) from the rotate-halves layout to adjacent pairs.

    Within each head, row j of the first half and row j of the second half become rows 2j and 2j+1.
    """
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
