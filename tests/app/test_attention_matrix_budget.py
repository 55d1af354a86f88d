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
        _expect(reference, ev)
        arrays.add(id(m._w))
        in_place += m.rows_dropped > dropped and id(m._w) == before
        assert m._w.nbytes <= m.max_bytes * 1.01 or m.weights.shape[1] <= 1
        assert m.nbytes <= 2 * m.max_bytes * 1.01  # with the spare the last reshape left
    assert m.rows_dropped > 0 and m.first_row > prompt
    assert in_place >= 5  # most drops reuse the array; only a wider key range needs a new one
    kept = m.weights
    np.testing.assert_array_equal(kept, reference[:, m.first_row: m.size, : m.size])
    assert m.first_row == m.rows_dropped + (0 if m.rows_skipped == 0 else m.rows_skipped)


def _expect(reference: np.ndarray, ev: AttentionCaptured) -> None:
    """The plain reference: the event's rows written where they belong, NaN above the diagonal."""
    h, nq, nk = ev.weights.shape
    block = ev.weights.copy()
    if nq > 1:
        block[:, np.arange(nk)[None, :] > np.arange(nq)[:, None]] = np.nan
    reference[:, ev.query_start: ev.query_start + nq, :nk] = block


def _run(m: AttentionMatrix, heads: int, prompt: int, steps: int, wait: bool):
    """Add the rows to `m` (waiting for each array made ahead when `wait`); returns the plain reference and the
    number of reshapes."""
    reference = np.ndarray((heads, prompt + steps, prompt + steps), dtype=np.float32)  # not np.full: counted below
    reference.fill(np.nan)
    reshapes = 0
    for ev in decode_rows(heads, prompt, steps):
        before = m._w.shape
        m.add(ev)
        if wait and m._ahead is not None:
            assert m._ahead.wait(10)
        _expect(reference, ev)
        reshapes += m._w.shape != before
        assert m.nbytes <= 2 * m.max_bytes * 1.01
    return reference, reshapes


def test_a_wider_key_range_at_the_budget_reuses_the_pages_of_an_earlier_array(monkeypatch):
    """Each widening of the keys at the budget needs a new array; a fresh one of the budget's size had its pages
    faulted in on the GUI thread (BENCHMARKS.md, "Long runs (issue 26)" on the AMD AVX-512 machine), so past the first
    two such arrays every reshape writes into the one it replaced before, and
    those two are written by a background thread (Prefaulted) before the reshape that needs them: the GUI thread
    fills none. What the matrix holds still equals the plain reference."""
    from app.panels import attention

    heads, prompt, steps = 2, 5, 900
    budget = 4 * heads * 300 * 60
    made = []  # arrays of half the budget or more made by numpy's own functions on the GUI thread
    for name in ("full", "empty"):
        monkeypatch.setattr(attention.np, name, _counting(getattr(np, name), made, budget))
    ahead = []

    class Counted(attention.Prefaulted):
        def _fault(self) -> None:
            ahead.append(self.nbytes)
            super()._fault()

    monkeypatch.setattr(attention, "Prefaulted", Counted)
    m = AttentionMatrix(heads, max_bytes=budget)
    reference, reshapes = _run(m, heads, prompt, steps, wait=True)
    assert reshapes >= 6 and len(ahead) == 2 and len(made) == len(ahead)  # the only ones: made ahead
    np.testing.assert_array_equal(m.weights, reference[:, m.first_row: m.size, : m.size])


def test_an_array_made_ahead_is_not_used_before_its_thread_is_done(monkeypatch):
    """While the background thread has not written its array, a reshape makes its own (as before) and the matrix
    never reads the unwritten one; once written, it is taken by a later reshape, and the result is exact."""
    import threading

    from app.panels import attention

    release = threading.Event()

    class Slow(attention.Prefaulted):
        def _fault(self) -> None:
            release.wait(10)
            super()._fault()

    monkeypatch.setattr(attention, "Prefaulted", Slow)
    heads, prompt, steps = 2, 5, 900
    m = AttentionMatrix(heads, max_bytes=4 * heads * 300 * 60)
    reference = np.ndarray((heads, prompt + steps, prompt + steps), dtype=np.float32)
    reference.fill(np.nan)
    reshaped_while_pending = taken = 0
    for ev in decode_rows(heads, prompt, steps):
        before, pending = m._w.shape, m._ahead
        m.add(ev)
        _expect(reference, ev)
        assert m.nbytes <= 2 * m.max_bytes * 1.01
        base = m._base()
        if pending is not None and m._w.shape != before:
            if pending.array is None:
                reshaped_while_pending += 1
                assert not np.shares_memory(base, pending._array)
                release.set()  # from here the thread writes it
                assert pending.wait(10)
            else:
                taken += np.shares_memory(base, pending._array)
    assert reshaped_while_pending == 1 and taken >= 1
    np.testing.assert_array_equal(m.weights, reference[:, m.first_row: m.size, : m.size])


def _counting(make, made: list, budget: int):
    """numpy's `make` (full, empty), noting the size of each array of half the budget or more it returns."""
    def counted(*a, **k):
        r = make(*a, **k)
        if 2 * r.nbytes >= budget:
            made.append(r.nbytes)
        return r
    return counted
