"""The Logit lens panel's tuned lens against a real engine process on the tiny model: 'tuned' before any fit says none
is saved and goes back to logit; Fit (progress, then in use, the switch on tuned) makes the next generation's steps
carry both lenses, the table reads the tuned rows and its KL column, the plot draws both lenses' KL; 'logit' reads
the same step's logit rows again; Cancel ends a fit; a damaged KL array in a step is not drawn. The picture of the
panel is saved (INFERENCE_LAB_SHOTS, when set, names the folder)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.events import LensCaptured
from engine.protocol import LensTuned, SamplingParams
from tests.app.conftest import wait_loaded

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")  # docks raised offscreen


@pytest.fixture
def lens_window(qtbot, make_window, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path / "cache"))  # its engine finds no lens another test saved
    w = make_window(persist=False)
    wait_loaded(qtbot, w)
    w.bridge.set_params(SamplingParams.greedy_params())
    gen = w.panels["generation"]
    gen.set_text("the cat sat on the mat")
    gen.set_max_new_tokens(3)
    gen.ignore_eos = True
    w.docks["lens"].show()
    w.docks["lens"].raise_()
    w.panels["lens"].set_capture(True)
    return w


def tuned(qtbot, w, start, timeout: int = 120_000) -> LensTuned:
    with qtbot.waitSignal(w.bridge.sig_lens_tuned, timeout=timeout) as done:
        start()
    return done.args[0]


def generate(qtbot, w) -> list[LensCaptured]:
    got: list[LensCaptured] = []
    w.bridge.sig_lens.connect(got.append)
    try:
        with qtbot.waitSignal(w.bridge.sig_finished, timeout=60_000):
            assert w.panels["generation"].generate()
        qtbot.waitUntil(lambda: w.panels["generation"].state == "idle", timeout=60_000)
    finally:
        w.bridge.sig_lens.disconnect(got.append)
    return got


def table_tops(panel) -> list[str]:
    return [panel.table.item(r, 3).text() for r in range(panel.table.rowCount())]


def test_fit_switch_and_both_kls(qtbot, lens_window, tmp_path):
    w = lens_window
    panel = w.panels["lens"]
    none = tuned(qtbot, w, lambda: panel.set_kind("tuned"))
    assert "no tuned lens is saved" in none.error and panel.kind == "logit"
    assert panel.kind_buttons["logit"].isChecked() and "no tuned lens" in panel.tune_status.text()

    progress: list[float] = []
    w.bridge.sig_tune_progress.connect(lambda f, _m: progress.append(f))
    fitted = tuned(qtbot, w, lambda: panel.fit(tokens=512, steps=2))
    assert fitted.in_use and progress and max(progress) == pytest.approx(1.0)
    assert panel.kind == "tuned" and panel.kind_buttons["tuned"].isChecked() and panel.fit_button.isEnabled()
    assert "held-out mean KL" in panel.tune_status.text()

    evs = generate(qtbot, w)
    assert evs and all(e.tuned is not None for e in evs)
    last = evs[-1]
    panel.draw()
    n = last.ids.shape[0]
    assert panel.table.rowCount() == n
    want = [f"{p[0]!r} {q:.2f}" for p, q in zip(last.tuned.pieces, last.tuned.probs[:, 0], strict=True)]
    assert table_tops(panel) == want
    assert [panel.table.item(r, 2).text() for r in range(n)] == [f"{v:.2f}" for v in last.tuned.kl_bits]
    for kind, values in (("logit", last.kl_bits), ("tuned", last.tuned.kl_bits)):
        _, y = panel.kl_curves[kind].getData()
        np.testing.assert_allclose(y, values, rtol=1e-6)
    shots = Path(os.environ.get("INFERENCE_LAB_SHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    assert panel.grab().save(str(shots / "lens_tuned_tiny.png"))

    off = tuned(qtbot, w, lambda: panel.set_kind("logit"))
    assert not off.in_use and panel.kind == "logit"
    panel.draw()
    assert table_tops(panel) == [f"{p[0]!r} {q:.2f}" for p, q in zip(last.pieces, last.probs[:, 0], strict=True)]
    _, y = panel.kl_curves["tuned"].getData()  # the step still carries the tuned lens's KL: both are drawn
    np.testing.assert_allclose(y, last.tuned.kl_bits, rtol=1e-6)

    again = tuned(qtbot, w, lambda: panel.set_kind("tuned"))
    assert again.in_use and again.action == "use" and "loaded" in panel.tune_status.text()
    cancelled = tuned(qtbot, w, lambda: (panel.fit(tokens=512, steps=10_000), panel.cancel_button.click()))
    assert cancelled.cancelled and "cancelled" in panel.tune_status.text() and panel.fit_button.isEnabled()


def test_a_damaged_kl_array_is_not_drawn(qtbot, lens_window):
    panel = lens_window.panels["lens"]
    ids = np.zeros((4, 2), np.int64)
    ev = LensCaptured(step=0, position=3, ids=ids, probs=np.full((4, 2), 0.5, np.float32),
                      entropy_bits=np.ones(4, np.float32), pieces=(("a", "b"),) * 4,
                      kl_bits=np.ones(7, np.float32))  # 7 values for 4 rows
    panel._on_lens(ev)
    panel.draw()
    assert panel.table.rowCount() == 4 and panel.table.item(0, 2).text() == ""
    assert len(panel.kl_curves["logit"].getData()[0] or []) == 0
    # a tuned record whose rows do not match the step's is not read: the logit rows are shown
    bad = replace(ev, step=1, ids=np.zeros((3, 2), np.int64), pieces=(("x", "y"),) * 3)
    panel.kind = "tuned"
    panel._on_lens(replace(ev, step=1, tuned=bad))
    panel.draw()
    assert panel.table.rowCount() == 4 and panel.table.item(0, 3).text() == "'a' 0.50"
    assert "captured without a tuned lens" in panel.header.text()
