"""Hugging Face model directories: config.json + *.safetensors + tokenizer.json (never pickled .bin files).

HF checkpoints store q/k rows in the rotate-halves RoPE layout; they are reordered into the adjacent-pair layout
of engine.model.rope here, so one RoPE implementation serves every loader.

Family differences read here (see engine/model/config.py): Gemma 3 (`gemma3_text`) names its four norms input_layernorm,
post_attention_layernorm (on the attention output), pre_feedforward_layernorm and post_feedforward_layernorm, and
its RMSNorm scales by (1 + w): the 1 is added to every norm weight on load, as llama.cpp's converter does. Phi-3
fuses qkv_proj and gate_up_proj (gate first); they are split. RoPE scaling of types linear and llama3 becomes
per-frequency divisors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from engine.model.config import LIMITS, ModelConfig, checked_float, checked_int
from engine.model.rope import halves_to_pairs_all, scaling_freq_factors

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

# Where a family's names differ from WEIGHT_MAP (Gemma 3's post_attention_layernorm is not the pre-MLP norm).
FAMILY_MAPS: dict[str, dict[str, str]] = {
    "gemma3_text": {
        "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attn_norm.weight",
        "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.mlp_norm.weight",
        "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.post_mlp_norm.weight",
    },
}
COMMON_EXTRA = {
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.weight",
    "model.layers.{}.self_attn.qkv_proj.weight": "layers.{}.attn.wqkv.weight",  # phi3, split on load
    "model.layers.{}.mlp.gate_up_proj.weight": "layers.{}.mlp.w_gate_up.weight",  # phi3, split on load
}

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
_REQUIRED = object()


def renamed(name: str, table: Mapping[str, str]) -> str | None:
    """`name` through a table of tensor names whose layer index is written {} (the first part of a name that is a
    number); None where the table has no such name. Every loader's and the exporter's names go through it."""
    parts = name.split(".")
    i = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if i is None:
        return table.get(name)
    template = table.get(".".join([*parts[:i], "{}", *parts[i + 1:]]))
    return template.format(parts[i]) if template else None


def _rope(c: dict, layer_type: str = "full_attention") -> dict:
    """RoPE settings of one layer type: transformers 5 writes `rope_parameters` (per layer type for Gemma 3);
    older configs write rope_theta, rope_scaling (global layers) and Gemma's rope_local_base_freq."""
    params = c.get("rope_parameters") or {}
    if not isinstance(params, dict) or not isinstance(c.get("rope_scaling") or {}, dict):
        raise ValueError("config.json: rope_parameters and rope_scaling must be JSON objects")
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif any(isinstance(v, dict) for v in params.values()):
        params = {}
    out = {**(c.get("rope_scaling") or {}), **params} if layer_type == "full_attention" else dict(params)
    if "rope_theta" not in out:
        local = layer_type == "sliding_attention"
        out["rope_theta"] = c.get("rope_local_base_freq", 10000.0) if local else c.get("rope_theta", 10000.0)
    return out


def _family(c: dict, mtype: str, n_layers: int, head_dim: int) -> dict:
    """The config fields in which this family differs from Llama (see engine/model/config.py)."""
    fam: dict = {}
    window = c.get("sliding_window")
    if mtype in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
        window = None
    types = c.get("layer_types")
    if mtype == "gemma3_text":
        if c.get("final_logit_softcapping") is not None or c.get("attn_logit_softcapping") is not None:
            raise ValueError("logit soft-capping is not supported (Gemma 3 checkpoints do not use it)")
        every = int(c.get("sliding_window_pattern", 6))
        types = types or ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
        fam.update(
            qk_norm=True, post_norms=True, mlp_activation="gelu_tanh", embedding_scale=c["hidden_size"] ** 0.5,
            attn_scale=float(c.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            rope_base_local=float(_rope(c, "sliding_attention")["rope_theta"]),
        )
        if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"activation {c['hidden_activation']!r} is not supported (gelu_pytorch_tanh is)")
    elif mtype == "qwen3":
        fam["qk_norm"] = True
    elif mtype == "phi3":
        partial = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial rotary embeddings ({partial}) are not supported")
    if window and types and "sliding_attention" in types:
        fam["layer_types"] = tuple("local" if t == "sliding_attention" else "global" for t in types)
        fam["sliding_window"] = int(window)
    elif window and not types:
        fam["sliding_window"] = int(window)  # Mistral, Phi-3: every layer local
    return fam


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path.name} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} must hold a JSON object, it holds a {type(value).__name__}")
    return value


def read_config(directory: Path) -> ModelConfig:
    """config.json as a ModelConfig; every field is type- and range-checked, and an error names the key."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    c = read_json_object(path)
    mtype = c.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {mtype!r} (Inference Lab runs: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    def need(key: str, field: str, default: object = _REQUIRED) -> int:
        value = c.get(key, default)
        if value is _REQUIRED:
            raise ValueError(f"config.json lacks {key}")
        return checked_int(value, f"config.json: {key}", LIMITS[field])

    n_layers = need("num_hidden_layers", "n_layers")
    d_model = need("hidden_size", "d_model")
    n_heads = need("num_attention_heads", "n_heads")
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    for i in eos_ids:
        checked_int(i, "config.json: eos_token_id", (0, LIMITS["vocab_size"][1]))
    bos = c.get("bos_token_id")
    head_dim = need("head_dim", "head_dim") if c.get("head_dim") else d_model // n_heads
    rope = _rope(c)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    rope_base = checked_float(rope["rope_theta"], "config.json: rope_theta", 0.0, math.inf)
    factors = () if kind == "default" else scaling_freq_factors(rope, head_dim, rope_base)
    return ModelConfig(
        name=directory.name,
        architecture=mtype,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=need("num_key_value_heads", "n_kv_heads", c.get("num_key_value_heads") or n_heads),
        ffn_dim=need("intermediate_size", "ffn_dim"),
        vocab_size=need("vocab_size", "vocab_size"),
        context_length=need("max_position_embeddings", "context_length", 2048),
        rope_base=rope_base,
        rope_freq_factors=factors,
        norm_eps=checked_float(c.get("rms_norm_eps", 1e-5), "config.json: rms_norm_eps", 0.0, 1.0),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=mtype == "qwen2" or bool(c.get("attention_bias", False)),
        head_dim=head_dim,
        bos_token_id=None if bos is None else checked_int(bos, "config.json: bos_token_id", (0, 2**31)),
        eos_token_ids=eos_ids,
        **_family(c, mtype, n_layers, head_dim),
    )


# safetensors dtypes this engine takes weights in, with their sizes in bytes.
WEIGHT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# The converted-weight cache (engine.loaders) also holds a quantized file's own blocks, as bytes.
CACHE_DTYPES = {**WEIGHT_DTYPES, "U8": 1}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def check_safetensors(path: Path, dtypes: Mapping[str, int] = WEIGHT_DTYPES) -> None:
    """Hold every claim of a safetensors header against the file before anything is read or allocated; `dtypes`
    maps the tensor types allowed to their bytes per value.

    Layout: an 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}}, then the
    data; each tensor's [begin, end) is relative to the data and must hold exactly prod(shape) · itemsize bytes.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if size == 0:
            raise ValueError(f"{path.name} is empty (0 bytes)")
        if head.startswith(b"PK\x03\x04") or (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05"):
            raise ValueError(
                f"{path.name} is a pickle (a PyTorch .bin/.pt file), not safetensors; pickles can run code when "
                "loaded and are never opened here: convert it to safetensors first"
            )
        if size < 8:
            raise ValueError(f"{path.name} is not a safetensors file: {size} bytes, shorter than its length field")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(
                f"{path.name} is not a valid safetensors file: its header claims {n:,} bytes, "
                f"the file has {size:,}"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path.name} is not a valid safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not a valid safetensors file: its header is not a JSON object")
    data_size = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict) or not {"dtype", "shape", "data_offsets"} <= set(t):
            raise ValueError(f"{path.name}: the header entry for {name!r} lacks dtype, shape or data_offsets")
        dtype, shape, offsets = t["dtype"], t["shape"], t["data_offsets"]
        if dtype not in dtypes:
            raise ValueError(f"{path.name}: tensor {name!r} has dtype {dtype!r}; weights must be one of "
                             f"{', '.join(dtypes)}")
        ints = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, *offsets])
        if not ints or len(shape) > 4:
            raise ValueError(f"{path.name}: tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offsets
        need = math.prod(shape) * dtypes[dtype]
        if end < begin or end - begin != need:
            raise ValueError(f"{path.name}: tensor {name!r} of shape {tuple(shape)} needs {need:,} bytes, "
                             f"its data_offsets give {end - begin:,}")
        if end > data_size:
            raise ValueError(
                f"{path.name}: tensor {name!r} claims bytes {begin:,}…{end:,} of the data, but the file ends "
                f"after {data_size:,} (truncated or damaged)"
            )


def storage(tensors: Iterable[tuple[str, str, int, int]], embedding: str) -> dict:
    """A file's own storage from its tensors' (name, type, bytes, values): {"file_tensors": {type: [bytes,
    values]}, "file_embedding_bytes": the bytes of the token table named `embedding`}."""
    by_type: dict[str, list[int]] = {}
    embedding_bytes = 0
    for name, kind, nbytes, values in tensors:
        entry = by_type.setdefault(kind, [0, 0])
        entry[0] += nbytes
        entry[1] += values
        embedding_bytes = nbytes if name == embedding else embedding_bytes
    return {"file_tensors": by_type, "file_embedding_bytes": embedding_bytes}


def tensor_stats(directory: Path) -> dict:
    """The checkpoint's own storage (`storage`)."""
    from safetensors import safe_open

    def tensors() -> Iterator[tuple[str, str, int, int]]:
        for f in sorted(directory.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for name in st.keys():  # noqa: SIM118 — safe_open is not a mapping
                    sl = st.get_slice(name)
                    values = math.prod(sl.get_shape())
                    yield name, sl.get_dtype(), values * WEIGHT_DTYPES.get(sl.get_dtype(), 4), values

    return storage(tensors(), "model.embed_tokens.weight")


# The JSON files of a model directory the tokenizer reads besides tokenizer.json; each must hold an object.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "generation_config.json", "chat_template.json")


def check_tokenizer_files(directory: Path) -> None:
    """Each JSON file the tokenizer reads parses and holds an object, else one ValueError naming the file."""
    for name in ("tokenizer.json", *TOKENIZER_SIDE_FILES):
        if (directory / name).is_file():
            read_json_object(directory / name)


def read_weights(directory: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights (pickled .bin files are never loaded)")
    sd: dict[str, torch.Tensor] = {}
    gemma = cfg.architecture == "gemma3_text"
    names = {**WEIGHT_MAP, **COMMON_EXTRA, **FAMILY_MAPS.get(cfg.architecture, {})}  # HF name -> the engine's
    for f in files:
        check_safetensors(f)
        try:
            tensors = load_file(str(f))
        except SafetensorError as e:
            raise ValueError(f"{f.name} is not a valid safetensors file ({e})") from None
        for hf_name, w in tensors.items():
            name = renamed(hf_name, names)
            if name is None:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # a cached RoPE table some checkpoints carry; recomputed from rope_theta
                raise ValueError(f"tensor {hf_name!r} is not part of a {cfg.architecture} model this engine knows")
            if name == "output.weight" and cfg.tied_embeddings:
                continue  # a tied head saved explicitly is the embedding again
            w = w.float()
            if gemma and name.endswith("norm.weight"):
                w = w + 1.0  # Gemma's RMSNorm scales by (1 + w)
            if name.endswith(".attn.wqkv.weight"):  # phi3: [q; k; v]
                q, k, v = w.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim])
                sd.update({name.replace("wqkv", "wq"): q, name.replace("wqkv", "wk"): k,
                           name.replace("wqkv", "wv"): v})
            elif name.endswith(".mlp.w_gate_up.weight"):  # phi3: [gate; up]
                gate, up = w.split(cfg.ffn_dim)
                sd.update({name.replace("w_gate_up", "w_gate"): gate, name.replace("w_gate_up", "w_up"): up})
            else:
                sd[name] = w
    return halves_to_pairs_all(sd, cfg)
