"""Batched decode, measured: the escape hatch from memory-bound decode.

One decode step reads every weight once whatever the batch, so running B sequences together costs little more per
step than running one, while producing B tokens. `bench_batch` measures that on the loaded model: the time per step
(TPOT, felt by each stream), tokens per second per stream (1 / TPOT) and for the system (B / TPOT), next to the
analytic FLOPs and bytes of each step from engine.costs.formulas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.costs import formulas as costs
from engine.loaders import LoadedModel
from engine.model.kv_cache import KVCache
from engine.protocol import BatchRow

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)


class Cancelled(Exception):
    """The caller asked the measurement to stop."""


@torch.inference_mode()
def generate_batch(
    lm: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[np.ndarray, float, np.ndarray]:
    """Greedy decode of B equal-length prompts together: (ids (B, n), prefill seconds, decode step seconds)."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError("batched prompts must have the same number of tokens")
    (n_prompt,) = lengths
    if n_prompt == 0 or max_new_tokens < 1:
        raise ValueError("need a non-empty prompt and at least one new token")
    B = len(prompts)
    if n_prompt + max_new_tokens > lm.cfg.context_length:
        raise ValueError(f"{n_prompt} + {max_new_tokens} tokens exceed the context of {lm.cfg.context_length}")
    cache = KVCache(lm.cfg, B, n_prompt + max_new_tokens, lm.dtype, lm.device)
    sync = torch.cuda.synchronize if lm.device.type == "cuda" else (lambda: None)
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=lm.device)
    t0 = time.perf_counter()
    logits = lm.model(torch.tensor([list(p) for p in prompts], device=lm.device), 0, cache)  # (B, V)
    out[:, 0] = logits.argmax(-1)
    sync()
    prefill_s = time.perf_counter() - t0
    steps = np.zeros(max_new_tokens - 1)
    for i in range(1, max_new_tokens):
        if should_stop is not None and should_stop():
            raise Cancelled()
        t0 = time.perf_counter()
        logits = lm.model(out[:, i - 1 : i], n_prompt + i - 1, cache)  # (B, V)
        out[:, i] = logits.argmax(-1)
        sync()
        steps[i - 1] = time.perf_counter() - t0
    return out.cpu().numpy(), prefill_s, steps


def bench_batch(
    lm: LoadedModel, batches: Sequence[int] = DEFAULT_BATCHES, prompt_tokens: int = 32, new_tokens: int = 16,
    progress: Callable[[float, str], None] | None = None, should_stop: Callable[[], bool] | None = None,
    memory_limit_bytes: float | None = None, on_row: Callable[[BatchRow], None] | None = None,
) -> list[BatchRow]:
    """Measure decode at each batch size (as memory allows); cancellable between steps (raises Cancelled)."""
    if new_tokens < 2 or prompt_tokens < 1:
        raise ValueError("the batching lab needs a prompt and at least 2 new tokens (one decode step to time)")
    dtype = str(lm.dtype).removeprefix("torch.")
    rows: list[BatchRow] = []
    rng = np.random.default_rng(0)
    for i, b in enumerate(batches):
        if b < 1:
            raise ValueError(f"batch sizes must be positive, got {b}")
        kv = costs.kv_bytes_per_token(lm.cfg, dtype, batch=b) * (prompt_tokens + new_tokens)
        if memory_limit_bytes is not None and kv > memory_limit_bytes:
            break  # this and larger batches do not fit
        if progress is not None:
            progress(i / len(batches), f"batch {b}: decoding {new_tokens} tokens")
        prompts = rng.integers(100, lm.cfg.vocab_size, size=(b, prompt_tokens)).tolist()
        _, _, steps = generate_batch(lm, prompts, new_tokens, should_stop)
        tpot = float(np.median(steps))
        mid = prompt_tokens + new_tokens // 2
        cost = costs.decode_cost(lm.cfg, mid, batch=b, weight_dtype=dtype)
        rows.append(BatchRow(
            batch=b, context=mid, tpot_s=tpot, tokens_per_s_per_stream=1 / tpot, tokens_per_s_system=b / tpot,
            flops_per_step=cost.flops, bytes_per_step=cost.bytes, intensity=cost.intensity,
            achieved_flops=cost.flops / tpot, achieved_bandwidth=cost.bytes / tpot, kv_bytes=kv,
        ))
        if on_row is not None:
            on_row(rows[-1])
    if progress is not None:
        progress(1.0, "done")
    return rows
