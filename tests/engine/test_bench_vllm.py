"""vLLM as a benchmark peer, without a server: the result's fields, the ratios, the report, the request body."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench import _print_report, _ratios, vllm_result
from engine.remote.loadlab import RequestResult


def _req(ttft: float, gaps: list[float], prompt_tokens: int = 41) -> RequestResult:
    return RequestResult(ok=True, ttft_s=ttft, e2el_s=ttft + sum(gaps), itl_s=tuple(gaps),
                         output_tokens=len(gaps) + 1, prompt_tokens=prompt_tokens)


def test_vllm_result_takes_the_fastest_runs_gaps_and_the_best_ttft():
    slow = _req(0.05, [0.03, 0.03, 0.03])
    fast = _req(0.08, [0.01, 0.02, 0.03])
    r = vllm_result([slow, fast], "0.32.0", "bfloat16", 42.0, 41, 2, [0, 1], 123)
    assert r["impl"] == "vLLM 0.32.0 (CPU)" and r["dtype"] == "bfloat16" and r["threads"] == "2"
    assert r["ttft_s"] == pytest.approx(0.05)  # best over runs, as the other peers report it
    assert r["tpot_s"]["mean"] == pytest.approx(0.02) and r["tpot_s"]["p50"] == pytest.approx(0.02)
    assert r["tpot_s"]["p90"] == pytest.approx(np.percentile([0.01, 0.02, 0.03], 90))
    assert r["tokens_per_s"] == pytest.approx(50.0)
    assert (r["new_tokens"], r["chunks"], r["prompt_tokens"], r["prompt_tokens_sent"]) == (4, 4, 41, 41)
    assert (r["load_s"], r["omp_cpus"], r["peak_rss_bytes"]) == (42.0, [0, 1], 123)


def test_vllm_result_counts_tokens_not_chunks():
    # two tokens arrived in one chunk: 4 tokens in 3 chunks, TPOT (e2el - ttft) / 3
    r = RequestResult(ok=True, ttft_s=0.1, e2el_s=0.4, itl_s=(0.1, 0.2), output_tokens=4, prompt_tokens=0)
    out = vllm_result([r], None, "float32", 1.0, 41, 1)
    assert out["tokens_per_s"] == pytest.approx(10.0) and out["chunks"] == 3 and out["new_tokens"] == 4
    assert out["prompt_tokens"] == 41 and out["impl"] == "vLLM ? (CPU)"  # the server reported none


def test_vllm_result_refuses_runs_without_decode_steps():
    with pytest.raises(ValueError):
        vllm_result([], "x", "float32", 1.0, 41, 1)
    with pytest.raises(ValueError):
        vllm_result([_req(0.1, [])], "x", "float32", 1.0, 41, 1)


def _row(tpot: float, ttft: float, rss: int | None = 2**20) -> dict:
    return {"load_s": 1.0, "ttft_s": ttft, "tpot_s": {"mean": tpot, "p50": tpot, "p90": tpot},
            "tokens_per_s": 1 / tpot, "peak_rss_bytes": rss, "impl": "x", "dtype": "float32", "threads": "2"}


def _report(results: dict) -> dict:
    r = {"machine": {"cpu": "cpu", "cores": 2, "ram_bytes": 2**30, "torch": "2", "threads": 2},
         "bandwidth_bytes_per_s": 1e10, "matmul_flops": 1e11, "decode_bytes_per_token_fp32": 1e8,
         "tpot_floor_s": 0.01, "results": results, "gui": None, "other_processes_cores": 0.0, "trustworthy": True}
    r["ratios"] = _ratios(r)
    return r


def test_ratios_and_report_include_vllm(capsys):
    r = _report({"ours-float32-none": _row(0.02, 0.1), "ours-bfloat16-none": _row(0.015, 0.12),
                 "vllm": _row(0.03, 0.2, rss=None)})
    assert r["ratios"]["ours_fastest_tpot_over_vllm"] == pytest.approx(0.5)
    assert r["ratios"]["ours_ttft_over_vllm"] == pytest.approx(0.5)
    _print_report(r)
    out = capsys.readouterr().out
    assert "vllm" in out and "ours_fastest_tpot_over_vllm" in out
    assert "load = server start" in out


def test_no_vllm_ratio_without_vllm():
    r = _report({"ours-float32-none": _row(0.02, 0.1), "vllm": None})
    assert not any("vllm" in k for k in r["ratios"])


def test_token_ids_go_to_the_completions_endpoint_as_they_are():
    from engine.protocol import SamplingParams
    from engine.remote.backend import RemoteBackend
    from engine.remote.client import ServerInfo

    b = RemoteBackend("http://127.0.0.1:1")
    b.info = ServerInfo(url=b.client.url, kind="vllm", model="m")
    path, p = b.request_payload(np.array([1, 2, 3]), SamplingParams(temperature=0.0), 8, chat=False,
                                top_logprobs=0, ignore_eos=True)
    assert path == "/v1/completions" and p["prompt"] == [1, 2, 3] and p["ignore_eos"] is True
    assert p["max_tokens"] == 8 and p["temperature"] == 0.0
    with pytest.raises(ValueError):
        b.request_payload([1, 2], SamplingParams(), 8, chat=True, top_logprobs=0)
