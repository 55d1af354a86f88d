"""Tiny random checkpoints of other families, held to Hugging Face transformers' own implementations.

Each family gets a tiny random transformers model (the reference), saved as a Hugging Face directory and, where
the `gguf` package can write it, as a GGUF file laid out as llama.cpp's converter lays it out (written here from
the converter's rules, sharing no code with engine/): Llama's q/k rows permuted into adjacent pairs, Gemma's norm
weights stored as 1 + w, Llama 3.1's RoPE scaling as a `rope_freqs` tensor, Phi-3's fused tensors kept fused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tests.tiny_model import CHATML, llama_cpp_permute
from tests.tiny_tokenizer import add_tiny_vocab, write_tiny_tokenizer_json

VOCAB = 300
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)
FAMILIES: dict[str, dict] = {
    # Gemma 3: 7 layers so that layer 5 is global (every sixth) and layers 0-4 and 6 are local, window 4.
    "gemma3": dict(
        cls="Gemma3ForCausalLM", config="Gemma3TextConfig", gguf_arch="gemma3",
        kw=dict(num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                sliding_window=4, query_pre_attn_scalar=32, tie_word_embeddings=True,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    ),
    "qwen3": dict(cls="Qwen3ForCausalLM", config="Qwen3Config", gguf_arch="qwen3",
                  kw=dict(num_hidden_layers=2, head_dim=24, rope_theta=1e6)),
    "phi3": dict(cls="Phi3ForCausalLM", config="Phi3Config", gguf_arch="phi3",
                 kw=dict(num_hidden_layers=2, num_key_value_heads=4, rope_theta=1e4, sliding_window=None)),
    # Gemma 3 4B and larger: linear RoPE scaling (factor 8) on the global layers only
    "gemma3-linear": dict(
        cls="Gemma3ForCausalLM", config="Gemma3TextConfig", gguf_arch="gemma3",
        kw=dict(num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                sliding_window=4, query_pre_attn_scalar=32, tie_word_embeddings=True,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    ),
    "mistral": dict(cls="MistralForCausalLM", config="MistralConfig", gguf_arch=None,
                    kw=dict(num_hidden_layers=2, sliding_window=4, rope_theta=1e4)),
    "llama3": dict(
        cls="LlamaForCausalLM", config="LlamaConfig", gguf_arch="llama",
        kw=dict(num_hidden_layers=2, rope_theta=5e5,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    ),
}


@dataclass
class FamilyCheckpoint:
    family: str
    model: torch.nn.Module  # the transformers reference, float32, eval
    hf_dir: Path
    gguf: Path | None


def make_reference(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    import transformers

    spec = FAMILIES[family]
    kw = {**BASE, **spec["kw"], **overrides}
    config = getattr(transformers, spec["config"])(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, spec["cls"])._from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # every weight random and O(1)-scaled, norms away from their init
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (0.0 if family.startswith("gemma3") else 1.0))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.eval()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits (T, V) of a full forward without a cache, float32."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def write_checkpoint(directory: Path, family: str, seed: int = 0, **overrides) -> FamilyCheckpoint:
    model = make_reference(family, seed, **overrides)
    hf_dir = directory / f"{family}-hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    write_tiny_tokenizer_json(hf_dir, VOCAB)
    arch = FAMILIES[family]["gguf_arch"]
    path = write_gguf(directory / f"{family}.gguf", model, arch) if arch else None
    return FamilyCheckpoint(family, model, hf_dir, path)


# ---- GGUF, as llama.cpp's converter writes it ---------------------------------------------------------------------
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
}
GEMMA_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def llama3_rope_freqs(scaling: dict, head_dim: int, base: float) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors) for rope_type llama3, written out."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_gguf(path: Path, model: torch.nn.Module, arch: str) -> Path:
    import gguf

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    add_tiny_vocab(w, VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim, rope["rope_theta"]))
    elif rope.get("rope_type") == "linear":  # llama.cpp writes linear scaling as metadata
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    names = dict(LAYER_NAMES, **(GEMMA_LAYER_NAMES if arch == "gemma3" else {}))
    for hf_name, t in model.state_dict().items():
        arr = t.float().numpy().copy()
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            name = "output.weight"
        else:
            parts = hf_name.split(".")
            rest = ".".join(parts[3:])
            name = f"blk.{parts[2]}.{names[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                arr = llama_cpp_permute(arr, c.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                arr = llama_cpp_permute(arr, c.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's Gemma3Model.norm_shift
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
