"""A loaded model's objects (its tokenizer's vocabulary above all) are left out of the collector's later walks: a
full collection walked them all while holding the GIL, and the GUI froze for it now and then during a run."""

from __future__ import annotations

import gc

from engine.protocol import Loaded


def test_a_loaded_models_objects_are_frozen_out_of_later_collections(bridge, tiny_lm):
    gc.unfreeze()
    try:
        tracked_before = len(gc.get_objects())
        bridge._loads_sent.clear()
        bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
        assert bridge.tokenizer is tiny_lm.tokenizer
        assert gc.get_freeze_count() >= tracked_before // 2  # what lived then now sits out of every collection
        assert len(gc.get_objects()) < tracked_before // 2
        assert not any(o is tiny_lm.tokenizer.__dict__ for o in gc.get_objects())
    finally:
        gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_runs_events_leave_the_collectors_walks_as_they_arrive_and_frozen_garbage_goes_at_the_next_load(
        bridge, tiny_lm):
    """An 8,000-token run's events stay in the run store: the oldest generation's walk grew with them, and with it
    the GUI's stalls late in a run. They are frozen every AGE_EVERY tokens; a cycle frozen alive and dropped later
    is freed when a model loads."""
    import weakref

    from app.bridge import AGE_EVERY
    from tests.app.test_long_run_gui import run_events

    gc.unfreeze()
    try:
        events = run_events(tiny_lm.cfg, tiny_lm.tokenizer, 2 * AGE_EVERY, logits=False)
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        tokens = [e for e in events if type(e).__name__ == "TokenSampled"]
        for ev in events:
            bridge._on_raw(ev)  # as the engine's messages arrive during a live run
            if ev is tokens[AGE_EVERY - 2]:
                assert gc.get_freeze_count() == 0  # nothing frozen yet
            if ev is tokens[AGE_EVERY - 1]:
                break
        del ev
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(e) in tracked for e in tokens[:AGE_EVERY])  # frozen: never walked again
        del cycle
        gc.collect()
        assert alive() is not None  # frozen garbage: no collection frees it…
        bridge._loads_sent.clear()
        bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
        assert alive() is None  # …until a model loads
    finally:
        gc.unfreeze()


def test_the_engine_hands_over_a_long_steps_events_without_waiting_for_the_relay(bridge):
    """A step's events late in a long run (one layer's attention row over 8,000 keys, 288 KB, and the logits) fit in
    the engine's events pipe at once, so its decode loop does not wait for the GUI process to read them: a 512 KiB
    message is written with nobody reading."""
    import multiprocessing
    import sys
    import threading

    import numpy as np

    from app.bridge import widen_pipe

    assert sys.platform.startswith("linux")  # where these machines run; F_SETPIPE_SZ is Linux's
    recv, send = multiprocessing.Pipe(duplex=False)
    assert widen_pipe(recv) >= 1 << 20
    sent = threading.Event()
    payload = np.ones(128 << 10, dtype=np.float32)  # 512 KiB
    threading.Thread(target=lambda: (send.send(payload), sent.set()), daemon=True).start()
    assert sent.wait(10)
    np.testing.assert_array_equal(recv.recv(), payload)
    plain_recv, plain_send = multiprocessing.Pipe(duplex=False)  # as the system makes it: the writer waits
    waiting = threading.Event()
    threading.Thread(target=lambda: (plain_send.send(payload), waiting.set()), daemon=True).start()
    assert not waiting.wait(1)
    plain_recv.recv()
    assert waiting.wait(10)
    assert fcntl_size(bridge) >= 1 << 20  # the bridge's own events pipe


def fcntl_size(bridge) -> int:
    import fcntl

    return fcntl.fcntl(bridge.relay.events.fileno(), fcntl.F_GETPIPE_SZ)
