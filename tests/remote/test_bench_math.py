"""serve-bench's figures follow `vllm bench serve`'s definitions (checked on hand-computed requests)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.remote.loadlab import RequestResult, arrival_gaps, summarize, to_csv


def test_summarize_matches_the_definitions():
    # request A: first chunk at 0.1 s, 5 tokens, done at 0.5 s -> TPOT (0.5-0.1)/4 = 0.1 s
    # request B: first chunk at 0.3 s, 3 tokens, done at 0.7 s -> TPOT (0.7-0.3)/2 = 0.2 s
    a = RequestResult(ok=True, ttft_s=0.1, e2el_s=0.5, itl_s=(0.1, 0.1, 0.1, 0.1), output_tokens=5, prompt_tokens=7)
    b = RequestResult(ok=True, ttft_s=0.3, e2el_s=0.7, itl_s=(0.2, 0.2), output_tokens=3, prompt_tokens=9)
    bad = RequestResult(ok=False, error="HTTP 500")
    run = summarize([a, b, bad], duration_s=2.0, concurrency=2, request_rate=math.inf,
                    slo_ms={"ttft": 200.0})
    assert (run.completed, run.failed) == (2, 1)
    assert run.request_throughput == pytest.approx(1.0)  # 2 completed / 2 s
    assert run.output_throughput == pytest.approx(4.0)  # 8 tokens / 2 s
    assert run.total_input_tokens == 16
    assert run.mean_ttft_ms == pytest.approx(200.0) and run.median_ttft_ms == pytest.approx(200.0)
    assert run.mean_tpot_ms == pytest.approx(150.0)  # (100 + 200) / 2
    assert run.mean_itl_ms == pytest.approx(np.mean([100, 100, 100, 100, 200, 200]))
    assert run.p99_ttft_ms == pytest.approx(np.percentile([100, 300], 99))
    assert run.mean_e2el_ms == pytest.approx(600.0)
    assert run.per_stream_tokens_per_s == pytest.approx(1000 / 150)
    assert run.goodput == pytest.approx(0.5)  # only A meets TTFT <= 200 ms: 1 request / 2 s
    assert run.errors == ["HTTP 500"]
    assert to_csv([run.to_dict()]).splitlines()[1].startswith("2,inf,2,1,2.0,1.0,4.0")


def test_one_token_requests_have_no_tpot():
    r = RequestResult(ok=True, ttft_s=0.1, e2el_s=0.1, output_tokens=1)
    assert r.tpot_s == 0.0
    assert summarize([r], 1.0, 1, math.inf).mean_tpot_ms == 0.0


def test_arrivals_are_gamma_with_the_asked_rate():
    g = arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=0)
    assert g.mean() == pytest.approx(0.25, rel=0.03)
    assert g.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean (Poisson arrivals)
    bursty = arrival_gaps(20000, rate=4.0, burstiness=0.25, seed=0)
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() == pytest.approx(0.25 / math.sqrt(0.25), rel=0.08)  # gamma: cv = 1/sqrt(shape)
    assert not arrival_gaps(5, math.inf, 1.0, 0).any()
    with pytest.raises(ValueError):
        arrival_gaps(5, 1.0, 0.0, 0)
