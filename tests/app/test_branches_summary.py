"""Branches: a run's one-line summary in the tree reads each token's probability once, as the token arrives, not the
whole run again at its end or for every branch each time any run is recorded (with long runs that walk held the GUI
thread at every run's end)."""

from __future__ import annotations

import pytest

from app.panels import branches as branches_module
from app.run_store import RunStore
from engine.events import Finished
from engine.protocol import Loaded
from tests.app.test_run_store import synthetic_run
from tests.app.test_sessions import generate

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


def counting(monkeypatch) -> list[int]:
    """The steps whose chosen-token probability the tree's summaries read (branches.Confidence.add), in order."""
    calls: list[int] = []
    real = branches_module.Confidence.add

    def counted(self, tokens):
        calls.extend(t.step for t in tokens)
        return real(self, tokens)

    monkeypatch.setattr(branches_module.Confidence, "add", counted)
    return calls


def test_a_long_runs_end_reads_no_token_again(qtbot, bridge, tiny_lm, monkeypatch):
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    store = RunStore(bridge)
    panel = branches_module.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.attach_store(store)
    n = 600
    events = list(synthetic_run(n))
    real_summary = branches_module.run_summary(_run_of(events))
    calls: list[int] = []  # the steps whose chosen-token probability is read (the panel is never drawn here)
    real = branches_module.token_prob
    monkeypatch.setattr(branches_module, "token_prob", lambda ev: (calls.append(ev.step), real(ev))[1])
    for ev in events:
        if isinstance(ev, Finished):
            before = len(calls)
            bridge.replay(ev)
            assert len(calls) == before  # the tree's summary at the end reads no token: each was read as it came
        else:
            bridge.replay(ev)
    assert sorted(calls) == list(range(n))  # every token once
    assert panel.tree.topLevelItem(0).text(1) == real_summary  # the same line as summing the run whole


def _run_of(events):
    store = RunStore()
    for ev in events:
        store.record(ev)
    return store.runs[0]


def test_finished_runs_are_not_read_again_when_others_are_recorded(qtbot, window, monkeypatch):
    panel = window.panels["branches"]
    calls = counting(monkeypatch)
    generate(qtbot, window, n=4)
    qtbot.waitUntil(lambda: window.bridge.state == "idle", timeout=10_000)
    done = len(calls)
    assert done == panel.branches[0].n_tokens
    for _ in range(3):
        generate(qtbot, window, n=4)
        qtbot.waitUntil(lambda: window.bridge.state == "idle", timeout=10_000)
    assert len(panel.branches) == 4
    assert len(calls) == sum(r.n_tokens for r in panel.branches)  # rebuilt three times over, each token read once
    for i, run in enumerate(panel.branches):  # and what the tree says is each run's own summary
        assert panel.tree.topLevelItem(i).text(1) == branches_module.run_summary(run)
