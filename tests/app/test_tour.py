"""The guided tour (app/tour.py, resources/tour.json): its step file names only what exists; it runs start to finish
on a real model pressing Next, every step's measured figure present and finite; leaving at any step gives back the
layout (saveState bytes), the prompt and the settings exactly; Esc leaves; it is offered once on a first start.

Every wait is on an event (the tour's sig_step_ready / sig_left), never a fixed sleep; no figure is checked against a
clock, only for being measured and finite.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6 import QtCore, QtWidgets

from app.tour import ACTIONS, FIGURES, OFFERED, TourController, load_steps
from tests.app.conftest import wait_loaded

STEP_TIMEOUT_MS = 240_000  # one step's actions on a busy 2-core machine (the labs run with their smallest settings)


def drive(qtbot, w, shots: Path | None = None, unsupported_ok: bool = False) -> dict[int, float]:
    """Press Next through the whole tour; each step's figure must be measured and finite (or, with
    `unsupported_ok`, the runtime said it cannot run that step's lab at all). Returns step → figure value."""
    tour: TourController = w.tour
    values: dict[int, float] = {}
    with qtbot.waitSignal(tour.sig_step_ready, timeout=STEP_TIMEOUT_MS):
        tour.start(0)
    for i in range(len(tour.steps)):
        assert tour.index == i and not tour.busy
        if shots is not None:
            w.tick_panels(flush=True)
            w.grab().save(str(shots / f"step{i + 1:02d}.png"))
        if unsupported_ok and i in tour.unsupported:
            assert tour.unsupported[i], "an unsupported lab must say why"
        else:
            assert i in tour.figures, f"step {i + 1} ({tour.steps[i].id}): {tour.failures.get(i)}"
            value = tour.figures[i].value
            assert math.isfinite(value), f"step {i + 1} ({tour.steps[i].id}) measured {value}"
            values[i] = value
        if i == len(tour.steps) - 1:
            with qtbot.waitSignal(tour.sig_left, timeout=10_000):
                qtbot.mouseClick(tour.card.next_button, QtCore.Qt.MouseButton.LeftButton)  # Finish
        else:
            with qtbot.waitSignal(tour.sig_step_ready, timeout=STEP_TIMEOUT_MS):
                qtbot.mouseClick(tour.card.next_button, QtCore.Qt.MouseButton.LeftButton)
    assert not tour.active
    return values


def test_the_step_file_names_panels_actions_and_figures_that_exist(make_window):
    w = make_window(load=False)
    intro, steps = load_steps()
    assert intro and len(steps) >= 12
    ids = [s.id for s in steps]
    assert len(set(ids)) == len(ids)
    for s in steps:
        assert set(s.panels) <= set(w.panels), f"{s.id}: unknown panels {set(s.panels) - set(w.panels)}"
        assert s.figure in FIGURES, f"{s.id}: unknown figure {s.figure}"
        for a in s.actions:
            assert a["do"] in ACTIONS and hasattr(TourController, f"_do_{a['do']}"), f"{s.id}: unknown action {a}"
        assert s.claim and s.text_says and s.agrees and s.disagrees
    # the claims of the text, in its order, each with a step; then the chapters it continues into, and Why
    assert ids == ["tokens", "kv_cache", "prefill_decode", "tpot_floor", "batching", "per_stream", "latency",
                   "sampling", "continuous", "paged", "speculative", "why"]


def test_a_bad_step_file_says_which_step(make_window):
    with pytest.raises(ValueError, match="step 1 has no 'figure'"):
        load_steps('{"steps": [{"id": "x", "title": "t", "claim": "c", "text_says": "s", "panels": ["prompt"], '
                   '"agrees": "a", "disagrees": "d"}]}')


def _user_settings(w) -> None:
    """Settings a user might have: none of them the tour's own."""
    w.panels["prompt"].set_text("My own prompt, kept through the tour.")
    w.panels["prompt"].set_chat(True)
    w.panels["generation"].set_chat(True)
    w.panels["generation"].set_max_new_tokens(37)
    w.bridge.set_params(replace(w.bridge.params, temperature=0.65, top_k=17, top_p=0.83, min_p=0.02, seed=1234))
    w.panels["scheduling"].requests_spin.setValue(11)
    w.panels["batching"].new_spin.setValue(9)
    w.docks["attention"].hide()  # a layout of the user's own
    w.docks["kv_cache"].setFloating(True)


def _settled(qtbot, w) -> None:
    """Let the window lay out the user's changes (Qt applies a dock's move on a later layout pass)."""
    seen: list[bytes] = []

    def same_twice() -> bool:
        QtWidgets.QApplication.processEvents()
        seen.append(bytes(w.saveState()))
        return len(seen) > 2 and seen[-1] == seen[-2] == seen[-3]

    qtbot.waitUntil(same_twice, timeout=10_000)


def _what_comes_back(w) -> tuple:
    p = w.panels
    return (bytes(w.saveState()), p["prompt"].text(), p["prompt"].chat(), p["generation"].chat(),
            p["generation"].max_tokens.value(), p["generation"].ignore_eos, w.bridge.params,
            p["scheduling"].config(), p["batching"].new_spin.value(), p["batching"].selected_batches())


@pytest.mark.qt_log_ignore("This plugin does not support raise")  # a floating dock, offscreen
def test_esc_at_a_middle_step_gives_back_layout_prompt_and_settings(qtbot, window):
    w = window
    _user_settings(w)
    _settled(qtbot, w)
    before = _what_comes_back(w)
    tour = w.tour
    sampling = [s.id for s in tour.steps].index("sampling")  # the step that changes the sampling knobs
    with qtbot.waitSignal(tour.sig_step_ready, timeout=STEP_TIMEOUT_MS):
        tour.start(sampling)
    assert tour.figures[sampling].value >= 0
    assert w.bridge.params != before[6] and w.panels["prompt"].text() != before[1]
    assert {n for n, d in w.docks.items() if d.isVisible()} == set(tour.steps[sampling].panels)
    with qtbot.waitSignal(tour.sig_left, timeout=10_000):
        qtbot.keyClick(w.panels["sampling"], QtCore.Qt.Key.Key_Escape)
    assert not tour.active
    _settled(qtbot, w)
    assert _what_comes_back(w) == before
    assert not w.docks["attention"].isVisible() and w.docks["kv_cache"].isFloating()


@pytest.mark.qt_log_ignore("This plugin does not support raise")  # a floating dock, offscreen
def test_leave_while_a_step_runs_stops_it_and_gives_everything_back(qtbot, window):
    w = window
    _user_settings(w)
    _settled(qtbot, w)
    before = _what_comes_back(w)
    tour = w.tour
    latency = [s.id for s in tour.steps].index("latency")
    with qtbot.waitSignal(w.bridge.sig_state, timeout=STEP_TIMEOUT_MS, check_params_cb=lambda s: s == "generating"):
        tour.start(latency)
    assert tour.busy
    with qtbot.waitSignal(tour.sig_left, timeout=10_000):
        qtbot.mouseClick(tour.card.leave_button, QtCore.Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: w.panels["generation"].state == "idle", timeout=60_000)
    _settled(qtbot, w)
    assert _what_comes_back(w) == before


def test_closing_the_window_on_tour_saves_the_users_layout(qtbot, make_window, settings_file):
    w = make_window()
    wait_loaded(qtbot, w)
    w.docks["attention"].hide()
    before = bytes(w.saveState())
    with qtbot.waitSignal(w.tour.sig_step_ready, timeout=STEP_TIMEOUT_MS):
        w.tour.start(0)
    w.close()
    from app.settings import Settings

    assert bytes(Settings().window_state(w._layout_version)) == before


def test_offered_once_on_a_first_start(qtbot, make_window):
    first = make_window(interactive=True)
    wait_loaded(qtbot, first)
    qtbot.waitUntil(lambda: getattr(first, "tour_offer", None) is not None)
    assert first.settings.store.value(OFFERED) in (True, "true")
    first.tour_offer.close()
    assert first.tour_action.text().startswith("&Tour")
    second = make_window(interactive=True)
    wait_loaded(qtbot, second)
    assert getattr(second, "tour_offer", None) is None


@pytest.mark.slow
def test_the_tour_on_the_default_model(qtbot, make_window):
    from tests.requires import default_model

    w = make_window(default_model())
    w.resize(1366, 768)
    wait_loaded(qtbot, w, timeout=120_000)
    drive(qtbot, w)


@pytest.mark.slow
def test_the_tour_on_gemma3(qtbot, make_window):
    from tests.requires import gemma3

    w = make_window(gemma3())
    w.resize(1366, 768)
    wait_loaded(qtbot, w, timeout=180_000)
    drive(qtbot, w)


@pytest.mark.slow
def test_the_tour_on_the_1b_file_on_llamacpp(qtbot, make_window):
    """The 1B-scale Llama-shaped Q4_0 file of random weights (benchmarks.llamacpp), which the app runs on llama.cpp.
    A lab that runtime cannot run at all must say so in its own sentence; every other step measures."""
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from benchmarks.llamacpp import big_path, build_big

    path = big_path("Q4_0")
    if not path.exists():
        build_big(path, "Q4_0")
    w = make_window(path)
    wait_loaded(qtbot, w, timeout=300_000)
    assert w.bridge.runtime == "llama.cpp"
    drive(qtbot, w, unsupported_ok=True)
