"""Tiny random checkpoints the tests write themselves, and an independent reference forward pass.

The reference is deliberately plain and shares no code with engine/: Hugging Face layout (rotate-halves RoPE),
key/value heads repeated for GQA, a full causal forward over the whole sequence with no cache, float64.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tests.tiny_tokenizer import add_tiny_vocab, write_tiny_tokenizer_json

CFG = dict(
    n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=300, context_length=256,
    rope_base=10000.0, norm_eps=1e-5,
)
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TinyCheckpoints:
    gguf: Path
    hf_dir: Path
    hf_weights: dict[str, torch.Tensor]  # HF names and layout, float32
    cfg: dict
    qkv_bias: bool = False


def random_hf_weights(seed: int = 0, qkv_bias: bool = False, tied: bool = False) -> dict[str, torch.Tensor]:
    c = CFG
    g = torch.Generator().manual_seed(seed)
    hd = c["d_model"] // c["n_heads"]

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(c["vocab_size"], c["d_model"], scale=1.0),
         "model.norm.weight": 1 + r(c["d_model"], scale=0.1)}
    if not tied:
        w["lm_head.weight"] = r(c["vocab_size"], c["d_model"])
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(c["d_model"], scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + r(c["d_model"], scale=0.1)
        w[p + "self_attn.q_proj.weight"] = r(c["n_heads"] * hd, c["d_model"])
        w[p + "self_attn.k_proj.weight"] = r(c["n_kv_heads"] * hd, c["d_model"])
        w[p + "self_attn.v_proj.weight"] = r(c["n_kv_heads"] * hd, c["d_model"])
        w[p + "self_attn.o_proj.weight"] = r(c["d_model"], c["n_heads"] * hd)
        w[p + "mlp.gate_proj.weight"] = r(c["ffn_dim"], c["d_model"])
        w[p + "mlp.up_proj.weight"] = r(c["ffn_dim"], c["d_model"])
        w[p + "mlp.down_proj.weight"] = r(c["d_model"], c["ffn_dim"])
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = r(c["n_heads"] * hd)
            w[p + "self_attn.k_proj.bias"] = r(c["n_kv_heads"] * hd)
            w[p + "self_attn.v_proj.bias"] = r(c["n_kv_heads"] * hd)
    return w


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF→GGUF converter does to attn_q / attn_k rows (written out here independently)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf_dir(directory: Path, weights: dict[str, torch.Tensor], model_type: str = "llama",
                 tied: bool = False) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    c = CFG
    config = {
        "model_type": model_type, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": c["n_layers"],
        "hidden_size": c["d_model"], "num_attention_heads": c["n_heads"], "num_key_value_heads": c["n_kv_heads"],
        "intermediate_size": c["ffn_dim"], "vocab_size": c["vocab_size"],
        "max_position_embeddings": c["context_length"], "rope_theta": c["rope_base"], "rms_norm_eps": c["norm_eps"],
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    write_tiny_tokenizer_json(directory, c["vocab_size"])
    return directory


def write_gguf(path: Path, weights: dict[str, torch.Tensor], quantize_embedding: bool = True) -> Path:
    import gguf

    c = CFG
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_block_count(c["n_layers"])
    w.add_context_length(c["context_length"])
    w.add_embedding_length(c["d_model"])
    w.add_feed_forward_length(c["ffn_dim"])
    w.add_head_count(c["n_heads"])
    w.add_head_count_kv(c["n_kv_heads"])
    w.add_rope_freq_base(c["rope_base"])
    w.add_layer_norm_rms_eps(c["norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tiny_vocab(w, c["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for hf_name, t in weights.items():
        arr = t.numpy().astype(np.float32)
        if hf_name in names:
            name = names[hf_name]
        else:
            i, rest = hf_name.split(".")[2], ".".join(hf_name.split(".")[3:])
            name = f"blk.{i}.{layer_names[rest]}"
            if rest == "self_attn.q_proj.weight":
                arr = llama_cpp_permute(arr, c["n_heads"])
            elif rest == "self_attn.k_proj.weight":
                arr = llama_cpp_permute(arr, c["n_kv_heads"])
        if name == "token_embd.weight" and quantize_embedding:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_effective_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF weights as the GGUF file really holds them (the embedding went through Q8_0)."""
    import gguf

    out = dict(weights)
    e = weights["model.embed_tokens.weight"].numpy().astype(np.float32)
    q = gguf.quants.quantize(e, gguf.GGMLQuantizationType.Q8_0)
    out["model.embed_tokens.weight"] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))
    return out


def write_tiny_checkpoints(directory: Path) -> TinyCheckpoints:
    weights = random_hf_weights(0)
    gguf_path = write_gguf(directory / "tiny.gguf", weights)
    hf_dir = write_hf_dir(directory / "tiny-hf", gguf_effective_weights(weights))
    return TinyCheckpoints(gguf=gguf_path, hf_dir=hf_dir, hf_weights=gguf_effective_weights(weights), cfg=CFG)


# ---- the independent reference ---------------------------------------------------------------------------------
def reference_logits(
    w: dict[str, torch.Tensor], ids: list[int], cfg: dict = CFG, attention: dict[int, torch.Tensor] | None = None,
    edit: Callable[[str, int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits (T, V) of a full causal forward, Hugging Face conventions, float64, no cache.

    `attention`, when given, receives each layer's attention weights (H, T, T). `edit(site, layer, value)`, when
    given, is called on each site's value and returns the value the pass goes on with (engine/why's tests):
        "resid" (T, d) the residual stream entering layer L (L = n_layers: entering the final norm)
        "z"     (T, H, hd) every head's output of layer L, before o_proj
        "attn"  (T, d) what attention adds to the residual;  "mlp" (T, d) what the MLP adds
    """
    ed = edit or (lambda _site, _layer, value: value)
    d, H, KV = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    hd = d // H
    W = {k: v.double() for k, v in w.items()}
    T = len(ids)

    def rms(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["norm_eps"]) * g

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)

    inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()

    x = W["model.embed_tokens.weight"][torch.tensor(ids)]
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        x = ed("resid", i, x)
        h = rms(x, W[p + "input_layernorm.weight"])
        q = h @ W[p + "self_attn.q_proj.weight"].T + W.get(p + "self_attn.q_proj.bias", 0)
        k = h @ W[p + "self_attn.k_proj.weight"].T + W.get(p + "self_attn.k_proj.bias", 0)
        v = h @ W[p + "self_attn.v_proj.weight"].T + W.get(p + "self_attn.v_proj.bias", 0)
        q = q.view(T, H, hd).transpose(0, 1)
        k = k.view(T, KV, hd).transpose(0, 1)
        v = v.view(T, KV, hd).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=0)
        v = v.repeat_interleave(H // KV, dim=0)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5 + mask, dim=-1)
        if attention is not None:
            attention[i] = att
        z = ed("z", i, (att @ v).transpose(0, 1))  # (T, H, hd)
        x = x + ed("attn", i, z.reshape(T, d) @ W[p + "self_attn.o_proj.weight"].T)
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + ed("mlp", i, (torch.nn.functional.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T)
    x = rms(ed("resid", cfg["n_layers"], x), W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x @ head.T
