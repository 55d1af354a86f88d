"""Rotary position embeddings (RoPE), one convention for the whole engine.

Convention: **adjacent pairs**. Each head vector x of size head_dim is read as head_dim/2 pairs
(x[2i], x[2i+1]); pair i at position p is rotated by the angle p · base^(-2i/head_dim).

This is the layout llama.cpp's converter writes into GGUF files for Llama models (it permutes the rows of attn_q
and attn_k). Hugging Face checkpoints use the "rotate halves" layout instead (pairs (x[i], x[i + head_dim/2])),
so loaders reorder the rows of q/k weights with `halves_to_pairs` and the same rotation code serves both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def rope_table(
    head_dim: int, max_pos: int, base: float, device: torch.device | str = "cpu",
    freq_factors: Sequence[float] = (),
) -> torch.Tensor:
    """cos/sin table as complex numbers e^{i·p·θ_j}: shape (max_pos, head_dim // 2), complex64.

    θ_j = base^(-2j/head_dim) / freq_factors[j] (RoPE scaling divides some frequencies; none by default).
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hd/2,)
    if len(freq_factors):
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
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


def halves_to_pairs_all(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Reorder every q/k projection (weights, biases) and q/k norm weight of an engine-named state dict.

    The q/k norms scale each head dimension, so their weights move with the rows they scale (one "head").
    """
    out = {}
    for name, w in sd.items():
        if name.endswith((".attn.wq.weight", ".attn.wq.bias")):
            w = halves_to_pairs(w, cfg.n_heads)
        elif name.endswith((".attn.wk.weight", ".attn.wk.bias")):
            w = halves_to_pairs(w, cfg.n_kv_heads)
        elif name.endswith((".attn.q_norm.weight", ".attn.k_norm.weight")):
            w = halves_to_pairs(w, 1)
        out[name] = w
    return out


def scaling_freq_factors(scaling: dict, head_dim: int, base: float) -> tuple[float, ...]:
    """The per-pair frequency divisors of a Hugging Face `rope_scaling` entry (types "linear" and "llama3").

    llama3 (Llama 3.1/3.2): wavelengths 2π/θ longer than original_context / low_freq_factor are slowed by
    `factor`, those shorter than original_context / high_freq_factor are kept, and the band between is blended
    linearly in original_context / wavelength. llama.cpp writes the same divisors into GGUF as `rope_freqs`.
    """
    kind = scaling.get("rope_type") or scaling.get("type")
    n = head_dim // 2
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (factor,) * n
    if kind != "llama3":
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    out = []
    for j in range(n):
        wavelen = 2 * math.pi * base ** (2 * j / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)
