"""The Attention panel's matrix at its budget on a long run: the oldest rows go in place (no new array of the
budget's size every few dozen tokens, which held the GUI thread), and what it keeps equals a plain reference."""

from __future__ import annotations

import numpy as np

from app.panels.attention import AttentionMatrix
from engine.events import AttentionCaptured


def decode_rows(heads: int, prompt: int, steps: int):
    rng = np.random.default_rng(1)
    q = np.arange(prompt)[:, None]
    block = np.where(np.arange(prompt)[None, :] <= q, rng.random((heads, prompt, prompt)), 0).astype(np.float32)
    yield AttentionCaptured(step=0, phase="prefill", layer=0, query_start=0, weights=block, group_size=1)
    for step in range(1, steps + 1):
        pos = prompt + step - 1
        yield AttentionCaptured(step=step, phase="decode", layer=0, query_start=pos,
                                weights=rng.random((heads, 1, pos + 1), dtype=np.float32), group_size=1)


def test_rows_past_the_budget_go_in_place_and_the_rest_is_kept_exactly():
    heads, prompt, steps = 3, 5, 400
    m = AttentionMatrix(heads, max_bytes=4 * heads * 300 * 40)  # about 40 rows of 300 keys
    reference = np.full((heads, prompt + steps, prompt + steps), np.nan, dtype=np.float32)
    arrays, in_place = set(), 0
    for ev in decode_rows(heads, prompt, steps):
        before, dropped = id(m._w), m.rows_dropped
        m.add(ev)
        h, nq, nk = ev.weights.shape
        block = ev.weights.copy()
        if nq > 1:
            block[:, np.arange(nk)[None, :] > np.arange(nq)[:, None]] = np.nan
        reference[:, ev.query_start: ev.query_start + nq, :nk] = block
        arrays.add(id(m._w))
        in_place += m.rows_dropped > dropped and id(m._w) == before
        assert m._w.nbytes <= m.max_bytes * 1.01 or m.weights.shape[1] <= 1
        assert m.nbytes <= 2 * m.max_bytes * 1.01  # with the spare the last reshape left
    assert m.rows_dropped > 0 and m.first_row > prompt
    assert in_place >= 5  # most drops reuse the array; only a wider key range needs a new one
    kept = m.weights
    np.testing.assert_array_equal(kept, reference[:, m.first_row: m.size, : m.size])
    assert m.first_row == m.rows_dropped + (0 if m.rows_skipped == 0 else m.rows_skipped)


def test_a_wider_key_range_at_the_budget_reuses_the_pages_of_an_earlier_array(monkeypatch):
    """Each widening of the keys at the budget needs a new array; a fresh one of the budget's size had its pages
    faulted in on the GUI thread (80–160 ms for 32 MiB), so past the first two such arrays every reshape writes into
    the one it replaced before (9 fresh arrays of half the budget or more in a 4,000-token run before, 2 now). What the
    matrix holds still equals the plain reference."""
    from app.panels import attention

    heads, prompt, steps = 2, 5, 900
    budget = 4 * heads * 300 * 60
    reference = np.full((heads, prompt + steps, prompt + steps), np.nan, dtype=np.float32)
    made = []  # the arrays of half the budget or more the matrix allocated (numpy's own functions, counted)
    for name in ("full", "empty"):
        monkeypatch.setattr(attention.np, name, _counting(getattr(np, name), made, budget))
    m = AttentionMatrix(heads, max_bytes=budget)
    reshapes = 0
    for ev in decode_rows(heads, prompt, steps):
        before = m._w.shape
        m.add(ev)
        h, nq, nk = ev.weights.shape
        block = ev.weights.copy()
        if nq > 1:
            block[:, np.arange(nk)[None, :] > np.arange(nq)[:, None]] = np.nan
        reference[:, ev.query_start: ev.query_start + nq, :nk] = block
        reshapes += m._w.shape != before
    assert reshapes >= 6 and len(made) == 2
    np.testing.assert_array_equal(m.weights, reference[:, m.first_row: m.size, : m.size])


def _counting(make, made: list, budget: int):
    """numpy's `make` (full, empty), noting the size of each array of half the budget or more it returns."""
    def counted(*a, **k):
        r = make(*a, **k)
        if 2 * r.nbytes >= budget:
            made.append(r.nbytes)
        return r
    return counted
