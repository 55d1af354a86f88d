"""The app's engine with libgomp's default spin against a short one: `python -m benchmarks.gui_spin [--pairs N]`.

Each of N pairs starts the app twice (fresh processes, benchmarks.gui's layout: every panel on screen), once with
GOMP_SPINCOUNT=300000 (libgomp's default, what the CLI uses) and once with 0 (what engine.server sets in the app's
engine process), and runs two 128-token greedy generations in each; one JSON line per generation: TPOT, the engine's
and the GUI's CPU per token, and the GUI thread's stall p99 (a 10 ms probe timer, as benchmarks.gui). Run it quiet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

SPINS = ("300000", "0")


def run_app(label: str, generations: int = 2) -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(tempfile.mkdtemp(prefix="ilab-spin-"), "s.ini")
    from dataclasses import replace

    import numpy as np
    import psutil
    from PySide6 import QtCore

    from benchmarks.gui import PROMPT, TickProbe, open_window, show_every_panel

    app, win = open_window(None, dtype="float32")
    show_every_panel(win)
    for _ in range(5):
        app.processEvents()
    win.panels["prompt"].set_text(PROMPT)
    gen = win.panels["generation"]
    gen.set_chat(True)
    gen.set_max_new_tokens(128)
    gen.ignore_eos = True
    for _ in range(5):
        app.processEvents()
    win.bridge.set_params(replace(win.bridge.params, temperature=0.0))
    engine = psutil.Process(win.bridge.process.pid)
    for r in range(generations):
        probe = TickProbe()
        done, fin = QtCore.QEventLoop(), {}
        conn = win.bridge.sig_finished.connect(lambda ev, fin=fin, done=done: (fin.setdefault("ev", ev), done.quit()))
        c0, g0 = sum(engine.cpu_times()[:2]), sum(os.times()[:2])
        probe.start()
        gen.generate()
        done.exec()
        probe.stop()
        c1, g1 = sum(engine.cpu_times()[:2]), sum(os.times()[:2])
        win.bridge.sig_finished.disconnect(conn)
        ev = fin["ev"]
        n = len(ev.ids)
        stalls = probe.stalls()
        print(json.dumps({"label": label, "rep": r, "tpot_ms": round(ev.tpot_s * 1e3, 2),
                          "engine_cpu_ms_per_token": round((c1 - c0) / n * 1e3, 1),
                          "gui_cpu_ms_per_token": round((g1 - g0) / n * 1e3, 1),
                          "stall_p99_ms": round(float(np.percentile(stalls, 99)), 1), "tokens": n}), flush=True)
        for _ in range(100):  # the end of the run (autosave) before the next
            app.processEvents()
            time.sleep(0.01)
    win.close()


def main(argv: list[str]) -> int:
    if "--app" in argv:  # one app process (the parent sets GOMP_SPINCOUNT)
        run_app(argv[argv.index("--app") + 1])
        return 0
    pairs = int(argv[argv.index("--pairs") + 1]) if "--pairs" in argv else 2
    for _ in range(pairs):
        for spin in SPINS:
            env = dict(os.environ, GOMP_SPINCOUNT=spin)
            r = subprocess.run([sys.executable, "-m", "benchmarks.gui_spin", "--app", f"spin{spin}"], env=env,
                               capture_output=True, text=True)
            print("\n".join(x for x in r.stdout.splitlines() if x.startswith("{")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
