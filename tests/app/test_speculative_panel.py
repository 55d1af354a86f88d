"""The speculative decoding panel draws what a real run on the tiny model yielded: each pass's guesses kept or
rejected, tokens per pass, acceptance by position, the speedup, and a k sweep; its help prices a verify pass."""

from __future__ import annotations

import html

import numpy as np
import pytest

from app.panels.speculative import SpeculativePanel
from app.theme import BACKGROUND, ERROR_COLOR, OK_COLOR, visible_whitespace
from engine.events import Failed
from engine.labs import speculative as sp
from engine.protocol import Loaded
from engine.run.sampling import SamplingParams
from engine.run.session import Session
from tests.engine.test_speculative import REPEATS

GREEDY = SamplingParams.greedy_params()


def cell(piece: str) -> str:
    return html.escape(visible_whitespace(piece))


@pytest.fixture(scope="module")
def spec_run(tiny_lm):
    # the random model's first layer guesses right now and then: passes with kept and with rejected guesses
    return list(sp.speculate(Session(tiny_lm), REPEATS,
                             sp.SpecConfig(k=4, source="early-exit", exit_layer=1, ignore_eos=True),
                             GREEDY, 40))


@pytest.fixture
def panel(qtbot, bridge, tiny_lm):
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    p = SpeculativePanel(bridge)
    qtbot.addWidget(p)
    p.resize(900, 500)
    p.show()
    return p


def test_a_run_is_drawn_pass_by_pass(panel, spec_run):
    panel.flush()
    assert panel.pass_note.isVisible() and panel.sweep_note.isVisible()
    for ev in spec_run:
        panel.on_spec_event(ev)
    panel.flush()
    steps = [e for e in spec_run if isinstance(e, sp.SpecStep)]
    fin = spec_run[-1]
    x, gained = panel.pass_bars()
    assert x.tolist() == [e.step for e in steps] and gained.tolist() == [e.tokens_gained for e in steps]
    np.testing.assert_array_equal(np.nan_to_num(panel.position_bars.opts["height"]),
                                  np.nan_to_num(fin.acceptance_by_position))
    assert not panel.pass_note.isVisible()
    strip = panel.strip_html()
    kept = next(e for e in reversed(steps) if e.n_accepted)
    rejected = next(e for e in reversed(steps) if e.n_accepted < len(e.drafted))
    assert f"background:{OK_COLOR};color:{BACKGROUND}'>{cell(kept.drafted_pieces[0])}</span>" in strip
    first_wrong = rejected.drafted_pieces[rejected.n_accepted]
    assert f"background:{ERROR_COLOR};color:{BACKGROUND}'><s>{cell(first_wrong)}</s></span>" in strip
    assert f"+{cell(rejected.piece)}</span>" in strip
    text = panel.summary.text()
    assert f"{fin.tokens_per_pass:.2f}</b> tokens per full pass" in text and f"{fin.speedup:.2f}×" in text
    assert "the same tokens as plain greedy decoding" in text


def test_a_new_run_clears_the_last_and_a_failure_is_said(panel, spec_run):
    for ev in spec_run:
        panel.on_spec_event(ev)
    panel.on_spec_event(spec_run[0])  # the next run starts
    panel.flush()
    assert panel.pass_bars()[0].size == 0 and panel.pass_note.isVisible()
    panel.on_spec_event(Failed(message="the prompt is empty: type something first"))
    panel.flush()
    assert "the prompt is empty" in panel.summary.text()


def test_a_sweep_plots_speedup_against_k(panel, tiny_lm):
    for ev in sp.sweep(Session(tiny_lm), REPEATS, sp.SpecConfig(ignore_eos=True), GREEDY, 8, ks=(1, 2, 3)):
        panel.on_spec_event(ev)
        last = ev
    panel.flush()
    xs, ys = panel.sweep_curve.getData()
    assert xs.tolist() == [1, 2, 3] and ys[-1] == pytest.approx(last.speedup)
    assert not panel.sweep_note.isVisible() and "best k =" in panel.summary.text()


def test_help_says_why_verifying_costs_about_one_step(panel):
    assert "memory-bound" in panel.help_text and "k + 1" in panel.help_text
    # the tiny model: a verify pass over 5 positions reads nearly the bytes of one decode step, 5 × the FLOPs
    assert "verify pass over 5 positions" in panel.help_text and "(5.0×)" in panel.help_text


def test_run_goes_through_the_engine_process(qtbot, window):
    """Run in the panel: the engine process speculates on the loaded model and the panel shows the passes and the
    comparison with plain greedy decoding of the same prompt."""
    panel = window.panels["speculative"]
    panel.tokens_spin.setValue(12)
    panel.source_combo.setCurrentIndex(panel.source_combo.findData("early-exit"))
    with qtbot.waitSignal(window.bridge.sig_spec_done, timeout=120_000) as done:
        assert panel.run()
    assert done.args[0].outcome == "done" and panel.outcome == "done"
    panel.flush()
    assert panel._finished is not None and panel._steps
    assert panel._finished.matches_baseline  # greedy speculation gives plain greedy decoding's tokens (float32)
    assert "tokens per full pass" in panel.summary.text() and panel.run_button.isEnabled()


def test_a_run_that_differs_says_where_and_why_in_one_sentence(panel, tiny_lm, monkeypatch):
    from tests.engine.test_spec_divergence import flip_one_pass

    flip_one_pass(monkeypatch)
    run = list(sp.speculate(Session(tiny_lm), REPEATS, sp.SpecConfig(k=3, ignore_eos=True), GREEDY, 12))
    for ev in run:
        panel.on_spec_event(ev)
    panel.flush()
    d = run[-1].differs
    text = panel.summary.text()
    assert html.escape("Plain greedy decoding " + d.sentence()) in text and f"color:{ERROR_COLOR}" in text
    assert "the same tokens" not in text


def _source_item(panel: SpeculativePanel, key: str):
    return panel.source_combo.model().item(panel.source_combo.findData(key))


def test_early_exit_is_offered_only_where_the_runtime_runs_it(qtbot, bridge, tiny_lm):
    """On the llama.cpp runtime early-exit drafting cannot run (one graph, no first-J-layer logits): the choice is
    disabled before Run, with one sentence saying why, and a panel left on it moves to prompt lookup; loading a
    model on the torch runtime offers it again."""
    p = SpeculativePanel(bridge)
    qtbot.addWidget(p)
    p.source_combo.setCurrentIndex(p.source_combo.findData("early-exit"))
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg, runtime="llama.cpp"))
    item = _source_item(p, "early-exit")
    assert not item.isEnabled() and _source_item(p, "lookup").isEnabled()
    assert p.source_combo.currentData() == "lookup"
    tip = item.toolTip()
    assert "llama.cpp runtime" in tip and "own first layers" in tip and tip.endswith(".") and ". " not in tip
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg, runtime="torch"))
    assert item.isEnabled() and item.toolTip() == ""
    # a panel opened after the model loaded (a dock shown later) knows too
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg, runtime="llama.cpp"))
    later = SpeculativePanel(bridge)
    qtbot.addWidget(later)
    assert not _source_item(later, "early-exit").isEnabled()


def test_early_exit_is_offered_on_the_torch_runtime(panel):
    assert panel.bridge.runtime == "torch" and _source_item(panel, "early-exit").isEnabled()
    panel.source_combo.setCurrentIndex(panel.source_combo.findData("early-exit"))
    assert panel.source_combo.currentData() == "early-exit"
