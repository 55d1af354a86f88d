"""The window keeps its layout through a run: no dock's minimum size changes when the first token, the first
preview or the end of a run arrives. A dock that grows lays the whole window out again and every plot repaints in
full at once (the longest stall at a run's start)."""

from __future__ import annotations

import pytest

from benchmarks.gui import show_every_panel

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


def min_sizes(w) -> dict[str, tuple[int, int]]:
    w.tick_panels(flush=True)
    return {name: (d.minimumSizeHint().width(), d.minimumSizeHint().height()) for name, d in w.docks.items()}


def test_no_dock_grows_during_a_run(qtbot, window):
    w = window
    show_every_panel(w)
    qtbot.wait(100)
    before = min_sizes(w)
    text = "The cat sat on the mat and looked at the door for a while"
    w.panels["prompt"].set_text(text)
    gen = w.panels["generation"]
    gen.set_max_new_tokens(6)
    with qtbot.waitSignal(w.bridge.sig_finished, timeout=30_000):
        assert gen.generate()
    preview = w.panels["preview"]
    # the preview of the prompt, asked for while the run went, arrives once the engine is idle
    qtbot.waitUntil(lambda: preview.result is not None and preview.result.text == text, timeout=30_000)
    after = min_sizes(w)
    assert w.panels["sampling"].shown_step() is not None
    grown = {n: (before[n], after[n]) for n in before if after[n][1] > before[n][1] or after[n][0] > before[n][0]}
    assert not grown, grown
