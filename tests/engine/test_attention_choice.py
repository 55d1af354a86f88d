"""A decode query's attention runs the way measured fastest on this machine for its key count
(engine.model.attention_choice): the choice follows the measurement (injected clocks), a layer a panel captures only
runs a way that forms the weights, the measurement is kept and read back, and every way gives the same decode as the
float64 attention on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from engine.loaders import load
from engine.model import attention_choice, kernel_cache
from engine.model.kv_cache import KVCache
from engine.model.transformer import decode_ways

HEADS = (3, 3, 64)


@pytest.fixture
def fresh_table(monkeypatch):
    """An empty choice table (restored after), so measurements made by other tests do not leak in."""
    monkeypatch.setattr(attention_choice, "_TIMES", {})
    monkeypatch.setattr(attention_choice, "_TOP", [1])
    monkeypatch.setattr(attention_choice, "_FORCED", [])


def costs(table: dict[str, dict[int, float]]):
    """time_once(keys, way) from {way: {keys: seconds}}, recording what was timed."""
    timed = []

    def time_once(keys: int, way: str) -> float:
        timed.append((keys, way))
        return table[way][keys]

    return time_once, timed


def test_the_way_measured_fastest_runs_at_the_nearest_measured_key_count(fresh_table, tmp_path):
    # bf16: sdpa fastest short, slowest long; upcast beats blocked short, blocked wins long
    time_once, timed = costs({"sdpa": {512: 1, 1024: 2, 2048: 9, 4096: 30},
                              "upcast": {512: 2, 1024: 3, 2048: 5, 4096: 20},
                              "blocked": {512: 4, 1024: 5, 2048: 6, 4096: 10}})
    entries = attention_choice.tune(decode_ways(torch.bfloat16), HEADS, torch.bfloat16, 4096, 30, [1],
                                    time_once=time_once, path=tmp_path / "attention.json")
    assert [e.keys for e in entries] == [512, 1024, 2048, 4096]
    assert {k for k, _ in timed} == {512, 1024, 2048, 4096}
    choice = attention_choice.choice
    assert [choice(torch.bfloat16, HEADS, n, weights=False) for n in (300, 700, 1300, 2000, 3500, 9000)] == \
        ["sdpa", "sdpa", "sdpa", "upcast", "blocked", "blocked"]
    # a layer a panel captures: never the fused kernel, which forms no weights
    assert [choice(torch.bfloat16, HEADS, n, weights=True) for n in (300, 1500, 2000, 5000)] == \
        ["upcast", "upcast", "upcast", "blocked"]
    # another head shape was not measured: the rule from before
    assert choice(torch.bfloat16, (8, 4, 128), 1000, weights=False) == "upcast"
    assert choice(torch.bfloat16, (8, 4, 128), 5000, weights=False) == "blocked"
    assert choice(torch.float32, HEADS, 5000, weights=False) == "sdpa"
    assert choice(torch.float32, HEADS, 5000, weights=True) == "explicit"


def test_a_measurement_is_kept_and_read_back_and_a_damaged_file_measures_again(fresh_table, tmp_path, monkeypatch):
    path = tmp_path / "attention.json"
    time_once, timed = costs({"sdpa": {512: 3, 1024: 6}, "explicit": {512: 2, 1024: 7}})
    attention_choice.tune(decode_ways(torch.float32), HEADS, torch.float32, 1024, 30, [1, 2], time_once=time_once,
                          path=path)
    assert len(timed) > 0
    timed.clear()
    again = attention_choice.tune(decode_ways(torch.float32), HEADS, torch.float32, 1024, 30, [1, 2],
                                  time_once=time_once, path=path)
    assert timed == []  # read from the file
    assert {(e.threads, e.keys): e.fastest() for e in again} == {(1, 512): "explicit", (1, 1024): "sdpa",
                                                                 (2, 512): "explicit", (2, 1024): "sdpa"}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert attention_choice.choice(torch.float32, HEADS, 600, weights=False) == "explicit"
    assert attention_choice.choice(torch.float32, HEADS, 1000, weights=False) == "sdpa"
    doc = json.loads(path.read_text())
    doc["entries"][0]["seconds"] = {"sdpa": -1.0}  # not one this code wrote: ignored, measured again
    path.write_text(json.dumps(doc))
    attention_choice.tune(decode_ways(torch.float32), HEADS, torch.float32, 1024, 30, [1, 2], time_once=time_once,
                          path=path)
    assert len(timed) > 0
    path.write_text("{not json")
    assert kernel_cache.read(path, kernel_cache.AttentionEntry) == {}


def test_a_forced_way_runs_where_it_applies(fresh_table):
    with attention_choice.forced("sdpa"):
        assert attention_choice.choice(torch.bfloat16, HEADS, 100, weights=False) == "sdpa"
        assert attention_choice.choice(torch.bfloat16, HEADS, 100, weights=True) == "upcast"  # it forms no weights
    with attention_choice.forced("blocked"):
        assert attention_choice.choice(torch.float32, HEADS, 100, weights=False) == "sdpa"  # not a float32 way
        assert attention_choice.choice(torch.bfloat16, HEADS, 100, weights=True) == "blocked"
    with pytest.raises(ValueError, match="valid: upcast, blocked, explicit, sdpa"):
        attention_choice.force("flash")


def _decode(lm, ids: list[int], way: str) -> torch.Tensor:
    cache = KVCache(lm.cfg, 1, len(ids), lm.dtype)
    out = [lm.model(torch.tensor([ids[:1]]), cache)[0]]
    with attention_choice.forced(way):
        for t in ids[1:]:
            out.append(lm.model(torch.tensor([[t]]), cache)[0])
    return torch.stack(out).float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_way_decodes_the_tiny_model_as_the_float64_model_does(tiny_dir, dtype):
    """The same decode logits whichever way runs the attention: float32's ways agree with a float64 copy of the
    model to float32 rounding; bf16's stay within the bound the bf16 decode is held to (test_bf16_decode.py)."""
    ids = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]
    lm = load(tiny_dir.gguf, device="cpu", dtype=dtype, use_cache=False)
    ref = load(tiny_dir.gguf, device="cpu", dtype="float32", use_cache=False)
    ref.model.double()
    ref.dtype = torch.float64
    ref.model.init_rope()
    want = _decode(ref, ids, "explicit")
    for way in decode_ways(lm.model.lm_head.dtype):
        got = _decode(lm, ids, way)
        if dtype == "float32":
            assert_close(got, want, atol=2e-4, rtol=1e-4, msg=way)
        else:
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8, way
            assert_close(got, want, atol=0.3, rtol=0.1, msg=way)


def test_timings_made_under_load_are_measured_again_once_a_load_finds_the_machine_quiet(fresh_table, tmp_path,
                                                                                         monkeypatch):
    """As the products' choices: a two-thread timing made while another program held a core is kept while the
    machine stays busy and measured again by the first load that finds it quiet; a one-thread timing stands."""
    path = tmp_path / "attention.json"
    # under load the fused kernel looks best at two threads; quiet, the explicit products are
    busy, _ = costs({"sdpa": {512: 1, 1024: 2}, "explicit": {512: 3, 1024: 6}})
    quiet, timed = costs({"sdpa": {512: 3, 1024: 6}, "explicit": {512: 1, 1024: 2}})

    def tune(clock, others: float) -> None:
        attention_choice.tune(decode_ways(torch.float32), HEADS, torch.float32, 1024, 30, [1, 2], time_once=clock,
                              path=path, others_cores=lambda: others)

    def at_two_threads() -> str:
        with monkeypatch.context() as m:
            m.setattr(torch, "get_num_threads", lambda: 2)
            return attention_choice.choice(torch.float32, HEADS, 1000, weights=False)

    tune(busy, 1.0)
    assert at_two_threads() == "sdpa"
    tune(quiet, 0.9)  # still busy: the cache is used, nothing measured
    assert timed == [] and at_two_threads() == "sdpa"
    tune(quiet, 0.0)  # quiet now: the two-thread key counts again
    assert set(timed) == {(k, w) for k in (512, 1024) for w in ("explicit", "sdpa")}
    assert at_two_threads() == "explicit"
    cached = kernel_cache.read(path, kernel_cache.AttentionEntry).values()
    assert sorted((e.threads, e.others_cores) for e in cached) == [(1, 1.0), (1, 1.0), (2, 0.0), (2, 0.0)]
    timed.clear()
    tune(quiet, 0.0)  # measured quiet: read from the cache from now on
    assert timed == []
