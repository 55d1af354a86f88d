"""The Steering panel against a real engine process on the tiny model: Build (progress, Cancel), Load…/Save… of a
control vector, the slider acting between two tokens of a running generation, the steered run's name, a session
that keeps the vector, a server that refuses, and the settings it remembers. No test reads a clock: a paused
generation steps one token at a time."""

from __future__ import annotations

import numpy as np
import pytest

from app import session_io
from app.settings import DEFAULT_STEER_PAIRS, Settings, SteerSettings
from engine.events import Steered
from engine.protocol import SamplingParams, SteerReady
from tests.app.conftest import wait_loaded

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")  # docks raised offscreen

N_NEW = 8
SWITCH_AFTER = 3  # the slider moves after this step's token
STRONG = 10.0  # the slider's end


@pytest.fixture
def steer_window(qtbot, make_window):
    """A window on the tiny model with the Steering panel in front, greedy sampling and fixed-length runs."""

    def make(**kw):
        w = make_window(**{"persist": False, **kw})
        if kw.get("load", True):
            wait_loaded(qtbot, w)
            w.bridge.set_params(SamplingParams.greedy_params())
            gen = w.panels["generation"]
            gen.set_text("the cat sat")
            gen.set_max_new_tokens(N_NEW)
            gen.ignore_eos = True
        w.docks["steer"].show()
        w.docks["steer"].raise_()
        return w

    return make


def answer(qtbot, w, start, timeout: int = 60_000) -> SteerReady:
    """Run `start()` (which sends one SteerVector) and wait for its SteerReady."""
    with qtbot.waitSignal(w.bridge.sig_steer_done, timeout=timeout) as done:
        assert start() is not None
    w.panels["steer"].flush()
    return done.args[0]


def generate(qtbot, w) -> list[int]:
    gen = w.panels["generation"]
    with qtbot.waitSignal(w.bridge.sig_finished, timeout=60_000) as done:
        assert gen.generate()
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=60_000)
    return [int(i) for i in done.args[0].ids]


def test_build_on_the_tiny_model_is_the_engines_vector(qtbot, steer_window, tiny_lm):
    from engine.run.session import Session
    from engine.why.steer import Pair, build

    w = steer_window()
    panel = w.panels["steer"]
    assert panel.layers.text() == "1"  # the middle third of the blocks a control vector holds: 1 of 1
    assert panel.pair_list() == list(DEFAULT_STEER_PAIRS) and not panel.on_box.isEnabled()
    progress: list[tuple[float, str]] = []
    w.bridge.sig_steer_progress.connect(lambda f, m: progress.append((f, m)))
    m = answer(qtbot, w, panel.build)
    assert m.ok and m.action == "build" and m.steer.layers == (1,) and m.steer.directions.shape == (1, 64)
    assert progress == [(k / 4, f"pair {k} of 4") for k in range(1, 5)]
    expected = build(Session(tiny_lm), [Pair(*p) for p in DEFAULT_STEER_PAIRS], [1], "mean").directions[1]
    np.testing.assert_allclose(m.steer.directions[0], expected, rtol=1e-5, atol=1e-6)
    assert panel.vector is m.steer and panel.on_box.isEnabled() and panel.save_button.isEnabled()
    assert "built from 4 pairs (mean)" in panel.vector_label.text() and "Built in" in panel.status.text()
    assert m.norms == pytest.approx((float(np.linalg.norm(expected)),), rel=1e-5)

    panel.method.setCurrentIndex(panel.method.findData("pca"))
    m = answer(qtbot, w, panel.build)
    assert m.ok and "(pca)" in m.steer.name and np.linalg.norm(m.steer.directions[0]) == pytest.approx(1, abs=1e-5)

    panel.layers.setText("0")  # a control vector has no place for block 0's output: said here, nothing sent
    assert not panel.build()
    panel.flush()
    assert "layer 0 cannot be steered" in panel.status.text() and panel.building is None


def test_a_build_cancelled_while_it_waits_for_a_generation(qtbot, steer_window):
    w = steer_window()
    panel = w.panels["steer"]
    with qtbot.waitSignal(w.bridge.sig_state, check_params_cb=lambda s: s == "paused", timeout=60_000):
        assert w.panels["generation"].generate(start_paused=True)
    assert panel.build()
    panel.flush()
    assert panel.cancel_button.isEnabled() and "starts when the generation ends" in panel.status.text()
    panel.cancel()
    with qtbot.waitSignal(w.bridge.sig_steer_done, timeout=60_000) as done:
        w.bridge.resume()  # the run ends on its own (no Stop): only Cancel stops the build that waited for it
    assert done.args[0].cancelled and panel.vector is None
    panel.flush()
    assert "Build cancelled" in panel.status.text() and not panel.cancel_button.isEnabled()


def test_save_and_load_a_control_vector(qtbot, steer_window, tmp_path):
    w = steer_window()
    panel = w.panels["steer"]
    built = answer(qtbot, w, panel.build).steer
    path = tmp_path / "happy.gguf"
    m = answer(qtbot, w, lambda: panel.save_file(str(path)))
    assert m.ok and path.stat().st_size > 64 * 4 and "Saved to" in panel.status.text()
    m = answer(qtbot, w, lambda: panel.load_file(str(path)))
    assert m.ok and m.steer.name == "happy.gguf" and m.steer.layers == (1,)
    np.testing.assert_array_equal(m.steer.directions, built.directions)
    assert panel.vector is m.steer

    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    m = answer(qtbot, w, lambda: panel.load_file(str(tmp_path / "bad.gguf")))
    assert not m.ok and "bad.gguf" in m.error and "\n" not in m.error
    assert "Loading failed" in panel.status.text() and panel.vector.name == "happy.gguf"  # the vector stays


def test_the_slider_mid_generation_changes_the_next_tokens_and_names_the_run(qtbot, steer_window, tmp_path):
    w = steer_window()
    panel, bridge = w.panels["steer"], w.bridge
    answer(qtbot, w, panel.build)
    panel.set_scale(0.0)
    panel.set_on(True)
    assert bridge.options.steer is not None and bridge.options.steer.scale == 0.0
    fixed = generate(qtbot, w)  # steered at a fixed scale of 0: the model's own tokens
    panel.set_scale(STRONG)
    strong = generate(qtbot, w)
    assert strong != fixed  # the vector moves this model's tokens at this scale
    assert w.run_store.shown_run().name == "run 2 · steered by built from 4 pairs (mean) at layer 1 × +10"

    panel.set_scale(0.0)
    qtbot.waitUntil(lambda: panel.scale_sent == 0.0, timeout=10_000)  # the next run starts at 0
    tokens: list[int] = []
    bridge.sig_token.connect(lambda ev: tokens.append(int(ev.token_id)))
    with qtbot.waitSignal(bridge.sig_state, check_params_cb=lambda s: s == "paused", timeout=60_000):
        assert w.panels["generation"].generate(start_paused=True)
    qtbot.waitUntil(lambda: len(tokens) == 1, timeout=60_000)  # the prefill's token
    for k in range(1, SWITCH_AFTER + 1):
        bridge.step()
        qtbot.waitUntil(lambda k=k: len(tokens) == k + 1, timeout=60_000)
    panel.set_scale(STRONG)  # while paused between two tokens, as a user drags it
    qtbot.waitUntil(lambda: panel.scale_sent == STRONG, timeout=10_000)
    with qtbot.waitSignal(bridge.sig_finished, timeout=60_000) as done:
        bridge.resume()
    qtbot.waitUntil(lambda: w.panels["generation"].state == "idle", timeout=60_000)
    moved = [int(i) for i in done.args[0].ids]
    assert moved[:SWITCH_AFTER + 1] == fixed[:SWITCH_AFTER + 1]  # up to the move: the fixed-scale run's tokens
    assert moved[SWITCH_AFTER + 1:] != fixed[SWITCH_AFTER + 1:]  # from the next token on: not

    run = w.run_store.shown_run()
    assert run.name == "run 3 · steered by built from 4 pairs (mean) at layer 1 × +0 → +10"
    assert [(e.step, e.scale) for e in run.events if isinstance(e, Steered)] == [(0, 0.0), (SWITCH_AFTER + 1, STRONG)]
    panel.flush()
    assert "now × +10.0" in panel.status.text()
    xs, ys = panel.curve.getData()
    assert list(xs) == [0, SWITCH_AFTER + 1, N_NEW] and list(ys) == [0.0, STRONG]

    # the session keeps the vector: its runs' names and Steered events, and the vector back in the panel
    path = tmp_path / "steered.ilab"
    assert session_io.save_session_to(w, path)
    other = steer_window(load=False)
    assert session_io.open_session_from(other, path)
    names = [r.name for r in other.run_store.runs]
    assert names == [r.name for r in w.run_store.runs]
    back = other.panels["steer"]
    assert back.vector is not None and back.vector.name == "built from 4 pairs (mean)" and back.vector.layers == (1,)
    np.testing.assert_array_equal(back.vector.directions, panel.vector.directions)
    assert back.scale == 0.0 and not back.on_box.isChecked()  # back at its first scale, off until ticked
    back.flush()
    assert "The session's vector is back" in back.status.text()


def test_a_server_refuses_steering_in_one_sentence(qtbot, steer_window):
    import threading
    from http.server import ThreadingHTTPServer

    from tests.remote.test_client_errors import Handler

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.mode = "ok"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        w = steer_window()
        panel = w.panels["steer"]
        answer(qtbot, w, panel.build)
        panel.set_on(True)
        w.connect_server(f"http://127.0.0.1:{srv.server_address[1]}")
        qtbot.waitUntil(lambda: w.bridge.server is not None, timeout=30_000)
        refusal = "steering adds a vector to the model's residual stream, which a server does not expose"
        with qtbot.waitSignal(w.bridge.sig_failed, check_params_cb=lambda m: "steering" in m, timeout=30_000) as failed:
            assert w.panels["generation"].generate()
        assert failed.args[0].startswith(refusal) and "\n" not in failed.args[0]
        panel.flush()
        assert "a server does not expose" in panel.status.text()
        m = answer(qtbot, w, panel.build)
        assert not m.ok and "disconnect from the server first" in m.error
    finally:
        srv.shutdown()
        srv.server_close()


def test_scale_layers_pairs_and_method_are_remembered(qtbot, steer_window):
    w = steer_window(persist=True)
    panel = w.panels["steer"]
    pairs = (("bright", "dark"), ("warm", "cold"))
    panel.set_pairs(pairs)
    panel.layers.setText("1")
    panel.method.setCurrentIndex(panel.method.findData("pca"))
    panel.set_scale(-3.5)
    w.save_settings()
    assert Settings().steer() == SteerSettings(scale=-3.5, layers="1", pairs=pairs, method="pca")
    again = steer_window(persist=True, load=False)
    p = again.panels["steer"]
    assert (p.scale, p.layers.text(), tuple(p.pair_list()), p.method.currentData()) == (-3.5, "1", pairs, "pca")


@pytest.mark.slow
def test_the_steering_stall_benchmark_runs(tmp_path):
    """benchmarks.steer_stall end to end (a short smoke run on the real model, in a subprocess)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), QT_QPA_PLATFORM="offscreen")
    shot = tmp_path / "steer.png"
    r = subprocess.run([sys.executable, "-m", "benchmarks.steer_stall", "--smoke", "--screenshot", str(shot)],
                       capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    for run in (d["plain"], d["steered_and_dragged"]):
        assert run["tokens"] == 8 and run["stall_max_ms"] >= run["stall_p99_ms"] >= 0
    assert d["plain"]["scale_changes_in_run"] == 0 and " · steered by " in d["steered_and_dragged"]["run"]
    assert shot.stat().st_size > 10_000
