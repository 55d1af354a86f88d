"""Prometheus text exposition (`GET /metrics`) parsed into the few figures the panels show.

vLLM names: `vllm:kv_cache_usage_perc` (a fraction 0–1 despite its name), `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`, and histograms
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`.
llama.cpp's `llama-server --metrics`: `llamacpp:kv_cache_usage_ratio`, `llamacpp:requests_processing`,
`llamacpp:requests_deferred`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample of each metric name (labels summed over: one model per server here); non-finite values
    are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if not math.isfinite(v):  # NaN, or an infinity no panel can show
            continue
        total = out.get(m.group(1), 0.0) + v
        if math.isfinite(total):
            out[m.group(1)] = total
    return out


@dataclass(frozen=True)
class ServerMetrics:
    """One scrape of the server's own figures; None where the server does not report it."""

    kv_usage: float | None = None  # fraction of the KV cache in use, 0–1
    running: float | None = None
    waiting: float | None = None
    prefix_hit_rate: float | None = None  # hits / queries since the server started
    mean_ttft_s: float | None = None  # the server's own histogram means, since it started
    mean_itl_s: float | None = None
    mean_e2el_s: float | None = None
    requests_done: float | None = None
    generation_tokens: float | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _ratio(a: float | None, b: float | None) -> float | None:
    r = a / b if a is not None and b else None
    return r if r is not None and math.isfinite(r) else None


def _mean(m: dict[str, float], base: str) -> float | None:
    return _ratio(m.get(base + "_sum"), m.get(base + "_count"))


def server_metrics(m: dict[str, float]) -> ServerMetrics:
    q, h = m.get("vllm:prefix_cache_queries_total"), m.get("vllm:prefix_cache_hits_total")
    if any(k.startswith("vllm:") for k in m):
        return ServerMetrics(
            kv_usage=m.get("vllm:kv_cache_usage_perc", m.get("vllm:gpu_cache_usage_perc")),
            running=m.get("vllm:num_requests_running"), waiting=m.get("vllm:num_requests_waiting"),
            prefix_hit_rate=_ratio(h, q),
            mean_ttft_s=_mean(m, "vllm:time_to_first_token_seconds"),
            mean_itl_s=_mean(m, "vllm:inter_token_latency_seconds")
            or _mean(m, "vllm:time_per_output_token_seconds"),
            mean_e2el_s=_mean(m, "vllm:e2e_request_latency_seconds"),
            requests_done=m.get("vllm:request_success_total"),
            generation_tokens=m.get("vllm:generation_tokens_total"),
        )
    if any(k.startswith("llamacpp:") for k in m):
        return ServerMetrics(
            kv_usage=m.get("llamacpp:kv_cache_usage_ratio"), running=m.get("llamacpp:requests_processing"),
            waiting=m.get("llamacpp:requests_deferred"),
            generation_tokens=m.get("llamacpp:tokens_predicted_total"),
        )
    return ServerMetrics()
