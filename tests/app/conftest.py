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
        w.close()
        assert not w.bridge.worker_thread.isRunning()


def wait_loaded(qtbot, w, timeout=30_000):
    qtbot.waitUntil(lambda: w.bridge.tokenizer is not None and w.panels["generation"]._loaded, timeout=timeout)


@pytest.fixture
def window(qtbot, make_window):
    """A MainWindow with the tiny random model loaded."""
    w = make_window()
    wait_loaded(qtbot, w)
    return w


@pytest.fixture
def bridge(qtbot):
    """A bare Bridge (its engine process runs but no model is loaded); shut down after the test."""
    from app.bridge import Bridge

    b = Bridge()
    yield b
    assert b.shutdown()


@pytest.fixture(scope="session")
def real_tokenizer(real_lm):
    """The tokenizer of the real default model (SmolLM2-135M-Instruct), loaded once per session."""
    return real_lm.tokenizer
