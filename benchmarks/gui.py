"""GUI responsiveness, measured: `python -m benchmarks.gui [--smoke]` prints one JSON line (run by `make bench`).

The window runs as users run it: with settings (a temporary settings file named by INFERENCE_LAB_SETTINGS, so the
user's own are never touched), hence with the autosave after every generation.

- main-thread stalls during a 128-token generation and the END_S seconds after it finished (where the autosave
  runs), with every panel on screen: the default layout tabs some docks
  behind others (Capacity and Batching lab behind Roofline), and a tabbed-away panel never paints, so the benchmark
  lays every dock out side by side (no tabs, 2400×1400) and reports which panels were on screen and painted;
  a 10 ms QTimer probe records the gaps between its ticks; a stall is a gap minus the 10 ms interval (p50, p99,
  worst, over the generation and its end together; the worst of each part apart too), and how long after the
  end the autosave file was complete;
- the panels' redraw rate during that generation (draws per second, all panels together and the busiest one), and
  per panel the draws and the paint events its widgets received (a panel whose data does not change during a
  generation, such as the capacity estimator, draws and paints once when laid out, not during it);
- keystroke → token boundaries for prompts of about 200 and 2,000 tokens: one key press through re-tokenizing,
  re-highlighting and a synchronous repaint of the editor;
- the generation's own TPOT with the GUI running, and the CPU time the GUI process and the engine process spent
  per token.

`python -m benchmarks.gui --compare [--rounds N] [--conditions quiet,busy] [--output F [--append LABEL]] [--model M]
[--dtype D] [--threads N]` is the app-against-the-CLI benchmark (--threads: both at that count, else both at auto;
--append adds this run to F's runs under LABEL instead of replacing the file):
on a quiet machine and next to one `yes` busy loop, each round runs the CLI, the app (this module, in a fresh
process) and the CLI again on the same prompt, dtype and thread setting, and prints the app's TPOT over the CLI's
mean of the same round, with the app's stalls. --dtype sets both (default: what the app chooses on this CPU). To
stand in for a CPU with only AVX2 on a machine with AVX-512, run it as
`ATEN_CPU_CAPABILITY=avx2 python -m benchmarks.gui --compare --dtype float32`: torch then takes its AVX2 kernels in
every process (the output's `cpu_capability` says which it used), and float32 is what the app loads there; the
memory system stays this machine's.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

WINDOW = (2400, 1400)
END_S = 2.0  # the probe keeps running this long after Finished: the end of a run (the autosave) is what users feel
# Every dock in its own place, no tabs, in a grid whose minimum sizes fit the window (a layout that does not fit
# makes the window grow, and a window resize repaints all of it): top and bottom rows side by side, left and right
# columns stacked. A panel not named here joins the shortest group.
BENCH_LAYOUT = {
    "top": ("prompt", "preview", "sampling", "timeline"),
    "left": ("generation", "branches", "constrain"),
    "right": ("attention", "lens", "load_lab"),
    "bottom": ("kv_cache", "roofline", "capacity", "batching"),
}
PROMPT = "Explain what a KV cache is in two sentences."
PROBE_MS = 10.0  # the stall probe's interval
PARAGRAPH = ("The key and value vectors of every past token never change during decoding, so an inference engine "
             "keeps them in a cache and appends one row per step; numbers like 2024 or 3.14159 split into digits. ")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:  # not a run: a measurement started by asking for help disturbs others
        print(__doc__)
        return 0
    if "--compare" in argv:
        return compare(argv)
    smoke = "--smoke" in argv  # a short run that only checks it works
    model = argv[argv.index("--model") + 1] if "--model" in argv else None  # default: SmolLM2-135M
    dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "auto"  # auto: what the app chooses
    n_new, sizes, presses = (8, (50, 200), 3) if smoke else (128, (200, 2000), 30)
    if "--tokens" in argv:  # the generation's length (issue 50 measures 256)
        n_new = int(argv[argv.index("--tokens") + 1])
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ilab-bench-gui-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else None  # None: the app's auto
        return _measure(model, n_new, sizes, presses, dtype, lens="--lens" in argv, threads=threads)


def _measure(model: str | None, n_new: int, sizes: tuple[int, ...], presses: int, dtype: str = "auto",
             lens: bool = False, threads: int | None = None) -> int:
    from PySide6 import QtCore
    from PySide6.QtTest import QTest

    from app import session_io

    app, win = open_window(model, dtype=dtype)
    if win is None:
        return 1
    paints = PaintCounter(win.panels)
    paints.start(app)
    show_every_panel(win)
    for _ in range(5):
        app.processEvents()
    painted_once = paints.stop(app)  # the layout's first paint: every panel on screen must have painted

    # ---- keystroke → boundaries ----
    prompt = win.panels["prompt"]
    typing = {}
    for target in sizes:
        text = ""
        while len(win.bridge.tokenizer.encode(text).ids) < target:
            text += PARAGRAPH
        prompt.set_text(text)
        app.processEvents()
        editor = prompt.editor
        editor.setFocus()
        cursor = editor.textCursor()
        cursor.movePosition(cursor.MoveOperation.End)
        editor.setTextCursor(cursor)
        times = []
        for i in range(presses):
            t0 = time.perf_counter()
            QTest.keyClick(editor, "a" if i % 2 else " ")
            editor.viewport().repaint()
            times.append((time.perf_counter() - t0) * 1e3)
        typing[target] = {"tokens": len(prompt.tok.ids), "p50_ms": float(np.median(times)),
                          "max_ms": float(np.max(times))}

    # ---- stalls during a generation ----
    prompt.set_text(PROMPT)
    gen = win.panels["generation"]
    try:  # a base model (Gemma 3 270M) has no chat template: its prompt goes as plain text, as in the CLI run
        win.bridge.tokenizer.chat_prompt(PROMPT)
        chat = True
    except ValueError:
        chat = False
    gen.set_chat(chat)
    gen.set_max_new_tokens(n_new)
    gen.ignore_eos = True  # the full n_new tokens, as the CLI's --ignore-eos (a test knob, not a GUI one)
    if lens:  # every capture the panels make, the logit lens's L + 2 heads a step included
        win.panels["lens"].set_capture(True)
    if threads is not None:  # Engine → Decode threads, as a user sets it
        win.set_threads(threads)
    for _ in range(5):  # the user typed and toggled before pressing Generate: that relayout is not the run's
        app.processEvents()
    size_before = win.size().toTuple()
    probe = TickProbe()
    finished = {}
    done = QtCore.QEventLoop()
    win.bridge.sig_finished.connect(lambda ev: (finished.setdefault("ev", ev), done.quit()))
    win.bridge.sig_failed.connect(lambda m: (finished.setdefault("error", m), done.quit()))
    last_token = [0.0]  # when the last token reached the window: what comes after is the run's end
    token_times: list[float] = []  # when each token reached the GUI thread: the app's time per token, end to end
    win.bridge.sig_token.connect(lambda _ev: (last_token.__setitem__(0, time.perf_counter()),
                                              token_times.append(last_token[0])))
    draws0 = {k: p.draw_count for k, p in win.panels.items()}
    visible = {k: on_screen(p) for k, p in win.panels.items()}
    bridge = win.bridge
    orig = bridge.params
    from dataclasses import replace

    bridge.set_params(replace(orig, temperature=0.0))
    import psutil

    engine_proc = psutil.Process(bridge.process.pid)
    cpu0 = (_cpu_s(), sum(engine_proc.cpu_times()[:2]))
    thread0 = time.thread_time()  # the GUI thread's own CPU (this is it): what issue 50 holds to a budget
    events = _EventCount(bridge)
    t_start = time.perf_counter()
    t_start_wall = time.time()
    probe.start()
    paints.start(app)
    if not gen.generate():
        return 1
    done.exec()
    gui_cpu_generating = _cpu_s() - cpu0[0]  # the GUI's CPU up to Finished: what shares the cores with decode
    gui_thread_generating = time.thread_time() - thread0
    redraws_generating = sum(p.draw_count - draws0[k] for k, p in win.panels.items())
    events.stop()
    # The probe goes on: the end of the run (the Finished event's handlers, the autosave) is what users wait through.
    t_end = time.perf_counter()
    autosave_s = run_on_watching_autosave(session_io.autosave_path(), t_start_wall, END_S)
    probe.stop()
    # What arrived with the last tokens is drawn now (a short run can end between two ticks of the shared timer,
    # and a panel's last update would otherwise go uncounted: the smoke test then saw a panel with no draw).
    win.tick_panels(flush=True)
    for _ in range(3):
        app.processEvents()
    painted = paints.stop(app)
    elapsed = t_end - t_start  # the generation: the redraw rates are per second of it
    cpu = (_cpu_s() - cpu0[0], sum(engine_proc.cpu_times()[:2]) - cpu0[1])
    if "ev" not in finished:
        print(finished.get("error", "generation failed"), file=sys.stderr)
        return 1
    fin = finished["ev"]
    stalls = probe.stalls()
    n_during = int(np.searchsorted(np.asarray(probe.ticks), last_token[0], side="right"))  # gaps the last token ended
    draws = {k: p.draw_count - draws0[k] for k, p in win.panels.items()}
    result = {
        "tokens": int(len(fin.ids)), "tpot_ms_with_gui": fin.tpot_s * 1e3, "ttft_ms_with_gui": fin.ttft_s * 1e3,
        "dtype": win.bridge.info.dtype,
        "cpu_capability": _cpu_capability(),
        # CPU time per generated token, from Generate to the last draw END_S after Finished (GUI: this process,
        # every thread, the autosave included), and the GUI's up to Finished alone
        "gui_cpu_ms_per_token": cpu[0] / max(len(fin.ids), 1) * 1e3,
        "gui_cpu_ms_per_token_while_generating": gui_cpu_generating / max(len(fin.ids), 1) * 1e3,
        "engine_cpu_ms_per_token": cpu[1] / max(len(fin.ids), 1) * 1e3,
        "gui_thread_cpu_ms_per_token_while_generating": gui_thread_generating / max(len(fin.ids), 1) * 1e3,
        # the same CPU per panel redraw up to Finished: drawing is gated by its cost, so a cheaper draw shows as
        # more redraws at the same CPU per token, and this is what fell
        "gui_thread_ms_per_redraw": gui_thread_generating / max(redraws_generating, 1) * 1e3,
        # what crossed from the engine process up to Finished: pipe messages, and the events they carried
        "engine_messages_per_token": events.messages / max(len(fin.ids), 1),
        "engine_events_per_token": events.events / max(len(fin.ids), 1),
        "stall_p50_ms": float(np.percentile(stalls, 50)), "stall_p99_ms": float(np.percentile(stalls, 99)),
        "stall_max_ms": float(stalls.max()),
        "stall_max_ms_during_generation": float(stalls[:n_during].max(initial=0.0)),
        "stall_max_ms_after_last_token": float(stalls[n_during:].max(initial=0.0)),
        # from the first token to the last as the GUI thread received them, per token: all the app's work included
        "wall_ms_per_token_received": (token_times[-1] - token_times[0]) / max(len(token_times) - 1, 1) * 1e3,
        "runtime": win.bridge.runtime,
        "stall_p99_ms_during_generation": float(np.percentile(stalls[:n_during], 99)) if n_during else 0.0,
        "after_finished_s": END_S,
        "autosave_done_after_finished_s": autosave_s,  # None: not written within END_S
        "redraws_per_s_all_panels": sum(draws.values()) / elapsed,
        "redraws_per_s_busiest_panel": max(draws.values()) / elapsed,
        **{f"keystroke_{n}_tokens_ms": typing[n]["p50_ms"] for n in sizes},
        **{f"keystroke_{n}_tokens_max_ms": typing[n]["max_ms"] for n in sizes},
        "peak_rss_mb": _peak_rss_mb(),
        "window": list(WINDOW),
        "window_during_generation": [list(size_before), list(win.size().toTuple())],  # a resize repaints it all
        "panels": len(win.panels),
        "panels_on_screen": sum(visible.values()),
        "panels_painted": sum(n > 0 for n in painted_once.values()),  # when laid out
        "panels_painted_during_generation": sum(n > 0 for n in painted.values()),
        "not_on_screen": [k for k, v in visible.items() if not v],
        "draws_per_panel": draws,
        "paints_per_panel": painted,  # during the generation (static panels, e.g. capacity, need none)
    }
    win.close()
    print(json.dumps(result))
    return 0


def open_window(model: str | None, **kwargs):
    """(the QApplication, the main window as users run it — settings on, WINDOW's size — with the model loaded), or
    (app, None) when the model could not be loaded (the reason printed to stderr)."""
    from PySide6 import QtCore, QtWidgets

    from app.main_window import MainWindow

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(sys.argv[:1])
    win = MainWindow(model, persist=True, interactive=False, **kwargs)
    win.resize(*WINDOW)
    win.show()
    loop = QtCore.QEventLoop()
    win.bridge.sig_model_loaded.connect(lambda _i: loop.quit())
    win.bridge.sig_load_failed.connect(lambda m: (print(m, file=sys.stderr), loop.quit()))
    loop.exec()
    return app, (win if win.bridge.info is not None else None)


def run_on_watching_autosave(autosave, since_wall: float, seconds: float) -> float | None:
    """Run the event loop for `seconds` from now (a run just ended): how long after now the autosave file was
    written (its mtime at or past `since_wall`, the run's start), or None when it was not within that time."""
    from PySide6 import QtCore

    t_end = time.perf_counter()
    saved_after: dict[str, float] = {}

    def watch() -> None:
        if "s" not in saved_after and autosave.is_file() and autosave.stat().st_mtime >= since_wall:
            saved_after["s"] = time.perf_counter() - t_end

    watcher = QtCore.QTimer()
    watcher.setInterval(20)
    watcher.timeout.connect(watch)
    watcher.start()
    end_loop = QtCore.QEventLoop()
    QtCore.QTimer.singleShot(int(seconds * 1e3), end_loop.quit)
    end_loop.exec()
    watcher.stop()
    return saved_after.get("s")


def show_every_panel(win) -> None:
    """Lay every dock out side by side (BENCH_LAYOUT), so that no panel hides behind a tab."""
    from PySide6 import QtCore

    areas = {"top": QtCore.Qt.DockWidgetArea.TopDockWidgetArea, "left": QtCore.Qt.DockWidgetArea.LeftDockWidgetArea,
             "right": QtCore.Qt.DockWidgetArea.RightDockWidgetArea,
             "bottom": QtCore.Qt.DockWidgetArea.BottomDockWidgetArea}
    rows = {area: [n for n in names if n in win.docks] for area, names in BENCH_LAYOUT.items()}
    listed = {n for names in rows.values() for n in names}
    for name in (n for n in win.docks if n not in listed):  # a newer panel joins the shortest group
        min(rows.values(), key=len).append(name)
    for dock in win.docks.values():
        dock.setFloating(False)
        win.removeDockWidget(dock)
    for area, names in rows.items():
        along = (QtCore.Qt.Orientation.Horizontal if area in ("top", "bottom") else QtCore.Qt.Orientation.Vertical)
        for i, name in enumerate(names):
            dock = win.docks[name]
            if i == 0:
                win.addDockWidget(areas[area], dock)
            else:
                win.splitDockWidget(win.docks[names[i - 1]], dock, along)
            dock.show()
        if names:
            extent = WINDOW[0] if along == QtCore.Qt.Orientation.Horizontal else WINDOW[1] // 2
            win.resizeDocks([win.docks[n] for n in names], [extent // len(names)] * len(names), along)


def on_screen(widget) -> bool:
    """Visible and not covered: some of the widget is really drawn in the window."""
    return widget.isVisible() and not widget.visibleRegion().isEmpty()


class TickProbe:
    """A PROBE_MS QTimer on the GUI thread: the gaps between its ticks, less the interval, are the GUI's stalls."""

    def __init__(self) -> None:
        from PySide6 import QtCore

        self.gaps: list[float] = []  # ms between ticks
        self.ticks: list[float] = []  # perf_counter of each tick
        self.last = time.perf_counter()
        self.timer = QtCore.QTimer()
        self.timer.setTimerType(QtCore.Qt.TimerType.PreciseTimer)
        self.timer.setInterval(int(PROBE_MS))
        self.timer.timeout.connect(self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        self.gaps.append((now - self.last) * 1e3)
        self.ticks.append(now)
        self.last = now

    def start(self) -> None:
        self.last = time.perf_counter()
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def stalls(self) -> np.ndarray:
        """Each gap less the interval (ms): 0 for a tick on time."""
        return np.maximum(np.asarray(self.gaps) - PROBE_MS, 0.0)


class PaintCounter:
    """Counts the paint events each panel's widgets receive (an event filter on each panel's widgets only: an
    application-wide Python filter would run for every event of the app and cost the GUI thread ~9 %)."""

    def __init__(self, panels: dict) -> None:
        from PySide6 import QtCore

        class _Filter(QtCore.QObject):
            def __init__(self, name: str) -> None:
                super().__init__()
                self.name = name

            def eventFilter(self, obj, event):  # noqa: N802 — Qt's name
                if event.type() == QtCore.QEvent.Type.Paint:
                    outer.counts[self.name] += 1
                return False

        outer = self
        self.panels = panels
        self.counts = dict.fromkeys(panels, 0)
        self._filters = {name: _Filter(name) for name in panels}
        self._watched: list = []

    def start(self, app) -> None:
        from PySide6 import QtWidgets

        self.counts = dict.fromkeys(self.panels, 0)
        for name, panel in self.panels.items():
            for w in (panel, *panel.findChildren(QtWidgets.QWidget)):
                w.installEventFilter(self._filters[name])
                self._watched.append((w, self._filters[name]))

    def stop(self, app) -> dict[str, int]:
        for w, f in self._watched:
            w.removeEventFilter(f)
        self._watched = []
        return dict(self.counts)


class _EventCount:
    """Counts the messages the bridge receives from the engine process, and the events they carry, until stop."""

    def __init__(self, bridge) -> None:
        self.messages = self.events = 0
        self._sig = bridge.relay.sig_raw
        self._sig.connect(self._count)

    def _count(self, msg) -> None:
        self.messages += 1
        self.events += len(msg) if isinstance(msg, list) else 1

    def stop(self) -> None:
        self._sig.disconnect(self._count)


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def compare(argv: list[str]) -> int:
    """The app against the CLI, in one run: quiet and next to one busy loop (see the module's docstring)."""
    from benchmarks.bench import BusyMeter, run_json
    from benchmarks.load import Competitor

    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
    output = argv[argv.index("--output") + 1] if "--output" in argv else None
    append = argv[argv.index("--append") + 1] if "--append" in argv else None  # a label: add to --output's runs
    conditions = argv[argv.index("--conditions") + 1].split(",") if "--conditions" in argv else ["quiet", "busy"]
    if set(conditions) - {"quiet", "busy"}:
        raise SystemExit(f"--conditions takes quiet, busy or both, got {','.join(conditions)}")
    model = ["--model", argv[argv.index("--model") + 1]] if "--model" in argv else []
    from benchmarks.bench import prompt_ids
    from engine.loaders import preferred_dtype
    from engine.tokenizer.load import load_tokenizer

    # what the app loads (or --dtype); the CLI's own "auto" is float32 on a CPU
    dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else preferred_dtype("cpu")
    chat = ["--chat"] if prompt_ids(load_tokenizer(model[1] if model else None))[1] else []  # as the app decides
    threads = ["--threads", argv[argv.index("--threads") + 1]] if "--threads" in argv else []  # both; default auto
    cli = ["-m", "engine", "generate", *chat, *model, "--greedy", "--ignore-eos", "--max-new-tokens", "128",
           "--prompt", PROMPT, "--json", "--dtype", dtype, *threads]
    command = " ".join(["python -m benchmarks.gui --compare", *model, "--dtype", dtype, *threads])
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        command = f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']} {command}"
    out: dict = {"command": command, "rounds": rounds,
                 "dtype": dtype, "cpu_capability": _cpu_capability(), "conditions": {}}
    for condition in conditions:
        rows = []
        for r in range(rounds):
            comp = Competitor(condition if condition == "busy" else "none", limit=900)
            meter = BusyMeter()
            try:
                before = run_json(cli)["tpot_s"] * 1e3
                gui = run_json(["-m", "benchmarks.gui", *model, "--dtype", dtype, *threads])
                after = run_json(cli)["tpot_s"] * 1e3
                others = meter.cores_used()  # every other process, the competitor included
            finally:
                comp.stop()
            if gui["dtype"] != dtype:
                raise RuntimeError(f"the app loaded {gui['dtype']}, the CLI ran {dtype}")
            cli_ms = (before + after) / 2
            rows.append({"cli_tpot_ms": [before, after], "app": gui, "app_over_cli": gui["tpot_ms_with_gui"] / cli_ms,
                         "other_processes_cores": others})
            print(f"{condition} round {r + 1}: CLI {before:.1f} / {after:.1f} ms, app {gui['tpot_ms_with_gui']:.1f} ms"
                  f" ({rows[-1]['app_over_cli']:.2f} ×), stall p99 {gui['stall_p99_ms']:.1f} ms, GUI CPU "
                  f"{gui['gui_cpu_ms_per_token']:.1f} ms/token ({gui['gui_cpu_ms_per_token_while_generating']:.1f} "
                  f"while generating), engine CPU {gui['engine_cpu_ms_per_token']:.1f} "
                  f"ms/token; other processes {others:.2f} cores", flush=True)
        out["conditions"][condition] = {
            "rounds": rows,
            "app_over_cli_median": float(np.median([x["app_over_cli"] for x in rows])),
            "stall_p99_ms_max": max(x["app"]["stall_p99_ms"] for x in rows),
        }
    print(json.dumps({c: {k: v for k, v in d.items() if k != "rounds"} for c, d in out["conditions"].items()}))
    if output and append:
        _append_run(output, append, out)
    elif output:
        with open(output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _append_run(path: str, label: str, run: dict) -> None:
    """Add `run` under `label` to the file's "runs", keeping what it held (an older file's single run becomes the
    first of its runs, labelled "earlier")."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        doc = {"runs": []}
    if "runs" not in doc:
        doc = {"runs": [{"label": "earlier", **doc}]}
    doc["runs"].append({"label": label, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **run})
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _cpu_capability() -> str:
    """The vector instructions torch's kernels use in this process (ATEN_CPU_CAPABILITY can lower them)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    sys.exit(main())
