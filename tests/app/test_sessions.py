"""Sessions in the app: save → open shows the same panels without the model; bad places keep the session;
autosave survives a crash; the headless --save-session / --open-session commands."""

from __future__ import annotations

import dataclasses

import pytest
from PySide6 import QtGui

from app import session_io
from engine.events import LensCaptured, TokenSampled
from engine.session_file import load_session, save_session
from tests.app.conftest import wait_loaded
from tests.app.test_main_window import _check_png, error_lines, run_cli
from tests.app.test_prompt_generation import finish_generation

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")  # floating docks, offscreen
SAME_PANELS = ("generation", "sampling", "attention", "kv_cache", "timeline", "lens")


def generate(qtbot, w, text="the cat sat on the mat", n=6):
    w.panels["prompt"].set_text(text)
    w.panels["generation"].set_max_new_tokens(n)
    w.panels["generation"].ignore_eos = True
    return finish_generation(qtbot, w, w.panels["generation"].generate)


def grabs(qtbot, w) -> dict[str, QtGui.QImage]:
    """Each panel alone, floating at one fixed size, so two windows' layouts cannot differ."""
    out = {}
    for name in SAME_PANELS:
        dock = w.docks[name]
        dock.setFloating(True)
        dock.resize(820, 560)
        dock.show()
        qtbot.wait(50)
        w.panels[name].mark_dirty()
        w.tick_panels(flush=True)
        out[name] = w.panels[name].grab().toImage()
    return out


def test_save_then_open_without_the_model_shows_the_same_panels(qtbot, make_window, tmp_path):
    live = make_window(persist=False)
    wait_loaded(qtbot, live)
    live.resize(1600, 1000)
    live.docks["lens"].raise_()  # the lens computes only while its panel is on screen (issue 50)
    qtbot.waitUntil(live.panels["lens"].on_screen)
    live.panels["lens"].set_capture(True)
    generate(qtbot, live)
    path = tmp_path / "run.ilab"
    assert session_io.save_session_to(live, path), live.last_error
    saved = load_session(path)
    assert sum(isinstance(e, LensCaptured) for e in saved.events) == 6  # the lens panel's capture was ticked
    assert [e.token_id for e in saved.events if isinstance(e, TokenSampled)] == [
        e.token_id for e in live.run_store.events() if isinstance(e, TokenSampled)]

    shown = make_window(persist=False, load=False)  # no model in this window, ever
    shown.resize(1600, 1000)
    assert shown.bridge.info is None
    assert session_io.open_session_from(shown, path), shown.last_error
    assert "Opened run.ilab" in shown.message.text()
    assert shown.panels["generation"].tokens and len(shown.panels["generation"].tokens) == 6
    assert shown.panels["lens"].shown_step() == 5
    # Live against opened: the same data in every panel, and the text panel's very pixels.
    assert live.panels["generation"].tokens == shown.panels["generation"].tokens
    assert live.panels["sampling"]._tokens.keys() == shown.panels["sampling"]._tokens.keys()
    assert live.panels["kv_cache"]._events == shown.panels["kv_cache"]._events
    t_live, t_shown = live.panels["timeline"], shown.panels["timeline"]
    assert t_live._seconds == t_shown._seconds and t_live.stats() == t_shown.stats()
    assert live.panels["lens"].lens.keys() == shown.panels["lens"].lens.keys()
    a, b = grabs(qtbot, live), grabs(qtbot, shown)
    assert a["generation"] == b["generation"]
    # Pictures: pyqtgraph's axes only ever widen, so a plot that grew token by token keeps a wider axis than one
    # drawn once. Two windows that both opened the session (the second from the first's re-save) draw the same
    # pixels in every panel, the timeline included.
    again = tmp_path / "again.ilab"
    assert session_io.save_session_to(shown, again)
    third = make_window(persist=False, load=False)
    third.resize(1600, 1000)
    assert session_io.open_session_from(third, again)
    c = grabs(qtbot, third)
    for name in SAME_PANELS:
        assert b[name] == c[name], f"the {name} panel differs between two opens of one session"


def test_unwritable_place_says_so_and_keeps_the_session(qtbot, window, tmp_path):
    generate(qtbot, window, n=3)
    n_events = len(window.run_store.events())
    assert not session_io.save_session_to(window, tmp_path / "no" / "such" / "dir" / "x.ilab")
    assert "cannot save the session" in window.last_error and "x.ilab" in window.last_error
    assert len(window.run_store.events()) == n_events
    assert session_io.save_session_to(window, tmp_path / "x.ilab")  # the same session, somewhere writable


def test_a_damaged_file_changes_nothing(qtbot, window, tmp_path):
    generate(qtbot, window, n=3)
    before = list(window.panels["generation"].tokens)
    bad = tmp_path / "bad.ilab"
    bad.write_bytes(b"PK\x03\x04 not really")
    assert not session_io.open_session_from(window, bad)
    assert "bad.ilab" in window.last_error
    assert window.panels["generation"].tokens == before


def test_a_session_from_another_model_says_so(qtbot, window, tmp_path):
    generate(qtbot, window, n=3)
    s = session_io.current_session(window)
    s.model = dict(s.model, name="SomeOtherModel", sha256="0" * 64)
    save_session(tmp_path / "other.ilab", s)
    assert session_io.open_session_from(window, tmp_path / "other.ilab")
    assert "recorded with SomeOtherModel" in window.last_error
    assert window.bridge.info.name != "SomeOtherModel"  # the loaded model stays for the next generation


def test_autosave_survives_a_crash_and_is_offered(qtbot, make_window, settings_file):
    w = make_window()  # keeps settings: autosaves beside the settings file
    wait_loaded(qtbot, w)
    generate(qtbot, w, n=3)
    auto = session_io.autosave_path()
    qtbot.waitUntil(auto.is_file, timeout=10_000)  # written by the writer thread after the run, not at Finished
    assert auto.parent == settings_file.parent and auto.is_file()
    assert len(load_session(auto).events) == len(w.run_store.events())
    # a crash leaves the file; the next start offers it
    second = make_window()
    assert second.autosave_offer == auto
    w.close()
    second.close()  # clean exits remove it
    assert not auto.exists()
    assert make_window().autosave_offer is None


def test_cli_save_then_open_session(qapp, tmp_path, tiny_dir):
    ilab, shot = tmp_path / "s.ilab", tmp_path / "shot.png"
    r = run_cli("--model", str(tiny_dir.gguf), "--prompt", "hello there", "--max-new-tokens", "4", "--greedy",
                "--lens", "--save-session", str(ilab), timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"session: {ilab}" in r.stdout
    saved = load_session(ilab)
    assert sum(isinstance(e, LensCaptured) for e in saved.events) == 4  # --lens brings its panel to the front
    assert saved.prompt == "hello there" and saved.model["sha256"]
    assert dataclasses.asdict(saved.settings["params"])["temperature"] == 0.0
    r = run_cli("--open-session", str(ilab), "--screenshot", str(shot), timeout=120)
    assert r.returncode == 0, r.stderr
    _check_png(shot)
    bad = run_cli("--open-session", str(tmp_path / "missing.ilab"), "--screenshot", str(shot), timeout=60)
    assert bad.returncode == 2 and len(error_lines(bad.stderr)) == 1


@pytest.mark.parametrize("name", ["s.txt", "missing/dir/s.ilab"])
def test_cli_bad_session_path(tmp_path, name):
    r = run_cli("--prompt", "hi", "--save-session", str(tmp_path / name), timeout=60)
    assert r.returncode == 2 and "--save-session" in r.stderr
