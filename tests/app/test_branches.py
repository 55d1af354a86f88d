"""Branches panel: confidence colours, alternatives, forking from an alternative, switching and comparing."""

from __future__ import annotations

import numpy as np
import pytest

from app import session_io
from app.panels.branches import alternatives_text, branch_html, confidence_color, token_entropy_bits, token_prob
from engine.events import PrefillDone, TokenSampled
from tests.app.test_sessions import generate

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")


def test_confidence_colours_go_from_red_to_green():
    hues = [confidence_color(x).hueF() for x in (0.0, 0.5, 1.0)]
    assert hues[0] < hues[1] < hues[2] and hues[0] == pytest.approx(0.0, abs=0.01)


def fork_and_wait(qtbot, w, panel, step, token):
    with qtbot.waitSignal(w.bridge.sig_finished, timeout=30_000):
        assert panel.fork(step, token)
    qtbot.waitUntil(lambda: w.bridge.state == "idle", timeout=10_000)
    w.tick_panels(flush=True)


def test_fork_from_an_alternative_then_switch_and_compare(qtbot, window, tmp_path):
    panel = window.panels["branches"]
    generate(qtbot, window, n=6)
    qtbot.waitUntil(lambda: window.bridge.state == "idle", timeout=10_000)
    assert len(panel.branches) == 1 and panel.shown == 0
    main = panel.branches[0]
    toks = main.tokens
    # colours and hover text come from the step's own funnel
    k = next(i for i, t in enumerate(toks) if i >= 1 and t.text)  # a step whose token shows some text
    t2 = toks[k]
    raw, final = token_prob(t2)
    i = int(np.flatnonzero(t2.funnel.ids == t2.token_id)[0])
    assert raw == pytest.approx(float(t2.funnel.p_raw[i])) and final == pytest.approx(float(t2.funnel.p_final[i]))
    h = token_entropy_bits(t2)
    p = np.exp(t2.logits - t2.logits.max())
    p /= p.sum()
    assert h == pytest.approx(float(-(p[p > 0] * np.log2(p[p > 0])).sum()), rel=1e-6)
    text = alternatives_text(t2)
    assert text.count("raw") == 5 and "final" in text
    page = branch_html(main, "prob")
    assert page.count("href='step:") == sum(1 for t in toks if t.text) and confidence_color(raw).name() in page
    menu = panel.alternatives_menu(t2)
    actions = [a for a in menu.actions() if not a.isSeparator()]
    assert len(actions) == 5 and sum(not a.isEnabled() for a in actions) <= 1  # the chosen one is disabled

    alt = next(int(t) for t in t2.funnel.ids[np.argsort(-t2.funnel.p_raw)] if int(t) != t2.token_id)
    fork_and_wait(qtbot, window, panel, k, alt)
    assert len(panel.branches) == 2 and panel.shown == 1
    fork = panel.branches[1]
    assert (fork.parent, fork.step, fork.token) == (0, k, alt)
    prefix = main.prompt.ids.tolist() + [t.token_id for t in toks[:k]]
    assert fork.prompt.ids.tolist() == prefix
    assert fork.tokens[0].token_id == alt and fork.tokens[0].forced
    pre = next(e for e in fork.events if isinstance(e, PrefillDone))
    # The KV cache of the shared prefix was reused (all of it unless a typing preview ran in between and kept only
    # the prompt's part; the engine test holds the exact count).
    assert pre.n_reused >= len(main.prompt.ids) - 1 and pre.n_reused + pre.n_tokens == len(prefix)
    gen = window.panels["generation"]
    assert [t.token_id for t in gen.tokens] == [t.token_id for t in fork.tokens]

    panel.show_branch(0)  # every panel shows the first run again (replayed in slices: done at once here)
    session_io.finish_replay(window)
    assert [t.token_id for t in gen.tokens] == [t.token_id for t in toks]
    assert len(panel.branches) == 2 and panel.shown == 0

    dialog = panel.compare(0, 1)
    views = dialog.findChildren(type(panel.view))
    assert len(views) == 2 and f"fork @ {k}" in dialog.windowTitle()
    dialog.close()

    # branches travel in the session file
    path = tmp_path / "b.ilab"
    assert session_io.save_session_to(window, path)
    from engine.session_file import load_session

    saved = load_session(path, with_tokenizer=False)
    assert [b["name"] for b in saved.branches] == [b.name for b in panel.branches]
    assert sum(isinstance(e, TokenSampled) for e in saved.branches[1]["events"]) == len(fork.tokens)


def test_score_the_prompt_colours_each_prompt_token(qtbot, window):
    panel = window.panels["branches"]
    panel.score_box.setChecked(True)
    assert window.bridge.options.score_prompt
    generate(qtbot, window, text="the cat sat on the mat", n=2)
    b = panel.branches[-1]
    sc = b.scores
    pre = next(e for e in b.events if isinstance(e, PrefillDone))
    # scoring runs the whole prompt even when a typing preview left part of it in the KV cache
    assert sc is not None and sc.first == 1 and pre.n_reused == 0 and len(sc.probs) == len(b.prompt.ids) - 1
    assert np.all((sc.probs > 0) & (sc.probs <= 1)) and np.allclose(sc.surprise_bits, -np.log2(sc.probs), atol=1e-4)
    page = branch_html(b, "prob")
    assert page.count("href='prompt:") >= 1
    tip = panel._prompt_tip(f"prompt:{sc.first}")
    assert "surprise" in tip and f"{sc.probs[0]:.4f}" in tip


def test_the_lens_is_captured_only_when_asked(qtbot, window):
    from engine.events import LensCaptured

    lens = window.panels["lens"]
    assert window.bridge.options.lens_top == 0 and not lens.capture_box.isChecked()
    generate(qtbot, window, n=2)
    assert not any(isinstance(e, LensCaptured) for e in window.run_store.events()) and not lens.lens
    window.docks["lens"].raise_()  # the lens computes only while its panel is on screen (issue 50)
    qtbot.waitUntil(lens.on_screen)
    lens.set_capture(True)
    assert window.bridge.options.lens_top > 0 and lens.capture_box.isChecked()
    generate(qtbot, window, n=2)
    assert sorted(lens.lens) == [0, 1]


def test_the_lens_is_computed_only_while_its_panel_is_on_screen(qtbot, window):
    """Issue 50: ticked but tabbed away behind the Attention panel, the lens costs the engine nothing; brought to the
    front it is computed again from the next generation (or the next token of a running one)."""
    from engine.events import LensCaptured

    lens = window.panels["lens"]
    window.docks["lens"].raise_()
    qtbot.waitUntil(lens.on_screen)
    lens.set_capture(True)
    assert window.bridge.options.lens_top > 0
    window.docks["attention"].raise_()  # the lens's tab goes behind
    qtbot.waitUntil(lambda: window.bridge.options.lens_top == 0)
    assert lens.capture_box.isChecked()  # still ticked: the user's choice stands
    generate(qtbot, window, n=2)
    assert not any(isinstance(e, LensCaptured) for e in window.run_store.events())
    window.docks["lens"].raise_()
    qtbot.waitUntil(lambda: window.bridge.options.lens_top > 0)
    generate(qtbot, window, n=2)
    assert sum(isinstance(e, LensCaptured) for e in window.run_store.events()) == 2
