"""Hostile prompts in the running app: every text view hovered all over, generations run and stopped at random.

The app must neither crash nor raise in a Qt callback (the autouse `callback_errors` fixture fails the test on any
exception the guard caught; pytest-qt fails it on any other), and every prompt must still generate or be refused
with one clear message.
"""

from __future__ import annotations

import random

import pytest
from PySide6 import QtCore, QtGui, QtWidgets

from tests.app.conftest import wait_loaded
from tests.app.test_prompt_generation import finish_generation
from tests.app.test_token_hover import HOSTILE

PROMPTS = [
    *HOSTILE,
    "\u202eevil RTL override\u202c and \u200b zero width \ufeff BOM",
    "🏳️‍🌈🧑🏽‍💻👩‍❤️‍💋‍👨 flags and skin tones",
    "a" + "\u0300" * 50,
    "\x00\x01\x02\x7f",
    "ok " * 2_000,  # longer than the tiny model's context: refused with a message
    "\n\n\n",
]


class Hover:
    """Sends Qt's tooltip events over a grid of points of a view; counts the tooltips shown."""

    def __init__(self, monkeypatch) -> None:
        self.shown = 0
        self.events = 0
        monkeypatch.setattr(QtWidgets.QToolTip, "showText", lambda *a: setattr(self, "shown", self.shown + 1))
        monkeypatch.setattr(QtWidgets.QToolTip, "hideText", lambda: None)

    def sweep(self, view: QtWidgets.QPlainTextEdit, step_x: int = 4, step_y: int = 6) -> None:
        vp = view.viewport()
        for y in range(0, vp.height(), step_y):
            for x in range(0, vp.width(), step_x):
                p = QtCore.QPoint(x, y)
                QtWidgets.QApplication.sendEvent(vp, QtGui.QHelpEvent(QtCore.QEvent.Type.ToolTip, p, vp.mapToGlobal(p)))
                self.events += 1


def run_hostile(qtbot, window, monkeypatch, prompts: list[str], max_new: int, cycles: int) -> Hover:
    prompt, gen = window.panels["prompt"], window.panels["generation"]
    hover = Hover(monkeypatch)
    prompt.set_chat(True)
    gen.set_max_new_tokens(max_new)
    gen.ignore_eos = True
    n_ctx = window.bridge.info.context_length
    for text in prompts:
        prompt.set_text(text)
        hover.sweep(prompt.editor)
        hover.sweep(prompt.chat_view)
        qtbot.waitUntil(lambda: gen.state == "idle", timeout=10_000)
        if not text.strip():
            assert gen.generate() is False and "prompt" in gen.status.text().lower()
            continue
        n_tokens = len(prompt.chat_tok.ids)
        if n_tokens + 1 >= n_ctx:
            with qtbot.waitSignal(window.bridge.sig_failed, timeout=20_000):
                assert gen.generate()
            assert "context holds" in window.message.text()
            continue
        finish_generation(qtbot, window, gen.generate, timeout=60_000)
        window.tick_panels(flush=True)
        hover.sweep(gen.output)
    # Rapid Generate/Stop: the buttons as fast as a user can press them, then one generation that must finish.
    rng = random.Random(0)
    prompt.set_text(prompts[0])
    for _ in range(cycles):
        gen.generate()
        qtbot.wait(rng.choice([0, 1, 5, 20]))
        gen.stop()
        if rng.random() < 0.3:
            gen.step()
        QtWidgets.QApplication.processEvents()
    qtbot.waitUntil(lambda: gen.state in ("idle", "paused"), timeout=20_000)
    if gen.state == "paused":
        gen.stop()
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=20_000)
    fin = finish_generation(qtbot, window, gen.generate, timeout=60_000)
    assert len(fin.ids) == max_new
    hover.sweep(gen.output)
    return hover


def test_hostile_prompts_in_the_running_app(qtbot, window, monkeypatch) -> None:
    hover = run_hostile(qtbot, window, monkeypatch, PROMPTS, max_new=3, cycles=30)  # every wait has its timeout
    assert hover.events > 20_000 and hover.shown > 1_000
    assert window.bridge.process.is_alive()


@pytest.mark.slow
def test_hostile_prompts_on_the_real_model(qtbot, make_window, monkeypatch) -> None:
    from engine.loaders import default_model_path

    window = make_window(default_model_path())
    wait_loaded(qtbot, window, timeout=120_000)
    hover = run_hostile(qtbot, window, monkeypatch, ["a\x04b", "x\U00040000y \x06\x13\x14", HOSTILE[3]],
                        max_new=2, cycles=8)
    assert hover.shown > 100
