"""Closing the window always ends the engine process: one that heeds neither Quit nor SIGTERM (here: stopped, as
a process stuck in native code would be) is killed, and the shutdown reports success; so does one that died and was
not restarted."""

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


def test_an_engine_not_restarted_closes_cleanly(qtbot):
    """The last death a model is allowed (MAX_RESTARTS used up): no new engine, and closing still succeeds."""
    from app.bridge import MAX_RESTARTS, Bridge

    b = Bridge()
    qtbot.waitUntil(lambda: b.process.is_alive(), timeout=10_000)
    b.deaths = MAX_RESTARTS  # as after three deaths in a row
    dead = b.process
    with qtbot.waitSignal(b.sig_engine_lost, timeout=30_000) as lost:
        os.kill(dead.pid, signal.SIGSEGV)
    assert not lost.args[0].restarted and "SIGSEGV" in lost.args[0].cause
    assert b.process is dead and not b.engine_running and not b.worker_thread.isRunning()
    assert b.shutdown(timeout_ms=500)
