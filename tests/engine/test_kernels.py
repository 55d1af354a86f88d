"""The decode autotuner (engine.model.kernels, engine.model.kernel_cache): every candidate is the same product as a
float64 reference; the tuner keeps the fastest of candidates whose costs the test sets (an injected clock, not a
timed test); a result is re-measured when its key changes or the cache is damaged; a forced kernel is the one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.model import kernel_cache, kernels
from engine.model import threads as thread_count
from engine.model.kernel_cache import Entry, Machine, entry_key
from engine.model.transformer import linear, pack_for_decode

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}  # relative: accumulation order; one bf16 rounding


@pytest.fixture
def clean_dispatch(monkeypatch):
    """Measured choices made by a test do not outlive it."""
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_MEASURED_AT", {})
    monkeypatch.setattr(kernels, "_TOP", [1])
    monkeypatch.setattr(kernels, "_FORCED", [])
    monkeypatch.setattr(thread_count, "_MEASURED", [])


def runnable(dtype: torch.dtype, threads: int) -> list[str]:
    """The candidates this machine can run for a (96, 64) weight of `dtype` (packed only where bf16 packs)."""
    w = torch.ones(96, 64, dtype=dtype)
    p = pack_for_decode(w)
    return [k for k in kernels.KERNELS
            if kernels.applicable(k, w, p, threads) and kernels._works(k, [(w, None, p, None)])]


def test_every_machine_has_the_plain_the_split_and_the_float32_onednn_candidates(threads):
    assert {"linear", "split", "onednn"} <= set(runnable(torch.float32, threads))
    assert {"linear", "split"} <= set(runnable(torch.bfloat16, threads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("rows", "n_in", "n_out"), [(1, 576, 960), (1, 64, 96), (4, 33, 96), (2, 1536, 576)])
def test_every_candidate_is_the_float64_product(threads, dtype, bias, rows, n_in, n_out):
    g = torch.Generator().manual_seed(rows * 1000 + n_in)
    w = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(dtype)
    x = torch.randn(1, rows, n_in, generator=g).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype) if bias else None
    packed = pack_for_decode(w)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())  # the same inputs, exact sums
    tol = TOLERANCE[dtype]
    names = [k for k in kernels.KERNELS if kernels.applicable(k, w, packed, threads)
             and kernels._works(k, [(w, b, packed, None)])]
    assert "linear" in names and ("split" in names) == (n_out % threads == 0)
    for name in names:
        y = kernels.KERNELS[name](x, w, b, packed)
        assert y.shape == (1, rows, n_out) and y.dtype == dtype, name
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item(), msg=name)


def test_the_tuner_keeps_the_fastest_of_known_costs():
    costs = {"linear": 1.5, "split": 1.0, "onednn": 1.2}
    calls: list[str] = []

    def time_once(name: str) -> float:
        calls.append(name)
        return costs[name] * (50 if len(calls) == 5 else 1)  # one burst of load on the fastest, early on

    seconds, rounds = kernels.choose(list(costs), time_once, rounds=5, budget_s=None)
    assert seconds == costs and rounds == 5  # medians: the burst is outvoted
    assert min(seconds, key=seconds.get) == "split"
    assert calls[:3] == ["linear", "split", "onednn"]  # the warm-up, then rounds in rotated order:
    assert calls[3:9] == ["linear", "split", "onednn", "split", "onednn", "linear"]
    assert len(calls) == 3 + 5 * 3


def test_a_candidate_far_slower_twice_is_not_run_again():
    costs = {"linear": 1.0, "split": 9.0, "onednn": 1.5}
    calls: list[str] = []
    seconds, _ = kernels.choose(list(costs), lambda k: calls.append(k) or costs[k], rounds=5, budget_s=None)
    assert seconds == costs and calls.count("split") == 2 and calls.count("linear") == 6  # warm-up and round 0
    everything, _ = kernels.choose(list(costs), lambda k: calls.append(k) or costs[k], rounds=5, budget_s=None,
                                   prune=None)
    assert everything == costs and calls.count("split") == 2 + 6


def test_one_burst_of_load_does_not_drop_the_fastest():
    costs = {"linear": 1.0, "split": 1.2}
    calls: list[str] = []

    def time_once(name: str) -> float:
        calls.append(name)
        return costs[name] * (15 if len(calls) == 1 else 1)  # F.linear's warm-up lands in a burst

    seconds, _ = kernels.choose(list(costs), time_once, rounds=5, budget_s=None)
    assert min(seconds, key=seconds.get) == "linear" and calls.count("linear") == 6


def test_a_slow_candidate_set_gets_fewer_rounds_but_never_below_the_minimum():
    _, rounds = kernels.choose(["linear", "split"], lambda k: 1.0, rounds=5, budget_s=0.01)
    assert rounds == kernels.MIN_ROUNDS


def test_a_shape_the_model_has_once_gets_more_rounds_within_the_budget(tmp_path, clean_dispatch):
    """The LM head is one sample per round where a layer shape averages over every layer: it runs SINGLE_ROUNDS."""
    clock = _fake_clock({"linear": 1e-3, "split": 1.5e-3, "onednn": 1.2e-3}, [])
    head = kernels.tune(_group((128, 64), n=1), counts=[1], time_once=clock, path=tmp_path / "a.json")
    layers = kernels.tune(_group((96, 64), n=3), counts=[1], time_once=clock, path=tmp_path / "b.json")
    assert (head[0].rounds, layers[0].rounds) == (kernels.SINGLE_ROUNDS, kernels.ROUNDS)
    slow = _fake_clock({"linear": 0.05, "split": 0.06, "onednn": 0.07}, [])  # the budget still bounds it
    assert kernels.tune(_group((130, 64), n=1), counts=[1], time_once=slow, path=tmp_path / "c.json",
                        remeasure=True)[0].rounds == kernels.MIN_ROUNDS


def _group(shape=(96, 64), n=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(shape[0])
    return {(*shape, kernel_cache.FLOAT): [(torch.randn(*shape, generator=g).to(dtype), None, None, None)
                                          for _ in range(n)]}


def _fake_clock(costs: dict[str, float], calls: list[str]):
    def time_once(products, name):
        calls.append(name)
        return costs[name]
    return time_once


def test_tune_measures_once_and_then_reads_the_cache(tmp_path, clean_dispatch):
    path, calls = tmp_path / "kernels.json", []
    clock = _fake_clock({"linear": 3.0, "split": 1.0, "onednn": 2.0, "packed": 9.0}, calls)
    entries = kernels.tune(_group(), counts=[1, 2], time_once=clock, path=path)
    assert [(e.threads, e.choice) for e in entries] == [(1, "split"), (2, "split")]
    assert calls and set(calls) == {"linear", "split", "onednn"}  # packed: no packed weight, not a candidate
    doc = json.loads(path.read_text())
    assert {e["choice"] for e in doc["entries"]} == {"split"} and len(doc["entries"]) == 2
    calls.clear()
    again = kernels.tune(_group(), counts=[1, 2], time_once=clock, path=path)
    assert calls == [] and [e.choice for e in again] == ["split", "split"]  # read, not measured
    kernels.tune(_group(), counts=[1, 2], time_once=clock, path=path, remeasure=True)
    assert calls  # --remeasure measures even what the cache holds


@pytest.mark.parametrize(("plain", "choice"), [(1.04, "linear"), (1.06, "split"), (0.9, "linear")])
def test_a_near_tie_goes_to_f_linear(plain, choice):
    e = Entry(Machine("cpu", 2, "t", "AVX2"), "float32", 1, (8, 8), {"linear": plain, "split": 1.0, "onednn": 1.3},
              30, 5, 0.0)
    assert e.choice == choice


@pytest.mark.parametrize(("seconds", "choice"), [
    ({"split": 1.0, "int8": 1.03, "int4": 1.2}, "int8"),  # a near tie: int8 reads a quarter of float32's bytes
    ({"split": 1.0, "int8": 1.08}, "int8"),
    ({"split": 1.0, "int8": 1.12}, "split"),  # not a tie
    ({"onednn": 1.0, "int8": 1.04, "int4": 1.095}, "int4"),
    ({"split": 1.0, "onednn": 0.98}, "onednn"),  # the same bytes: the faster
])
def test_a_near_tie_without_f_linear_goes_to_the_fewest_bytes(seconds, choice):
    e = Entry(Machine("cpu", 2, "t", "AVX512"), "float32", 2, (49152, 576), {"linear": 2.0, **seconds}, 1, 5, 0.0,
              weights="q4")
    assert e.choice == choice
    assert Entry(Machine("cpu", 2, "t", "AVX512"), "bfloat16", 1, (8, 8), {"packed": 1.0, "split": 0.99}, 1, 5,
                 0.0).choice == "split"  # both bf16


def test_the_key_names_everything_a_measurement_depends_on():
    m = Machine("AMD EPYC", 2, "2.13.0+cpu", "AVX2")
    base = entry_key(m, "float32", 2, (960, 576))
    others = [entry_key(Machine("AMD EPYC", 2, "2.14.0+cpu", "AVX2"), "float32", 2, (960, 576)),
              entry_key(Machine("AMD EPYC", 4, "2.13.0+cpu", "AVX2"), "float32", 2, (960, 576)),
              entry_key(Machine("Intel Xeon", 2, "2.13.0+cpu", "AVX2"), "float32", 2, (960, 576)),
              entry_key(Machine("AMD EPYC", 2, "2.13.0+cpu", "AVX512"), "float32", 2, (960, 576)),
              entry_key(m, "bfloat16", 2, (960, 576)), entry_key(m, "float32", 1, (960, 576)),
              entry_key(m, "float32", 2, (576, 960))]
    assert len({base, *others}) == 1 + len(others)


@pytest.mark.parametrize("change", ["torch", "cores", "shape"])
def test_a_changed_key_is_measured_again(tmp_path, monkeypatch, clean_dispatch, change):
    path, calls = tmp_path / "kernels.json", []
    clock = _fake_clock({"linear": 1.0, "split": 2.0, "onednn": 3.0}, calls)
    kernels.tune(_group(), counts=[1], time_once=clock, path=path)
    calls.clear()
    shape = (96, 64)
    m = kernels.this_machine()
    if change == "torch":
        monkeypatch.setattr(kernels, "this_machine", lambda: Machine(m.cpu, m.cores, "9.9.9", m.capability))
    elif change == "cores":
        monkeypatch.setattr(kernels, "this_machine", lambda: Machine(m.cpu, m.cores + 1, m.torch, m.capability))
    else:
        shape = (64, 64)
    kernels.tune(_group(shape), counts=[1], time_once=clock, path=path)
    assert calls  # measured again
    assert len(kernel_cache.read(path)) == 2  # the first result is kept beside the new one


@pytest.mark.parametrize("damage", ["not json", '{"format": 1, "entries": {}}', "[1, 2]", "\x00\xff"])
def test_a_damaged_cache_is_ignored_and_measured_again(tmp_path, clean_dispatch, damage):
    path, calls = tmp_path / "kernels.json", []
    path.write_bytes(damage.encode("latin-1"))
    clock = _fake_clock({"linear": 2.0, "split": 1.0, "onednn": 3.0}, calls)
    entries = kernels.tune(_group(), counts=[1], time_once=clock, path=path)
    assert calls and entries[0].choice == "split"
    assert list(kernel_cache.read(path).values())[0].choice == "split"  # written back whole


def test_a_tampered_entry_is_not_trusted(tmp_path, clean_dispatch):
    path, calls = tmp_path / "kernels.json", []
    clock = _fake_clock({"linear": 2.0, "split": 1.0, "onednn": 3.0}, calls)
    kernels.tune(_group(), counts=[1], time_once=clock, path=path)
    doc = json.loads(path.read_text())
    doc["entries"][0]["seconds"] = {"rm -rf": 0.0}  # a candidate that does not exist
    path.write_text(json.dumps(doc))
    assert kernel_cache.read(path) == {}
    calls.clear()
    kernels.tune(_group(), counts=[1], time_once=clock, path=path)
    assert calls


def _spy(monkeypatch, name: str) -> list[int]:
    seen: list[int] = []
    real = kernels.KERNELS[name]

    def spy(x, w, b, p, q=None):
        seen.append(w.shape[0])
        return real(x, w, b, p, q)

    monkeypatch.setitem(kernels.KERNELS, name, spy)
    return seen


def test_the_measured_choice_is_the_kernel_decode_runs(tmp_path, monkeypatch, clean_dispatch):
    seen = _spy(monkeypatch, "onednn")
    n = torch.get_num_threads()
    clock = _fake_clock({"linear": 2.0, "split": 3.0, "onednn": 1.0}, [])
    kernels.tune(_group((96, 64)), counts=[n], time_once=clock, path=tmp_path / "k.json")
    seen.clear()  # the tuner tried each candidate once
    w = torch.randn(96, 64)
    linear(torch.randn(1, 64), w)
    assert seen == [96] and kernels.chosen((96, 64), torch.float32, n) == "onednn"
    linear(torch.randn(32, 64), w)  # a prefill is not a decode product
    linear(torch.randn(1, 64), torch.randn(48, 64))  # a shape never measured: F.linear
    assert seen == [96]


def test_each_thread_count_runs_its_own_choice(tmp_path, monkeypatch, clean_dispatch):
    """--threads auto switches between one and all threads between steps: each step runs that count's kernel."""
    seen_split, seen_linear = _spy(monkeypatch, "split"), _spy(monkeypatch, "linear")

    def time_once(products, name):  # the split wins with two threads, F.linear with one
        return {"linear": 2.0, "split": 1.0 if torch.get_num_threads() == 2 else 3.0, "onednn": 4.0}[name]

    before = torch.get_num_threads()
    kernels.tune(_group((96, 64)), counts=[1, 2], time_once=time_once, path=tmp_path / "k.json")
    seen_split.clear()
    seen_linear.clear()
    x, w = torch.randn(1, 64), torch.randn(96, 64)
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert len(seen_linear) == 2 and len(seen_split) == 1
    assert torch.get_num_threads() == before


def test_a_forced_kernel_is_used_over_the_measured_one(tmp_path, monkeypatch, clean_dispatch):
    seen = _spy(monkeypatch, "split")
    clock = _fake_clock({"linear": 1.0, "split": 3.0, "onednn": 2.0}, [])
    kernels.tune(_group((96, 64)), counts=[torch.get_num_threads()], time_once=clock, path=tmp_path / "k.json")
    seen.clear()  # the tuner tried each candidate once
    x, w = torch.randn(1, 64), torch.randn(96, 64)
    with kernels.forced("split"):
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert kernels.forced_name() == "split"
    assert seen == [96]
    linear(x, w)
    assert seen == [96] and kernels.forced_name() is None  # forcing ends with the block


def test_an_unknown_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="valid: linear, split, onednn, packed"):
        kernels.force("fastest")


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **(env or {})})


def test_the_environment_forces_the_app_engine_process_kernel():
    r = _run(["-c", "from engine.model import kernels; print(kernels.forced_name())"],
             {kernel_cache.KERNEL_ENV: "onednn"})
    assert r.returncode == 0 and r.stdout.strip() == "onednn", r.stderr


def test_kernels_command_lists_every_shape_of_the_model_at_each_thread_count(tiny_dir):
    r = _run(["-m", "engine", "kernels", "--model", str(tiny_dir.gguf), "--dtype", "float32", "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    shapes = {tuple(row["shape"]) for row in doc["rows"]}
    threads = {row["threads"] for row in doc["rows"]}
    assert len(doc["rows"]) == len(shapes) * len(threads) and 1 in threads
    for row in doc["rows"]:
        fastest = min(row["seconds"], key=row["seconds"].get)
        assert row["choice"] == fastest or (row["choice"] == "linear" and row["vs_fastest"]["linear"] <= 1.05)
        assert {"linear", "split"} <= set(row["seconds"]) or row["shape"][0] % row["threads"]


def test_generate_takes_a_kernel_and_refuses_an_unknown_one(tiny_dir):
    args = ["-m", "engine", "generate", "--model", str(tiny_dir.gguf), "--prompt", "hi", "--max-new-tokens", "3",
            "--greedy", "--json"]
    forced, measured = _run([*args, "--kernel", "split"]), _run(args)
    assert forced.returncode == 0 and measured.returncode == 0, forced.stderr + measured.stderr
    assert json.loads(forced.stdout)["ids"] == json.loads(measured.stdout)["ids"]
    bad = _run([*args, "--kernel", "fastest"])
    assert bad.returncode == 2 and "invalid choice" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_kernels_command_names_a_bad_forced_kernel(tiny_dir):
    r = _run(["-m", "engine", "kernels", "--model", str(tiny_dir.gguf), "--dtype", "float32"],
             {kernel_cache.KERNEL_ENV: "fastest"})
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == ("error: INFERENCE_LAB_KERNEL=fastest is not a kernel (valid: linear, split, onednn, "
                                "packed, int4, int8); the engine ignores it and runs the measured choice")
