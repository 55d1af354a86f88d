"""GGUF files (llama.cpp's format): config from metadata, weights dequantized to float32 with the gguf package.

Weight names are mapped by data, below. ggml stores a matrix's shape as [in, out] (`ne`); torch's is [out, in].
For `llama` files llama.cpp's converter already put q/k rows in the adjacent-pair RoPE layout this engine uses;
`qwen2` files keep the rotate-halves layout, so their q/k rows are reordered here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.rope import halves_to_pairs

# GGUF tensor name -> this engine's (unfused) name; {} is the layer index.
WEIGHT_MAP: dict[str, str] = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "blk.{}.attn_norm.weight": "layers.{}.attn_norm.weight",
    "blk.{}.attn_q.weight": "layers.{}.attn.wq.weight",
    "blk.{}.attn_k.weight": "layers.{}.attn.wk.weight",
    "blk.{}.attn_v.weight": "layers.{}.attn.wv.weight",
    "blk.{}.attn_q.bias": "layers.{}.attn.wq.bias",
    "blk.{}.attn_k.bias": "layers.{}.attn.wk.bias",
    "blk.{}.attn_v.bias": "layers.{}.attn.wv.bias",
    "blk.{}.attn_output.weight": "layers.{}.attn.wo.weight",
    "blk.{}.ffn_norm.weight": "layers.{}.mlp_norm.weight",
    "blk.{}.ffn_gate.weight": "layers.{}.mlp.w_gate.weight",
    "blk.{}.ffn_up.weight": "layers.{}.mlp.w_up.weight",
    "blk.{}.ffn_down.weight": "layers.{}.mlp.w_down.weight",
}

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Architectures whose GGUF q/k rows are in the rotate-halves layout (llama.cpp's NEOX RoPE).
HALVES_LAYOUT = ("qwen2",)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _engine_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        templ = WEIGHT_MAP.get(".".join(["blk", "{}", *parts[2:]]))
        return templ.format(parts[1]) if templ else None
    return WEIGHT_MAP.get(gguf_name)


def read_config(reader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (Inference Lab runs: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"the GGUF metadata lacks {arch}.{key}")
        return v

    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ValueError("the GGUF metadata gives no vocabulary size")
    n_heads = int(need("attention.head_count"))
    d_model = int(need("embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name,
        architecture=arch,
        n_layers=int(need("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        ffn_dim=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        context_length=int(need("context_length")),
        rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        head_dim=int(_field(reader, f"{arch}.attention.key_length", 0) or 0),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def file_type_name(reader) -> str:
    import gguf

    ft = _field(reader, "general.file_type")
    try:
        return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else "unknown"
    except ValueError:
        return f"type {ft}"


def read_weights(
    reader, cfg: ModelConfig, progress: Callable[[float, str], None] | None = None
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 and name it as the engine does (unfused)."""
    import gguf

    sd: dict[str, torch.Tensor] = {}
    n = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = _engine_name(t.name)
        if name is None:
            raise ValueError(f"tensor {t.name!r} is not part of a {cfg.architecture} model this engine knows")
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne [in, out] -> torch [out, in]
        if arr.size != int(np.prod(shape)):
            raise ValueError(f"tensor {t.name!r} holds {arr.size} values, its shape {shape} needs {np.prod(shape)}")
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors are read-only file maps
        if cfg.architecture in HALVES_LAYOUT and (".attn_q." in t.name or ".attn_k." in t.name):
            w = halves_to_pairs(w, cfg.n_heads if ".attn_q." in t.name else cfg.n_kv_heads)
        sd[name] = w
        if progress is not None and i % 16 == 0:
            progress(i / n, f"dequantizing {t.name}")
    return sd


def open_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises many kinds on a damaged file
        raise ValueError(f"{path.name} is not a readable GGUF file ({type(e).__name__}: {e})") from None
