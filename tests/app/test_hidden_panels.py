"""A panel that is not on screen does no work: a dock tabbed behind another keeps its new data undrawn until it is
shown, then draws it once (issue 50). Counted, not timed: every tick is let past the rate limit (draw_soon)."""

from __future__ import annotations

import pytest
from PySide6 import QtWidgets

from engine.events import LensCaptured
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


def tick_all(w) -> None:
    """As many timer ticks as there are panels (each draws one panel), none held back by a panel's rate limit."""
    for _ in range(len(w.panels) + 1):
        for p in w.panels.values():
            p.draw_soon()
        w.tick_panels()


def test_a_tabbed_away_panel_draws_nothing_until_its_tab_is_chosen(qtbot, window, tiny_lm):
    w = window
    lens, attention = w.panels["lens"], w.panels["attention"]
    qtbot.waitExposed(w)
    assert w.docks["lens"] in w.tabifiedDockWidgets(w.docks["attention"])  # the default layout: behind Attention
    assert attention.on_screen() and not lens.on_screen()
    QtWidgets.QApplication.processEvents()
    tick_all(w)
    events = list(Session(tiny_lm).generate("the cat sat on the mat", SamplingParams(temperature=0.0),
                                            max_new_tokens=6, capture=Capture(lens_top=5), ignore_eos=True))
    last_lens = [e for e in events if isinstance(e, LensCaptured)][-1]
    lens_before, attention_before = lens.draw_count, attention.draw_count
    for ev in events:
        w.bridge.replay(ev)
        tick_all(w)
    assert attention.draw_count > attention_before  # the ticks did draw the panels on screen
    assert lens.draw_count == lens_before and lens.dirty  # …and not the one behind its tab

    w.docks["lens"].raise_()
    qtbot.waitUntil(lambda: lens.draw_count == lens_before + 1, timeout=5_000)
    assert not lens.dirty
    assert len(lens.h_curve.getData()[0]) == last_lens.ids.shape[0]  # the run's last step, drawn
    tick_all(w)
    assert lens.draw_count == lens_before + 1  # nothing new: no second draw


def test_flush_draws_a_hidden_panel(qtbot, window):
    """Screenshots, exports and tests draw every panel, on screen or not."""
    lens = window.panels["lens"]
    assert not lens.on_screen()
    lens.mark_dirty()
    before = lens.draw_count
    window.tick_panels()
    assert lens.draw_count == before
    window.tick_panels(flush=True)
    assert lens.draw_count == before + 1
