"""The model against an independent reference, both loaders, both attention paths, and the KV cache."""

import dataclasses

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from engine.loaders import ModelLoadError, load
from engine.model.kv_cache import KVCache
from engine.model.rope import halves_to_pairs
from engine.model.seam import Reads
from tests.tiny_model import (
    CFG,
    llama_cpp_permute,
    random_hf_weights,
    reference_logits,
    write_hf_dir,
)

IDS = [5, 77, 140, 3, 250, 99, 12, 200, 41, 7, 66]


def full_logits(lm, ids):
    cache = KVCache(lm.cfg, 1, len(ids), lm.dtype, device=lm.device)
    return lm.model(torch.tensor([ids], device=lm.device), cache, all_logits=True)[0]  # (T, V)


def test_gguf_loader_matches_reference(tiny_dir, tiny_lm):
    ref = reference_logits(tiny_dir.hf_weights, IDS).float()
    assert_close(full_logits(tiny_lm, IDS), ref, atol=2e-4, rtol=1e-4)


def test_hf_loader_matches_gguf_loader(tiny_dir, tiny_lm):
    hf = load(tiny_dir.hf_dir, device="cpu", dtype="float32")
    assert hf.cfg.n_kv_heads == CFG["n_kv_heads"] and hf.cfg.group_size == 2
    assert_close(full_logits(hf, IDS), full_logits(tiny_lm, IDS), atol=1e-5, rtol=1e-5)


def test_qwen2_style_biases_through_hf_loader(tmp_path):
    w = random_hf_weights(seed=3, qkv_bias=True)
    lm = load(write_hf_dir(tmp_path / "qwen", w, model_type="qwen2"), device="cpu", dtype="float32")
    assert lm.cfg.qkv_bias
    assert_close(full_logits(lm, IDS), reference_logits(w, IDS).float(), atol=2e-4, rtol=1e-4)


def test_tied_embeddings_have_no_output_matrix(tmp_path):
    w = random_hf_weights(seed=4, tied=True)
    lm = load(write_hf_dir(tmp_path / "tied", w, tied=True), device="cpu", dtype="float32")
    assert lm.model.output is None and lm.cfg.tied_embeddings
    assert_close(full_logits(lm, IDS), reference_logits(w, IDS).float(), atol=2e-4, rtol=1e-4)


def test_permutation_is_the_inverse_of_llama_cpp():
    w = torch.randn(8 * 16, 5)
    assert torch.equal(halves_to_pairs(w, 8), torch.from_numpy(llama_cpp_permute(w.numpy(), 8)))


def test_sdpa_and_explicit_attention_agree(tiny_lm):
    ids = torch.tensor([IDS])
    c1, c2 = KVCache(tiny_lm.cfg, 1, 32, torch.float32), KVCache(tiny_lm.cfg, 1, 32, torch.float32)
    probe = Reads(range(tiny_lm.cfg.n_layers), norms=True)
    fast = tiny_lm.model(ids, c1, None, all_logits=True)
    slow = tiny_lm.model(ids, c2, probe, all_logits=True)
    assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    w = probe.pattern[1][0]  # (H, T, T)
    assert w.shape == (CFG["n_heads"], len(IDS), len(IDS))
    assert abs(w.sum(-1) - 1).max() < 1e-5  # every row is a distribution
    above = np.triu_indices(len(IDS), 1)
    assert (w[:, above[0], above[1]] == 0).all()  # causal: no query reads a later key
    assert probe.norms.shape == (1, CFG["n_layers"] + 1)


def test_cached_decode_equals_full_forward(tiny_lm):
    """Prefill 6 tokens, then decode the rest one at a time: every step's logits equal the full forward's."""
    full = full_logits(tiny_lm, IDS)
    cache = KVCache(tiny_lm.cfg, 1, 64, torch.float32)
    out = [tiny_lm.model(torch.tensor([IDS[:6]]), cache)[0]]
    for p in range(6, len(IDS)):
        probe = Reads([0]) if p % 2 else None  # mix both attention paths
        out.append(tiny_lm.model(torch.tensor([[IDS[p]]]), cache, probe)[0])
    assert cache.pos == len(IDS)
    assert_close(torch.stack(out), full[5:], atol=2e-5, rtol=1e-5)


def test_prefill_after_a_cached_prefix_equals_full_forward(tiny_lm):
    full = full_logits(tiny_lm, IDS)
    cache = KVCache(tiny_lm.cfg, 1, 64, torch.float32)
    tiny_lm.model(torch.tensor([IDS[:4]]), cache)
    for probe in (None, Reads([1])):
        cache.truncate(4)
        last = tiny_lm.model(torch.tensor([IDS[4:]]), cache, probe)[0]
        assert_close(last, full[-1], atol=2e-5, rtol=1e-5)


def test_batch_rows_are_independent(tiny_lm):
    a, b = IDS[:8], IDS[3:11]
    cache = KVCache(tiny_lm.cfg, 2, 16, torch.float32)
    both = tiny_lm.model(torch.tensor([a, b]), cache)
    assert_close(both[0], full_logits(tiny_lm, a)[-1], atol=2e-5, rtol=1e-5)
    assert_close(both[1], full_logits(tiny_lm, b)[-1], atol=2e-5, rtol=1e-5)


def test_bfloat16_stays_close_to_float32(tiny_dir, tiny_lm):
    bf = load(tiny_dir.gguf, device="cpu", dtype="bfloat16", use_cache=False)
    lf, lb = full_logits(tiny_lm, IDS), full_logits(bf, IDS)
    assert lb.dtype == torch.float32  # logits are returned as float32 whatever the weights are
    assert (lf.argmax(-1) == lb.argmax(-1)).float().mean() > 0.8
    assert_close(lb, lf, atol=0.3, rtol=0.1)


def test_kv_cache_bytes():
    from engine.model.config import PRESETS

    cfg = PRESETS["tiny-test"]
    c = KVCache(cfg, 1, 10, torch.float32)
    k = torch.zeros(1, cfg.n_kv_heads, 3, cfg.head_dim)
    for layer in range(cfg.n_layers):
        c.update(layer, 0, k, k)
    c.advance(3)
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    assert (c.bytes_used(), c.bytes_allocated()) == (3 * per_token, 10 * per_token)
    with pytest.raises(ValueError, match="does not fit"):
        c.update(0, 9, k, k)
    # reusable for a smaller or equal request on the same device, however the device is spelled ("cuda" = "cuda:0")
    assert c.fits(1, 8, torch.float32, "cpu") and c.fits(1, 10, torch.float32, torch.device("cpu", 0))
    assert not c.fits(1, 11, torch.float32, "cpu") and not c.fits(2, 8, torch.float32, "cpu")


def test_corrupt_and_unknown_models_give_one_clear_error(tmp_path, tiny_dir):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load(bad, use_cache=False)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(tiny_dir.gguf.read_bytes()[:5000])
    with pytest.raises(ModelLoadError):
        load(trunc, use_cache=False)
    with pytest.raises(ModelLoadError, match="not found"):
        load(tmp_path / "nope.gguf")
    d = tmp_path / "gpt"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt_neox'"):
        load(d)


def test_gguf_cache_round_trip(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path / "cache"))
    first = load(tiny_dir.gguf, device="cpu", dtype="float32")
    second = load(tiny_dir.gguf, device="cpu", dtype="float32")
    assert not first.info.from_cache and second.info.from_cache
    assert_close(full_logits(first, IDS), full_logits(second, IDS))
    assert second.tokenizer.encode("hello there").ids == first.tokenizer.encode("hello there").ids


@pytest.mark.parametrize("damage", ["truncate", "config"])
def test_a_damaged_weight_cache_is_rebuilt(tiny_dir, tmp_path, monkeypatch, damage):
    """A cache cut short (a crash, a full disk) or unreadable is converted again from the source, not reported."""
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path / "cache"))
    first = load(tiny_dir.gguf, device="cpu", dtype="float32")
    (weights,) = (tmp_path / "cache").rglob("model.safetensors")
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        (weights.parent / "config.json").write_text("{not json")
    again = load(tiny_dir.gguf, device="cpu", dtype="float32")
    assert not again.info.from_cache
    assert_close(full_logits(again, IDS), full_logits(first, IDS))
    assert load(tiny_dir.gguf, device="cpu", dtype="float32").info.from_cache  # and the cache is whole again


def test_rope_table_grows_with_the_positions_used(tiny_lm):
    """The RoPE table is built for the positions a run reaches, not for the whole claimed context at load."""
    from engine.model.rope import rope_table
    from engine.model.transformer import ROPE_ROWS, build_model

    cfg = dataclasses.replace(tiny_lm.cfg, context_length=16_000_000)  # a 16M-token table would be ~1 GB
    net = build_model(cfg, tiny_lm.model.state_dict())
    assert net.rope.shape[0] == ROPE_ROWS
    cache = KVCache(cfg, 1, ROPE_ROWS + 8, torch.float32)
    net(torch.zeros(1, ROPE_ROWS, dtype=torch.long), cache)
    net(torch.tensor([[5, 6, 7]]), cache)  # positions past the first table
    assert net.rope.shape[0] == 2 * ROPE_ROWS
    torch.testing.assert_close(net.rope, rope_table(cfg.head_dim, 2 * ROPE_ROWS, cfg.rope_base))
