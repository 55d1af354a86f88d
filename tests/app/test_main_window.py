"""The main window: docks, menus, model loading and its failures, settings, timeline export, the headless CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6 import QtGui, QtWidgets

from app.main_window import DEFAULT_SIZE, discover_panels
from app.panels import PANEL_MODULES
from tests.app.conftest import wait_loaded

ROOT = Path(__file__).resolve().parents[2]


def test_one_dock_per_panel_with_stable_names(window):
    found = discover_panels()
    names = [cls.object_name for _, cls in found]
    assert len(set(names)) == len(names)
    assert [d.objectName() for d in window.docks.values()] == names
    for name, dock in window.docks.items():
        assert dock.widget().panel is window.panels[name]
        assert dock.windowTitle() == window.panels[name].title
    for name in ("prompt", "preview", "generation"):
        assert name in window.docks


def test_every_panel_file_is_registered_and_every_registered_panel_is_found():
    """Against the files in app/panels (not the registry discover_panels reads): each panel module there is in
    PANEL_MODULES once, and discover_panels finds every one of them with the panel class its module defines."""
    from app.panels.base import Panel

    on_disk = {p.stem for p in (ROOT / "app" / "panels").glob("*.py")} - {"__init__", "base"}
    assert sorted(PANEL_MODULES) == sorted(on_disk)  # a file not registered would never get a dock
    found = discover_panels()
    assert {name for name, _ in found} == on_disk
    for name, cls in found:
        assert issubclass(cls, Panel) and cls.__module__ == f"app.panels.{name}", (name, cls)


def test_view_menu_toggles_docks_and_reset_layout(qtbot, window):
    view = window.view_menu
    groups = window.view_groups
    assert [g.title() for g in groups] == ["The live run", "What-if labs", "The server", "Why it answers"]
    assert [a.text() for a in view.actions()[:4]] == [g.title() for g in groups]
    actions = [a for g in groups for a in g.actions() if a.isCheckable()]
    assert len(actions) == len(window.docks)
    keys = [a.shortcut().toString() for a in actions]
    assert keys[0] == "Alt+1" and all(keys) and len(set(keys)) == len(keys)  # every panel has its own
    # no panel hides: every dock is in sight, or a tab whose name shows beside the panel in front
    for name, dock in window.docks.items():
        assert dock.isVisible() or any(d.isVisible() for d in window.tabifiedDockWidgets(dock)), name
    labs = {window.docks[n] for n in ("capacity", "batching", "load_lab", "why")}
    assert labs <= {window.docks["capacity"], *window.tabifiedDockWidgets(window.docks["capacity"])}
    assert window.docks["roofline"] not in window.tabifiedDockWidgets(window.docks["capacity"])  # not behind it
    dock = window.docks["preview"]
    action = next(a for a in actions if a.text() == window.panels["preview"].title)
    action.trigger()
    assert not dock.isVisible()
    window.reset_layout()
    assert dock.isVisible() and not dock.isFloating()


def test_window_shows_model_info_and_help(qtbot, window):
    info = window.bridge.info
    label = window.model_label.text()
    assert label.startswith(f"{info.name} · ") and f"· {info.n_layers} layers ·" in label
    assert label.endswith(f"{info.dtype} · {info.kernels} kernels on {info.device}")  # the mode its numbers ran in
    assert window.progress.isHidden()
    window.show_panel_help()
    text = window.help_dialog.findChild(QtWidgets.QTextBrowser).toPlainText()
    for panel in window.panels.values():
        assert panel.title in text
    window.help_dialog.close()


def test_shared_timer_draws_dirty_panels(qtbot, window):
    panel = window.panels["generation"]
    before = panel.draw_count
    panel.mark_dirty()
    qtbot.waitUntil(lambda: panel.draw_count > before, timeout=2_000)  # no flush(): the timer drew it
    assert not panel._dirty


def test_load_failure_shows_error_and_app_stays_usable(qtbot, make_window, tmp_path, tiny_dir):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00 this is not a model")
    w = make_window(bad, interactive=True)
    with qtbot.waitSignal(w.bridge.sig_load_failed, timeout=30_000):
        pass
    assert w.last_error
    assert "broken.gguf" in w.message.text() and "Open model" in w.message.text()
    assert w.error_box.isVisible() and not w.error_box.isModal()
    assert w.progress.isHidden()
    gen = w.panels["generation"]
    assert not gen.generate_btn.isEnabled()
    # The app keeps working: load a good model.
    w.error_box.close()
    with qtbot.waitSignal(w.bridge.sig_model_loaded, timeout=30_000):
        w.load_model(str(tiny_dir.gguf))
    assert w.last_error == ""
    assert gen.generate_btn.isEnabled()
    w.panels["prompt"].set_text("hello")
    gen.set_max_new_tokens(3)
    with qtbot.waitSignal(w.bridge.sig_finished, timeout=10_000):
        gen.generate()


def test_settings_restored_in_a_second_window(qtbot, make_window, settings_file):
    from engine.run.sampling import SamplingParams

    w1 = make_window()
    wait_loaded(qtbot, w1)
    w1.panels["prompt"].set_text("remember me")
    w1.panels["prompt"].set_chat(False)
    w1.panels["generation"].set_max_new_tokens(17)
    w1.bridge.set_params(SamplingParams(temperature=0.3, top_k=5, top_p=0.9, seed=7))
    w1.resize(1100, 760)
    w1.docks["preview"].hide()
    w1.close()
    saved = w1.saveGeometry()
    assert settings_file.exists()

    w2 = make_window()
    assert w2.panels["prompt"].text() == "remember me"
    assert not w2.panels["prompt"].chat() and not w2.panels["generation"].chat()
    assert w2.panels["generation"].max_tokens.value() == 17
    assert w2.bridge.params == SamplingParams(temperature=0.3, top_k=5, top_p=0.9, seed=7)
    assert w2.settings.geometry() == saved
    # restoreGeometry() ran: without it the window would have the default 1600×1000. (The offscreen platform's
    # screen is 800×800, so Qt clamps the restored size to it and the docks' minimum sizes: no exact size here.)
    assert (w2.width(), w2.height()) != DEFAULT_SIZE and w2.height() <= 1000
    assert not w2.docks["preview"].isVisible()


def test_sampling_settings_survive_a_bad_settings_file(qtbot, make_window, settings_file):
    settings_file.write_text("[sampling]\ntemperature=banana\ntop_p=7\n")
    w = make_window(load=False)
    assert w.bridge.params.top_p == 1.0


def test_export_timeline_reports_bad_paths(qtbot, window, tmp_path):
    assert not window.export_timeline(str(tmp_path / "missing" / "t.png"))
    assert "t.png" in window.last_error
    assert not window.export_timeline(str(tmp_path / "t.bmp"))
    assert window.last_error


def test_closing_right_after_start_while_loading(qtbot, make_window):
    w = make_window()
    w.close()  # the load may still be running: close waits for it rather than destroying a running thread
    assert not w.bridge.worker_thread.isRunning()


# ---- the headless command line ---------------------------------------------------------------------------------
def run_cli(*args, timeout=240):
    env = dict(os.environ)
    env["QT_QPA_PLATFORM"] = "offscreen"
    env.setdefault("PYTHONPATH", str(ROOT))
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and "propagateSizeHints" not in line]


@pytest.mark.parametrize("option,name", [("--screenshot", "shot.jpg"), ("--export-timeline", "t.pdf"),
                                         ("--screenshot", "missing/dir/shot.png")])
def test_cli_bad_output_path_exits_2_with_one_line(tmp_path, option, name):
    r = run_cli("--prompt", "hi", option, str(tmp_path / name), timeout=60)
    assert r.returncode == 2, r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("inference-lab:") and option in lines[0]


def test_cli_load_failure_exits_1_with_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    r = run_cli("--model", str(bad), "--prompt", "hi", "--screenshot", str(tmp_path / "s.png"), timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [line for line in error_lines(r.stderr) if line.startswith("inference-lab:")]
    assert len(lines) == 1 and "broken.gguf" in lines[0], r.stderr
    assert not (tmp_path / "s.png").exists()


def _check_png(path: Path, size=(1600, 1000)) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = QtGui.QImage(str(path))
    assert not image.isNull() and (image.width(), image.height()) == size


def test_cli_screenshot_on_the_tiny_model(qapp, tmp_path, tiny_dir):
    shot, timeline = tmp_path / "shot.png", tmp_path / "timeline.svg"
    r = run_cli("--model", str(tiny_dir.gguf), "--prompt", "hello there", "--max-new-tokens", "5", "--greedy",
                "--screenshot", str(shot), "--export-timeline", str(timeline), timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"screenshot: {shot}" in r.stdout and f"timeline: {timeline}" in r.stdout
    _check_png(shot)
    assert timeline.read_text().lstrip().startswith(("<?xml", "<svg"))


def test_cli_why_runs_the_experiment_into_the_picture_and_the_session(qapp, tmp_path, tiny_dir):
    from engine.session_file import load_session

    shot, session = tmp_path / "why.png", tmp_path / "why.ilab"
    r = run_cli("--model", str(tiny_dir.gguf), "--prompt", "hello there", "--max-new-tokens", "3", "--greedy",
                "--why", "heads", "--screenshot", str(shot), "--save-session", str(session), timeout=240)
    assert r.returncode == 0, r.stderr
    _check_png(shot)
    saved = load_session(session, with_tokenizer=False).settings["why"]
    heads = next(r["result"] for r in saved if r["kind"] == "heads")
    n_layers = len(heads["scores"]["induction"])
    assert n_layers >= 1 and {"previous_token", "duplicate_token", "induction", "sink"} <= set(heads["scores"])


@pytest.mark.slow
def test_cli_screenshot_on_the_real_model(qapp, tmp_path):
    shot = tmp_path / "shot.png"
    r = run_cli("--prompt", "Explain what a KV cache is in two sentences.", "--chat", "--max-new-tokens", "8",
                "--seed", "1", "--screenshot", str(shot), timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"screenshot: {shot}" in r.stdout
    _check_png(shot)
    image = QtGui.QImage(str(shot))
    # Not a blank window: the picture holds many distinct colours (text, heatmaps, bars).
    colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
    assert len(colours) > 200



def test_threads_setting_is_sent_and_remembered(qtbot, make_window):
    w = make_window(load=False)
    assert w.threads_setting() == "auto"  # the default: the engine adapts to the machine's load
    one = next(a for a in w.threads_group.actions() if a.data() == 1)
    sent = []
    w.bridge.set_threads = sent.append
    one.trigger()
    assert sent == [1] and w.threads_setting() == 1
    w2 = make_window(load=False)
    assert w2.threads_setting() == 1


def test_a_local_run_is_drawn_against_this_machine(qtbot, window):
    """The Roofline of a local run opens on the machine the model runs on, measured once in the background."""
    from app.panels.roofline import THIS_MACHINE

    roof = window.panels["roofline"]
    qtbot.waitUntil(lambda: roof.this_machine_roofs() is not None, timeout=60_000)
    assert roof.hw_combo.currentData() == THIS_MACHINE
    hw = roof.hardware()
    assert hw is not None and hw.bandwidth_bytes_per_s > 0 and hw.peak_for(roof.dtype()) > 0


def test_one_chat_toggle_in_the_window(qtbot, window):
    """The Prompt panel holds the only Chat toggle on screen; the generation follows it."""
    toggles = [b for b in window.findChildren(QtWidgets.QCheckBox) if b.text() in ("Chat", "Chat template")
               and b.isVisibleTo(window)]
    assert toggles == [window.panels["prompt"].chat_box]
    gen = window.panels["generation"]
    for on in (True, False, True):
        window.panels["prompt"].chat_box.setChecked(on)
        assert gen.chat() is on
