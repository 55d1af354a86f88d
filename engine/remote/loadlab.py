"""serve-bench: a bounded load benchmark against a server, with the definitions of `vllm bench serve`.

Per request: TTFT = time to the first chunk with content; ITL = the gaps between content chunks; E2EL = the whole
request; TPOT = (E2EL − TTFT) / (output tokens − 1). Per run: completed, failed, duration, request throughput
(completed / duration), output throughput (output tokens / duration), mean/median/p99 of each latency, and goodput
(requests per second meeting every SLO given). Arrivals: gaps drawn from a gamma distribution with shape =
burstiness and mean 1/rate (burstiness 1 = Poisson); rate ∞ sends everything at once. Concurrency is a client-side
cap on requests in flight. Every run is bounded by its request count and by a time limit.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from engine.protocol import SamplingParams
from engine.remote.backend import RemoteBackend
from engine.remote.client import RemoteError
from engine.remote.metrics import ServerMetrics
from engine.remote.otlp import SpanReceiver

PROMPTS = (
    "Explain what a KV cache is in two sentences.",
    "Write a short poem about the sea.",
    "What is the capital of France, and why is it famous?",
    "List three uses of a hash map.",
    "Describe how a bicycle works to a child.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Summarise the plot of a detective story in four lines.",
)


MAX_TIMELINE = 4096  # content chunks whose arrival, token count and text a request keeps (its Gantt row)
MAX_PIECES_CHARS = 64 << 10  # the text of a request's chunks kept for its detail, in all


@dataclass(frozen=True)
class RequestResult:
    """One request of a load run. Its timeline: `token_times_s[k]` is when content chunk k arrived, in seconds after
    the request was sent (so TTFT = token_times_s[0] and E2EL = token_times_s[-1] are the same subtractions), with
    `chunk_tokens[k]` tokens and the text `pieces[k]`; at most MAX_TIMELINE chunks are kept (`timeline_cut` says
    more came). `sent_wall_s` is the send time on the wall clock (time.time()), where a server's spans are placed."""

    ok: bool
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    start_s: float = 0.0  # since the run began
    index: int = -1  # which request of its level (the order they were started in)
    concurrency: int | None = None  # its level
    request_id: str = ""  # the server's id for it (the stream's `id`)
    sent_wall_s: float = 0.0
    token_times_s: tuple[float, ...] = ()
    chunk_tokens: tuple[int, ...] = ()
    pieces: tuple[str, ...] = ()
    end_s: float = 0.0  # the stream closed, seconds after sending (after the last chunk: usage, [DONE])
    timeline_cut: bool = False
    server: object = None  # engine.remote.spans.ServerSpan: the server's own account, where it exports one

    @property
    def tpot_s(self) -> float:
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class RunResult:
    concurrency: int | None
    request_rate: float
    burstiness: float
    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    per_stream_tokens_per_s: float = 0.0  # 1 / mean TPOT: how fast one stream sees tokens
    mean_ttft_ms: float = 0.0
    median_ttft_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    mean_tpot_ms: float = 0.0
    median_tpot_ms: float = 0.0
    p99_tpot_ms: float = 0.0
    mean_itl_ms: float = 0.0
    median_itl_ms: float = 0.0
    p99_itl_ms: float = 0.0
    mean_e2el_ms: float = 0.0
    median_e2el_ms: float = 0.0
    p99_e2el_ms: float = 0.0
    goodput: float | None = None
    timed_out: bool = False
    errors: list[str] = field(default_factory=list)
    server_kv_usage_max: float | None = None
    server_waiting_max: float | None = None
    server_spans: int | None = None  # completed requests the server's spans were found for (None: not asked)

    def to_dict(self) -> dict:
        return asdict(self)


def _stats(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return 0.0, 0.0, 0.0
    a = np.asarray(xs) * 1e3
    return float(a.mean()), float(np.median(a)), float(np.percentile(a, 99))


def summarize(results: list[RequestResult], duration_s: float, concurrency: int | None, request_rate: float,
              burstiness: float = 1.0, slo_ms: dict[str, float] | None = None) -> RunResult:
    """The run's figures from its requests, as `vllm bench serve` computes them."""
    ok = [r for r in results if r.ok]
    run = RunResult(concurrency=concurrency, request_rate=request_rate, burstiness=burstiness)
    run.completed, run.failed = len(ok), len(results) - len(ok)
    run.duration_s = duration_s
    run.total_output_tokens = sum(r.output_tokens for r in ok)
    run.total_input_tokens = sum(r.prompt_tokens for r in ok)
    if duration_s > 0:
        run.request_throughput = run.completed / duration_s
        run.output_throughput = run.total_output_tokens / duration_s
    run.mean_ttft_ms, run.median_ttft_ms, run.p99_ttft_ms = _stats([r.ttft_s for r in ok])
    tpots = [r.tpot_s for r in ok if r.output_tokens > 1]
    run.mean_tpot_ms, run.median_tpot_ms, run.p99_tpot_ms = _stats(tpots)
    run.mean_itl_ms, run.median_itl_ms, run.p99_itl_ms = _stats([x for r in ok for x in r.itl_s])
    run.mean_e2el_ms, run.median_e2el_ms, run.p99_e2el_ms = _stats([r.e2el_s for r in ok])
    run.per_stream_tokens_per_s = 1e3 / run.mean_tpot_ms if run.mean_tpot_ms > 0 else 0.0
    if slo_ms:
        good = 0
        for r in ok:
            vals = {"ttft": r.ttft_s * 1e3, "tpot": r.tpot_s * 1e3, "e2el": r.e2el_s * 1e3}
            if all(vals[k] <= v for k, v in slo_ms.items()):
                good += 1
        run.goodput = good / duration_s if duration_s > 0 else 0.0
    run.errors = sorted({r.error for r in results if not r.ok})[:5]
    return run


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Gaps (s) between request starts: gamma with shape = burstiness, mean 1/rate; zeros when rate is infinite."""
    if not math.isfinite(rate) or rate <= 0:
        return np.zeros(n)
    if burstiness <= 0:
        raise ValueError("burstiness must be positive (1 = Poisson)")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def one_request(backend: RemoteBackend, prompt: str | Sequence[int], max_new_tokens: int, cancel: threading.Event,
                t_run: float, timeout_s: float) -> RequestResult:
    """Stream one completion and time it (chunk arrivals, several tokens per chunk counted via usage).

    `prompt` is text, or token ids sent as they are (no template, no BOS added by the server)."""
    path, payload = backend.request_payload(prompt, SamplingParams(temperature=0.0), max_new_tokens, chat=False,
                                            top_logprobs=0, ignore_eos=True)
    wall = time.time()
    t0 = time.perf_counter()
    ttft = 0.0
    last = t0
    itl: list[float] = []
    times: list[float] = []
    counts: list[int] = []
    pieces: list[str] = []
    kept_chars = 0
    n_tokens = n_chunks = 0
    usage = None
    rid = ""

    def failed(error: str) -> RequestResult:
        return RequestResult(ok=False, error=error, start_s=t0 - t_run, request_id=rid, sent_wall_s=wall,
                             token_times_s=tuple(times), chunk_tokens=tuple(counts), pieces=tuple(pieces),
                             end_s=time.perf_counter() - t0, timeline_cut=n_chunks > len(times))

    try:
        stream = backend.client.stream(path, payload, timeout=timeout_s)
        try:
            for t, chunk in stream:
                if chunk.id and not rid:
                    rid = chunk.id
                if chunk.usage:
                    usage = chunk.usage
                if not chunk.text and not chunk.tokens:
                    continue
                if n_tokens == 0:
                    ttft = t - t0
                else:
                    itl.append(t - last)
                last = t
                n = max(1, len(chunk.tokens))
                n_tokens += n
                n_chunks += 1
                if len(times) < MAX_TIMELINE:
                    times.append(t - t0)
                    counts.append(n)
                    piece = chunk.text[:max(0, MAX_PIECES_CHARS - kept_chars)]
                    kept_chars += len(piece)
                    pieces.append(piece)
                if cancel.is_set():
                    return failed("cancelled")
        finally:
            stream.close()
    except RemoteError as e:
        return failed(str(e))
    out = int(usage.get("completion_tokens", n_tokens)) if usage else n_tokens
    pin = int(usage.get("prompt_tokens", 0)) if usage else 0
    return RequestResult(ok=True, ttft_s=ttft, e2el_s=last - t0, itl_s=tuple(itl), output_tokens=out,
                         prompt_tokens=pin, start_s=t0 - t_run, request_id=rid, sent_wall_s=wall,
                         token_times_s=tuple(times), chunk_tokens=tuple(counts), pieces=tuple(pieces),
                         end_s=time.perf_counter() - t0, timeline_cut=n_chunks > len(times))


def run_once(backend: RemoteBackend, concurrency: int | None, num_prompts: int, max_new_tokens: int,
             request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0, time_limit_s: float = 120.0,
             slo_ms: dict[str, float] | None = None, cancel: threading.Event | None = None,
             on_request: Callable[[RequestResult], None] | None = None,
             on_metrics: Callable[[float, ServerMetrics], None] | None = None,
             spans: SpanReceiver | None = None, span_wait_s: float = 5.0,
             on_spans: Callable[[list[RequestResult]], None] | None = None,
             prompts: Sequence[str] | None = None) -> RunResult:
    """One bounded run: `num_prompts` requests, at most `concurrency` in flight, within `time_limit_s`; request i
    sends `prompts[i % len(prompts)]` (default PROMPTS).

    With `spans` (a receiver the server exports to), the completed requests get the server's span (waiting up to
    `span_wait_s` after the last request for the server's batch to arrive), and `on_spans` gets them all again."""
    cancel = cancel or threading.Event()
    texts = tuple(prompts) if prompts else PROMPTS
    stop = threading.Event()
    gaps = arrival_gaps(num_prompts, request_rate, burstiness, seed)
    workers = concurrency or num_prompts
    sem = threading.Semaphore(workers)
    results: list[RequestResult] = []
    lock = threading.Lock()
    kv: list[float] = []
    waiting: list[float] = []
    t_run = time.perf_counter()
    deadline = t_run + time_limit_s

    def watch() -> None:  # the server's own view, ~4 times a second, while the run lasts
        while not stop.wait(0.25):
            m = backend.metrics()
            if m is None:
                return
            if m.kv_usage is not None:
                kv.append(m.kv_usage)
            if m.waiting is not None:
                waiting.append(m.waiting)
            if on_metrics:
                on_metrics(time.perf_counter() - t_run, m)

    def task(i: int) -> None:
        try:
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or cancel.is_set():
                r = RequestResult(ok=False, error="not sent: time limit reached" if remaining <= 0 else "cancelled")
            else:
                r = one_request(backend, texts[i % len(texts)], max_new_tokens, cancel, t_run,
                                timeout_s=max(1.0, remaining))
            r = replace(r, index=i, concurrency=concurrency)
            with lock:
                results.append(r)
            if on_request:
                on_request(r)
        finally:
            sem.release()

    watcher = threading.Thread(target=watch, daemon=True)
    if backend._info().metrics:
        watcher.start()
    timed_out = False
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i in range(num_prompts):
            if gaps[i] > 0:
                if cancel.wait(min(gaps[i], max(0.0, deadline - time.perf_counter()))):
                    break
            if time.perf_counter() >= deadline:
                timed_out = True
                break
            while not sem.acquire(timeout=0.1):
                if cancel.is_set() or time.perf_counter() >= deadline:
                    break
            else:
                pool.submit(task, i)
                continue
            timed_out = time.perf_counter() >= deadline
            break
    duration = time.perf_counter() - t_run
    stop.set()
    if watcher.is_alive():
        watcher.join(timeout=2)
    if spans is not None and not cancel.is_set():
        results = attach_spans(results, spans, span_wait_s)
        if on_spans:
            on_spans(list(results))
    run = summarize([r for r in results if r.error != "cancelled"], duration, concurrency, request_rate,
                    burstiness, slo_ms)
    run.timed_out = timed_out or any(r.error.startswith("not sent") for r in results)
    run.server_kv_usage_max = max(kv) if kv else None
    run.server_waiting_max = max(waiting) if waiting else None
    if spans is not None:
        run.server_spans = sum(1 for r in results if r.server is not None)
    return run


def attach_spans(results: list[RequestResult], spans: SpanReceiver, wait_s: float) -> list[RequestResult]:
    """The results, each completed one with the server's span for it where one arrived within `wait_s`."""
    found = spans.wait_for([r.request_id for r in results if r.ok and r.request_id], wait_s)
    return [replace(r, server=found[r.request_id]) if r.ok and r.request_id in found else r for r in results]


def sweep(backend: RemoteBackend, concurrencies: list[int | None], num_prompts: int, max_new_tokens: int,
          **kw) -> list[RunResult]:
    runs = []
    cancel = kw.get("cancel")
    for c in concurrencies:
        if cancel is not None and cancel.is_set():
            break
        runs.append(run_once(backend, c, num_prompts, max_new_tokens, **kw))
    return runs


CSV_FIELDS = ("concurrency", "request_rate", "completed", "failed", "duration_s", "request_throughput",
              "output_throughput", "per_stream_tokens_per_s", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
              "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "goodput", "server_kv_usage_max",
              "server_waiting_max")


def to_csv(runs: list[dict]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in runs:
        w.writerow({k: ("inf" if isinstance(r.get(k), float) and math.isinf(r[k]) else r.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()
