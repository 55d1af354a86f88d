"""The app's engine with libgomp's spin counts side by side: `python -m benchmarks.gui_spin [--pairs N]
[--spins 300000,10000,0] [--dtype D]`.

Each of N rounds starts the app once per spin count (fresh processes, benchmarks.gui's layout: every panel on
screen) with GOMP_SPINCOUNT set to it (300,000 is libgomp's default, what the CLI and the
app's engine use unless GOMP_SPINCOUNT is set), and runs two 128-token greedy generations in each, in `D` (default: the
dtype the app loads on this CPU); one JSON line per generation: TPOT, the engine's and the GUI's CPU per token (an
engine CPU near the TPOT: decode ran on one thread), and the GUI thread's stall p99 (a 10 ms probe timer, as
benchmarks.gui). Run it quiet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

SPINS = "300000,10000,0"


def run_app(label: str, dtype: str, generations: int = 2) -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(tempfile.mkdtemp(prefix="ilab-spin-"), "s.ini")
    from dataclasses import replace

    import numpy as np
    import psutil
    from PySide6 import QtCore

    from benchmarks.gui import PROMPT, TickProbe, open_window, show_every_panel

    app, win = open_window(None, dtype=dtype)
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
        print(json.dumps({"label": label, "dtype": dtype, "rep": r, "tpot_ms": round(ev.tpot_s * 1e3, 2),
                          "engine_cpu_ms_per_token": round((c1 - c0) / n * 1e3, 1),
                          "gui_cpu_ms_per_token": round((g1 - g0) / n * 1e3, 1),
                          "stall_p99_ms": round(float(np.percentile(stalls, 99)), 1), "tokens": n}), flush=True)
        for _ in range(100):  # the end of the run (autosave) before the next
            app.processEvents()
            time.sleep(0.01)
    win.close()


def main(argv: list[str]) -> int:
    def opt(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default

    if "--app" in argv:  # one app process (the parent sets GOMP_SPINCOUNT)
        run_app(opt("--app", ""), opt("--dtype", "float32"))
        return 0
    from engine.loaders import preferred_dtype

    dtype = opt("--dtype", preferred_dtype("cpu"))
    spins = [str(int(x)) for x in opt("--spins", SPINS).split(",")]
    for _ in range(int(opt("--pairs", "2"))):
        for spin in spins:
            env = dict(os.environ, GOMP_SPINCOUNT=spin)
            r = subprocess.run([sys.executable, "-m", "benchmarks.gui_spin", "--app", f"spin{spin}", "--dtype", dtype],
                               env=env, capture_output=True, text=True)
            print("\n".join(x for x in r.stdout.splitlines() if x.startswith("{")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
