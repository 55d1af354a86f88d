"""A server's model shapes (engine.remote.shapes): read from the config.json of the directory vLLM reports as
`root`, else one line on what is missing; the measured decode rate costed with them."""

from __future__ import annotations

import json

import pytest

from engine.costs import formulas as costs
from engine.remote.shapes import measured_decode, server_model_config

# SmolLM2-135M's published config.json (huggingface.co/HuggingFaceTB/SmolLM2-135M), 134,515,008 parameters
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000,
           "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def test_root_directory_gives_the_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    cfg, source = server_model_config("smollm2", str(tmp_path), loopback=True)
    assert cfg is not None and str(tmp_path) in source
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert costs.n_params(cfg) == 134_515_008


def test_unknown_shapes_say_what_is_missing(tmp_path):
    cfg, line = server_model_config("meta-llama/Llama-3-70B", None, loopback=True)
    assert cfg is None and "'meta-llama/Llama-3-70B'" in line and "config.json" in line and "\n" not in line
    (tmp_path / "config.json").write_text("{not json")
    cfg, line = server_model_config("m", str(tmp_path), loopback=True)
    assert cfg is None and "could not be read" in line


def test_measured_decode_rate(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    cfg, _ = server_model_config("m", str(tmp_path), loopback=True)
    # 4 decode tokens in 3 chunks: 24 ms, 0 (same chunk), 24 ms, 48 ms -> TPOT 24 ms
    m = measured_decode(cfg, 100, [0.024, 0.0, 0.024, 0.048], "bf16")
    assert m.tpot_s == pytest.approx(0.024) and m.tokens_per_s == pytest.approx(1 / 0.024)
    # a decode step reads every weight once: bf16 weights of 134.5M parameters ≈ 269 MB per token
    assert m.bytes_per_s == pytest.approx(m.cost.bytes / 0.024)
    assert 134_515_008 * 2 <= m.cost.bytes < 134_515_008 * 2 * 1.05
    # and multiplies each non-embedding weight once (2 FLOP), plus the tied LM head
    assert m.flops_per_s == pytest.approx(m.cost.flops / 0.024)
    assert m.cost.flops == pytest.approx(2 * 134_515_008, rel=0.05)
    assert measured_decode(cfg, 100, [], "bf16") is None and measured_decode(cfg, 100, [0.0], "bf16") is None


def test_a_gguf_model_path_gives_the_same_shapes_as_its_hf_directory(tiny_dir):
    """llama.cpp's servers name the model by its GGUF path: its metadata gives the shapes, equal to those the same
    checkpoint's config.json gives (two independent readers)."""
    from_gguf, source = server_model_config(str(tiny_dir.gguf), None, loopback=True)
    from_hf, _ = server_model_config("tiny", str(tiny_dir.hf_dir), loopback=True)
    assert from_gguf is not None and str(tiny_dir.gguf) in source
    for key in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "tied_embeddings"):
        assert getattr(from_gguf, key) == getattr(from_hf, key), key
    assert costs.n_params(from_gguf) == costs.n_params(from_hf)
