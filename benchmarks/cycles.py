"""Memory over many runs: `python -m benchmarks.cycles [--cycles N] [--model M]` prints one JSON line.

The real window, with settings (a temporary settings file, so the autosave runs after every run), does N
Generate/Stop cycles through the keyboard, as a user would: Ctrl+Enter, three tokens, Esc, wait for the end of the
run and for its autosave. The GUI process's resident memory is read after the first ten cycles and after the last;
a GUI that keeps every run it ever made grows with every cycle, one that bounds what it keeps (app.run_store) stops
growing once its bound is reached. The default model is the tests' tiny random one (written to a temporary folder),
so this measures the app's bookkeeping rather than a model's size.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cycles = int(argv[argv.index("--cycles") + 1]) if "--cycles" in argv else 150
    model = argv[argv.index("--model") + 1] if "--model" in argv else None
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="ilab-bench-cycles-") as tmp:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(tmp, "inference-lab.ini")
        if model is None:
            from tests.tiny_model import write_tiny_checkpoints

            (Path(tmp) / "tiny").mkdir()
            model = str(write_tiny_checkpoints(Path(tmp) / "tiny").gguf)
        result = measure(model, cycles)
    print(json.dumps(result))
    return 0 if result.get("cycles") == cycles else 1


def measure(model: str, cycles: int) -> dict:
    import gc

    import psutil
    from PySide6 import QtCore, QtWidgets
    from PySide6.QtTest import QTest

    from app.main_window import MainWindow

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(sys.argv[:1])
    win = MainWindow(model, persist=True, interactive=False, device="cpu", dtype="float32")
    win.show()
    proc = psutil.Process()

    def wait(pred, timeout: float = 60.0) -> bool:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                return False
            app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 10)
        return True

    if not wait(lambda: win.bridge.info is not None and win.panels["generation"]._loaded):
        return {"error": "the model did not load"}
    gen = win.panels["generation"]
    gen.set_max_new_tokens(64)
    gen.ignore_eos = True
    tokens = [0]
    finished = [0]
    win.bridge.sig_token.connect(lambda _ev: tokens.__setitem__(0, tokens[0] + 1))
    win.bridge.sig_finished.connect(lambda _ev: finished.__setitem__(0, finished[0] + 1))
    rss: list[float] = []
    writer = getattr(win, "session_writer", None)
    t0 = time.perf_counter()
    done = 0
    for _ in range(cycles):
        tokens[0], before = 0, finished[0]
        QTest.keyClick(win, QtCore.Qt.Key.Key_Return, QtCore.Qt.KeyboardModifier.ControlModifier)
        if not wait(lambda b=before: tokens[0] >= 3 or finished[0] > b):
            break
        QTest.keyClick(win, QtCore.Qt.Key.Key_Escape)
        if not wait(lambda b=before: finished[0] > b and win.bridge.state == "idle"):
            break
        wait(lambda: writer is None or not writer.busy())  # the autosave of this run is written
        win.tick_panels(flush=True)
        done += 1
        if done % 10 == 0 or done == cycles:
            gc.collect()
            rss.append(proc.memory_info().rss / 2**20)
            print(f"cycle {done}: {rss[-1]:.1f} MiB, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    store = getattr(win, "run_store", None)
    win.close()
    if len(rss) < 2:
        return {"cycles": done, "error": "the cycles did not complete"}
    return {"cycles": done, "rss_mib_after_10": rss[0], "rss_mib_after_all": rss[-1],
            "growth_after_10": rss[-1] / rss[0] - 1.0, "rss_mib_every_10": rss, "seconds_per_cycle": seconds / done,
            "runs_kept": len(store.runs) if store is not None else None}


if __name__ == "__main__":
    sys.exit(main())
