"""The scheduling lab: static against continuous batching, served by the loaded model, with a paged KV cache.

Requests arrive on a clock (engine.labs.schedule_events.make_requests: a rate and a burstiness, lengths from a
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

from engine.labs.schedule_events import (  # noqa: F401 — re-exported: the lab's events live with their generator
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
from engine.runtime import Row, Runtime, runtime_of


@dataclass
class _Live:
    spec: RequestSpec
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    admitted_s: float = math.nan
    first_s: float = math.nan


def _timed_step(rt: Runtime, slots: dict[int, int], rows: list[_Live], prefill: bool) -> float:
    """Run one step, append each row's greedy token; returns the measured seconds."""
    inputs = [r.prompt if prefill else [r.tokens[-1]] for r in rows]
    t0 = time.perf_counter()
    logits = rt.forward([Row(slots[r.spec.request_id], x) for r, x in zip(rows, inputs, strict=True)])
    nxt = torch.stack(logits).argmax(-1).tolist()  # waits for the device
    dt = time.perf_counter() - t0
    for r, t in zip(rows, nxt, strict=True):
        r.tokens.append(int(t))
    return dt


def _serve(rt: Runtime, cfg: SchedConfig, policy: str, requests: Sequence[RequestSpec],
           prompts: Sequence[list[int]], bpp: float, reserve_len: int,
           should_stop: Callable[[], bool]) -> Iterator[SchedStep | SchedRequestDone]:
    free_slots = list(range(rt.n_seq - 1, -1, -1))  # the runtime's sequences; a running request holds one
    slots: dict[int, int] = {}
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
            slot = slots.pop(r.spec.request_id)
            rt.remove(slot)
            free_slots.append(slot)
            running.remove(r)
        reserved = len(running) if policy == "continuous" or not running else reserved
        yield SchedStep(
            policy=policy, index=index, kind=kind, start_s=t0, step_s=dt,
            request_ids=tuple(r.spec.request_id for r in rows), positions=tuple(positions), n_queued=n_queued,
            n_running=len(running), pages_in_use=rt.pages_in_use(),
            used_bytes=sum(rt.length(s) for s in slots.values()) * bpp,
            paged_bytes=rt.pages_in_use() * rt.page_size * bpp, contiguous_bytes=reserved * reserve_len * bpp,
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
            slots[spec.request_id] = free_slots.pop()
            running.append(live)
            if policy == "continuous":
                reserved = len(running)
            dt = _timed_step(rt, slots, [live], prefill=True)
            live.first_s = now + dt
            yield from step("prefill", [live], [0], dt, len(queue) + len(waiting))
            arrivals()
        rows = [r for r in running if r.tokens]
        if rows:
            if should_stop():
                return
            positions = [rt.length(slots[r.spec.request_id]) for r in rows]
            n_queued = len(queue)
            dt = _timed_step(rt, slots, rows, prefill=False)
            yield from step("decode", rows, positions, dt, n_queued)


def warm_up(rt: Runtime, prompt_lens: Sequence[int], max_batch: int, should_stop: Callable[[], bool]) -> bool:
    """Run, unmeasured, one prefill of each prompt length and one decode step of each batch size; False if stopped.
    The runtime is left empty.

    The first product of each new shape is slower (oneDNN builds a kernel per shape, the allocator grows; llama.cpp
    builds a graph per batch), so without this the policy measured first would pay for both.
    """
    for n in prompt_lens:
        if should_stop():
            return False
        rt.forward([Row(0, [1] * n)])
        rt.remove(0)
    for b in range(1, max_batch + 1):
        if should_stop():
            return False
        rt.forward([Row(i, [1]) for i in range(b)])
        for i in range(b):
            rt.remove(i)
    return True


def schedule(session, cfg: SchedConfig, should_stop: Callable[[], bool] | None = None,
             memory_limit_bytes: float | None = None) -> Iterator[SchedEvent]:
    """Serve the same requests under each policy of cfg: SchedPlan, then each policy's SchedSteps and
    SchedRequestDones (the policies' steps alternate), and its SchedSummary when its last request is done.
    Stops quietly (no further summary) when should_stop() turns true.

    `session`: either runtime's session, run by its runtime (engine.runtime: the torch engine's paged cache, or
    llama.cpp's unified cache, whose pages are single positions). Bad settings raise ValueError with one sentence,
    before any step runs.
    """
    cfg.validate(session.cfg.context_length)
    stop = should_stop or (lambda: False)
    longest = cfg.longest()
    with runtime_of(session, 1, 1, page_size=cfg.page_size) as probe:
        bpp, page, dtype, device = probe.kv_bytes_per_position(), probe.page_size, probe.dtype_name, probe.device
    reserve_len = cfg.reserve_len or longest
    n_pages = cfg.max_batch * -(-longest // page)
    policies = cfg.policies()
    pool_bytes = len(policies) * n_pages * page * bpp  # a pool per policy: the policies run side by side
    if memory_limit_bytes is not None and pool_bytes > memory_limit_bytes:
        raise ValueError(f"the KV page pools ({pool_bytes / 2**20:,.0f} MiB: {len(policies)} × {cfg.max_batch} "
                         f"requests of up to {longest} positions) exceed the memory available "
                         f"({memory_limit_bytes / 2**20:,.0f} MiB)")
    budget = cfg.kv_budget_bytes or cfg.max_batch * reserve_len * bpp
    requests = make_requests(cfg)
    rng = np.random.default_rng(cfg.seed + 1)
    low = 100 if session.cfg.vocab_size > 200 else 0
    prompts = [rng.integers(low, session.cfg.vocab_size, size=r.prompt_len).tolist() for r in requests]
    yield SchedPlan(config=cfg, policies=policies, requests=requests, kv_bytes_per_position=bpp,
                    reserve_len=reserve_len, pool_pages=n_pages, dtype=dtype, device=str(device), page_size=page)
    runtimes = {p: runtime_of(session, cfg.max_batch, longest, page_size=cfg.page_size) for p in policies}
    try:
        yield from _take_turns(runtimes, cfg, requests, prompts, bpp, reserve_len, budget, stop)
    finally:
        for rt in runtimes.values():
            rt.close()


def _take_turns(runtimes: dict[str, Runtime], cfg: SchedConfig, requests: Sequence[RequestSpec],
                prompts: Sequence[list[int]], bpp: float, reserve_len: int, budget: float,
                stop: Callable[[], bool]) -> Iterator[SchedEvent]:
    for rt in runtimes.values():
        if not warm_up(rt, sorted({r.prompt_len for r in requests}), min(cfg.max_batch, len(requests)), stop):
            return
    # The policies take turns, a step each: on a machine whose speed drifts (other programs, clocks, heat) both
    # see the same conditions, where one policy after the other could each meet a different machine.
    runs = {}
    for policy, rt in runtimes.items():
        runs[policy] = _serve(rt, cfg, policy, requests, prompts, bpp, reserve_len, stop)
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
