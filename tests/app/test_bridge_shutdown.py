"""Closing the window always ends the engine process: one that heeds neither Quit nor SIGTERM (here: stopped, as
a process stuck in native code would be) is killed, and the shutdown reports success."""

from __future__ import annotations

import os
import signal


def test_a_wedged_engine_is_killed_at_shutdown(qtbot):
    from app.bridge import Bridge

    b = Bridge()
    qtbot.waitUntil(lambda: b.process.is_alive(), timeout=10_000)
    os.kill(b.process.pid, signal.SIGSTOP)  # reads no command, and SIGTERM stays pending
    try:
        assert b.shutdown(timeout_ms=500)
        assert not b.process.is_alive() and b.process.exitcode == -signal.SIGKILL
    finally:
        if b.process.is_alive():
            os.kill(b.process.pid, signal.SIGKILL)
