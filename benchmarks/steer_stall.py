"""The GUI thread while a steered generation runs and its slider moves: `python -m benchmarks.steer_stall [--smoke]
[--model M] [--screenshot OUT.png]` prints one JSON line.

The window runs as benchmarks.gui runs it (settings on, every dock on screen side by side, 2400×1400). The Steering
panel builds its default vector (the sentiment pairs, the middle third of the blocks); then two greedy 128-token
generations of the same prompt: one plain, then one steered at × +0.5 while the slider is dragged back and forth
every DRAG_MS (each move as a user's: the panel sends at most one SetSteerScale per SCALE_SEND_MS). A 10 ms QTimer
probe records the GUI thread's stalls in each (gaps past the interval: p50, p99, worst), from Generate to END_S
after Finished, as benchmarks.gui does; the steered run also reports how many scale changes reached the run
(its Steered events) and its name. The app's target: stall p99 within 33 ms.

--screenshot then runs one more steered generation in the window's default layout (1600×1000), the Steering
panel in front: SHOT_PROMPT at × +0.5, the slider moved to × −0.5 after token SHOT_SWITCH, and saves the window.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from benchmarks.gui import END_S, PROMPT, TickProbe, open_window, run_on_watching_autosave, show_every_panel

DRAG_MS = 50  # the slider moves one step this often during the steered run
DRAG = [x / 10 for x in (*range(5, 11), *range(10, -6, -1), *range(-5, 6))]  # +0.5 → +1 → −0.5 → +0.5
START_SCALE = 0.5
SHOT_PROMPT = "Tell me about your day in two sentences."
SHOT_TOKENS, SHOT_SWITCH, SHOT_SCALE = 48, 16, -0.5  # the picture's run: its scale moves after token SHOT_SWITCH
TARGET_P99_MS = 33.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    n_new = 8 if "--smoke" in argv else 128
    model = argv[argv.index("--model") + 1] if "--model" in argv else None
    shot = argv[argv.index("--screenshot") + 1] if "--screenshot" in argv else None
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ilab-bench-steer-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        return _measure(model, n_new, shot)


def _run(app, win, n_new: int, drag: bool) -> dict:
    """One greedy generation with the probe on (and the slider dragged): its stalls and what it ran."""
    from PySide6 import QtCore

    from app import session_io

    gen, steer = win.panels["generation"], win.panels["steer"]
    gen.set_max_new_tokens(n_new)
    gen.ignore_eos = True
    for _ in range(5):
        app.processEvents()
    probe, done, finished = TickProbe(), QtCore.QEventLoop(), {}
    last_token = [0.0]
    slots = {win.bridge.sig_finished: lambda ev: (finished.setdefault("ev", ev), done.quit()),
             win.bridge.sig_failed: lambda m: (finished.setdefault("error", m), done.quit()),
             win.bridge.sig_token: lambda _ev: last_token.__setitem__(0, time.perf_counter())}
    for sig, slot in slots.items():
        sig.connect(slot)
    moves = iter(DRAG * 100)
    mover = QtCore.QTimer()
    mover.setInterval(DRAG_MS)
    mover.timeout.connect(lambda: steer.set_scale(next(moves)))
    t_wall = time.time()
    probe.start()
    if not gen.generate():
        raise RuntimeError("could not start the generation")
    if drag:
        mover.start()
    done.exec()
    mover.stop()
    run_on_watching_autosave(session_io.autosave_path(), t_wall, END_S)
    probe.stop()
    for sig, slot in slots.items():  # only these: the panels' and the run store's stay connected
        sig.disconnect(slot)
    if "ev" not in finished:
        raise RuntimeError(finished.get("error", "the generation failed"))
    fin, stalls = finished["ev"], probe.stalls()
    n_during = int(np.searchsorted(np.asarray(probe.ticks), last_token[0], side="right"))
    run = win.run_store.shown_run()
    return {
        "tokens": int(len(fin.ids)), "tpot_ms": fin.tpot_s * 1e3,
        "stall_p50_ms": float(np.percentile(stalls, 50)), "stall_p99_ms": float(np.percentile(stalls, 99)),
        "stall_max_ms": float(stalls.max()),
        "stall_p99_ms_during_generation": float(np.percentile(stalls[:n_during], 99)) if n_during else 0.0,
        "scale_changes_in_run": max(0, len(run.steered) - 1), "run": run.name,
    }


def _measure(model: str | None, n_new: int, shot: str | None) -> int:
    from PySide6 import QtCore

    from engine.protocol import SamplingParams

    app, win = open_window(model)
    if win is None:
        return 1
    show_every_panel(win)
    win.panels["prompt"].set_text(PROMPT)
    win.bridge.set_params(SamplingParams.greedy_params())
    steer = win.panels["steer"]
    loop, built = QtCore.QEventLoop(), {}
    win.bridge.sig_steer_done.connect(lambda m: (built.setdefault("m", m), loop.quit()))
    if not steer.build():
        return 1
    loop.exec()
    if not built["m"].ok:
        print(built["m"].error, file=sys.stderr)
        return 1
    plain = _run(app, win, n_new, drag=False)
    steer.set_scale(START_SCALE)
    steer.set_on(True)
    steered = _run(app, win, n_new, drag=True)
    result = {"model": win.bridge.info.name, "dtype": win.bridge.info.dtype, "vector": built["m"].steer.label,
              "build_s": built["m"].seconds, "plain": plain, "steered_and_dragged": steered,
              "target_p99_ms": TARGET_P99_MS,
              "within_target": max(plain["stall_p99_ms"], steered["stall_p99_ms"]) <= TARGET_P99_MS}
    if shot:
        win.reset_layout()
        win.resize(1600, 1000)
        win.docks["steer"].show()
        win.docks["steer"].raise_()
        gen = win.panels["generation"]
        win.panels["prompt"].set_text(SHOT_PROMPT)
        gen.set_max_new_tokens(SHOT_TOKENS)
        gen.ignore_eos = False
        steer.set_scale(START_SCALE)
        moved = QtCore.QEventLoop()
        win.bridge.sig_token.connect(lambda ev: steer.set_scale(SHOT_SCALE) if ev.step == SHOT_SWITCH else None)
        win.bridge.sig_finished.connect(lambda _ev: moved.quit())
        if not gen.generate():
            return 1
        moved.exec()
        for _ in range(6):
            end = time.monotonic() + 0.06
            while time.monotonic() < end:
                app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 20)
            win.tick_panels(flush=True)
        result["screenshot"] = shot if win.grab().save(shot, "PNG") else None
    win.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
