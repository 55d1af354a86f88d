"""engine.costs (formulas, catalog): parameter counts, KV sizes, FLOPs and bytes against hand-computed values.

The matmul FLOPs are also checked against torch's own FlopCounterMode on a small reference forward pass
written here (causal attention computed query by query, so the counter sees exactly the useful query-key
pairs).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from engine.costs import formulas as costs
from engine.costs.catalog import (
    Hardware,
    UnknownNameError,
    hardware_preset,
    hardware_presets,
    model_preset,
    model_presets,
)
from engine.model.config import ModelConfig

SMOLLM2 = ModelConfig(
    name="SmolLM2-135M", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, ffn_dim=1536,
    vocab_size=49152, context_length=8192, tied_embeddings=True,
)

# A small model whose numbers are easy to work out by hand: head_dim 16, q_dim 64, kv_dim 32.
TINY = ModelConfig(name="tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=300)


# ---------------------------------------------------------------- parameters and sizes


def test_smollm2_parameter_count_is_exact() -> None:
    # per layer: q 576·576 + k,v 2·192·576 + o 576·576 + MLP 3·576·1536 + 2 norms·576 = 3,540,096
    # 30 layers = 106,202,880; embedding 49152·576 = 28,311,552 (tied: counted once); final norm 576
    assert costs.n_params(SMOLLM2) == 106_202_880 + 28_311_552 + 576 == 134_515_008
    assert costs.n_params(model_preset("smollm2-135m")) == 134_515_008


@pytest.mark.parametrize(
    ("key", "published"),
    [
        # The parameter counts the Hugging Face model pages report for these checkpoints.
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-70b", 68_976_648_192),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("mistral-7b", 7_241_732_096),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-0.5b", 494_032_768),
        ("llama-3.2-1b", 1_235_814_400),
    ],
)
def test_catalogue_parameter_counts_match_published(key: str, published: int) -> None:
    assert costs.n_params(model_preset(key)) == published


def test_kv_bytes_per_token() -> None:
    # 2 (K and V) · layers · kv heads · head_dim · bytes
    assert costs.kv_bytes_per_token(SMOLLM2, "float32") == 2 * 30 * 3 * 64 * 4 == 46_080
    assert costs.kv_bytes_per_token(model_preset("llama-2-7b"), "fp16") == 2 * 32 * 32 * 128 * 2 == 524_288
    assert costs.kv_bytes_per_token(model_preset("llama-3-70b"), "fp16") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert costs.kv_bytes_per_token(model_preset("llama-3-70b"), "fp16", batch=4) == 4 * 327_680


def test_dtype_bytes() -> None:
    assert costs.bytes_per_value("float32") == costs.bytes_per_value("fp32") == 4
    assert costs.bytes_per_value("bf16") == costs.bytes_per_value("torch.float16") == 2
    assert costs.bytes_per_value("int4") == 0.5
    assert costs.bytes_per_value("q4_1") == 0.625  # (16 bytes of nibbles + 2 + 2) / 32
    assert costs.bytes_per_value("q8_0") == 34 / 32
    with pytest.raises(ValueError, match="valid: .*float32.*q4_1"):
        costs.bytes_per_value("fp5")


def test_weight_bytes() -> None:
    assert costs.weight_bytes(model_preset("llama-2-70b"), "fp16") == 2 * 68_976_648_192
    assert costs.weight_bytes(SMOLLM2, "q4_1") == pytest.approx(134_515_008 * 0.625)


# ---------------------------------------------------------------- FLOPs and bytes by hand

# TINY by hand:
#   layer matrices: wq 64·64 = 4096, wk 32·64 = 2048, wv 2048, wo 4096, gate+up+down 3·96·64 = 18432 → 30720
#   linear FLOPs per token = 2 · 2 layers · 30720 = 122,880
#   LM head per position   = 2 · 300 · 64 = 38,400
#   attention per pair     = 2 (QKᵀ, AV) · 2 FLOPs · 2 layers · 4 heads · 16 = 512
#   parameters: 2·(30720 + 2·64) + embedding 300·64 + final norm 64 + LM head 300·64 = 100,160
#   KV per token (fp32)    = 2 · 2 layers · 2 kv heads · 16 · 4 bytes = 512


def test_tiny_helpers_by_hand() -> None:
    assert costs.layer_matrix_params(TINY) == 30_720
    assert costs.linear_flops_per_token(TINY) == 122_880
    assert costs.lm_head_flops_per_token(TINY) == 38_400
    assert costs.n_params(TINY) == 100_160
    assert costs.kv_bytes_per_token(TINY, "float32") == 512


def test_prefill_cost_by_hand() -> None:
    c = costs.prefill_cost(TINY, 5)
    # positions 0..4 attend to 1+2+3+4+5 = 15 keys; logits for the last position only
    assert c.flops == 5 * 122_880 + 15 * 512 + 38_400 == 660_480
    # all matrices except the untied embedding table, plus the 5 embedding rows looked up
    assert c.weight_bytes == (100_160 - 300 * 64 + 5 * 64) * 4
    assert c.kv_read_bytes == 0
    assert c.kv_write_bytes == 5 * 512

    c = costs.prefill_cost(TINY, 5, all_logits=True)
    assert c.flops == 5 * 122_880 + 15 * 512 + 5 * 38_400

    # 3 new tokens after a reused prefix of 4: positions 4,5,6 attend to 5+6+7 = 18 keys
    c = costs.prefill_cost(TINY, 3, start=4, batch=2)
    assert c.flops == 2 * (3 * 122_880 + 18 * 512 + 38_400) == 2 * 416_256
    assert c.kv_read_bytes == 4 * 512 * 2
    assert c.kv_write_bytes == 3 * 512 * 2
    assert c.weight_bytes == (100_160 - 300 * 64 + 6 * 64) * 4  # weights once for the batch


def test_decode_cost_by_hand() -> None:
    c = costs.decode_cost(TINY, 8)  # the token at position 7 attends keys 0…7; 0…6 were cached before
    assert c.flops == 122_880 + 8 * 512 + 38_400 == 165_376
    assert c.weight_bytes == (100_160 - 300 * 64 + 64) * 4 == 324_096
    assert c.kv_read_bytes == 7 * 512
    assert c.kv_write_bytes == 512
    assert c.bytes == 324_096 + 3584 + 512
    c3 = costs.decode_cost(TINY, 8, batch=3, weight_dtype="bf16", kv_dtype="float32")
    assert c3.flops == 3 * 165_376
    assert c3.weight_bytes == (100_160 - 300 * 64 + 3 * 64) * 2
    assert c3.kv_read_bytes == 3 * 7 * 512


def test_prefill_and_decode_agree_on_the_same_step() -> None:
    """The token at position 9, fed as a one-token prefill after 9 cached ones or as a decode step at context 10.

    By hand on TINY (2 layers, 2 KV heads, head_dim 16, float32): one position holds 2·2·2·16·4 = 512 B of K/V;
    the step reads the 9 cached positions (4,608 B), writes its own (512 B), and attends 10 keys (10 · 512 FLOPs).
    """
    pre, dec = costs.prefill_cost(TINY, 1, start=9), costs.decode_cost(TINY, 10)
    assert pre.kv_read_bytes == dec.kv_read_bytes == 9 * 512 == 4_608
    assert pre.kv_write_bytes == dec.kv_write_bytes == 512
    assert pre.flops == dec.flops == 122_880 + 10 * 512 + 38_400
    assert pre == dec


def test_tied_model_reads_its_embedding_as_the_lm_head() -> None:
    tied = ModelConfig(name="t", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=300,
                       tied_embeddings=True)
    assert costs.n_params(tied) == 100_160 - 300 * 64
    assert costs.decode_cost(tied, 4).weight_bytes == (costs.n_params(tied) + 64) * 4


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_token_counts_raise(bad: float) -> None:
    with pytest.raises(ValueError):
        costs.prefill_cost(TINY, bad)
    with pytest.raises(ValueError):
        costs.decode_cost(TINY, bad)


# ---------------------------------------------------------------- FLOPs counted by torch


def _weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    d = cfg.d_model
    out = {"embed": w(cfg.vocab_size, d), "norm": torch.ones(d)}
    if not cfg.tied_embeddings:
        out["lm_head"] = w(cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        out |= {
            f"{i}.wq": w(cfg.q_dim, d), f"{i}.wk": w(cfg.kv_dim, d), f"{i}.wv": w(cfg.kv_dim, d),
            f"{i}.wo": w(d, cfg.q_dim), f"{i}.w_gate": w(cfg.ffn_dim, d), f"{i}.w_up": w(cfg.ffn_dim, d),
            f"{i}.w_down": w(d, cfg.ffn_dim), f"{i}.attn_norm": torch.ones(d), f"{i}.mlp_norm": torch.ones(d),
        }
        if cfg.qkv_bias:
            out |= {f"{i}.bq": w(cfg.q_dim), f"{i}.bk": w(cfg.kv_dim), f"{i}.bv": w(cfg.kv_dim)}
    return out


def _forward(
    cfg: ModelConfig, W: dict[str, torch.Tensor], ids: torch.Tensor, cache: list, all_logits: bool = False
) -> torch.Tensor:
    """A plain Llama forward with a KV cache and query-by-query causal attention (no RoPE: elementwise)."""
    B, T = ids.shape
    H, KV, hd, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    x = W["embed"][ids]
    for i in range(cfg.n_layers):
        h = F.rms_norm(x, (d,), W[f"{i}.attn_norm"])
        q = F.linear(h, W[f"{i}.wq"], W.get(f"{i}.bq")).view(B, T, H, hd).transpose(1, 2)
        k = F.linear(h, W[f"{i}.wk"], W.get(f"{i}.bk")).view(B, T, KV, hd).transpose(1, 2)
        v = F.linear(h, W[f"{i}.wv"], W.get(f"{i}.bv")).view(B, T, KV, hd).transpose(1, 2)
        if cache[i] is not None:
            k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
        cache[i] = (k, v)
        start = k.shape[2] - T
        kk, vv = k.repeat_interleave(cfg.group_size, dim=1), v.repeat_interleave(cfg.group_size, dim=1)
        rows = []
        for t in range(T):
            n = start + t + 1  # keys this query may read
            scores = (q[:, :, t : t + 1] @ kk[:, :, :n].transpose(-1, -2)) / math.sqrt(hd)
            rows.append(torch.softmax(scores, dim=-1) @ vv[:, :, :n])
        o = torch.cat(rows, dim=2).transpose(1, 2).reshape(B, T, cfg.q_dim)
        x = x + F.linear(o, W[f"{i}.wo"])
        h = F.rms_norm(x, (d,), W[f"{i}.mlp_norm"])
        gated = F.silu(F.linear(h, W[f"{i}.w_gate"])) * F.linear(h, W[f"{i}.w_up"])
        x = x + F.linear(gated, W[f"{i}.w_down"])
    x = F.rms_norm(x if all_logits else x[:, -1:], (d,), W["norm"])
    return F.linear(x, W.get("lm_head", W["embed"]))


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


QWEN_LIKE = ModelConfig(name="qwen-like", n_layers=3, d_model=48, n_heads=6, n_kv_heads=2, ffn_dim=80,
                        vocab_size=97, tied_embeddings=True, qkv_bias=True)


@pytest.mark.parametrize("cfg", [TINY, QWEN_LIKE])
def test_flops_match_torch_flop_counter(cfg: ModelConfig) -> None:
    W = _weights(cfg)
    assert sum(t.numel() for t in W.values()) == costs.n_params(cfg)
    B = 2
    ids = torch.randint(0, cfg.vocab_size, (B, 7))
    with torch.no_grad():
        # a prefill of 4 tokens, a prefill of 3 more reusing those 4 as a cached prefix, then one decode step
        cache: list = [None] * cfg.n_layers
        got = _counted(lambda: _forward(cfg, W, ids[:, :4], cache))
        assert got == costs.prefill_cost(cfg, 4, batch=B).flops
        got = _counted(lambda: _forward(cfg, W, ids[:, 4:7], cache))
        assert got == costs.prefill_cost(cfg, 3, start=4, batch=B).flops
        got = _counted(lambda: _forward(cfg, W, ids[:, :1], cache))
        assert got == costs.decode_cost(cfg, 8, batch=B).flops  # position 7, so 8 keys including itself
        cache = [None] * cfg.n_layers
        got = _counted(lambda: _forward(cfg, W, ids, cache, all_logits=True))
        assert got == costs.prefill_cost(cfg, 7, batch=B, all_logits=True).flops


# ---------------------------------------------------------------- roofline and the seed's worked example


@pytest.mark.parametrize("key", ["llama-2-7b", "llama-2-70b", "llama-3-8b", "mistral-7b", "qwen2.5-7b"])
def test_decode_intensity_is_about_one_flop_per_byte_at_fp16(key: str) -> None:
    cfg = model_preset(key)
    intensity = costs.decode_cost(cfg, 1024, weight_dtype="fp16").intensity
    assert 0.9 < intensity < 1.15  # ~2 FLOPs per parameter over 2 bytes per parameter


def test_decode_intensity_grows_about_linearly_with_batch() -> None:
    cfg = model_preset("llama-2-70b")
    base = costs.decode_cost(cfg, 128, weight_dtype="fp16").intensity
    batches = (1, 2, 4, 8, 16, 32, 64)
    values = [costs.decode_cost(cfg, 128, batch=b, weight_dtype="fp16").intensity for b in batches]
    assert values == sorted(values)
    assert values[3] / base == pytest.approx(8, rel=0.05)  # batch 8: weights shared, KV at 128 tokens is tiny
    assert values[-1] / base > 50


def test_seed_70b_on_h100_worked_example() -> None:
    cfg, h100 = model_preset("llama-2-70b"), hardware_preset("h100-sxm")
    step = costs.decode_cost(cfg, 4096, weight_dtype="fp16")
    assert 137e9 < step.bytes < 141e9  # "a 70B FP16 model touches ~140 GB per token"
    floor = costs.tpot_floor_s(cfg, 4096, h100.bandwidth_bytes_per_s, weight_dtype="fp16")
    assert floor == pytest.approx(step.bytes / 3.35e12)
    assert 0.041 < floor < 0.043  # "a hard floor near ~42 ms/token"
    assert 23 < 1 / floor < 25  # "~24 tok/s"
    # the roofline agrees: decode sits far below the ridge, so its time is the memory time
    assert costs.step_time_estimate_s(step, h100.peak_for("fp16"), h100.bandwidth_bytes_per_s) == floor


def test_roofline_helpers() -> None:
    assert costs.ridge_point(989.5e12, 3.35e12) == pytest.approx(295.37, abs=0.01)
    assert costs.attainable_flops(1.0, 989.5e12, 3.35e12) == 3.35e12  # memory roof
    assert costs.attainable_flops(1000.0, 989.5e12, 3.35e12) == 989.5e12  # compute roof
    from engine.events import StepCost

    mem = StepCost(flops=1e9, weight_bytes=1e9, kv_read_bytes=0, kv_write_bytes=0)
    assert costs.step_time_estimate_s(mem, 1e12, 1e11) == pytest.approx(1e-2)  # 1 GB at 100 GB/s
    comp = StepCost(flops=1e13, weight_bytes=1e9, kv_read_bytes=0, kv_write_bytes=0)
    assert costs.step_time_estimate_s(comp, 1e12, 1e11) == pytest.approx(10.0)  # 10 TFLOP at 1 TFLOP/s
    with pytest.raises(ValueError):
        costs.step_time_estimate_s(mem, 0, 1e11)


def test_prefill_is_compute_bound_and_decode_memory_bound_on_h100() -> None:
    cfg, h100 = model_preset("llama-3-8b"), hardware_preset("h100-sxm")
    ridge = costs.ridge_point(h100.peak_for("bf16"), h100.bandwidth_bytes_per_s)
    assert costs.prefill_cost(cfg, 2048, weight_dtype="bf16").intensity > ridge
    assert costs.decode_cost(cfg, 2048, weight_dtype="bf16").intensity < ridge


# ---------------------------------------------------------------- catalogue


def test_model_catalogue_has_the_required_entries() -> None:
    presets = model_presets()
    required = ("smollm2-135m", "llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "mistral-7b",
                "qwen2.5-7b")
    assert set(required) <= presets.keys()
    q = presets["qwen2.5-7b"]
    shape = (q.n_layers, q.d_model, q.n_heads, q.n_kv_heads, q.ffn_dim, q.vocab_size)
    assert shape == (28, 3584, 28, 4, 18944, 152064)
    assert q.qkv_bias and not q.tied_embeddings
    assert presets["smollm2-135m"].tied_embeddings
    with pytest.raises(KeyError, match="valid: .*llama-2-70b"):
        model_preset("gpt-5")


def test_hardware_catalogue() -> None:
    presets = hardware_presets()
    for key in ("h100-sxm", "h200", "a100-80gb", "rtx-4090", "l4", "mi300x", "m2-ultra"):
        hw = presets[key]
        assert isinstance(hw, Hardware) and not hw.measured
        assert hw.bandwidth_bytes_per_s > 1e11 and hw.memory_bytes >= 24e9 and hw.source
        assert all(v > 1e12 for v in hw.peak_flops.values())
        assert hw.peak_for("fp16") >= hw.peak_for("fp32")
    h100 = presets["h100-sxm"]
    assert (h100.bandwidth_bytes_per_s, h100.memory_bytes, h100.peak_for("bf16")) == (3.35e12, 80e9, 989.5e12)
    assert h100.peak_for("int4") == h100.peak_flops["int8"]  # no int4 figure: falls back to int8
    assert presets["m2-ultra"].peak_for("int4") == presets["m2-ultra"].peak_flops["fp16"]  # no int8 either
    assert presets["h200"].bandwidth_bytes_per_s == 4.8e12 and presets["h200"].memory_bytes == 141e9
    with pytest.raises(ValueError, match="valid: .*h100-sxm"):
        hardware_preset("tpu-v9")
    assert issubclass(UnknownNameError, KeyError) and issubclass(UnknownNameError, ValueError)
