"""A Python exception in a Qt callback never kills the app: it is logged, shown, and the app goes on."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap

from PySide6 import QtCore

from app.guard import guarded

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_guarded_returns_the_default_and_reports(callback_errors) -> None:
    @guarded(default=False)
    def filter_(x):
        return [][x]

    assert filter_(1) is False
    assert callback_errors.count == 1 and "IndexError" in callback_errors.reporter.last
    callback_errors.accept()


def _qt_overrides() -> list[tuple[str, str]]:
    """(class, method) of every method an app class defines that overrides a method of a Qt (PySide6) base."""
    from app.panels import PANEL_MODULES

    modules = ["app.main_window", "app.bridge", "app.token_view", "app.panels.base",
               *(f"app.panels.{m}" for m in PANEL_MODULES)]
    found = []
    for name in modules:
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and issubclass(cls, QtCore.QObject) and cls.__module__ == name):
                continue
            qt_bases = [b for b in cls.__mro__ if b.__module__.startswith("PySide6")]
            for attr, value in vars(cls).items():
                if callable(value) and not attr.startswith("__") and any(attr in vars(b) for b in qt_bases):
                    found.append((f"{name}.{cls.__name__}", attr, value))
    return found


def test_every_qt_override_in_the_app_is_guarded() -> None:
    """PySide6 aborts the process when an exception escapes a virtual override (eventFilter, showEvent, …)."""
    overrides = _qt_overrides()
    assert {"eventFilter", "highlightBlock", "showEvent", "closeEvent"} <= {a for _, a, _ in overrides}
    unguarded = [f"{c}.{a}" for c, a, f in overrides if not hasattr(f, "__wrapped__")]
    assert unguarded == []


def test_an_exception_in_a_tooltip_event_filter_does_not_kill_the_process() -> None:
    """In a fresh process (an unguarded filter would take pytest down with it): rc 0 and the error reported."""
    script = textwrap.dedent("""
        import os
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        from PySide6 import QtCore, QtGui, QtWidgets
        app = QtWidgets.QApplication([])
        from app.guard import reporter
        from app.token_view import TokenTextEdit, segments
        view = TokenTextEdit()
        view.setPlainText("abc")
        view.highlighter.formats = [QtGui.QTextCharFormat()]
        view.highlighter.set_segments(segments("abc", [(0, 3)]), [0])
        view.tooltip_for = lambda tokens, lost: ["only one"][tokens[0] + 1]   # IndexError, as the old bug
        view.resize(300, 100)
        view.show()
        app.processEvents()
        for _ in range(3):
            p = QtCore.QPoint(6, view.cursorRect().center().y())
            ev = QtGui.QHelpEvent(QtCore.QEvent.Type.ToolTip, p, view.viewport().mapToGlobal(p))
            QtWidgets.QApplication.sendEvent(view.viewport(), ev)
        print("caught", reporter().count)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split("caught")[1]) >= 3  # every hover reported (Qt may add a tooltip event of its own)
    assert "IndexError" in r.stderr  # logged once, with its traceback
    assert r.stderr.count("Traceback") == 1


def test_a_panel_whose_draw_raises_does_not_stop_the_others(qtbot, window, monkeypatch, callback_errors) -> None:
    from tests.app.test_prompt_generation import finish_generation, setup_generation

    broken = window.panels["kv_cache"]

    def draw():
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(broken, "draw", draw)
    others = {n: p.draw_count for n, p in window.panels.items() if n != "kv_cache"}
    gen = setup_generation(window, max_new=4)
    finish_generation(qtbot, window, gen.generate)
    assert window.draw_errors["kv_cache"] == "RuntimeError: broken on purpose"
    assert "broken on purpose" in window.message.text() and "KV cache" in window.message.text()
    assert callback_errors.count >= 1
    for name in ("generation", "sampling", "timeline"):
        assert window.panels[name].draw_count > others[name], name
    # The app goes on: another generation runs to its end, and the shared draw timer still runs.
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=5_000)
    fin = finish_generation(qtbot, window, gen.generate)
    assert len(fin.ids) == 4 and window.draw_timer.isActive()
    callback_errors.accept()


def test_status_bar_error_clears_on_the_next_successful_generation(qtbot, window) -> None:
    from tests.app.test_prompt_generation import finish_generation, setup_generation

    n_ctx = window.bridge.info.context_length
    gen = setup_generation(window, text="the " * (n_ctx + 10), max_new=2)
    with qtbot.waitSignal(window.bridge.sig_failed, timeout=20_000):
        gen.generate()
    assert "context holds" in window.message.text()
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=5_000)
    assert "context holds" in window.message.text()  # idle again, the error stays until something else happens
    gen = setup_generation(window, max_new=2)
    finish_generation(qtbot, window, gen.generate)
    qtbot.waitUntil(lambda: window.message.text() == "Ready.", timeout=5_000)
    assert window.last_error == ""


def test_panels_subscribe_through_their_table() -> None:
    """Each panel names its bridge signals in `subscriptions` (connected by Panel); no file repeats connect blocks."""
    from pathlib import Path

    from app.bridge import Bridge
    from app.main_window import discover_panels

    for name, cls in discover_panels():
        for signal, slot in cls.subscriptions.items():
            assert isinstance(getattr(Bridge, signal), QtCore.Signal), (name, signal)
            assert callable(getattr(cls, slot)), (name, slot)
        source = (Path(ROOT) / "app" / "panels" / f"{name}.py").read_text(encoding="utf-8")
        assert "bridge.sig_" not in source, name


def test_excepthook_reports_an_unguarded_slot(qtbot, monkeypatch, callback_errors) -> None:
    """python -m app installs it: an exception in a slot nobody guarded is logged and shown, and the app goes on."""
    import sys

    from app.guard import install_excepthook

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # pytest-qt's own hook comes back after the test
    install_excepthook()

    class Emitter(QtCore.QObject):
        sig = QtCore.Signal()

    e = Emitter()
    e.sig.connect(lambda: [][1])
    e.sig.emit()
    assert callback_errors.count == 1 and "IndexError" in callback_errors.reporter.last
    callback_errors.accept()
