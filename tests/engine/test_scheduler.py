"""The scheduling lab: ragged batched steps on the paged cache equal each row run alone; the policies' bookkeeping.

The reference for a row is the model's ordinary single-sequence path (engine.model.kv_cache.KVCache, one start for
the batch), which tests/engine/test_model.py and test_families.py hold to independent references.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from engine.labs.schedule_events import SchedConfig, make_requests
from engine.labs.scheduler import SchedPlan, SchedRequestDone, SchedStep, SchedSummary, schedule
from engine.model.kv_cache import KVCache
from engine.run.session import Session
from engine.runtime.paged import PagedKVCache
from tests.requires import import_required

ROOT = Path(__file__).resolve().parents[2]


def forward_rows(lm, cache: PagedKVCache, request_ids: list[int], tokens: list[list[int]]) -> torch.Tensor:
    """One forward step of rows at their own positions (equal token counts) on the paged cache: float32 logits of
    each row's last token (B, V)."""
    with torch.inference_mode():
        cache.bind(request_ids, len(tokens[0]))
        return lm.model(torch.tensor(tokens, dtype=torch.long, device=lm.device), cache)


def single_row(lm, prompt: list[int], then: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt, then after each token of `then`, by the single-sequence path."""
    cache = KVCache(lm.cfg, 1, len(prompt) + len(then) + 1, lm.dtype)
    with torch.inference_mode():
        out = [lm.model(torch.tensor([prompt]), cache)[0]]
        for t in then:
            out.append(lm.model(torch.tensor([[t]]), cache)[0])
    return out


def check_ragged(lm, page_size: int, tol: float = 1e-4) -> None:
    rng = np.random.default_rng(5)
    prompts = {rid: rng.integers(3, lm.cfg.vocab_size, size=n).tolist() for rid, n in ((0, 5), (1, 9), (2, 14))}
    nxt = {rid: int(t) for rid, t in zip(prompts, rng.integers(3, lm.cfg.vocab_size, size=3), strict=True)}
    cache = PagedKVCache(lm.cfg, 40, page_size, lm.dtype)
    for rid, p in prompts.items():
        logits = forward_rows(lm, cache, [rid], [p])[0]
        assert_close(logits, single_row(lm, p, [])[0], rtol=tol, atol=tol)
    # one decode step, three rows at positions 5, 9 and 14, each reading only its own pages
    batched = forward_rows(lm, cache, [2, 0, 1], [[nxt[2]], [nxt[0]], [nxt[1]]])
    for row, rid in enumerate((2, 0, 1)):
        assert_close(batched[row], single_row(lm, prompts[rid], [nxt[rid]])[1], rtol=tol, atol=tol)
    # request 1 leaves; a new request takes its freed pages (stale keys past its length) and joins the batch
    cache.release(1)
    prompts[3] = rng.integers(3, lm.cfg.vocab_size, size=3).tolist()
    first = int(forward_rows(lm, cache, [3], [prompts[3]])[0].argmax())
    assert cache.tables[3][0] in range(40) and cache.pages_in_use() == sum(map(len, cache.tables.values()))
    t2 = int(rng.integers(3, lm.cfg.vocab_size))
    batched = forward_rows(lm, cache, [0, 3, 2], [[t2], [first], [t2]])
    assert_close(batched[0], single_row(lm, prompts[0], [nxt[0], t2])[2], rtol=tol, atol=tol)
    assert_close(batched[1], single_row(lm, prompts[3], [first])[1], rtol=tol, atol=tol)
    assert_close(batched[2], single_row(lm, prompts[2], [nxt[2], t2])[2], rtol=tol, atol=tol)


@pytest.mark.parametrize("page_size", [4, 16])
def test_ragged_step_equals_each_row_alone(tiny_lm, page_size):
    check_ragged(tiny_lm, page_size)


def test_ragged_step_in_bfloat16(tiny_dir):
    """bf16 on a CPU takes other kernels (upcast attention for one query, oneDNN's packed products up to 4 rows):
    each row still reads only its own keys (a wrong mask moves logits by whole units, rounding by hundredths)."""
    from engine.loaders import load

    check_ragged(load(tiny_dir.gguf, device="cpu", dtype="bfloat16", use_cache=False), page_size=4, tol=0.1)


def test_ragged_step_on_sliding_window_layers(tmp_path):
    """Gemma 3 (window 4 on its local layers): the ragged mask keeps each row to its own window."""
    import_required("transformers")  # tests.tiny_families writes its checkpoints with it
    from engine.loaders import load
    from tests.tiny_families import write_checkpoint

    ckpt = write_checkpoint(tmp_path, "gemma3")
    check_ragged(load(ckpt.hf_dir, device="cpu", dtype="float32", use_cache=False), page_size=4)


def test_ragged_start_refuses_reads(tiny_lm):
    from engine.model.seam import Reads

    cache = PagedKVCache(tiny_lm.cfg, 4, 4, torch.float32)
    cache.bind([0], 2)  # a start per row
    with pytest.raises(ValueError, match="one position"):
        tiny_lm.model(torch.tensor([[5, 6]]), cache, reads=Reads({0}))


def test_pages_are_allocated_as_needed_and_freed(tiny_lm):
    cache = PagedKVCache(tiny_lm.cfg, 6, 4, torch.float32)
    forward_rows(tiny_lm, cache, [7], [[3] * 5])  # 5 positions: 2 pages
    forward_rows(tiny_lm, cache, [8], [[3] * 4])  # 4 positions: 1 page
    assert cache.pages_of(7) == 2 and cache.pages_of(8) == 1 and cache.pages_in_use() == 3
    for _ in range(4):  # 7 grows to 9 positions (3 pages), 8 to 8 (2 pages)
        forward_rows(tiny_lm, cache, [7, 8], [[4], [4]])
    assert cache.lengths == {7: 9, 8: 8} and cache.pages_of(7) == 3 and cache.pages_of(8) == 2
    cache.release(7)
    assert cache.pages_in_use() == 2 and 7 not in cache.tables
    forward_rows(tiny_lm, cache, [9], [[3] * 16])  # reuses the 3 freed pages and one more
    assert cache.pages_in_use() == 6
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.bind([8], 1)  # 8 positions + 1 needs a third page; none is left


# ---- the policies --------------------------------------------------------------------------------------------------
CFG = SchedConfig(n_requests=10, rate=math.inf, prompt_len=12, output_len=8, range_ratio=0.5, max_batch=4,
                  page_size=4, seed=3)


@pytest.fixture(scope="module")
def run(tiny_lm):
    events = list(schedule(Session(tiny_lm), CFG))
    return events


def by_policy(events, cls, policy):
    return [e for e in events if isinstance(e, cls) and e.policy == policy]


def test_every_request_gets_exactly_its_tokens_under_both_policies(tiny_lm, run):
    plan = run[0]
    assert isinstance(plan, SchedPlan) and plan.policies == ("static", "continuous")
    specs = {r.request_id: r for r in plan.requests}
    tokens = {}
    for policy in plan.policies:
        done = by_policy(run, SchedRequestDone, policy)
        assert sorted(d.request_id for d in done) == sorted(specs)
        for d in done:
            assert len(d.tokens) == d.output_len == specs[d.request_id].output_len
            assert d.arrival_s <= d.admitted_s < d.first_token_s <= d.finish_s
            assert d.e2e_s == pytest.approx(d.ttft_s + (d.output_len - 1) * d.tpot_s)
        tokens[policy] = {d.request_id: d.tokens for d in done}
    assert tokens["static"] == tokens["continuous"]  # batching changes timing, never the tokens
    # …and they are the greedy continuation of each prompt alone (rebuilt with the lab's own seed)
    rng = np.random.default_rng(CFG.seed + 1)
    prompts = [rng.integers(100, tiny_lm.cfg.vocab_size, size=r.prompt_len).tolist() for r in plan.requests]
    for rid in (0, 7):
        out = []
        for _ in range(specs[rid].output_len):
            out.append(int(single_row(tiny_lm, prompts[rid], out)[-1].argmax()))
        assert tuple(out) == tokens["continuous"][rid]


def test_continuous_batching_keeps_the_batch_full_and_bounded(run):
    steps = by_policy(run, SchedStep, "continuous")
    decodes = [s for s in steps if s.kind == "decode"]
    assert all(len(s.request_ids) <= CFG.max_batch and s.n_running <= CFG.max_batch for s in steps)
    # requests join mid-flight: some decode step mixes rows at different positions, as new ones replace finished
    assert any(len(set(s.positions)) > 1 for s in decodes)
    done = {d.request_id: d for d in by_policy(run, SchedRequestDone, "continuous")}
    first_finish = min(d.finish_s for d in done.values())
    joined_early = [d for d in done.values() if d.admitted_s >= first_finish and d.admitted_s
                    < max(e.finish_s for e in done.values() if e.admitted_s < first_finish)]
    assert joined_early, "a request should join while the first batch is still decoding"


def test_static_batching_waits_for_the_longest_request(run):
    done = sorted(by_policy(run, SchedRequestDone, "static"), key=lambda d: d.admitted_s)
    batches = [done[i:i + CFG.max_batch] for i in range(0, len(done), CFG.max_batch)]  # all arrive at t = 0
    assert [len(b) for b in batches] == [4, 4, 2]
    for prev, nxt in zip(batches, batches[1:], strict=False):
        assert {d.request_id for d in prev} == set(range(prev[0].request_id, prev[0].request_id + len(prev)))
        longest = max(d.finish_s for d in prev)
        assert min(d.admitted_s for d in nxt) == pytest.approx(longest)  # not a step before, not idle after
    for s in by_policy(run, SchedStep, "static"):
        assert len(s.request_ids) <= CFG.max_batch


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_pages_follow_each_requests_length_and_are_freed(run, policy):
    plan = run[0]
    bpp, page = plan.kv_bytes_per_position, CFG.page_size
    lengths: dict[int, int] = {}
    finished = {d.request_id: d.finish_s for d in by_policy(run, SchedRequestDone, policy)}
    for s in by_policy(run, SchedStep, policy):
        for rid in s.request_ids:
            lengths[rid] = lengths.get(rid, 0) + (plan.requests[rid].prompt_len if s.kind == "prefill" else 1)
        for rid in [r for r in lengths if finished[r] <= s.start_s + s.step_s + 1e-12]:
            del lengths[rid]  # freed at the step that ended it
        assert s.pages_in_use == sum(-(-n // page) for n in lengths.values())
        assert s.used_bytes == pytest.approx(sum(lengths.values()) * bpp)
        assert s.used_bytes <= s.paged_bytes < s.used_bytes + len(lengths) * page * bpp + 1e-9
        assert s.paged_bytes <= s.contiguous_bytes
    assert s.pages_in_use == 0 and not lengths


def test_summaries_match_the_requests(run):
    plan = run[0]
    summaries = {e.policy: e for e in run if isinstance(e, SchedSummary)}
    assert set(summaries) == {"static", "continuous"}
    bpp = plan.kv_bytes_per_position
    for policy, s in summaries.items():
        done = by_policy(run, SchedRequestDone, policy)
        assert s.output_tokens == sum(r.output_len for r in plan.requests)
        assert s.system_tokens_per_s == pytest.approx(s.output_tokens / s.duration_s)
        assert s.ttft.p50 == pytest.approx(np.median([d.ttft_s for d in done]))
        assert s.ttft.p50 <= s.ttft.p90 <= s.ttft.p99 <= max(d.ttft_s for d in done)
        assert s.prefill_steps == CFG.n_requests
        assert s.contiguous_bytes_per_request == plan.reserve_len * bpp == CFG.longest() * bpp
        assert s.fits_contiguous == CFG.max_batch  # the default budget is max_batch contiguous reservations
        assert s.fits_paged > s.fits_contiguous  # requests are shorter than the longest, and paged holds no more
    # static decodes fewer rows per step on average: its batches drain while nobody may join
    assert summaries["static"].mean_decode_batch < summaries["continuous"].mean_decode_batch
    # timing-free: continuous batching needs fewer decode steps for the same tokens
    assert summaries["continuous"].decode_steps < summaries["static"].decode_steps


def test_workload_follows_rate_burstiness_and_lengths():
    def gaps(burstiness):
        reqs = make_requests(SchedConfig(n_requests=1000, rate=5.0, burstiness=burstiness, seed=1))
        return np.diff([r.arrival_s for r in reqs])

    poisson, bursty = gaps(1.0), gaps(0.25)
    assert poisson.mean() == pytest.approx(0.2, rel=0.1) and bursty.mean() == pytest.approx(0.2, rel=0.2)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.15)  # exponential gaps: CV 1
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.2)  # gamma shape k: CV 1/√k
    cfg = SchedConfig(n_requests=200, prompt_len=40, output_len=10, range_ratio=0.5)
    reqs = make_requests(cfg)
    assert reqs == make_requests(cfg) and reqs[0].arrival_s == 0.0
    assert {r.prompt_len for r in reqs} <= set(range(20, 61)) and {r.output_len for r in reqs} <= set(range(5, 16))
    assert min(r.prompt_len for r in reqs) < 25 and max(r.prompt_len for r in reqs) > 55
    assert all(r.arrival_s == 0 for r in make_requests(SchedConfig(rate=math.inf)))


@pytest.mark.parametrize("bad, words", [
    (dict(rate=0.0), "rate"), (dict(rate=math.nan), "rate"), (dict(burstiness=-1.0), "burstiness"),
    (dict(n_requests=0), "requests"), (dict(max_batch=0), "max batch"), (dict(page_size=0), "page size"),
    (dict(range_ratio=1.0), "range ratio"), (dict(policy="fifo"), "policy"), (dict(output_len=0), "lengths"),
    (dict(prompt_len=200, output_len=100), "context"),
])
def test_bad_settings_are_one_sentence(tiny_lm, bad, words):
    with pytest.raises(ValueError, match=words) as e:
        next(schedule(Session(tiny_lm), SchedConfig(**bad)))
    assert "\n" not in str(e.value)


def test_the_pool_must_fit_in_memory(tiny_lm):
    with pytest.raises(ValueError, match="exceed the memory available"):
        next(schedule(Session(tiny_lm), SchedConfig(max_batch=256, prompt_len=80, output_len=40),
                      memory_limit_bytes=1e6))


def test_every_policys_pool_counts_against_memory(tiny_lm):
    cfg = SchedConfig(max_batch=8, prompt_len=16, output_len=8)
    plan = next(schedule(Session(tiny_lm), cfg))
    assert len(plan.policies) == 2  # static and continuous, each with a pool of its own
    one_pool = plan.pool_pages * plan.page_size * plan.kv_bytes_per_position
    with pytest.raises(ValueError, match="2 × 8 requests"):  # one pool fits, the two the run holds do not
        next(schedule(Session(tiny_lm), cfg, memory_limit_bytes=1.5 * one_pool))
    assert isinstance(next(schedule(Session(tiny_lm), cfg, memory_limit_bytes=2.5 * one_pool)), type(plan))


def test_stop_ends_the_run_without_a_summary(tiny_lm):
    events = []
    stop = lambda: sum(isinstance(e, SchedStep) for e in events) >= 3  # noqa: E731
    for ev in schedule(Session(tiny_lm), SchedConfig(n_requests=6, rate=math.inf, prompt_len=8, output_len=6), stop):
        events.append(ev)
    assert sum(isinstance(e, SchedStep) for e in events) == 3
    assert not any(isinstance(e, SchedSummary | SchedRequestDone) for e in events)


def test_schedule_cli(tiny_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "engine", "schedule", "--model", str(tiny_dir.gguf), "--device", "cpu", "--requests",
         "5", "--rate", "inf", "--prompt-len", "8", "--output-len", "4", "--max-batch", "2", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [s["policy"] for s in out["summaries"]] == ["static", "continuous"]
    assert len(out["requests"]) == 10 and all(s["output_tokens"] == sum(q["output_len"] for q in out["plan"]
                                                                          ["requests"]) for s in out["summaries"])
    text = subprocess.run(
        [sys.executable, "-m", "engine", "schedule", "--model", str(tiny_dir.gguf), "--device", "cpu", "--requests",
         "3", "--prompt-len", "8", "--output-len", "4", "--policy", "continuous"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert text.returncode == 0, text.stderr
    header = next(line for line in text.stdout.splitlines() if line.strip() in ("continuous", "static  continuous"))
    assert header.split() == ["continuous"] and "TTFT p99 (ms)" in text.stdout
    assert "pages of 16;" in text.stdout  # the torch engine's paged cache, as asked (the default)
    one = subprocess.run(  # the names: --num-requests; one policy's figures at the top level
        [sys.executable, "-m", "engine", "schedule", "--model", str(tiny_dir.gguf), "--device", "cpu",
         "--num-requests", "4", "--rate", "50", "--prompt-len", "8", "--output-len", "4", "--max-batch", "2",
         "--policy", "static", "--seed", "1", "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert one.returncode == 0, one.stderr
    d = json.loads(one.stdout)
    (s,) = d["summaries"]
    assert len(d["requests"]) == 4 and all(q["e2el_s"] >= q["ttft_s"] > 0 for q in d["requests"])
    assert d["system_tokens_per_s"] == s["system_tokens_per_s"] > 0
    assert d["kv"]["paged_peak_bytes"] == s["peak_paged_bytes"] <= d["kv"]["contiguous_reserved_bytes"]
    for args in (["--rate", "0"], ["--max-batch", "0"], ["--burstiness", "x"]):
        bad = subprocess.run([sys.executable, "-m", "engine", "schedule", *args], capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=60)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
