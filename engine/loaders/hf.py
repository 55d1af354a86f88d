"""Hugging Face model directories: config.json + *.safetensors + tokenizer.json (never pickled .bin files).

HF checkpoints store q/k rows in the rotate-halves RoPE layout; they are reordered into the adjacent-pair layout
of engine.rope here, so one RoPE implementation serves every loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.rope import halves_to_pairs

WEIGHT_MAP: dict[str, str] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attn_norm.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attn.wv.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attn.wq.bias",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attn.wk.bias",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attn.wv.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attn.wo.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.w_gate.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.mlp.w_up.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.w_down.weight",
}

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _engine_name(hf_name: str) -> str | None:
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit():
        templ = WEIGHT_MAP.get(".".join(["model", "layers", "{}", *parts[3:]]))
        return templ.format(parts[2]) if templ else None
    return WEIGHT_MAP.get(hf_name)


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    mtype = c.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {mtype!r} (Inference Lab runs: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if c.get("rope_scaling"):
        raise ValueError(f"RoPE scaling ({c['rope_scaling'].get('rope_type', '?')}) is not supported yet")
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        name=directory.name,
        architecture=mtype,
        n_layers=c["num_hidden_layers"],
        d_model=c["hidden_size"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        ffn_dim=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        context_length=c.get("max_position_embeddings", 2048),
        rope_base=float(c.get("rope_theta", 10000.0)),
        norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=mtype == "qwen2" or bool(c.get("attention_bias", False)),
        head_dim=int(c.get("head_dim") or 0),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def read_weights(directory: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights (pickled .bin files are never loaded)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        for hf_name, w in load_file(str(f)).items():
            name = _engine_name(hf_name)
            if name is None:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # a cached RoPE table some checkpoints carry; recomputed from rope_theta
                raise ValueError(f"tensor {hf_name!r} is not part of a {cfg.architecture} model this engine knows")
            if name == "output.weight" and cfg.tied_embeddings:
                continue  # a tied head saved explicitly is the embedding again
            w = w.float()
            if ".attn.wq." in name:
                w = halves_to_pairs(w, cfg.n_heads)
            elif ".attn.wk." in name:
                w = halves_to_pairs(w, cfg.n_kv_heads)
            sd[name] = w
    return sd
