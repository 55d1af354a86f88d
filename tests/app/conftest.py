"""Fixtures for the app tests: private settings, windows on the tiny random model, the real tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def settings_file(tmp_path, monkeypatch):
    """Every app test reads and writes a private settings file, never the user's."""
    path = tmp_path / "inference-lab.ini"
    monkeypatch.setenv("INFERENCE_LAB_SETTINGS", str(path))
    return path


class CallbackErrors:
    """The exceptions the guard (app.guard) caught at Qt boundaries during one test."""

    def __init__(self) -> None:
        from app.guard import reporter

        self.reporter = reporter()
        self.start = self.reporter.count
        self.accepted = 0

    @property
    def count(self) -> int:
        return self.reporter.count - self.start

    def accept(self) -> None:
        """This test raised on purpose: what was caught so far is expected."""
        self.accepted = self.count


@pytest.fixture(autouse=True)
def callback_errors():
    """A guarded callback that raised fails the test (the guard keeps the app alive, but hides nothing here)."""
    errors = CallbackErrors()
    yield errors
    assert errors.count == errors.accepted, f"a Qt callback raised (caught by the guard): {errors.reporter.last}"


@pytest.fixture(autouse=True)
def _hardware_cache_untouched():
    """A test that measures this machine must not leave its figures to later tests (they expect none measured)."""
    path = Path(os.environ["INFERENCE_LAB_CACHE"]) / "hardware.json"
    before = path.read_bytes() if path.exists() else None
    yield
    if before is None:
        path.unlink(missing_ok=True)
    else:
        path.write_bytes(before)


@pytest.fixture
def make_window(qtbot, tiny_dir):
    """Build MainWindows on the tiny model; each is closed (worker stopped) before pytest-qt deletes it."""
    from app.main_window import MainWindow

    windows = []

    def make(model=None, **kw):
        kw.setdefault("interactive", False)
        w = MainWindow(str(model or tiny_dir.gguf), device="cpu", dtype="float32", **kw)
        if "roofline" in w.panels:
            w.panels["roofline"].measure_kwargs = {"quick": True}  # its measurement at load (auto_measure), kept short
        qtbot.addWidget(w)
        windows.append(w)
        w.show()
        return w

    yield make
    for w in windows:
        w.close()  # MainWindow.shutdown: the engine gets 10 s, then is terminated; the relay thread is waited for
        assert not w.bridge.worker_thread.isRunning()
        process = w.bridge.process
        process.join(SHUTDOWN_BUDGET_S)  # terminated above when it was slow to quit: gone at once, or wedged
        if process.is_alive():
            process.kill()
            process.join(30)
            pytest.fail(f"the engine process (pid {process.pid}) outlived the window's shutdown and a SIGTERM by "
                        f"{SHUTDOWN_BUDGET_S} s: killed", pytrace=False)


def wait_loaded(qtbot, w, timeout=30_000):
    qtbot.waitUntil(lambda: w.bridge.tokenizer is not None and w.panels["generation"]._loaded, timeout=timeout)


@pytest.fixture
def window(qtbot, make_window):
    """A MainWindow with the tiny random model loaded."""
    w = make_window()
    wait_loaded(qtbot, w)
    return w


# Stopping the engine waits for it to read "quit": on a busy machine a process still importing torch, or finishing
# a step, can take tens of seconds. Only a process that outlives this budget was left wedged by its test.
SHUTDOWN_BUDGET_S = 180


def stop_bridge(b) -> None:
    """Stop the bridge's engine process and relay thread. One that does not stop on `quit` within the budget (the
    bridge then terminates it) was left wedged by its test: kill what is left and fail that test, never leaving a
    process behind for the next one."""
    stopped = b.shutdown(timeout_ms=SHUTDOWN_BUDGET_S * 1000)
    if stopped and b.process.exitcode == 0:
        return
    problems = []
    if b.process.is_alive():
        b.process.kill()
        b.process.join(30)
        problems.append(f"the engine process (pid {b.process.pid}) outlived {SHUTDOWN_BUDGET_S} s after `quit` and "
                        "a SIGTERM: killed")
    elif b.process.exitcode != 0:
        problems.append(f"the engine process did not stop on `quit` within {SHUTDOWN_BUDGET_S} s (exit code "
                        f"{b.process.exitcode}: stopped by the bridge's SIGTERM)")
    if b.worker_thread.isRunning():
        b.relay.stopping.set()
        if not b.worker_thread.wait(30_000):
            problems.append("the relay thread is still running")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def bridge(qtbot):
    """A bare Bridge (its engine process runs but no model is loaded); shut down after the test."""
    from app.bridge import Bridge

    b = Bridge()
    yield b
    stop_bridge(b)


@pytest.fixture(scope="session")
def real_tokenizer(real_lm):
    """The tokenizer of the real default model (SmolLM2-135M-Instruct), loaded once per session."""
    return real_lm.tokenizer
