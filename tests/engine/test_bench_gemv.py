"""benchmarks.gemv (bench-gemv) part 2: the end-to-end decode comparison's bookkeeping with the child processes
replaced by known results (the rotation of rounds, each configuration's best run, the ratios it prints), and the
lines that say on which machine and under what load it ran."""

from __future__ import annotations

import re

import pytest

from benchmarks import bench, gemv
from engine.model import threads as th

# mean TPOT in seconds per configuration (its --impl and --threads), and per round: the second round is under load
TPOT = {("ours", "auto"): [0.020, 0.030], ("ours", "1"): [0.030, 0.031], ("ours", "2"): [0.016, 0.060],
        ("hf", "2"): [0.045, 0.090], ("hf", "1"): [0.050, 0.052]}


@pytest.fixture
def children(monkeypatch):
    """bench-one replaced: each configuration returns its next TPOT; the order of the calls is kept."""
    calls: list[tuple[str, str]] = []

    def child(args, timeout=900):
        conf = (args[args.index("--impl") + 1], args[args.index("--threads") + 1])
        n = sum(1 for c in calls if c == conf)
        calls.append(conf)
        return {"tpot_s": {"mean": TPOT[conf][n]}, "ttft_s": 0.1, "threads_at_end": 1, "text": "x"}

    monkeypatch.setattr(bench, "_child", child)
    monkeypatch.setattr(th, "available_cores", lambda: 2)
    return calls


def test_rounds_rotate_and_each_configuration_keeps_its_best_run(children, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path))
    e = gemv.decode_end_to_end("float32", 8, 1, rounds=2)
    assert children[:5] == [("ours", "auto"), ("ours", "1"), ("ours", "2"), ("hf", "2"), ("hf", "1")]
    assert children[5:] == [("ours", "1"), ("ours", "2"), ("hf", "2"), ("hf", "1"), ("ours", "auto")]
    assert {k: r["tpot_s"] for k, r in e["runs"].items()} == {
        "ours auto": 0.020, "ours 1 thread": 0.030, "ours 2 threads": 0.016, "hf 2 threads": 0.045,
        "hf 1 thread": 0.050}
    assert e["every_tpot_s"]["ours 2 threads"] == [0.016, 0.060]
    r = e["ratios"]
    assert r["decode_tokens_per_s_vs_hf"] == pytest.approx(0.045 / 0.020)
    assert r["decode_tokens_per_s_vs_hf_same_threads"] == pytest.approx(0.045 / 0.016)
    assert r["decode_tokens_per_s_vs_hf_one_thread"] == pytest.approx(0.050 / 0.030)
    assert r["tpot_all_threads_over_one"] == pytest.approx(0.016 / 0.030)
    assert e["threads"] is None  # no chain measured in this (empty) cache


def test_one_round_runs_auto_again_at_the_end(children, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path))
    e = gemv.decode_end_to_end("float32", 8, 1)
    assert children[0] == children[-1] == ("ours", "auto") and len(children) == 6
    assert e["ratios"]["decode_tokens_per_s_vs_hf"] == pytest.approx(0.045 / 0.025)  # the mean of the two auto runs


def test_the_engine_thread_measurement_is_the_newest_of_this_cpu_and_dtype(tmp_path, monkeypatch):
    from engine.model.kernel_cache import this_cpu

    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path))
    cpu, cores = this_cpu()
    old = th.ChainTiming("a", cpu, cores, "float32", {1: 0.03, 2: 0.04}, 0.0, 5, 1.0)
    new = th.ChainTiming("b", cpu, cores, "float32", {1: 0.03, 2: 0.016}, 0.0, 5, 2.0)
    bf16 = th.ChainTiming("c", cpu, cores, "bfloat16", {1: 0.03, 2: 0.04}, 0.0, 5, 3.0)
    one = th.ChainTiming("d", cpu, cores, "float32", {1: 0.03}, 0.0, 5, 4.0)  # a process held to one thread
    monkeypatch.setattr(th, "decode_thread_counts", lambda: [1, 2])
    for t in (old, new, bf16, one):
        th.write_chain(t)
    assert gemv._thread_choice("float32") == new.summary()


def test_the_machine_line_names_the_flags_and_the_load():
    line = gemv._machine_line()
    assert re.fullmatch(r"CPU: .+; flags: .+; \d+ cores; load average \d+\.\d \(1 min\), \d+\.\d \(5 min\)", line)
