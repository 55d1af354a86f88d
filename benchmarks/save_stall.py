"""The GUI thread's stalls while the session writer saves a long session: `python -m benchmarks.save_stall --open
FILE.ilab` opens the session in a window with every panel docked (offscreen unless QT_QPA_PLATFORM says otherwise),
then saves it four times through the writer thread, as File → Save does: first with the writer's `gc.freeze()`
turned off (what it did before), then as the app does now; then twice while two panels redraw every REDRAW_MS, at
Python's default GIL switch interval (5 ms, the app's) and at TRIAL_SWITCH_S (each of the panels' calls back into
Python waits for the writer's turn to end: a shorter turn shortens the redraws). For each it prints one
JSON line: the save's seconds, the GUI thread's stalls (a 10 ms QTimer probe: p99 and the worst, with when they
happened), the collector's full collections over 5 ms (when, how long, in which thread) and, while redrawing, each
redraw's worst and median time.

Keep FILE outside the repository (a long run's session is ~200 MB): `python -m benchmarks.longrun --keep-session`
writes one.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import threading
import time

PROBE_MS = 10.0
REDRAW_MS = 100
TRIAL_SWITCH_S = 0.0005  # the GIL switch interval tried against Python's default (5 ms)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv) or "--open" not in argv or argv.index("--open") + 1 >= len(argv):
        print(__doc__)
        return 0 if {"-h", "--help"} & set(argv) else 2
    path = argv[argv.index("--open") + 1]
    if not os.path.isfile(path):
        print(f"--open {path}: no such file", file=sys.stderr)
        return 2
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="ilab-bench-save-") as d:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(d, "inference-lab.ini")
        return _measure(path, d)


def _measure(path: str, out_dir: str) -> int:
    from PySide6 import QtWidgets

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(sys.argv[:1])
    from app import session_io
    from app.main_window import MainWindow
    from benchmarks.gui import WINDOW, show_every_panel
    from benchmarks.reopen import _wait

    win = MainWindow(None, persist=False, load=False, interactive=False)
    win.resize(*WINDOW)
    show_every_panel(win)
    win.show()
    opened: dict = {}
    original = session_io.replay

    def replay(window, saved, warning=None, wait=True, done=None):
        return original(window, saved, warning, wait=wait, done=lambda c: opened.setdefault("completed", c))

    session_io.replay = replay
    try:
        session_io.open_session_from(win, path, wait=False)
        if not _wait(app, lambda: "completed" in opened or bool(win.last_error), 600) or not opened.get("completed"):
            print(f"not opened: {win.last_error or 'timed out'}", file=sys.stderr)
            return 1
    finally:
        session_io.replay = original
    _wait(app, lambda: False, 3)  # the replay's last draws

    target = os.path.join(out_dir, "saved.ilab")
    default = sys.getswitchinterval()
    for how, no_freeze, redraw, switch_s in (
            ("without the writer's freeze", True, False, default),
            ("as the app does", False, False, default),
            ("panels redrawing, as the app does", False, True, default),
            ("panels redrawing, a shorter GIL switch interval", False, True, TRIAL_SWITCH_S)):
        sys.setswitchinterval(switch_s)
        print(json.dumps({"how": how, "session_file": path, "gil_switch_ms": switch_s * 1e3,
                          **_save_once(app, win, no_freeze, target, redraw)}), flush=True)
    win.close()
    return 0


def _save_once(app, win, no_freeze: bool, target: str, redraw: bool = False) -> dict:
    """Save the window's session through its writer once, timing the GUI thread's ticks and the full collections;
    redraw: the roofline and attention panels draw and paint every REDRAW_MS meanwhile (as after a live run's end,
    when the autosave starts while the panels still draw), and "redraw_ms" gives each such draw's worst and median."""
    import numpy as np
    from PySide6 import QtCore

    from app import session_io
    from benchmarks.reopen import _wait

    gc.unfreeze()
    tracked = len(gc.get_objects())
    ticks: list[tuple[float, float]] = []
    collections: list[tuple[float, float, str]] = []
    clock = {"t0": time.perf_counter(), "last": time.perf_counter()}

    def probe() -> None:
        now = time.perf_counter()
        ticks.append((now - clock["t0"], (now - clock["last"]) * 1e3 - PROBE_MS))
        clock["last"] = now

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            clock["gc"] = time.perf_counter()
        elif "gc" in clock:
            ms = (time.perf_counter() - clock["gc"]) * 1e3
            if ms > 5:
                collections.append((round(clock["gc"] - clock["t0"], 3), round(ms, 1),
                                    threading.current_thread().name))

    freeze = gc.freeze
    if no_freeze:
        gc.freeze = lambda: None  # the writer's call (app.session_io.Job.run), put back below
    gc.callbacks.append(on_gc)
    timer = QtCore.QTimer()
    timer.setInterval(int(PROBE_MS))
    timer.timeout.connect(probe)
    clock["t0"] = clock["last"] = time.perf_counter()
    draws: list[float] = []

    def redraw_some() -> None:
        t = time.perf_counter()
        for name in ("roofline", "attention"):
            win.panels[name].mark_dirty()
            win.panels[name].flush()
        draws.append((time.perf_counter() - t) * 1e3)

    redraw_timer = QtCore.QTimer()
    redraw_timer.setInterval(REDRAW_MS)
    redraw_timer.timeout.connect(redraw_some)
    timer.start()
    if redraw:
        redraw_timer.start()
    try:
        session_io.save_session_to(win, target, wait=False)
        _wait(app, lambda: not win.session_writer.busy(), 120)
        save_s = time.perf_counter() - clock["t0"]
        _wait(app, lambda: False, 1)
    finally:
        timer.stop()
        redraw_timer.stop()
        gc.callbacks.remove(on_gc)
        gc.freeze = freeze
    stalls = np.array([s for _, s in ticks])
    worst = sorted(ticks, key=lambda x: -x[1])[:3]
    return {"objects_tracked": tracked, "save_s": round(save_s, 2),
            "stall_p99_ms": round(float(np.percentile(stalls, 99)), 1) if len(stalls) else None,
            "worst_stalls_ms_at_s": [[round(s, 1), round(t, 3)] for t, s in worst],
            "full_collections_over_5ms": collections, "load_average": os.getloadavg()[0],
            **({"redraw_ms": {"worst": round(max(draws), 1), "median": round(float(np.median(draws)), 1),
                              "draws": len(draws)}} if draws else {})}


if __name__ == "__main__":
    sys.exit(main())
