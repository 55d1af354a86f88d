"""Branches: a finished run's one-line summary is computed once, not again for every branch each time any run is
recorded (with long runs that walk held the GUI thread at every run's end)."""

from __future__ import annotations

import pytest

from app.panels import branches as branches_module
from tests.app.test_sessions import generate

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


def test_a_finished_runs_summary_is_not_computed_again(qtbot, window, monkeypatch):
    panel = window.panels["branches"]
    calls: list[int] = []
    real = branches_module.run_summary

    def counted(run):
        calls.append(run.id)
        return real(run)

    monkeypatch.setattr(branches_module, "run_summary", counted)
    generate(qtbot, window, n=4)
    qtbot.waitUntil(lambda: window.bridge.state == "idle", timeout=10_000)
    first = panel.branches[0]
    done = calls.count(first.id)
    for _ in range(3):
        generate(qtbot, window, n=4)
        qtbot.waitUntil(lambda: window.bridge.state == "idle", timeout=10_000)
    assert len(panel.branches) == 4
    assert calls.count(first.id) == done  # rebuilt three times over, never summed again
    for i, run in enumerate(panel.branches):  # and what the tree says is each run's own summary
        assert panel.tree.topLevelItem(i).text(1) == real(run)
