"""What the tests of engine/why share: a forward pass written by hand, with a seam at every point the hooks edit.

`by_hand` is tests.tiny_model's reference forward (Hugging Face layout, float64, no cache, no engine code) with one
addition: `edit(site, layer, value)` is called on each site's value and returns the value the pass goes on with:
    "resid" (T, d) the residual stream entering layer L (L = n_layers: entering the final norm)
    "z"     (T, H, hd) every head's output of layer L, before o_proj
    "attn"  (T, d) what attention adds to the residual;  "mlp" (T, d) what the MLP adds
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.tiny_model import CFG

Editor = Callable[[str, int, torch.Tensor], torch.Tensor]


def by_hand_logits(w: dict[str, torch.Tensor], ids: list[int], edit: Editor | None = None,
                   cfg: dict = CFG) -> torch.Tensor:
    """Logits (T, V), float64, of a full causal forward with `edit` applied at every site."""
    d, H, KV = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    hd, T = d // H, len(ids)
    W = {k: v.double() for k, v in w.items()}
    ed = edit or (lambda _site, _layer, v: v)

    def rms(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["norm_eps"]) * g

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)

    inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    x = W["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        x = ed("resid", i, x)
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(T, H, hd).transpose(0, 1)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(T, KV, hd).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5 + mask, dim=-1)
        z = ed("z", i, (att @ v).transpose(0, 1))  # (T, H, hd)
        x = x + ed("attn", i, z.reshape(T, d) @ W[p + "self_attn.o_proj.weight"].T)
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T))
        x = x + ed("mlp", i, m @ W[p + "mlp.down_proj.weight"].T)
    x = ed("resid", cfg["n_layers"], x)
    return rms(x, W["model.norm.weight"]) @ W.get("lm_head.weight", W["model.embed_tokens.weight"]).T


@pytest.fixture(scope="session")
def by_hand() -> Callable[..., torch.Tensor]:
    return by_hand_logits


def engine_logits(model: torch.nn.Module, ids: list[list[int]] | list[int]) -> torch.Tensor:
    """The engine's logits at every position, (T, V) for one row or (B, T, V) for a batch, from a fresh cache."""
    from engine.model.kv_cache import KVCache

    rows = ids if ids and isinstance(ids[0], list) else [ids]
    cache = KVCache(model.cfg, len(rows), len(rows[0]), model.lm_head.dtype)
    with torch.inference_mode():
        out = model(torch.tensor(rows), 0, cache, all_logits=True)
    return out if rows is ids else out[0]
