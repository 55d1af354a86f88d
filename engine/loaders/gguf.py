"""GGUF files (llama.cpp's format): config from metadata, weights dequantized to float32 with the gguf package.

Weight names are mapped by data, below. ggml stores a matrix's shape as [in, out] (`ne`); torch's is [out, in].
For `llama` files llama.cpp's converter already put q/k rows in the adjacent-pair RoPE layout this engine uses;
the other architectures keep the rotate-halves layout (llama.cpp's NEOX RoPE), so their q/k rows (and the q/k
norm weights, which act on the same head dimensions) are reordered here.

Per-architecture facts that the metadata does not carry are taken from llama.cpp (src/llama-model.cpp):
gemma3 has local layers with RoPE base 10,000 and every sixth layer global, embeddings scaled by √d_model, softmax
scale 1/√head_dim (1/√(d_model / n_heads) for the 27B model) and GELU-tanh; its converter stores Gemma's RMSNorm
weights as 1 + w, which is what the engine's plain x / rms(x) · w needs. phi3 fuses q, k and v into `attn_qkv`
and gate and up into `ffn_up` (gate first); they are split here.

A projection stored as Q4_0, Q4_1 or Q4_K also keeps its raw blocks beside its float weight (engine.model.quant): the
int4 decode candidate multiplies by them as they are in the file. A projection stored in another quantized type
(Q5_0, Q8_0, Q6_K, …) keeps an empty marker instead: it gets the int8 candidate, requantized from its float weight.
A tied model's token table is its LM head, so it keeps its blocks or marker the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine.formats.gguf_meta import EVERY_KEY, read_metadata
from engine.loaders.hf import renamed, storage
from engine.model import quant
from engine.model.config import LIMITS, ModelConfig, checked_float, checked_int
from engine.model.rope import halves_to_pairs, halves_to_pairs_all

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
    "blk.{}.attn_q_norm.weight": "layers.{}.attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "layers.{}.attn.k_norm.weight",
    "blk.{}.post_attention_norm.weight": "layers.{}.post_attn_norm.weight",
    "blk.{}.post_ffw_norm.weight": "layers.{}.post_mlp_norm.weight",
    # fused in phi3 files; split by read_weights
    "blk.{}.attn_qkv.weight": "layers.{}.attn.wqkv.weight",
    "blk.{}.attn_qkv.bias": "layers.{}.attn.wqkv.bias",
}
# Not weights: llama.cpp's RoPE frequency divisors (Llama 3.1 scaling), read into the config.
ROPE_FREQS = "rope_freqs.weight"

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
# Architectures whose GGUF q/k rows are in the rotate-halves layout (llama.cpp's NEOX RoPE).
HALVES_LAYOUT = ("qwen2", "qwen3", "phi3", "gemma3")
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp: hparams.set_swa_pattern(6)
GEMMA3_ROPE_BASE_LOCAL = 10000.0  # llama.cpp: rope_freq_base_train_swa


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (Inference Lab runs: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def need(key: str, field: str, default: object = None) -> int:
        v = _field(reader, f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"the GGUF metadata lacks {arch}.{key}")
        return checked_int(v, f"the GGUF metadata {arch}.{key}", LIMITS[field])

    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ValueError("the GGUF metadata gives no vocabulary size")
    n_heads = need("attention.head_count", "n_heads")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    token_id = (0, LIMITS["vocab_size"][1])
    n_layers = need("block_count", "n_layers")
    d_model = need("embedding_length", "d_model")
    head_dim = need("attention.key_length", "head_dim") if _field(reader, f"{arch}.attention.key_length") else 0
    window = checked_int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0,
                         f"{arch}.attention.sliding_window", (0, LIMITS["context_length"][1]))
    family: dict = {}
    if arch == "gemma3":
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
        if isinstance(pattern, list):  # newer converters: one bool per layer, true = sliding window
            types = tuple("local" if p else "global" for p in pattern)
        else:
            every = checked_int(pattern, f"{arch}.attention.sliding_window_pattern", (1, n_layers + 1))
            types = tuple("global" if (i + 1) % every == 0 else "local" for i in range(n_layers))
        base_local = _field(reader, f"{arch}.rope.freq_base_swa", GEMMA3_ROPE_BASE_LOCAL)
        family = dict(
            qk_norm=True, post_norms=True, mlp_activation="gelu_tanh", embedding_scale=d_model**0.5,
            # llama.cpp: 1/√(n_embd/n_head) for the 27B model (62 layers), 1/√head_dim otherwise
            attn_scale=(d_model / n_heads) ** -0.5 if n_layers == 62 else 0.0,
            sliding_window=window, layer_types=types,
            rope_base_local=checked_float(base_local, f"{arch}.rope.freq_base_swa", 0.0, math.inf),
        )
    elif arch == "qwen3":
        family = dict(qk_norm=True)
    elif window:  # phi3 and others that state a window: every layer is local
        family = dict(sliding_window=window)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        family["rope_freq_factors"] = tuple(float(f) for f in np.asarray(freqs.data, dtype=np.float32).ravel())
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor", 1.0)
    if scaling == "linear" and factor != 1.0:  # e.g. Gemma 3 4B+: positions of the global layers divided by 8
        factor = checked_float(factor, f"{arch}.rope.scaling.factor", 0.0, math.inf)
        pairs = (head_dim or d_model // n_heads) // 2
        old = family.get("rope_freq_factors", (1.0,) * pairs)
        family["rope_freq_factors"] = tuple(f * factor for f in old)
    elif scaling not in ("none", "linear"):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported (linear, and llama3's rope_freqs tensor, are)")
    return ModelConfig(
        name=name,
        architecture=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=need("attention.head_count_kv", "n_kv_heads", n_heads),
        ffn_dim=need("feed_forward_length", "ffn_dim"),
        vocab_size=checked_int(vocab, "the GGUF vocabulary size", LIMITS["vocab_size"]),
        context_length=need("context_length", "context_length"),
        rope_base=checked_float(
            _field(reader, f"{arch}.rope.freq_base", 10000.0), f"{arch}.rope.freq_base", 0.0, math.inf),
        norm_eps=checked_float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
                               f"{arch}.attention.layer_norm_rms_epsilon", 0.0, 1.0),
        tied_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        head_dim=head_dim,
        bos_token_id=None if bos is None else checked_int(bos, "tokenizer.ggml.bos_token_id", token_id),
        eos_token_ids=() if eos is None else (checked_int(eos, "tokenizer.ggml.eos_token_id", token_id),),
        **family,
    )


def file_type_name(reader) -> str:
    import gguf

    ft = _field(reader, "general.file_type")
    try:
        return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else "unknown"
    except ValueError:
        return f"type {ft}"


def tensor_stats(reader) -> dict:
    """The file's own storage (loaders.hf.storage), by ggml type."""
    return storage(((t.name, t.tensor_type.name, int(t.n_bytes), int(t.n_elements)) for t in reader.tensors),
                   "token_embd.weight")


def read_weights(
    reader, cfg: ModelConfig, progress: Callable[[float, str], None] | None = None
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 and name it as the engine does (unfused).

    A projection stored as Q4_0/Q4_1/Q4_K also gets its raw blocks (out, in/32, bytes) uint8 under
    quant.block_name(weight name, kind), with the same rows as its float weight (split and reordered alike); one
    stored in another quantized type an empty quant.requant_marker under quant.block_name(weight name, REQUANT).
    A tied model's token table is its LM head, a projection too.
    """
    import gguf

    sd: dict[str, torch.Tensor] = {}
    n = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        if t.name == ROPE_FREQS:
            continue  # read into the config
        name = renamed(t.name, WEIGHT_MAP)
        if name is None:
            raise ValueError(f"tensor {t.name!r} is not part of a {cfg.architecture} model this engine knows")
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne [in, out] -> torch [out, in]
        if arr.size != int(np.prod(shape)):
            raise ValueError(f"tensor {t.name!r} holds {arr.size} values, its shape {shape} needs {np.prod(shape)}")
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors are read-only file maps
        kind = t.tensor_type.name.lower()
        blocks = None
        # a projection, or the token table where it is also the LM head (tied): the head multiplies by it every
        # decode step, while the embedding lookup gathers rows of the float weight
        if len(shape) == 2 and (name != "tok_embeddings.weight" or cfg.tied_embeddings):
            if kind in quant.INT4_KINDS:
                raw = np.array(t.data, dtype=np.uint8, copy=True)  # (out, bytes per row), off the file map
                blocks = torch.from_numpy(raw).reshape(shape[0], shape[1] // quant.GROUP, quant.BLOCK_BYTES[kind])
            elif t.tensor_type.name not in quant.FLOAT_TYPES:
                kind, blocks = quant.REQUANT, quant.requant_marker(*shape)
        for x, suffix in ((w, ""), (blocks, f".{kind}")):  # the float weight, then its blocks: the same rows
            if x is None:
                continue
            parts = {name: x}
            if ".attn_qkv." in t.name:  # phi3: [q; k; v] rows, split into the unfused names
                qkv = x.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim])
                parts = {name.replace("wqkv", f"w{c}"): y for c, y in zip("qkv", qkv, strict=True)}
            elif cfg.architecture == "phi3" and ".ffn_up." in t.name:  # phi3: [gate; up] rows
                gate, up = x.split(cfg.ffn_dim)
                parts = {name.replace("w_up", "w_gate"): gate, name: up}
            sd.update({n + suffix: y.contiguous() if suffix else y for n, y in parts.items()})
        if progress is not None and i % 16 == 0:
            progress(i / n, f"dequantizing {t.name}")
    if cfg.architecture not in HALVES_LAYOUT:
        return sd
    for kind in quant.KINDS:  # the q/k blocks' rows move as their weights' rows do
        for name, heads in ((".attn.wq.weight", cfg.n_heads), (".attn.wk.weight", cfg.n_kv_heads)):
            for n in [n for n in sd if n.endswith(name + "." + kind)]:
                sd[n] = halves_to_pairs(sd[n], heads)
    return halves_to_pairs_all(sd, cfg)


def check_file(path: Path) -> None:
    """Walk a GGUF file's header (engine.formats.gguf_meta: every count, length and shape held against the file's
    size) and hold each tensor's type, rows and data against the file too.

    The gguf package trusts these numbers (a huge count or length makes it loop or read past the end); after this
    check it only sees a header whose claims fit the file.
    """
    import gguf

    meta = read_metadata(path, EVERY_KEY, tensors=True)
    size = path.stat().st_size
    for t in meta.tensors:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path.name} is damaged: tensor {t.name!r} has unknown ggml type {t.ggml_type}") from None
        if t.dims[0] % block:
            raise ValueError(f"{path.name} is damaged: tensor {t.name!r} has rows of {t.dims[0]:,} values, not whole "
                             f"{block}-value blocks")
        begin = meta.data_start + t.offset
        end = begin + math.prod(t.dims) // block * type_size
        if end > size:
            raise ValueError(f"{path.name} is damaged: tensor {t.name!r} claims bytes {begin:,}…{end:,}, but the file "
                             f"ends at byte {size:,} (truncated?)")
        if t.offset % meta.alignment:
            raise ValueError(f"{path.name} is damaged: tensor {t.name!r} starts at an unaligned offset {t.offset:,}")


def open_reader(path: Path):
    import gguf

    check_file(path)
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises many kinds on a damaged file
        raise ValueError(f"{path.name} is not a readable GGUF file ({type(e).__name__}: {e})") from None
