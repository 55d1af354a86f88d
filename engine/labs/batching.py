"""Batched decode, measured: the escape hatch from memory-bound decode.

One decode step reads every weight once whatever the batch, so running B sequences together costs little more per
step than running one, while producing B tokens. `bench_batch` measures that on the loaded model, on whichever
runtime holds it (engine.runtime: the torch engine or llama.cpp): the time per step (TPOT, felt by each stream),
tokens per second per stream (1 / TPOT) and for the system (B / TPOT), next to the analytic FLOPs and bytes of each
step from engine.costs.formulas (on llama.cpp, the weights at the file's own bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.protocol import BatchRow
from engine.runtime import Row, Runtime, runtime_of

if TYPE_CHECKING:
    from engine.run.session import Engine

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)


class Cancelled(Exception):
    """The caller asked the measurement to stop."""


def _greedy(logits: list[torch.Tensor]) -> list[int]:
    return torch.stack(logits).argmax(-1).tolist()  # waits for the device


def generate_batch(
    session: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
) -> tuple[np.ndarray, float, np.ndarray]:
    """decode_batch on a runtime of the session's model made for these prompts (and freed after)."""
    if not prompts:
        raise ValueError("need at least one non-empty prompt and at least one new token")
    with runtime_of(session, len(prompts), max(len(p) for p in prompts) + max_new_tokens) as rt:
        return decode_batch(rt, prompts, max_new_tokens)


def decode_batch(
    rt: Runtime, prompts: Sequence[Sequence[int]], max_new_tokens: int,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[np.ndarray, float, np.ndarray]:
    """Greedy decode of B prompts together, sequence i of the runtime holding prompt i (prompts may differ in
    length: each sequence keeps its own positions): (ids (B, n), prefill seconds, decode step seconds). The runtime
    needs at least B sequences of the longest prompt + max_new_tokens positions."""
    B = len(prompts)
    if B == 0 or min(len(p) for p in prompts) == 0 or max_new_tokens < 1:
        raise ValueError("need at least one non-empty prompt and at least one new token")
    need = max(len(p) for p in prompts) + max_new_tokens
    if B > rt.n_seq or need > rt.capacity:
        raise ValueError(f"{B} sequences of {need} positions exceed this runtime's {rt.n_seq} of {rt.capacity}")
    for i in range(B):
        rt.remove(i)
    out = np.empty((B, max_new_tokens), dtype=np.int64)
    t0 = time.perf_counter()
    out[:, 0] = _greedy(rt.forward([Row(i, list(p)) for i, p in enumerate(prompts)]))
    prefill_s = time.perf_counter() - t0
    steps = np.zeros(max_new_tokens - 1)
    for j in range(1, max_new_tokens):
        if should_stop is not None and should_stop():
            raise Cancelled()
        t0 = time.perf_counter()
        out[:, j] = _greedy(rt.forward([Row(i, [int(out[i, j - 1])]) for i in range(B)]))
        steps[j - 1] = time.perf_counter() - t0
    return out, prefill_s, steps


def bench_batch(
    session: Engine, batches: Sequence[int] = DEFAULT_BATCHES, prompt_tokens: int = 32, new_tokens: int = 16,
    progress: Callable[[float, str], None] | None = None, should_stop: Callable[[], bool] | None = None,
    memory_limit_bytes: float | None = None, on_row: Callable[[BatchRow], None] | None = None,
) -> list[BatchRow]:
    """Measure decode at each batch size (as memory allows) on `session`'s model (torch or
    llama.cpp: engine.runtime.runtime_of makes a runtime of each batch size); cancellable between steps (raises
    Cancelled)."""
    if new_tokens < 2 or prompt_tokens < 1:
        raise ValueError("the batching lab needs a prompt and at least 2 new tokens (one decode step to time)")
    if any(b < 1 for b in batches):
        raise ValueError(f"batch sizes must be positive, got {list(batches)}")
    positions = prompt_tokens + new_tokens
    rows: list[BatchRow] = []
    rng = np.random.default_rng(0)
    with runtime_of(session, 1, positions) as probe:  # the cache's bytes, from the kind of runtime that will hold it
        cfg = probe.cfg
        kv_of = {b: probe.kv_bytes_per_position() * probe.cells_reserved(b, positions) for b in batches}
    for i, b in enumerate(batches):
        kv = kv_of[b]
        if memory_limit_bytes is not None and kv > memory_limit_bytes:
            break  # this and larger batches do not fit
        if progress is not None:
            progress(i / len(batches), f"batch {b}: decoding {new_tokens} tokens")
        prompts = rng.integers(min(100, cfg.vocab_size // 2), cfg.vocab_size, size=(b, prompt_tokens)).tolist()
        with runtime_of(session, b, positions) as rt:
            _, _, steps = decode_batch(rt, prompts, new_tokens, should_stop)
            tpot = float(np.median(steps))
            mid = prompt_tokens + new_tokens // 2
            cost = rt.step_cost(1, mid - 1, batch=b)
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
