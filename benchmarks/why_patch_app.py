"""Activation patching on the user's own model, driven from the app: `python -m benchmarks.why_patch_app [--model
PATH] [--smoke] [--screenshot OUT.png]` prints one JSON line.

The window runs as benchmarks.gui runs it (settings on, 2400×1400), with the model loaded as a user loads it (a
GGUF goes to llama.cpp). The Why panel's patch mode, its defaults ("The Eiffel Tower…" / "The Colosseum…", " Paris"
against " Rome"), per head too, is run twice through the panel's own Run and Cancel buttons:
- to the end: the wall time from Run to the result, the progress reports the panel received, the grid's shape;
- again, with Cancel clicked after the CANCEL_AFTER-th progress report: the time from the click to the panel's
  "cancelled" outcome (the engine checks between forward passes), and that nothing of it was kept.
Without --model it uses benchmarks.llamacpp's 1B-scale Q4_0 file of random weights (built once, 0.56 GB).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

CANCEL_AFTER = 4  # progress reports before Cancel is clicked


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    model = argv[argv.index("--model") + 1] if "--model" in argv else None
    shot = argv[argv.index("--screenshot") + 1] if "--screenshot" in argv else None
    if model is None:
        from benchmarks.llamacpp import big_path, build_big

        path = big_path("Q4_0")
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            build_big(path, "Q4_0")
        model = str(path)
    with tempfile.TemporaryDirectory(prefix="ilab-bench-patch-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        return _measure(model, "--smoke" in argv, shot)


def _run(app, win, cancel_after: int | None) -> dict:
    from PySide6 import QtCore, QtTest

    panel = win.panels["why"]
    reports: list[tuple[float, str]] = []
    outcome: dict = {}
    loop = QtCore.QEventLoop()

    def progress(fraction: float, message: str) -> None:
        reports.append((fraction, message))
        if cancel_after is not None and len(reports) == cancel_after and "click" not in outcome:
            outcome["click"] = time.perf_counter()
            QtTest.QTest.mouseClick(panel.cancel_button, QtCore.Qt.MouseButton.LeftButton)

    def done(msg) -> None:
        outcome["done"], outcome["msg"] = time.perf_counter(), msg
        loop.quit()

    win.bridge.sig_why_progress.connect(progress)
    win.bridge.sig_why_done.connect(done)
    before = panel.results.get("patch")
    t0 = time.perf_counter()
    if not panel.run():
        raise SystemExit(f"the Why panel refused to run: {panel.summary.text()}")
    loop.exec()
    win.bridge.sig_why_progress.disconnect(progress)
    win.bridge.sig_why_done.disconnect(done)
    panel.flush()
    msg = outcome["msg"]
    out = {"seconds": round(outcome["done"] - t0, 2), "progress_reports": len(reports),
           "last_fraction": round(reports[-1][0], 3) if reports else None, "ok": msg.ok,
           "cancelled": msg.cancelled, "failure": msg.failure}
    if "click" in outcome:
        out["cancel_to_done_s"] = round(outcome["done"] - outcome["click"], 2)
        out["kept"] = panel.results.get("patch") is not before  # a cancelled run keeps nothing
    elif msg.ok:
        r = msg.result
        out["forwards"] = r["forwards"]
        out["grid"] = [len(r["restored"]), len(r["restored"][0])]
        if "restored_heads" in r:
            out["heads_grid"] = [len(r["restored_heads"]), len(r["restored_heads"][0])]
    return out


def _measure(model: str, smoke: bool, shot: str | None) -> int:
    from benchmarks.gui import open_window

    app, win = open_window(model)
    if win is None:
        return 1
    win.docks["why"].show()
    win.docks["why"].raise_()
    panel = win.panels["why"]
    panel.set_mode("patch")
    panel.patch_heads_box.setChecked(not smoke)
    info = win.bridge.info
    full = _run(app, win, None)
    if shot:
        win.tick_panels(flush=True)
        full["screenshot"] = shot if win.docks["why"].grab().save(shot, "PNG") else None
    cancelled = _run(app, win, CANCEL_AFTER)
    result = {"model": info.name, "runtime": win.bridge.runtime, "layers": info.n_layers,
              "heads": info.n_heads, "full": full, "cancelled": cancelled}
    win.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
