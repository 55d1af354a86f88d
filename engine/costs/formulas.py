"""What one forward step costs, counted from the model's shapes: FLOPs and bytes moved.

This module is the one home of these formulas; the session, the app and the estimator all call it.

Conventions
-----------
* A multiply-add counts as 2 FLOPs. Multiplying an (m×k) matrix by a (k×n) one is therefore 2·m·k·n FLOPs.
* Only matrix products are counted. Norms, RoPE, softmax, SiLU, bias adds and residual adds are a few FLOPs
  per value of the activations, several hundred times fewer than the products at real model sizes, so
  leaving them out keeps the formulas readable without changing any conclusion.
* Bytes are the traffic to and from main memory (HBM, or RAM on a CPU). Activations are assumed to stay in
  caches and are not counted (`StepCost.activation_bytes` stays 0); weights and the KV cache are what move.

Parameters
----------
Per layer the decoder holds wq (q_dim×d), wk and wv (kv_dim×d each), wo (d×q_dim), the SwiGLU matrices
w_gate and w_up (ffn×d each) and w_down (d×ffn), and two RMSNorm weight vectors (d each); Qwen2 adds biases
on q, k and v (q_dim + 2·kv_dim). Around the layers sit the token embedding (vocab×d), the final norm (d)
and the LM head (vocab×d), which is the embedding matrix itself when the embeddings are tied, so it is
counted once then. Gemma 3 has four norms per layer and per-head q/k norms (2·head_dim).

FLOPs of a step
---------------
Each new token passes through every layer's matrices once: 2·(matrix weights of the layers) FLOPs per token.
The embedding is a row lookup, not a product, so it costs no FLOPs. The LM head costs 2·vocab·d per position
whose logits are computed; during prefill the engine only needs the next token after the prompt, so it
computes logits for the last position alone (pass `all_logits=True` to count every position).

Attention adds two products per layer and head: the query against each key (QKᵀ, head_dim multiply-adds) and
the softmax weights against each value (AV, head_dim multiply-adds again), i.e. 2·2·head_dim FLOPs per
query-key pair per head. Causal attention lets the token at position p read keys 0…p, i.e. p + 1 keys. A
prefill of n tokens starting at position s (a reused prefix of s cached tokens) thus sees
    Σ_{p=s}^{s+n-1} (p + 1) = n·s + n·(n + 1)/2   query-key pairs,
and one decode step at context c (c positions including the new one) sees c pairs. These are the useful
pairs; a kernel that computes the full square and masks half of it performs more arithmetic than this.
A local (sliding-window) layer lets position p read only keys p − W + 1…p, i.e. min(p + 1, W) keys
(window_pairs); Gemma 3 has five local layers (W = 512) for each global one.

Bytes of a step
---------------
Weights: every matrix is streamed from memory once per step, whatever the batch, because all tokens of the
step share it. The embedding table is the exception: a lookup only touches the rows of the tokens in the
step, so an untied table counts as (rows touched)·d values, while a tied table is read whole anyway as the
LM head.
KV cache: per token and per layer the cache keeps one key and one value vector per KV head, so
    KV bytes per token = 2 · n_layers · n_kv_heads · head_dim · bytes per value.
A step writes the keys and values of its new tokens (kv_write_bytes) and reads those of the positions that were
in the cache before it (kv_read_bytes): a step of n tokens after s cached ones reads s and writes n positions.
Its own new keys and values are used while they are fresh, like the other activations, and are not counted
again as a read. One decode step at context c is such a step with n = 1 and s = c − 1. A local layer reads at
most W − 1 cached positions and needs to keep only the last W, so at context c the cache holds
    2 · n_kv_heads · head_dim · bytes per value · (n_global · c + n_local · min(c, W))   (kv_bytes).
The engine's cache (engine.model.kv_cache) keeps at most 2·W positions in a local layer.

Time
----
The roofline model: a step takes at least flops / peak FLOP/s (compute roof) and at least bytes / bandwidth
(memory roof), so its time is estimated as the larger of the two. Arithmetic intensity = flops / bytes; the
ridge point peak / bandwidth is the intensity where both roofs meet. Below it a step is memory-bound, above
it compute-bound. Decode at batch 1 does about 2 FLOPs per parameter and reads each parameter once, so with
2-byte weights its intensity is about 1 FLOP/byte, far below the few hundred FLOP/byte ridge point of a
modern GPU; batching B sequences multiplies the FLOPs by B but not the weight bytes, which is why batching
helps.
"""

from __future__ import annotations

from engine.events import ModelInfo, StepCost
from engine.model import dtypes
from engine.model.config import ModelConfig

bytes_per_value = dtypes.bytes_per_value  # storage of one value in a dtype, in bytes (packed 4-bit: fractions)


def _positive(name: str, value: int, minimum: int = 1) -> int:
    if int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")
    return int(value)


def layer_matrix_params(cfg: ModelConfig) -> int:
    """Weights of one layer's matrices (attention projections and SwiGLU MLP), in parameters."""
    d = cfg.d_model
    attention = cfg.q_dim * d + 2 * cfg.kv_dim * d + d * cfg.q_dim
    mlp = 3 * cfg.ffn_dim * d
    return attention + mlp


def n_params(cfg: ModelConfig) -> int:
    """Total parameters of the model, in parameters (a tied embedding/LM-head matrix counted once)."""
    d = cfg.d_model
    bias = (cfg.q_dim + 2 * cfg.kv_dim) if cfg.qkv_bias else 0
    norms = (4 if cfg.post_norms else 2) * d + (2 * cfg.head_dim if cfg.qk_norm else 0)  # Gemma 3: 4 + q/k norms
    per_layer = layer_matrix_params(cfg) + norms + bias
    embedding = cfg.vocab_size * d
    lm_head = 0 if cfg.tied_embeddings else cfg.vocab_size * d
    return cfg.n_layers * per_layer + embedding + d + lm_head


def weight_bytes(cfg: ModelConfig, dtype: str) -> float:
    """Memory the weights occupy with every parameter stored in `dtype`, in bytes."""
    return n_params(cfg) * bytes_per_value(dtype)


def step_weight_bytes(cfg: ModelConfig, dtype: str, rows: int) -> float:
    """Weights one step streams from memory (all matrices once, plus `rows` embedding rows), in bytes."""
    untouched = 0 if cfg.tied_embeddings else cfg.vocab_size * cfg.d_model
    looked_up = min(rows, cfg.vocab_size) * cfg.d_model
    return (n_params(cfg) - untouched + looked_up) * bytes_per_value(dtype)


def step_weight_bytes_file(cfg: ModelConfig, file_bytes: float, embedding_file_bytes: float, rows: int) -> float:
    """The same weights at the file's own format (e.g. Q4_K blocks), as llama.cpp would stream them, in bytes.

    file_bytes: all tensors of the file; embedding_file_bytes: its token-embedding table, of which an untied model
    reads only the `rows` looked-up rows.
    """
    if cfg.tied_embeddings:
        return float(file_bytes)
    return file_bytes - embedding_file_bytes + min(rows, cfg.vocab_size) * embedding_file_bytes / cfg.vocab_size


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, batch: int = 1) -> float:
    """Keys plus values that one position adds to the cache across all layers (times `batch`), in bytes.

    This is the growth while the context is shorter than any sliding window; past it, local layers stop growing
    (see kv_bytes).
    """
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_value(dtype) * batch


def kv_cache_dtype(info: ModelInfo) -> str:
    """The dtype the loaded model's KV cache holds, as its runtime reported it in bytes per position.

    The torch engine keeps keys and values in the running dtype (ModelInfo.dtype); llama.cpp keeps them in its own
    cache type (float16 by default) whatever the weights' type, and ModelInfo.dtype names the weights. The bytes
    one position adds in one layer (kv_bytes_per_token_global or _local over its layers) divided by
    2 · n_kv_heads · head_dim is the bytes per value: the running dtype when that matches it, else the first format
    of engine.model.dtypes with those bytes per value.
    """
    n_global = sum(t == "global" for t in info.layer_types) if info.layer_types else info.n_layers
    layers, per_token = ((n_global, info.kv_bytes_per_token_global) if n_global
                         else (info.n_layers - n_global, info.kv_bytes_per_token_local))
    if not per_token or not layers:
        return info.dtype  # a session saved before these figures were kept
    per_value = per_token / (2 * layers * info.n_kv_heads * info.head_dim)
    try:
        if abs(dtypes.bytes_per_value(info.dtype) - per_value) <= 1e-3 * per_value:
            return info.dtype
    except ValueError:
        pass  # a weights' type the table does not know: the bytes name the cache's format below
    for d in dtypes.TABLE:
        if abs(d.bytes_per_value - per_value) <= 1e-3 * per_value:
            return d.spellings[0] if d.spellings else d.name
    raise ValueError(f"{info.name}'s KV cache holds {per_value:g} bytes per value, which no known dtype has")


def kv_bytes(cfg: ModelConfig, dtype: str, context: int, batch: int = 1) -> tuple[float, float]:
    """KV cache holding `context` positions, split (global layers, local layers), in bytes.

    A global layer keeps every position; a local (sliding-window) layer needs only the last min(context, window):
        2 · kv_heads · head_dim · bytes per value · (n_global · context + n_local · min(context, window)).
    """
    per_position = 2 * cfg.n_kv_heads * cfg.head_dim * bytes_per_value(dtype) * batch
    local = min(context, cfg.sliding_window) if cfg.sliding_window else context
    return per_position * cfg.n_global_layers * context, per_position * cfg.n_local_layers * local


def kv_bytes_per_token_at(cfg: ModelConfig, dtype: str, context: int, batch: int = 1) -> float:
    """Average KV bytes per position of a cache holding `context` positions (windowed layers capped), in bytes."""
    return sum(kv_bytes(cfg, dtype, context, batch)) / context


def linear_flops_per_token(cfg: ModelConfig) -> float:
    """Matrix products one token makes through all layers (embedding and LM head excluded), in FLOPs."""
    return 2.0 * cfg.n_layers * layer_matrix_params(cfg)


def lm_head_flops_per_token(cfg: ModelConfig) -> float:
    """Computing the logits of one position, in FLOPs."""
    return 2.0 * cfg.vocab_size * cfg.d_model


def causal_pairs(n_tokens: int, start: int = 0) -> int:
    """Query-key pairs of n causal queries at positions start…start+n-1, in pairs: n·start + n·(n+1)/2."""
    return n_tokens * start + n_tokens * (n_tokens + 1) // 2


def window_pairs(n_tokens: int, start: int, window: int) -> int:
    """Query-key pairs of n queries at positions start… in a sliding window: Σ_p min(p + 1, window), in pairs."""
    unclipped = max(0, min(start + n_tokens, window) - start)  # queries that still see every earlier key
    return unclipped * start + unclipped * (unclipped + 1) // 2 + (n_tokens - unclipped) * window


def attention_flops(cfg: ModelConfig, n_tokens: int, start: int = 0) -> float:
    """QKᵀ and AV of n queries after `start` cached positions, global layers causal and local ones windowed, in
    FLOPs: 4 · heads · head_dim per query-key pair and layer."""
    per_pair_layer = 2.0 * 2.0 * cfg.n_heads * cfg.head_dim
    local = window_pairs(n_tokens, start, cfg.sliding_window) if cfg.sliding_window else 0
    return per_pair_layer * (cfg.n_global_layers * causal_pairs(n_tokens, start) + cfg.n_local_layers * local)


def kv_positions_read(cfg: ModelConfig, start: int) -> int:
    """Cached positions a step after `start` cached ones reads, summed over layers: a local layer reads at most
    window − 1 of them (its first new query reaches back that far)."""
    local = min(start, cfg.sliding_window - 1) if cfg.sliding_window else start
    return cfg.n_global_layers * start + cfg.n_local_layers * local


def prefill_cost(
    cfg: ModelConfig,
    n_tokens: int,
    *,
    start: int = 0,
    batch: int = 1,
    weight_dtype: str = "float32",
    kv_dtype: str | None = None,
    all_logits: bool = False,
) -> StepCost:
    """One prefill step of `n_tokens` new tokens per sequence after `start` cached ones (FLOPs and bytes)."""
    n_tokens = _positive("n_tokens", n_tokens)
    start = _positive("start", start, minimum=0)
    batch = _positive("batch", batch)
    kv_dtype = kv_dtype or weight_dtype
    logit_rows = n_tokens if all_logits else 1
    per_sequence = (
        n_tokens * linear_flops_per_token(cfg)
        + attention_flops(cfg, n_tokens, start)
        + logit_rows * lm_head_flops_per_token(cfg)
    )
    kv_token = kv_bytes_per_token(cfg, kv_dtype)
    return StepCost(
        flops=batch * per_sequence,
        weight_bytes=step_weight_bytes(cfg, weight_dtype, rows=n_tokens * batch),
        kv_read_bytes=kv_positions_read(cfg, start) * kv_token / cfg.n_layers * batch,
        kv_write_bytes=n_tokens * kv_token * batch,
    )


def decode_cost(
    cfg: ModelConfig,
    context: int,
    *,
    batch: int = 1,
    weight_dtype: str = "float32",
    kv_dtype: str | None = None,
) -> StepCost:
    """One decode step: one new token per sequence attending over `context` positions (FLOPs and bytes).

    It is the prefill of one token after context − 1 cached ones, and is computed as exactly that, so the two
    phases can never disagree about the same step.
    """
    context = _positive("context", context)
    return prefill_cost(cfg, 1, start=context - 1, batch=batch, weight_dtype=weight_dtype, kv_dtype=kv_dtype)


def tpot_floor_s(
    cfg: ModelConfig,
    context: int,
    bandwidth_bytes_per_s: float,
    *,
    batch: int = 1,
    weight_dtype: str = "float32",
    kv_dtype: str | None = None,
) -> float:
    """Lower bound on one decode step set by memory traffic alone (bytes / bandwidth), in seconds."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s!r}")
    cost = decode_cost(cfg, context, batch=batch, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    return cost.bytes / bandwidth_bytes_per_s


def step_time_estimate_s(cost: StepCost, peak_flops: float, bandwidth: float) -> float:
    """Roofline time of a step, the slower of compute and memory: max(flops/peak, bytes/bw), in seconds."""
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"peak FLOP/s and bandwidth must be positive, got {peak_flops!r}, {bandwidth!r}")
    return max(cost.flops / peak_flops, cost.bytes / bandwidth)


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """Best throughput at a given arithmetic intensity: min(peak, intensity·bw), in FLOP/s."""
    return min(peak_flops, intensity * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Arithmetic intensity where the memory roof meets the compute roof (peak / bw), in FLOP/byte."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth!r}")
    return peak_flops / bandwidth
