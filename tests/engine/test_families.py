"""Gemma 3, Qwen3, Phi-3, Mistral and Llama 3.1 RoPE scaling, each held to transformers' own implementation.

Every family is a tiny random transformers model (tests/tiny_families.py) loaded through the Hugging Face loader
and, where gguf can write it, through the GGUF loader; the engine's logits must equal transformers' at every
position. Each feature is also switched off once to show that the comparison would catch its absence.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from tests.requires import import_required

import_required("transformers")

from engine.loaders import load  # noqa: E402
from engine.model.kv_cache import KVCache  # noqa: E402
from engine.model.seam import Reads  # noqa: E402
from engine.model.transformer import build_model  # noqa: E402
from tests.tiny_families import FAMILIES, reference_logits, write_checkpoint  # noqa: E402

IDS = [5, 77, 140, 3, 250, 99, 12, 200, 41, 7, 66, 13, 290, 31, 8]  # 15 tokens: several sliding windows of 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {f: write_checkpoint(d, f) for f in FAMILIES}


def full_logits(model, cfg, ids, probe=None):
    device = next(model.parameters()).device
    cache = KVCache(cfg, 1, len(ids), torch.float32, device=device)
    return model(torch.tensor([ids], device=device), cache, probe, all_logits=True)[0]  # (T, V)


def _sources(checkpoints):
    return [(f, kind) for f in FAMILIES for kind in ("hf", "gguf") if kind == "hf" or FAMILIES[f]["gguf_arch"]]


@pytest.mark.parametrize(("family", "kind"), _sources({}))
def test_family_matches_transformers(checkpoints, family, kind):
    ck = checkpoints[family]
    lm = load(ck.hf_dir if kind == "hf" else ck.gguf, device="cpu", dtype="float32", use_cache=False)
    ref = reference_logits(ck.model, IDS)
    assert_close(full_logits(lm.model, lm.cfg, IDS), ref, atol=1e-4, rtol=1e-4)
    # the explicit (captured) attention path gives the same logits
    probe = Reads(range(lm.cfg.n_layers))
    assert_close(full_logits(lm.model, lm.cfg, IDS, probe), ref, atol=1e-4, rtol=1e-4)


def test_gemma3_config_from_both_loaders(checkpoints):
    ck = checkpoints["gemma3"]
    for src in (ck.hf_dir, ck.gguf):
        cfg = load(src, device="cpu", dtype="float32", use_cache=False).cfg
        assert cfg.layer_types == ("local",) * 5 + ("global", "local")
        assert (cfg.sliding_window, cfg.rope_base, cfg.rope_base_local) == (4, 1e6, 1e4)
        assert cfg.qk_norm and cfg.post_norms and cfg.mlp_activation == "gelu_tanh" and cfg.tied_embeddings
        assert cfg.embedding_scale == pytest.approx(64**0.5) and cfg.softmax_scale == pytest.approx(32**-0.5)


def _without(lm, **changes):
    cfg = dataclasses.replace(lm.cfg, **changes)
    return build_model(cfg, dict(lm.model.state_dict()), torch.float32), cfg


@pytest.mark.parametrize(("family", "changes"), [
    ("gemma3", dict(sliding_window=0, layer_types=())),  # no window
    ("gemma3", dict(rope_base_local=1e6)),  # one RoPE base for all layers
    ("gemma3", dict(embedding_scale=1.0)),
    ("gemma3", dict(mlp_activation="silu")),
    ("gemma3", dict(post_norms=False)),
    ("gemma3", dict(attn_scale=0.1)),
    ("mistral", dict(sliding_window=0, layer_types=())),
    ("llama3", dict(rope_freq_factors=())),
    ("gemma3-linear", dict(rope_freq_factors=())),
])
def test_each_feature_matters(checkpoints, family, changes):
    ck = checkpoints[family]
    lm = load(ck.hf_dir, device="cpu", dtype="float32", use_cache=False)
    ref = reference_logits(ck.model, IDS)
    if "post_norms" in changes:  # the post-norm weights have nowhere to go: drop them
        sd = {k: v for k, v in lm.model.state_dict().items() if "post_" not in k}
        cfg = dataclasses.replace(lm.cfg, **changes)
        model = build_model(cfg, sd, torch.float32)
    else:
        model, cfg = _without(lm, **changes)
    assert (full_logits(model, cfg, IDS) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_windowed_cache_decode_equals_transformers(checkpoints, family):
    """Prefill 3 tokens, decode the rest one by one (both attention paths): local layers keep ≤ 2 windows."""
    ck = checkpoints[family]
    lm = load(ck.gguf or ck.hf_dir, device="cpu", dtype="float32", use_cache=False)
    ref = reference_logits(ck.model, IDS)
    cache = KVCache(lm.cfg, 1, 64, torch.float32)
    out = [lm.model(torch.tensor([IDS[:3]]), cache)[0]]
    for p in range(3, len(IDS)):
        probe = Reads([0, lm.cfg.n_layers - 1]) if p % 2 else None
        out.append(lm.model(torch.tensor([[IDS[p]]]), cache, probe)[0])
    assert_close(torch.stack(out), ref[2:], atol=1e-4, rtol=1e-4)
    W = lm.cfg.sliding_window
    held = [cache.positions_held(i) for i in range(lm.cfg.n_layers)]
    assert all(h <= 2 * W if lm.cfg.is_local(i) else h == len(IDS) for i, h in enumerate(held))
    per_slot = 2 * lm.cfg.n_kv_heads * lm.cfg.head_dim * 4
    assert cache.bytes_used() == per_slot * sum(held) < per_slot * lm.cfg.n_layers * len(IDS)
    assert cache.bytes_allocated() == per_slot * (lm.cfg.n_global_layers * 64 + lm.cfg.n_local_layers * 2 * W)


def test_long_prefill_after_prefix_and_truncate(checkpoints):
    """A prefill longer than the local buffers after a cached prefix, and prefix reuse within / beyond reach."""
    ck = checkpoints["gemma3"]
    lm = load(ck.gguf, device="cpu", dtype="float32", use_cache=False)
    ref = reference_logits(ck.model, IDS)
    cache = KVCache(lm.cfg, 1, 64, torch.float32)
    lm.model(torch.tensor([IDS[:2]]), cache)
    last = lm.model(torch.tensor([IDS[2:]]), cache)[0]  # 13 new tokens > 2 · window slots
    assert_close(last, ref[-1], atol=1e-4, rtol=1e-4)
    assert cache.truncate(len(IDS) - 3) == len(IDS) - 3  # the window before it is still held
    assert_close(lm.model(torch.tensor([IDS[-3:]]), cache)[0], ref[-1], atol=1e-4, rtol=1e-4)
    assert cache.truncate(3) == 0  # local layers dropped positions 0..: nothing can be reused


def test_captured_attention_shows_the_window_band(checkpoints):
    ck = checkpoints["gemma3"]
    lm = load(ck.gguf, device="cpu", dtype="float32", use_cache=False)
    probe = Reads([0, 5])
    full_logits(lm.model, lm.cfg, IDS, probe)
    local, glob = probe.pattern[0][0], probe.pattern[5][0]  # (H, T, S)
    T = len(IDS)
    q, k = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    assert (local[:, (k > q) | (q - k >= 4)] == 0).all() and (local[:, (k <= q) & (q - k < 4)] > 0).all()
    assert (glob[:, k > q] == 0).all() and (glob[:, k <= q] > 0).all()
    assert abs(local.sum(-1) - 1).max() < 1e-5


@pytest.mark.parametrize("keep_all", [True, False], ids=["every position kept", "ring"])
def test_session_prefix_reuse_on_a_windowed_model(checkpoints, keep_all, monkeypatch):
    """The session's prefix caching asks the cache how far back it can resume: within the local layers' reach it
    reuses the prefix, beyond it it recomputes; a generation's local layers that keep every position (within
    engine.runtime.torch.KEEP_ALL_WINDOW_BYTES) reach back to the start. The logits are transformers' either way."""
    import engine.runtime.torch as rt
    from engine.run.session import Session

    if not keep_all:
        monkeypatch.setattr(rt, "KEEP_ALL_WINDOW_BYTES", 0)
    ck = checkpoints["gemma3"]
    s = Session(load(ck.gguf, device="cpu", dtype="float32", use_cache=False))
    ref = reference_logits(ck.model, IDS)
    logits, reuse, _ = s.next_token_logits(IDS[:12])
    assert reuse == 0
    assert_close(logits, ref[11], atol=1e-4, rtol=1e-4)
    logits, reuse, _ = s.next_token_logits(IDS)  # the 12 cached positions are still reachable
    assert reuse == 12
    assert_close(logits, ref[-1], atol=1e-4, rtol=1e-4)
    other = IDS[:5] + [9, 10, 11]
    logits, reuse, _ = s.next_token_logits(other)  # a ring's local layers dropped positions < 7: start again
    assert reuse == (5 if keep_all else 0)
    assert_close(logits, reference_logits(ck.model, other)[-1], atol=1e-4, rtol=1e-4)


def test_phi3_with_a_sliding_window(tmp_path):
    """Phi-3-mini-4k's config states sliding_window 2047: transformers then masks every layer; so does the engine."""
    ck = write_checkpoint(tmp_path, "phi3", sliding_window=4)
    lm = load(ck.hf_dir, device="cpu", dtype="float32", use_cache=False)
    assert lm.cfg.sliding_window == 4 and lm.cfg.n_local_layers == lm.cfg.n_layers
    assert_close(full_logits(lm.model, lm.cfg, IDS), reference_logits(ck.model, IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_residual_norms_match_transformers_hidden_states(checkpoints, family):
    """The residual-stream norms a panel shows (after the embedding, then after each layer) are the L2 norms of
    transformers' own hidden states at the last position (its last entry is after the final norm: left out)."""
    ck = checkpoints[family]
    lm = load(ck.hf_dir, device="cpu", dtype="float32", use_cache=False)
    probe = Reads(norms=True)
    full_logits(lm.model, lm.cfg, IDS, probe)
    with torch.no_grad():
        hidden = ck.model(torch.tensor([IDS]), output_hidden_states=True).hidden_states
    ref = np.array([h[0, -1].float().norm().item() for h in hidden[:-1]])
    got = probe.norms[0]
    assert got.shape == (lm.cfg.n_layers + 1,)
    np.testing.assert_allclose(got[:-1], ref, rtol=1e-4)
