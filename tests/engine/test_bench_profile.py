"""bench-profile's split of a decode step: the parts add up to the step, and the model is left as it was."""

import pytest

from benchmarks.bench import PROMPT
from benchmarks.profile import decode_attention, profile
from engine.model import transformer as m


def test_split_adds_up_and_restores_the_model():
    before = (m.linear, m.explicit_attention, m.sdpa_attention)
    r = profile("float32", 1, 4, PROMPT)
    assert (m.linear, m.explicit_attention, m.sdpa_attention) == before
    parts = r["ms_per_step"]
    assert set(parts) == {"products", "attention", "everything else"}
    assert parts["products"] > 0 and parts["attention"] > 0
    # timed inside the decode steps they belong to (the prefill's left out): together within a step's time
    assert parts["products"] + parts["attention"] <= r["tpot_timed_ms"]
    assert r["operators_per_step"] > 100


@pytest.mark.timing
def test_float32_decode_is_mostly_its_products():
    """A claim about this machine's speed (the products' share of a step), for a quiet machine: pytest -m timing."""
    r = profile("float32", 1, 4, PROMPT)
    parts = r["ms_per_step"]
    # float32 decode is mostly its matrix products (~80 % here), and a decode step's share excludes the prefill's
    assert 0.3 * r["tpot_timed_ms"] < parts["products"] < r["tpot_timed_ms"]


def test_decode_attention_times_each_way():
    att = decode_attention(keys=(16, 64), repeats=3)
    assert set(att) == {"fused kernel (bf16)", "two bf16 products", "two float32 products on upcast copies"}
    assert all(set(row) == {16, 64} and all(us > 0 for us in row.values()) for row in att.values())
