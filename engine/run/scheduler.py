"""The scheduling lab: static against continuous batching, served by the loaded model, with a paged KV cache.

Requests arrive on a clock (engine.run.schedule_events.make_requests: a rate and a burstiness, lengths from a
range) and are served by real forward steps whose time is measured; the clock advances by each step's measured
time and jumps over idle gaps to the next arrival, so a run takes only as long as its steps.

- static batching: when the engine is idle and max_batch requests wait (or no more will come), they form a batch;
  it runs until its longest request ends, and whoever arrives meanwhile waits for the next batch.
- continuous batching: at every step, waiting requests join while fewer than max_batch run; a request leaves the
  batch at the step that gives it its last token.
Prefill: each joining request gets its own prefill step (its whole prompt in one forward pass), and decode steps
resume after it; the running requests wait meanwhile (the stall chunked prefill would remove). Tokens are greedy
and every request generates exactly its output length (no EOS), as `vllm bench serve --ignore-eos` does.

The KV cache is paged (PagedKVCache): fixed-size pages from one pool, allocated to a request as it grows and freed
when it ends; the model reads each row's keys through its page table, at its own positions, masked to its own
length (engine.model.transformer takes a start per row). Each step reports the memory in use, the pages held and
what a contiguous cache reserving `reserve_len` positions per request would hold.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.costs import formulas as costs
from engine.loaders import LoadedModel
from engine.run.schedule_events import (  # noqa: F401 — re-exported: the lab's events live with their generator
    PREFILL_MODE,
    Percentiles,
    RequestSpec,
    SchedConfig,
    SchedEvent,
    SchedPlan,
    SchedRequestDone,
    SchedStep,
    SchedSummary,
    make_requests,
    summarize,
)
from engine.runtime.paged import PagedKVCache


def forward_rows(lm: LoadedModel, cache: PagedKVCache, request_ids: Sequence[int],
                 tokens: Sequence[Sequence[int]]) -> torch.Tensor:
    """One forward step of rows at their own positions (equal token counts): float32 logits of each row's last
    token (B, V)."""
    with torch.inference_mode():
        starts = cache.bind(request_ids, len(tokens[0]))
        return lm.model(torch.tensor(tokens, dtype=torch.long, device=lm.device), starts, cache)


@dataclass
class _Live:
    spec: RequestSpec
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    admitted_s: float = math.nan
    first_s: float = math.nan


def _timed_step(lm: LoadedModel, cache: PagedKVCache, rows: list[_Live], prefill: bool) -> float:
    """Run one step, append each row's greedy token; returns the measured seconds."""
    ids = [r.spec.request_id for r in rows]
    inputs = [r.prompt for r in rows] if prefill else [[r.tokens[-1]] for r in rows]
    t0 = time.perf_counter()
    logits = forward_rows(lm, cache, ids, inputs)  # (B, V)
    nxt = logits.argmax(-1).tolist()  # waits for the device
    dt = time.perf_counter() - t0
    for r, t in zip(rows, nxt, strict=True):
        r.tokens.append(int(t))
    return dt


def _serve(lm: LoadedModel, cfg: SchedConfig, policy: str, requests: Sequence[RequestSpec],
           prompts: Sequence[list[int]], cache: PagedKVCache, bpp: float, reserve_len: int,
           should_stop: Callable[[], bool]) -> Iterator[SchedStep | SchedRequestDone]:
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
    queue: deque[RequestSpec] = deque()
    running: list[_Live] = []
    now, index, reserved = 0.0, 0, 0  # reserved: requests a contiguous cache would hold a reservation for

    def arrivals() -> None:
        while pending and pending[0].arrival_s <= now:
            queue.append(pending.popleft())

    def step(kind: str, rows: list[_Live], positions: list[int], dt: float, n_queued: int
             ) -> Iterator[SchedStep | SchedRequestDone]:
        nonlocal now, index, reserved
        t0, now = now, now + dt
        ended = [r for r in rows if len(r.tokens) == r.spec.output_len]
        for r in ended:
            cache.release(r.spec.request_id)
            running.remove(r)
        reserved = len(running) if policy == "continuous" or not running else reserved
        yield SchedStep(
            policy=policy, index=index, kind=kind, start_s=t0, step_s=dt,
            request_ids=tuple(r.spec.request_id for r in rows), positions=tuple(positions), n_queued=n_queued,
            n_running=len(running), pages_in_use=cache.pages_in_use(), used_bytes=cache.positions_held() * bpp,
            paged_bytes=cache.pages_in_use() * cache.page_size * bpp, contiguous_bytes=reserved * reserve_len * bpp,
        )
        index += 1
        for r in ended:
            s = r.spec
            e2e, ttft = now - s.arrival_s, r.first_s - s.arrival_s
            tpot = (e2e - ttft) / (s.output_len - 1) if s.output_len > 1 else math.nan
            yield SchedRequestDone(
                policy=policy, request_id=s.request_id, arrival_s=s.arrival_s, admitted_s=r.admitted_s,
                first_token_s=r.first_s, finish_s=now, prompt_len=s.prompt_len, output_len=s.output_len,
                ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, tokens=tuple(r.tokens),
            )

    while pending or queue or running:
        arrivals()
        joiners: list[RequestSpec] = []
        if policy == "continuous":
            while queue and len(running) + len(joiners) < cfg.max_batch:
                joiners.append(queue.popleft())
        elif not running and queue and (len(queue) >= cfg.max_batch or not pending):
            joiners = [queue.popleft() for _ in range(min(cfg.max_batch, len(queue)))]
            reserved = len(joiners)  # a static batch's slots stay reserved until its longest request ends
        if not running and not joiners:
            now = pending[0].arrival_s  # idle (or a static batch still filling) until the next arrival
            continue
        waiting = deque(joiners)
        while waiting:
            if should_stop():
                return
            spec = waiting.popleft()
            live = _Live(spec, list(prompts[spec.request_id]), admitted_s=now)
            running.append(live)
            if policy == "continuous":
                reserved = len(running)
            dt = _timed_step(lm, cache, [live], prefill=True)
            live.first_s = now + dt
            yield from step("prefill", [live], [0], dt, len(queue) + len(waiting))
            arrivals()
        rows = [r for r in running if r.tokens]
        if rows:
            if should_stop():
                return
            positions = [cache.lengths[r.spec.request_id] for r in rows]
            n_queued = len(queue)
            dt = _timed_step(lm, cache, rows, prefill=False)
            yield from step("decode", rows, positions, dt, n_queued)


def warm_up(lm: LoadedModel, prompt_lens: Sequence[int], max_batch: int, should_stop: Callable[[], bool]) -> bool:
    """Run, unmeasured, one prefill of each prompt length and one decode step of each batch size; False if stopped.

    The first product of each new shape is slower (oneDNN builds a kernel per shape, the allocator grows), so
    without this the policy measured first would pay for both.
    """
    page = 16
    with torch.inference_mode():
        cache = PagedKVCache(lm.cfg, max_batch + -(-max(prompt_lens) // page) + 1, page, lm.dtype, lm.device)
    for n in prompt_lens:
        if should_stop():
            return False
        forward_rows(lm, cache, [-1], [[1] * n])
        cache.release(-1)
    for b in range(max_batch):
        forward_rows(lm, cache, [b], [[1]])
    for b in range(1, max_batch + 1):
        if should_stop():
            return False
        forward_rows(lm, cache, list(range(b)), [[1]] * b)
    return True


def schedule(lm: LoadedModel, cfg: SchedConfig, should_stop: Callable[[], bool] | None = None,
             memory_limit_bytes: float | None = None) -> Iterator[SchedEvent]:
    """Serve the same requests under each policy of cfg: SchedPlan, then each policy's SchedSteps and
    SchedRequestDones (the policies' steps alternate), and its SchedSummary when its last request is done.
    Stops quietly (no further summary) when should_stop() turns true.

    Bad settings raise ValueError with one sentence, before any step runs.
    """
    cfg.validate(lm.cfg.context_length)
    stop = should_stop or (lambda: False)
    dtype = str(lm.dtype).removeprefix("torch.")
    bpp = costs.kv_bytes_per_token(lm.cfg, dtype)
    longest = cfg.longest()
    reserve_len = cfg.reserve_len or longest
    n_pages = cfg.max_batch * -(-longest // cfg.page_size)
    pool_bytes = n_pages * cfg.page_size * bpp
    if memory_limit_bytes is not None and pool_bytes > memory_limit_bytes:
        raise ValueError(f"the KV page pool ({pool_bytes / 2**20:,.0f} MiB for {cfg.max_batch} requests of up to "
                         f"{longest} positions) exceeds the memory available ({memory_limit_bytes / 2**20:,.0f} MiB)")
    budget = cfg.kv_budget_bytes or cfg.max_batch * reserve_len * bpp
    requests = make_requests(cfg)
    rng = np.random.default_rng(cfg.seed + 1)
    low = 100 if lm.cfg.vocab_size > 200 else 0
    prompts = [rng.integers(low, lm.cfg.vocab_size, size=r.prompt_len).tolist() for r in requests]
    yield SchedPlan(config=cfg, policies=cfg.policies(), requests=requests, kv_bytes_per_position=bpp,
                    reserve_len=reserve_len, pool_pages=n_pages, dtype=dtype, device=str(lm.device))
    if not warm_up(lm, sorted({r.prompt_len for r in requests}), min(cfg.max_batch, len(requests)), stop):
        return
    # The policies take turns, a step each: on a machine whose speed drifts (other programs, clocks, heat) both
    # see the same conditions, where one policy after the other could each meet a different machine.
    runs = {}
    for policy in cfg.policies():
        with torch.inference_mode():
            cache = PagedKVCache(lm.cfg, n_pages, cfg.page_size, lm.dtype, lm.device)
        runs[policy] = _serve(lm, cfg, policy, requests, prompts, cache, bpp, reserve_len, stop)
    steps: dict[str, list[SchedStep]] = {p: [] for p in runs}
    done: dict[str, list[SchedRequestDone]] = {p: [] for p in runs}
    while runs:
        for policy in list(runs):
            for ev in runs[policy]:
                yield ev
                if isinstance(ev, SchedStep):
                    steps[policy].append(ev)
                    break  # the other policy's turn
                done[policy].append(ev)
            else:
                del runs[policy]
                if len(done[policy]) < len(requests):
                    return  # stopped
                yield summarize(policy, done[policy], steps[policy], reserve_len * bpp, budget)
