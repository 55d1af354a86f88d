"""A long prompt's attention: the engine sends only the prefill's last query rows (their bytes bounded by
engine.model.seam.Reads); the panel must keep memory bounded by what the events carry — never a (heads, S, S)
array — draw those rows at their real positions and say that the first rows were left out. The sizes below are the
issue's 4,054-token prompt; the expected row count comes from the engine's own bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.events import AttentionCaptured
from engine.model.seam import Reads
from engine.protocol import ATTENTION_MAX_BYTES, Loaded

S = 4054  # prompt tokens


def causal_rows(h: int, q0: int, nq: int, nk: int) -> np.ndarray:
    q = np.arange(q0, q0 + nq)[:, None]
    w = (np.arange(nk)[None, :] <= q).astype(np.float32)
    w /= w.sum(-1, keepdims=True)  # uniform over the readable keys: each row sums to 1
    return np.broadcast_to(w, (h, nq, nk)).copy()


@pytest.fixture
def loaded(bridge, tiny_lm):
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    return bridge


def long_prefill(h: int, layer: int) -> AttentionCaptured:
    kept = Reads().attention_rows(h, S, S)
    assert 1 <= kept < S
    return AttentionCaptured(step=0, phase="prefill", layer=layer, query_start=S - kept,
                             weights=causal_rows(h, S - kept, kept, S), group_size=1, rows_skipped=S - kept)


def _held(am) -> int:
    """The matrix's bytes without the array a background thread makes ahead for its next growth."""
    return am.nbytes - (am._ahead.nbytes if am._ahead is not None else 0)


def test_long_prefill_keeps_the_panel_small_and_draws_the_last_rows(qtbot, loaded, tiny_lm):
    from app.panels import attention

    panel = attention.PANEL(loaded)
    qtbot.addWidget(panel)
    panel.resize(600, 400)
    panel.show()
    h, layer = 9, panel.layer()  # SmolLM2's 9 heads: a full matrix would be the issue's 592 MB
    ev = long_prefill(h, layer)
    kept = ev.weights.shape[1]
    full = h * S * S * 4  # what a (heads, S, S) float32 matrix would take
    assert full > 590e6
    loaded.sig_attention.emit(ev)
    panel.flush()
    am = panel._matrices[layer]
    assert am.first_row == S - kept and am.rows_skipped == S - kept
    # the rows held take about what was sent; with the array of the budget's size made ahead for the next growth
    # (off the GUI thread), the matrix stays within twice its budget
    assert _held(am) <= 2 * ev.weights.nbytes <= 2 * ATTENTION_MAX_BYTES and _held(am) < full / 20
    assert am.nbytes <= 2 * attention.MATRIX_BYTES < full / 8
    m = panel.matrix()
    assert m.shape == (h, kept, S)
    np.testing.assert_array_equal(np.nan_to_num(m), ev.weights)  # the rows sent, nothing above the diagonal
    assert panel.image.image.shape == (kept, S)
    rect = panel.image.mapRectToParent(panel.image.boundingRect())
    assert (rect.top(), rect.bottom(), rect.width()) == pytest.approx((S - kept, S, S))  # real query positions
    assert f"first {S - kept:,} query rows were left out" in panel.status.text()

    # decode steps add one row each; memory still follows the rows held, not S × S
    for step in range(1, 6):
        pos = S + step - 1
        loaded.sig_attention.emit(AttentionCaptured(step=step, phase="decode", layer=layer, query_start=pos,
                                                    weights=causal_rows(h, pos, 1, pos + 1), group_size=1))
    panel.tabs.setCurrentIndex(1)  # the small multiples draw the same rows
    panel.flush()
    m = panel.matrix()
    assert m.shape == (h, kept + 5, S + 5)
    assert np.isnan(m[:, -1, S + 5:]).all() and np.allclose(np.nansum(m[:, -1], -1), 1.0)
    assert _held(panel._matrices[layer]) < 3 * ev.weights.nbytes < full / 10  # capacity grew for the new rows
    assert panel._matrices[layer].nbytes <= 2 * attention.MATRIX_BYTES
    # each small multiple is drawn at its own pixels: a block of fy × fx weights shows its largest
    vb = panel.grid_boxes[0]
    fy, fx = attention.per_pixel(kept + 5, vb.height()), attention.per_pixel(S + 5, vb.width())
    assert fx > 1
    drawn = panel.grid_images[0].image
    assert drawn.shape == (-(-(kept + 5) // fy), -(-(S + 5) // fx))
    for i, j in ((0, 0), (drawn.shape[0] - 1, drawn.shape[1] - 1), (drawn.shape[0] // 2, 3)):
        block = m[0, i * fy:(i + 1) * fy, j * fx:(j + 1) * fx].astype(np.float64)
        want = np.nan if np.isnan(block).all() else np.sqrt(np.nanmax(block))  # the panel's √ scale
        np.testing.assert_allclose(drawn[i, j], want, rtol=1e-6)
    img = panel.grab().toImage()
    assert not img.isNull() and img.width() > 0


def test_long_prefill_on_a_local_layer_draws_the_window_edge_over_the_kept_rows(qtbot, bridge, tiny_lm):
    from app.panels import attention

    w = 512
    cfg = dataclasses.replace(tiny_lm.cfg, sliding_window=w, layer_types=("local", "global"))
    info = dataclasses.replace(tiny_lm.info, sliding_window=w, layer_types=("local", "global"))
    bridge.replay(Loaded(info, tiny_lm.tokenizer, cfg))
    panel = attention.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.layer_spin.setValue(0)
    ev = long_prefill(cfg.n_heads, 0)
    kept = ev.weights.shape[1]
    bridge.sig_attention.emit(ev)
    panel.flush()
    m = panel.matrix()[0]
    last = S - 1  # the last query reads keys S − W … S − 1 only
    assert np.isnan(m[-1, : last - w + 1]).all() and not np.isnan(m[-1, last - w + 1 :]).any()
    x, y = panel.window_edge.getData()
    top = S - kept
    assert list(y) == [top, S] and list(x) == [top - w + 1, S - w + 1]  # x = y − W + 1 over the kept rows only
