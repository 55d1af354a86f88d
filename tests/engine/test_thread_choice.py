"""Threads by measurement (issue 27): the tuner times the decode step's chain of products at each thread count with
that count's chosen kernels, and `--threads auto` never decodes at more threads than the fastest count measured
quiet; a fixed count is kept. Injected clocks and loads, never the wall clock, decide every case here.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.model import kernel_cache, kernels
from engine.model import threads as th
from engine.model.kernel_cache import Machine


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """Measured choices and chain timings made by a test do not outlive it; torch's count is restored."""
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_MEASURED_AT", {})
    monkeypatch.setattr(kernels, "_TOP", [1])
    monkeypatch.setattr(kernels, "_FORCED", [])
    monkeypatch.setattr(th, "_MEASURED", [])
    monkeypatch.setattr(th, "_CONFIGURED", [2])  # a 2-core machine as torch started on it
    monkeypatch.setattr(th, "available_cores", lambda: 2)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _groups(shapes=((96, 64), (64, 96)), n=3):
    g = torch.Generator().manual_seed(7)
    return {(*s, kernel_cache.FLOAT): [(torch.randn(*s, generator=g), None, None, None) for _ in range(n)]
            for s in shapes}


def _clock(costs_at: dict[int, dict[str, float]], calls: list | None = None):
    """Each candidate's seconds for one product at the thread count torch is set to (the tuner sets it)."""
    def time_once(products, name):
        if calls is not None:
            calls.append(name)
        return costs_at[torch.get_num_threads()][name]
    return time_once


# two threads slower than one with the best kernel at each (the Intel AVX-512 class: 88.5 against 69.0 ms)
TWO_SLOWER = {1: {"linear": 1.0, "split": 1.5, "onednn": 2.0}, 2: {"linear": 1.3, "split": 1.4, "onednn": 3.0}}
# two threads faster (a quiet AVX2 machine: the split halves the time)
TWO_FASTER = {1: {"linear": 1.0, "split": 1.2, "onednn": 2.0}, 2: {"linear": 1.0, "split": 0.5, "onednn": 3.0}}


def _tune(tmp_path, costs_at, others: float | None = 0.0, **kw) -> list:
    return kernels.tune(_groups(), counts=[1, 2], time_once=_clock(costs_at, kw.pop("calls", None)),
                        path=tmp_path / "kernels.json", chain_path=tmp_path / "threads.json",
                        others_cores=lambda: others, **kw)


class IdleMeter:
    def others_cores(self) -> float:
        return 0.0

    def elapsed(self) -> float:
        return 1.0

    def restart(self) -> None:
        pass


def _auto() -> th.AdaptiveThreads:
    c = th.AdaptiveThreads("auto")
    c._meter = IdleMeter()  # the other cores idle: nothing but the measurement holds `auto` back
    return c


def test_where_two_threads_measure_slower_auto_uses_one(tmp_path):
    _tune(tmp_path, TWO_SLOWER)
    chain = th.measured_chain()
    assert chain.seconds == {1: 3 * 2 * 1.0, 2: 3 * 2 * 1.3}  # both shapes, 3 weights each, the chosen kernel
    assert chain.quiet and chain.fastest() == 1 and chain.cap() == 1
    c = _auto()
    assert c.max == 1 and c.describe() == "auto (1 of 1: more measured slower)"
    used = []
    for _ in range(600):  # a quiet machine's steps: `auto` would otherwise try two threads again and again
        used.append(c.begin_step())
        c.end_step(0.01, 1000.0)
    assert set(used) == {1}
    assert th.AdaptiveThreads(2).begin_step() == 2  # a fixed count is the user's: kept


def test_where_two_threads_measure_faster_auto_uses_two(tmp_path):
    _tune(tmp_path, TWO_FASTER)
    chain = th.measured_chain()
    assert chain.seconds == {1: 6.0, 2: 3.0} and chain.fastest() == 2
    c = _auto()
    assert c.max == 2 and c.begin_step() == 2 and c.describe() == "auto (2 of 2)"


def test_a_chain_measured_under_load_does_not_cap_auto(tmp_path):
    """One core busy while measuring makes two threads look slow; that says nothing about the machine."""
    _tune(tmp_path, TWO_SLOWER, others=1.0)
    chain = th.measured_chain()
    assert chain.fastest() == 1 and not chain.quiet and chain.cap() is None
    assert _auto().max == 2  # `auto` adapts at run time, as without a measurement
    _tune(tmp_path, TWO_SLOWER, others=None, remeasure=True)  # unknown load (a tiny chain, no /proc/stat): no cap
    assert th.measured_chain().cap() is None and _auto().max == 2


@pytest.mark.parametrize(("two_over_one", "fastest"), [(0.95, 1), (0.85, 2), (1.0, 1), (1.6, 1)])
def test_more_threads_must_be_clearly_faster(two_over_one, fastest):
    """A near tie goes to fewer threads, with the margin `auto` asks at run time (SLOWER_THAN_ONE)."""
    t = th.ChainTiming("k", "cpu", 2, "float32", {1: 1.0, 2: two_over_one}, 0.0, 5, 0.0)
    assert t.fastest() == fastest
    four = th.ChainTiming("k", "cpu", 4, "float32", {1: 1.0, 2: 0.6, 4: 0.58}, 0.5, 5, 0.0)
    assert four.fastest() == 2 and four.quiet  # 0.5 cores of others is idle enough among 3 other cores


def test_the_chain_is_read_from_the_cache_and_measured_again_with_remeasure(tmp_path):
    calls: list[str] = []
    _tune(tmp_path, TWO_SLOWER, calls=calls)
    assert calls and len(th.read_chains(tmp_path / "threads.json")) == 1
    calls.clear()
    th.use_chain(None)
    _tune(tmp_path, TWO_FASTER, calls=calls)  # the caches answer: the clock is not asked, the old verdict holds
    assert calls == [] and th.measured_chain().fastest() == 1
    _tune(tmp_path, TWO_FASTER, calls=calls, remeasure=True)
    assert calls and th.measured_chain().fastest() == 2


@pytest.mark.parametrize("change", ["torch", "cores", "capability", "cpu"])
def test_a_changed_machine_measures_the_chain_again(tmp_path, monkeypatch, change):
    _tune(tmp_path, TWO_SLOWER)
    m = kernels.this_machine()
    other = {"torch": Machine(m.cpu, m.cores, "9.9.9", m.capability),
             "cores": Machine(m.cpu, m.cores + 1, m.torch, m.capability),
             "capability": Machine(m.cpu, m.cores, m.torch, "AVX512" if m.capability != "AVX512" else "AVX2"),
             "cpu": Machine("Another CPU", m.cores, m.torch, m.capability)}[change]
    monkeypatch.setattr(kernels, "this_machine", lambda: other)
    calls: list[str] = []
    _tune(tmp_path, TWO_FASTER, calls=calls)
    assert calls and th.measured_chain().fastest() == 2  # measured again, on what is now this machine
    assert len(th.read_chains(tmp_path / "threads.json")) == 2  # the first result is kept beside the new one


def test_a_chain_timed_with_another_openmp_spin_is_measured_again(tmp_path, monkeypatch):
    """With no spin (GOMP_SPINCOUNT=0, what the app's engine once set) two threads timed slower than one, and that
    verdict capped `auto` at one thread for the CLI too: a chain timed under another spin does not answer."""
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    _tune(tmp_path, TWO_SLOWER)
    monkeypatch.delenv("GOMP_SPINCOUNT")
    th.use_chain(None)
    calls: list[str] = []
    _tune(tmp_path, TWO_FASTER, calls=calls)  # the products' choices still come from their cache
    assert calls  # the chain was timed again
    keys = list(th.read_chains(tmp_path / "threads.json"))
    assert len(keys) == 2 and any("|spin 0|" in k for k in keys) and "|spin default|" in th.measured_chain().key


def test_a_changed_kernel_set_is_another_chain(tmp_path):
    """The chain's key names the kernel each shape runs at each count: forcing one measures the chain again (the
    per-shape entries still come from the cache)."""
    _tune(tmp_path, TWO_FASTER)
    calls: list[str] = []
    with kernels.forced("linear"):
        _tune(tmp_path, TWO_FASTER, calls=calls)
        assert set(calls) == {"linear"}  # only the chain, with the forced kernel everywhere
        assert th.measured_chain().seconds == {1: 6.0, 2: 6.0} and th.measured_chain().fastest() == 1
    assert len(th.read_chains(tmp_path / "threads.json")) == 2


@pytest.mark.parametrize("damage", ["not json", '{"format": 1, "chains": {}}', "[1]",
                                    '{"format": 1, "chains": [{"key": "k", "seconds": {"0": 1.0}}]}'])
def test_a_damaged_chain_cache_is_ignored(tmp_path, damage):
    (tmp_path / "threads.json").write_text(damage)
    assert th.read_chains(tmp_path / "threads.json") == {}
    _tune(tmp_path, TWO_SLOWER)
    assert th.measured_chain().fastest() == 1
    written = json.loads((tmp_path / "threads.json").read_text())["chains"][0]["seconds"]
    assert written == pytest.approx({"1": 6.0, "2": 7.8})


def test_every_chosen_kernel_is_within_ten_percent_of_the_fastest_of_its_own_measurement(tmp_path):
    """Random costs, many shapes and counts: each entry's choice is at most 10 % slower than the fastest candidate
    in that same measurement, and it is the kernel decode dispatches to."""
    rng = random.Random(27)
    shapes = [(96, 64), (64, 96), (192, 64), (32, 32)]
    costs = {(s, n): {k: rng.uniform(0.5, 2.0) for k in ("linear", "split", "onednn")} for s in shapes for n in (1, 2)}

    def time_once(products, name):
        return costs[(tuple(products[0][0].shape), torch.get_num_threads())][name]

    entries = kernels.tune(_groups(shapes), counts=[1, 2], time_once=time_once, path=tmp_path / "k.json",
                           chain_path=tmp_path / "t.json", others_cores=lambda: 0.0)
    assert len(entries) == len(shapes) * 2
    for e in entries:
        assert e.seconds == costs[(e.shape, e.threads)]  # every candidate measured (none far slower here)
        assert e.seconds[e.choice] <= 1.10 * min(e.seconds.values()), e
        assert kernels.chosen(e.shape, torch.float32, e.threads) == e.choice


def test_a_fixed_count_above_the_measured_ones_runs_the_nearest_measured_below(tmp_path, monkeypatch):
    """--threads 3 on a machine measured at 1 and 2: the products run the 2-thread choice, not F.linear."""
    _tune(tmp_path, TWO_FASTER)  # the split at two threads, F.linear at one
    seen: list[int] = []
    real = kernels.KERNELS["split"]
    monkeypatch.setitem(kernels.KERNELS, "split", lambda x, w, b, p, q=None: seen.append(1) or real(x, w, b, p, q))
    kernels.use([])  # dispatch rebuilt from the same measurements, now through the spy
    torch.set_num_threads(3)
    assert kernels.chosen((96, 64), torch.float32, 3) == "split"
    x, w = torch.randn(1, 64), torch.randn(96, 64)
    torch.testing.assert_close(kernels.decode_product(x, w, None, None), x @ w.T, rtol=1e-5, atol=1e-5)
    assert seen == [1]


def test_the_real_chain_timer_runs_every_product_at_each_count(tmp_path, monkeypatch):
    """Not a speed test: the real clock times the whole chain through the dispatch at each count."""
    dispatched: list[int] = []
    real = kernels.decode_product
    monkeypatch.setattr(kernels, "decode_product",
                        lambda x, w, b, p, q=None: dispatched.append(torch.get_num_threads()) or real(x, w, b, p, q))
    groups = _groups()
    kernels.tune(groups, counts=[1, 2], path=tmp_path / "k.json", chain_path=tmp_path / "t.json")
    chain = th.measured_chain()
    assert set(chain.seconds) == {1, 2} and all(s > 0 for s in chain.seconds.values())
    products = sum(len(p) for p in groups.values())
    assert len(dispatched) % products == 0 and {1, 2} == set(dispatched)
    assert dispatched.count(1) >= products * (1 + kernels.MIN_ROUNDS)  # a warm-up, then every round


def test_kernels_command_shows_the_thread_counts(tiny_dir):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = [sys.executable, "-m", "engine", "kernels", "--model", str(tiny_dir.gguf), "--dtype", "float32"]
    r = subprocess.run([*args, "--json"], capture_output=True, text=True, cwd=root, timeout=300, env=os.environ)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (chain,) = doc["threads"]
    assert chain["dtype"] == "float32" and set(chain["seconds"]) >= {"1"}
    assert chain["fastest"] in {int(n) for n in chain["seconds"]}
    # and the attention's ways at each key count measured for the model's heads (engine.model.attention_choice)
    assert doc["attention"] and {r["fastest"] for r in doc["attention"]} <= {"explicit", "sdpa"}
    assert all(set(r["seconds"]) == {"explicit", "sdpa"} for r in doc["attention"])
    text = subprocess.run(args, capture_output=True, text=True, cwd=root, timeout=300, env=os.environ)
    lines = text.stdout.strip().splitlines()
    assert text.returncode == 0 and any(line.startswith("float32, the decode step's products: 1 thread ")
                                        for line in lines), text.stdout
    assert any(line.startswith("a decode query's attention") for line in lines)


def test_the_dialog_lines_are_this_cpus_newest_chains():
    from app.kernels_dialog import SHOWN_CHAINS, thread_lines

    old = th.ChainTiming("a", "cpu", 2, "float32", {1: 0.03, 2: 0.04}, 0.0, 5, 1.0)
    new = th.ChainTiming("b", "cpu", 2, "bfloat16", {1: 0.03, 2: 0.016}, 1.3, 5, 2.0)
    other = th.ChainTiming("c", "other", 2, "float32", {1: 0.03, 2: 0.04}, 0.0, 5, 3.0)
    lines = thread_lines([old, new, other], "cpu", 2)
    assert lines == [new.summary(), old.summary()] and SHOWN_CHAINS >= 2
    assert lines[1].endswith("--threads auto uses at most 1 thread")
    assert "measured under load" in lines[0]
    single = th.ChainTiming("d", "cpu", 1, "float32", {1: 0.03}, 0.0, 5, 4.0)
    assert single.summary().endswith("one thread count only, nothing to choose")


def test_the_kernel_cache_and_the_chain_cache_are_apart(tmp_path):
    """The kernels' file keeps its own format: the chain timings never go into it."""
    _tune(tmp_path, TWO_SLOWER)
    doc = json.loads((tmp_path / "kernels.json").read_text())
    assert set(doc) == {"format", "entries"} and kernel_cache.read(tmp_path / "kernels.json")


def test_choices_made_under_load_are_measured_again_once_a_load_finds_the_machine_quiet(tmp_path):
    """On a 2-core Zen 3 the first load, made while another program held a core, kept two-thread choices (F.linear)
    that decoded at twice one thread's time once the machine was quiet; a cached timing made under load is now
    measured again by the first load that finds the machine quiet, and kept while it stays busy."""
    # under load, two threads look best with F.linear; quiet, the split is twice as fast
    busy = {1: {"linear": 1.0, "split": 1.2, "onednn": 2.0}, 2: {"linear": 1.3, "split": 4.0, "onednn": 5.0}}
    _tune(tmp_path, busy, others=1.0)
    assert kernels.chosen((96, 64), torch.float32, 2) == "linear"
    assert not th.measured_chain().quiet
    calls: list[str] = []
    _tune(tmp_path, TWO_FASTER, others=0.9, calls=calls)  # still busy: the cache is used, nothing measured
    assert calls == [] and kernels.chosen((96, 64), torch.float32, 2) == "linear"
    _tune(tmp_path, TWO_FASTER, others=0.0, calls=calls)  # quiet now: the two-thread shapes and the chain again
    assert calls and kernels.chosen((96, 64), torch.float32, 2) == "split"
    assert th.measured_chain().quiet and th.measured_chain().cap() == 2
    cached = kernel_cache.read(tmp_path / "kernels.json")
    assert {e.threads: e.others_cores for e in cached.values()} == {1: 1.0, 2: 0.0}  # one thread: kept as measured
    calls.clear()
    _tune(tmp_path, TWO_FASTER, others=0.0, calls=calls)  # measured quiet: read from the cache from now on
    assert calls == []
