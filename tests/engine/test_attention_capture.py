"""Attention capture is bounded: a long prefill keeps only its last query rows, and the event says so.

The weights are held to an independent float64 reference forward (tests/tiny_model.py), row for row.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.events import AttentionCaptured, PrefillDone
from engine.model.seam import ATTENTION_MAX_BYTES
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session
from tests.tiny_model import reference_logits

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [int(i) for i in np.random.default_rng(5).integers(3, 300, size=40)]


def _prefill_attention(tiny_lm, capture: Capture) -> AttentionCaptured:
    events = list(Session(tiny_lm).generate(PROMPT, GREEDY, 1, capture, ignore_eos=True))
    assert any(isinstance(e, PrefillDone) for e in events)
    return next(e for e in events if isinstance(e, AttentionCaptured) and e.step == 0)


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict:
    att: dict = {}
    reference_logits(tiny_dir.hf_weights, PROMPT, attention=att)
    return {i: a.numpy() for i, a in att.items()}


def test_a_long_prefill_keeps_its_last_rows_within_the_budget(tiny_lm, reference):
    H, T = tiny_lm.cfg.n_heads, len(PROMPT)
    budget = 6 * H * T * 4 + 100  # room for 6 rows of (H, T) float32 weights
    ev = _prefill_attention(tiny_lm, Capture(attention_layers=frozenset({1}), attention_max_bytes=budget))
    assert ev.weights.shape == (H, 6, T) and ev.weights.nbytes <= budget
    assert ev.rows_skipped == T - 6 and ev.query_start == T - 6  # rows 34…39: the last queries of the prompt
    np.testing.assert_allclose(ev.weights, reference[1][:, T - 6:, :], atol=2e-5)
    np.testing.assert_allclose(ev.weights.sum(-1), 1.0, atol=1e-5)


def test_a_short_prefill_keeps_every_row(tiny_lm, reference):
    ev = _prefill_attention(tiny_lm, Capture(attention_layers=frozenset({0})))
    T = len(PROMPT)
    assert ev.rows_skipped == 0 and ev.query_start == 0 and ev.weights.shape == (tiny_lm.cfg.n_heads, T, T)
    np.testing.assert_allclose(ev.weights, reference[0], atol=2e-5)


def test_the_default_budget_bounds_the_issue_s_case() -> None:
    """The 4,054-token prompt on SmolLM2 (9 heads): 590 MB for one layer's full matrix; the default keeps ≤ 16 MiB."""
    from engine.model.seam import Reads

    full = 9 * 4054 * 4054 * 4
    assert full > 590e6
    rows = Reads().attention_rows(9, 4054, 4054)
    assert 1 <= rows < 4054 and rows * 9 * 4054 * 4 <= ATTENTION_MAX_BYTES
    assert Reads().attention_rows(9, 1, 4054) == 1  # a decode step always keeps its one row


def test_every_layer_is_captured_only_while_the_context_is_short(tiny_lm, reference):
    """A short run captures every layer; past `every_layer_below` positions only the layers asked for, so a long
    run's capture does not grow with layers × context (the rest is recomputed on demand)."""
    L, T = tiny_lm.cfg.n_layers, len(PROMPT)
    capture = Capture(attention_layers=frozenset({1}), every_layer_below=T + 2)
    events = list(Session(tiny_lm).generate(PROMPT, GREEDY, 5, capture, ignore_eos=True))
    layers: dict[int, set[int]] = {}
    for e in events:
        if isinstance(e, AttentionCaptured):
            layers.setdefault(e.step, set()).add(e.layer)
    # step 0 is the prefill (positions 0…T−1), step k ≥ 1 queries position T + k − 1
    assert layers == {0: set(range(L)), 1: set(range(L)), 2: set(range(L)), 3: {1}, 4: {1}}
    prefill = {e.layer: e for e in events if isinstance(e, AttentionCaptured) and e.step == 0}
    np.testing.assert_allclose(prefill[0].weights, reference[0], atol=2e-5)  # an extra layer is the real one
