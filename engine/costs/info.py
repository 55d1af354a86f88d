"""The one place a ModelInfo is made: the config's shapes, the file's facts and the runtime's own storage, with
every derived figure (KV bytes per position, the file's bits per weight, the bytes a decode step streams) computed
here by engine.costs.formulas, so the torch engine and llama.cpp describe one model with the same arithmetic."""

from __future__ import annotations

from collections.abc import Mapping

from engine.costs import formulas as costs
from engine.events import ModelInfo
from engine.model.config import ModelConfig


def model_info(cfg: ModelConfig, path: str, *, n_params: int, dtype: str, device: str, kv_dtype: str,
               kv_windowed: bool, weight_bytes: float, decode_weight_bytes: float, file_type: str,
               file_tensors: Mapping[str, tuple[int, int]], file_embedding_bytes: float, load_s: float,
               from_cache: bool, sha256: str, kernels: str) -> ModelInfo:
    """The ModelInfo of `cfg` loaded from `path`.

    dtype: what a user reads as the weights' precision; kv_dtype: the KV cache's element type; kv_windowed: whether
    sliding-window layers keep only their window (the torch engine's ring) or every position (llama.cpp's full
    cache); weight_bytes: the weights as the runtime holds them; decode_weight_bytes: what one decode step streams
    with the kernels in use (bytes); file_tensors: tensor type → (bytes, values) in the file.
    """
    files = {k: (int(b), int(n)) for k, (b, n) in file_tensors.items()}
    file_bytes = sum(b for b, _ in files.values())
    per_position = costs.kv_bytes_per_token(cfg, kv_dtype) / cfg.n_layers  # one position in one layer
    kv_per_token = (costs.kv_bytes_per_token_at(cfg, kv_dtype, cfg.context_length) if kv_windowed
                    else costs.kv_bytes_per_token(cfg, kv_dtype))
    return ModelInfo(
        name=cfg.name, path=path, architecture=cfg.architecture, n_layers=cfg.n_layers,
        d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, context_length=cfg.context_length,
        rope_base=cfg.rope_base, n_params=n_params, dtype=dtype, device=device,
        weight_bytes=int(weight_bytes), kv_bytes_per_token=round(kv_per_token),
        file_type=file_type, load_s=load_s, from_cache=from_cache,
        sliding_window=cfg.sliding_window, layer_types=cfg.layer_types, rope_base_local=cfg.rope_base_local,
        kv_bytes_per_token_global=round(per_position * cfg.n_global_layers),
        kv_bytes_per_token_local=round(per_position * cfg.n_local_layers),
        file_bytes_by_type={k: b for k, (b, _) in files.items()},
        file_params_by_type={k: n for k, (_, n) in files.items()},
        file_bits_per_weight={k: round(8 * b / n, 4) for k, (b, n) in files.items() if n},
        decode_weight_bytes_file=round(costs.step_weight_bytes_file(cfg, file_bytes, file_embedding_bytes, rows=1))
        if files else 0,
        decode_weight_bytes=round(decode_weight_bytes), sha256=sha256, kernels=kernels,
    )
