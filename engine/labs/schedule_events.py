"""The scheduling lab's settings, workload and events: plain data, no torch (the GUI process reads them).

engine.labs.scheduler runs the lab on the loaded model and yields these; the app's Scheduling panel and the
`python -m engine schedule` command only read them.

Definitions follow `vllm bench serve`:
  TTFT = first token's time − arrival;  TPOT = (E2EL − TTFT) / (output tokens − 1);  E2EL = last token's time − arrival;
  system tokens/s = all output tokens / (last finish − first arrival);  per-stream tokens/s = 1 / TPOT (median).
Arrivals: gamma-distributed gaps with shape = burstiness and mean 1 / rate (burstiness 1 is a Poisson process;
below 1 burstier, above 1 more even), the first request at t = 0. Lengths: uniform integers in
[L·(1 − r), L·(1 + r)] for a mean L and range ratio r (vLLM's --random-range-ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

POLICIES = ("static", "continuous")
MAX_REQUESTS = 1024
MAX_BATCH = 256
PREFILL_MODE = "each joining request gets its own prefill step; the running batch waits during it (no chunking)"


@dataclass(frozen=True)
class SchedConfig:
    policy: str = "both"  # static, continuous or both (same arrivals, one after the other)
    n_requests: int = 16
    rate: float = 4.0  # requests per second; math.inf = all arrive at t = 0
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps (1 = Poisson)
    prompt_len: int = 64  # mean prompt tokens
    output_len: int = 32  # mean output tokens (each request generates exactly its own count, no EOS)
    range_ratio: float = 0.5  # lengths uniform in [L·(1 − r), L·(1 + r)]
    max_batch: int = 8  # requests decoded together at most
    page_size: int = 16  # positions per KV page
    seed: int = 0
    kv_budget_bytes: float | None = None  # for "how many fit"; None = the contiguous reservation of max_batch
    reserve_len: int | None = None  # positions a contiguous cache reserves per request; None = longest possible

    def policies(self) -> tuple[str, ...]:
        return POLICIES if self.policy == "both" else (self.policy,)

    def length_range(self, mean: int) -> tuple[int, int]:
        """(shortest, longest) length a request may get for this mean."""
        return max(1, round(mean * (1 - self.range_ratio))), max(1, round(mean * (1 + self.range_ratio)))

    def longest(self) -> int:
        """Positions of the longest request the distribution allows (prompt + output)."""
        return self.length_range(self.prompt_len)[1] + self.length_range(self.output_len)[1]

    def validate(self, context_length: int | None = None) -> None:
        """Raise ValueError with one sentence naming the first bad setting."""
        if self.policy not in (*POLICIES, "both"):
            raise ValueError(f"policy must be static, continuous or both, got {self.policy!r}")
        if not 1 <= self.n_requests <= MAX_REQUESTS:
            raise ValueError(f"requests must be between 1 and {MAX_REQUESTS}, got {self.n_requests}")
        if not self.rate > 0:  # also refuses NaN
            raise ValueError(f"rate must be a positive number of requests per second (inf = all at once), "
                             f"got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number (1 = Poisson), got {self.burstiness}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"prompt and output lengths must be at least 1, got {self.prompt_len} and "
                             f"{self.output_len}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")
        if not 1 <= self.max_batch <= MAX_BATCH:
            raise ValueError(f"max batch must be between 1 and {MAX_BATCH}, got {self.max_batch}")
        if not 1 <= self.page_size <= 4096:
            raise ValueError(f"page size must be between 1 and 4096 positions, got {self.page_size}")
        if context_length is not None and self.longest() > context_length:
            raise ValueError(f"the longest request ({self.longest()} positions) exceeds the model's context of "
                             f"{context_length}")
        if self.reserve_len is not None and self.reserve_len < self.longest():
            raise ValueError(f"a contiguous reservation of {self.reserve_len} positions cannot hold the longest "
                             f"request ({self.longest()})")
        if self.kv_budget_bytes is not None and not self.kv_budget_bytes > 0:
            raise ValueError(f"the KV budget must be a positive number of bytes, got {self.kv_budget_bytes}")


@dataclass(frozen=True)
class RequestSpec:
    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int


def make_requests(cfg: SchedConfig) -> tuple[RequestSpec, ...]:
    """The workload of one run, from cfg.seed: the same arrivals and lengths for every policy."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.n_requests
    if math.isinf(cfg.rate):
        arrivals = np.zeros(n)
    else:
        gaps = rng.gamma(shape=cfg.burstiness, scale=1.0 / (cfg.rate * cfg.burstiness), size=n)  # mean 1 / rate
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    p_lo, p_hi = cfg.length_range(cfg.prompt_len)
    o_lo, o_hi = cfg.length_range(cfg.output_len)
    prompts = rng.integers(p_lo, p_hi + 1, size=n)
    outputs = rng.integers(o_lo, o_hi + 1, size=n)
    return tuple(RequestSpec(i, float(arrivals[i]), int(prompts[i]), int(outputs[i])) for i in range(n))


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: list[float] | np.ndarray) -> Percentiles:
        v = np.asarray(values, dtype=float)
        if v.size == 0:
            return cls(math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), float(v.mean()))


@dataclass(frozen=True)
class SchedPlan:
    """First event of a run: the workload both policies serve and the cache's units."""

    config: SchedConfig
    policies: tuple[str, ...]
    requests: tuple[RequestSpec, ...]
    kv_bytes_per_position: float  # engine.costs.formulas.kv_bytes_per_token of the loaded model and dtype
    reserve_len: int  # positions a contiguous cache reserves per request
    pool_pages: int  # pages the paged cache holds (enough for max_batch requests of the longest length)
    dtype: str
    device: str
    prefill_mode: str = PREFILL_MODE
    page_size: int = 16  # positions per page of the runtime's cache (llama.cpp's cells: 1, whatever was asked)


@dataclass(frozen=True)
class SchedStep:
    """One measured forward step of one policy; times are on the run's clock (seconds since the first arrival).

    The clock advances by each step's measured time and jumps over idle gaps to the next arrival (nothing sleeps).
    """

    policy: str
    index: int
    kind: str  # "prefill" (one request's prompt) or "decode" (one token for every running request)
    start_s: float
    step_s: float  # measured wall time of the forward step, argmax included
    request_ids: tuple[int, ...]  # rows of the step
    positions: tuple[int, ...]  # each row's first position written in this step
    n_queued: int  # requests arrived and waiting to be admitted when the step began
    n_running: int  # requests admitted and not finished when the step ended
    pages_in_use: int  # after the step (finished requests' pages freed)
    used_bytes: float  # positions actually held × bytes per position
    paged_bytes: float  # pages_in_use × page_size × bytes per position
    contiguous_bytes: float  # what a contiguous cache would hold reserved: slots × reserve_len × bytes per position


@dataclass(frozen=True)
class SchedRequestDone:
    policy: str
    request_id: int
    arrival_s: float
    admitted_s: float  # its prefill step began
    first_token_s: float
    finish_s: float
    prompt_len: int
    output_len: int
    ttft_s: float
    tpot_s: float  # nan for a one-token output
    e2e_s: float
    tokens: tuple[int, ...]  # the greedy output ids (the same under every policy)


@dataclass(frozen=True)
class SchedSummary:
    policy: str
    n_requests: int
    duration_s: float  # first arrival to last finish
    busy_s: float  # sum of measured step times
    output_tokens: int
    system_tokens_per_s: float
    stream_tokens_per_s: float  # median over requests of 1 / TPOT
    ttft: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    prefill_steps: int
    decode_steps: int
    mean_decode_batch: float
    peak_used_bytes: float
    peak_paged_bytes: float
    peak_contiguous_bytes: float
    paged_bytes_per_request: float  # mean over decode steps of paged bytes / running requests
    contiguous_bytes_per_request: float  # reserve_len × bytes per position
    kv_budget_bytes: float
    fits_paged: int  # requests the budget holds at paged_bytes_per_request
    fits_contiguous: int  # requests the budget holds at contiguous_bytes_per_request


SchedEvent = SchedPlan | SchedStep | SchedRequestDone | SchedSummary


def summarize(policy: str, done: list[SchedRequestDone], steps: list[SchedStep], reserve_bytes: float,
              budget: float) -> SchedSummary:
    """The summary of one policy's run from its finished requests and its steps."""
    out_tokens = sum(d.output_len for d in done)
    duration = max(d.finish_s for d in done) - min(d.arrival_s for d in done)
    tpots = [d.tpot_s for d in done if not math.isnan(d.tpot_s)]
    decodes = [s for s in steps if s.kind == "decode"]
    per_request = [s.paged_bytes / s.n_running for s in decodes if s.n_running]
    paged_per = float(np.mean(per_request)) if per_request else 0.0
    return SchedSummary(
        policy=policy, n_requests=len(done), duration_s=duration, busy_s=sum(s.step_s for s in steps),
        output_tokens=out_tokens, system_tokens_per_s=out_tokens / duration if duration > 0 else math.nan,
        stream_tokens_per_s=float(np.median([1 / t for t in tpots])) if tpots else math.nan,
        ttft=Percentiles.of([d.ttft_s for d in done]), tpot=Percentiles.of(tpots),
        e2e=Percentiles.of([d.e2e_s for d in done]),
        prefill_steps=len(steps) - len(decodes), decode_steps=len(decodes),
        mean_decode_batch=float(np.mean([len(s.request_ids) for s in decodes])) if decodes else 0.0,
        peak_used_bytes=max((s.used_bytes for s in steps), default=0.0),
        peak_paged_bytes=max((s.paged_bytes for s in steps), default=0.0),
        peak_contiguous_bytes=max((s.contiguous_bytes for s in steps), default=0.0),
        paged_bytes_per_request=paged_per, contiguous_bytes_per_request=reserve_bytes, kv_budget_bytes=budget,
        fits_paged=int(budget // paged_per) if paged_per else 0, fits_contiguous=int(budget // reserve_bytes),
    )
