"""A long run's session reopened, and a late step of the live run selected, in the app (issue 26): each prints one
JSON line.

`python -m benchmarks.reopen --make FILE.ilab [--tokens N] [--step K] [--model M] [--layers 0,15,29]
[--long-prompt]` runs the app as users run it (settings on, every dock laid out side by side, offscreen:
benchmarks.gui), generates N new tokens (greedy, --ignore-eos, the short chat prompt of benchmarks.longrun, so every
layer's attention is captured; --long-prompt: that prompt eight times, so only the shown layer is; --prompt-tokens P:
a plain-text prompt of P tokens, a KV cache of P positions at once, only the shown layer captured), copies the run's
autosave to FILE.ilab (keep it outside the repository: it is large), then, with the run still live in the engine,
selects step K as a click on the heat map does (`Bridge.select_step`) and times until the Attention panel has drawn
that step and its heat map has painted:
- for each of --layers (default: first, middle, last), head 0 … the model's last head in turn: the newest step
  selected, layer and head set (and what that asks of the engine answered), then step K; a step whose row the
  window let go is recomputed by the engine from the live KV cache (engine.run.recompute), so this is click →
  request → engine → reply → draw → paint;
- then, step K still selected, a layer switch to a layer not yet asked for (the other way a user reaches a step);
- and a step the panel holds (the newest, of the captured layer), for comparison.

`python -m benchmarks.reopen --open FILE.ilab` is the reopening, in this fresh process, without the model (as
`python -m app --open-session` does): window built, File → Open session's path (read in the writer thread, replayed in
slices on the GUI thread) until the replay is done and the window has painted. It prints the time from the process's
start and from the moment the window was ready (the open alone), the process's peak RSS, and what the Attention panel
says: a step it kept (the newest) drawn, and the steps that were not kept named.

`python -m benchmarks.reopen --resave IN.ilab OUT.ilab` reads a session file of any version and writes it again in
the current format (a file written before the packed format, version 2, measured as it is written now); it prints
the seconds of each.

Run them under /tmp/quiet.sh (or another quiet moment): the times are wall-clock and include waiting for a core.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time

T_START = time.time()  # this module's import: the process's own start comes from psutil


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def opt(name: str, default: str | None) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else default

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    if "--open" in argv:
        return reopen(opt("--open", ""))
    if "--resave" in argv:
        i = argv.index("--resave")
        return resave(*argv[i + 1:i + 3])
    if "--make" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    layers = opt("--layers", None)
    with tempfile.TemporaryDirectory(prefix="ilab-bench-reopen-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        return make(opt("--make", ""), int(opt("--tokens", "7200")), int(opt("--step", "7000")), opt("--model", None),
                    [int(x) for x in layers.split(",")] if layers else None, "--long-prompt" in argv,
                    int(opt("--prompt-tokens", "0")))


def _rss_mib() -> tuple[float, float]:
    """(current, peak) RSS of this process in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _wait(app, until, timeout_s: float) -> bool:
    """Turn the event loop (as the app's own exec() would: timers, queued signals, paints) until `until()`."""
    from PySide6 import QtCore

    deadline = time.perf_counter() + timeout_s
    while not until():
        if time.perf_counter() > deadline:
            return False
        app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 5)
    return True


class Painted:
    """Counts the paint events of a widget (the heat map's viewport): drawn means painted on screen."""

    def __init__(self, widget) -> None:
        from PySide6 import QtCore

        class Filter(QtCore.QObject):
            def eventFilter(inner, obj, event):  # noqa: N802, N805 — Qt's name
                if event.type() == QtCore.QEvent.Type.Paint:
                    self.count += 1
                    self.last = time.perf_counter()
                return False

        self.count, self.last = 0, 0.0
        self._filter = Filter()
        widget.installEventFilter(self._filter)


def _select_and_time(app, win, step: int, layer: int, head: int, painted: Painted, how: str = "select",
                     timeout_s: float = 30.0) -> dict:
    """Time from selecting `step` (how="select") or switching to `layer` (how="layer", the step already selected)
    until the Attention panel drew that step of that layer and its heat map painted after that draw."""
    panel = win.panels["attention"]
    drawn: dict[str, float] = {}
    original = panel.draw

    def shows_it() -> str:
        if panel._selected_step != step or panel.layer() != layer or panel.head() != head:
            return ""
        if panel.row_held(step):
            return "held"
        ev = panel.recomputed_row()
        return "recomputed" if ev is not None and ev.layer == layer and ev.step == step else ""

    def draw() -> None:
        original()
        if "t" not in drawn and shows_it():
            drawn["t"], drawn["how"] = time.perf_counter(), shows_it()

    panel.draw = draw
    try:
        t0 = time.perf_counter()
        if how == "select":
            win.bridge.select_step(step)
        else:
            panel.layer_spin.setValue(layer)
        ok = _wait(app, lambda: "t" in drawn and painted.last > drawn["t"], timeout_s)
    finally:
        panel.draw = original
    out = {"step": step, "layer": layer, "head": head, "action": how, "ok": ok}
    if ok:
        out.update(shown=drawn["how"], drawn_ms=round((drawn["t"] - t0) * 1e3, 1),
                   painted_ms=round((painted.last - t0) * 1e3, 1))
    out["status"] = panel.status.text()[:300]
    return out


def make(path: str, n_new: int, step: int, model: str | None, layers: list[int] | None,
         long_prompt: bool = False, prompt_tokens: int = 0) -> int:
    from app import session_io
    from benchmarks.gui import open_window, run_on_watching_autosave, show_every_panel
    from benchmarks.longrun import PROMPT, greedy_run
    from benchmarks.recompute import TEXT

    if not path:
        print("--make needs a file to write the session to", file=sys.stderr)
        return 2
    app, win = open_window(model)
    if win is None:
        return 1
    show_every_panel(win)
    # --long-prompt: the prompt repeated past ALL_LAYERS_BELOW tokens, so only the shown layer is captured (a run
    # that captures every layer costs several times as long to make; the step's recompute costs the same)
    win.panels["prompt"].set_text(" ".join([PROMPT] * 8) if long_prompt else PROMPT)
    gen = win.panels["generation"]
    if prompt_tokens:  # --prompt-tokens P: a plain-text prompt of P tokens, its KV cache filled by one prefill
        ids = win.bridge.tokenizer.encode(TEXT * (prompt_tokens // 20 + 1)).ids[:prompt_tokens]
        win.panels["prompt"].set_text(win.bridge.tokenizer.decode(ids))
    greedy_run(app, win, n_new, chat=not prompt_tokens)
    finished: dict = {}
    win.bridge.sig_finished.connect(lambda ev: finished.setdefault("ev", ev))
    win.bridge.sig_failed.connect(lambda m: finished.setdefault("error", m))
    load0 = os.getloadavg()[0]
    t_wall = time.time()
    t0 = time.perf_counter()
    if not gen.generate():
        return 1
    _wait(app, lambda: bool(finished), 3600)
    run_s = time.perf_counter() - t0
    if "ev" not in finished:
        print(finished.get("error", "generation failed"), file=sys.stderr)
        return 1
    fin = finished["ev"]
    autosave_s = run_on_watching_autosave(session_io.autosave_path(), t_wall, 10.0)
    if autosave_s is None:
        print("the autosave was not written within 10 s of the run's end", file=sys.stderr)
        return 1
    shutil.copyfile(session_io.autosave_path(), path)
    store = win.run_store
    run = store.shown_run()
    cfg = win.bridge.cfg
    if step >= run.n_tokens:
        print(f"--step {step}: the run has steps 0…{run.n_tokens - 1}", file=sys.stderr)
        return 1
    layers = layers if layers is not None else sorted({0, cfg.n_layers // 2, cfg.n_layers - 1})
    panel = win.panels["attention"]
    painted = Painted(panel.heat.viewport())
    newest = run.n_tokens - 1
    shown_layer = panel.layer()  # the layer the run captured
    cases = []

    def settled() -> None:  # a layer or head chosen with a step selected asks for that step at once: not timed
        _wait(app, lambda: not panel._asked, 60)

    win.bridge.select_step(newest)
    for i, layer in enumerate(layers):
        head = (cfg.n_heads - 1) * i // max(1, len(layers) - 1)
        win.bridge.select_step(newest)
        panel.layer_spin.setValue(layer)
        panel.head_spin.setValue(head)
        settled()
        cases.append(_select_and_time(app, win, step, layer, head, painted))
    other = next((i for i in range(cfg.n_layers - 1, -1, -1) if i not in layers), None)
    if other is not None:  # step K still selected: another layer chosen
        cases.append(_select_and_time(app, win, step, other, panel.head(), painted, how="layer"))
    panel.layer_spin.setValue(shown_layer)
    settled()
    cases.append(_select_and_time(app, win, newest, shown_layer, panel.head(), painted))  # held: for comparison
    result = {
        "what": "select a step of the live run in the app", "model": win.bridge.info.name,
        "dtype": win.bridge.info.dtype, "tokens": len(fin.ids), "prompt_tokens": len(fin.prompt_ids),
        "run_s": round(run_s, 1), "autosave_done_after_finished_s": autosave_s,
        "session_file": path, "session_bytes": os.path.getsize(path),
        "kept": run.attention_note(), "cases": cases,
        "load_average_start": load0, "load_average_end": os.getloadavg()[0],
    }
    win.close()
    print(json.dumps(result))
    return 0


def resave(source: str = "", target: str = "") -> int:
    from engine.session_file import VERSION, load_session, save_session

    if not source or not target or not os.path.isfile(source):
        print("--resave IN.ilab OUT.ilab: IN must be a session file", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    saved = load_session(source)
    t1 = time.perf_counter()
    save_session(target, saved)
    t2 = time.perf_counter()
    print(json.dumps({"what": "a session file written again", "source": source, "source_bytes": os.path.getsize(source),
                      "read_s": round(t1 - t0, 3), "target": target, "target_bytes": os.path.getsize(target),
                      "version": VERSION, "write_s": round(t2 - t1, 3), "events": len(saved.events)}))
    return 0


def reopen(path: str) -> int:
    import psutil
    from PySide6 import QtWidgets

    if not path or not os.path.isfile(path):
        print(f"--open {path}: no such file", file=sys.stderr)
        return 2
    t_process = psutil.Process().create_time()
    load0 = os.getloadavg()[0]
    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(sys.argv[:1])
    from app import session_io
    from app.main_window import MainWindow
    from benchmarks.gui import WINDOW, show_every_panel

    win = MainWindow(None, persist=False, load=False, interactive=False)
    win.resize(*WINDOW)
    show_every_panel(win)
    win.show()
    for _ in range(5):
        app.processEvents()
    rss_ready = _rss_mib()[0]
    t_ready = time.time()
    t0 = time.perf_counter()
    opened: dict = {}
    original = session_io.replay

    def replay(window, saved, warning=None, wait=True, done=None):  # the window's own call, observed
        opened["read"] = time.perf_counter()  # the writer thread has read the file

        def both(completed: bool) -> None:
            if done is not None:
                done(completed)
            opened["completed"], opened["t"] = completed, time.perf_counter()

        return original(window, saved, warning, wait=wait, done=both)

    session_io.replay = replay
    try:
        session_io.open_session_from(win, path, wait=False)
        ok = _wait(app, lambda: "t" in opened or bool(win.last_error), 600)
    finally:
        session_io.replay = original
    if not ok or not opened.get("completed"):
        print(f"not opened: {win.last_error or 'timed out'}", file=sys.stderr)
        return 1
    job = win.replay_job
    painted = Painted(win)  # then the window's paint that shows what the replay's last draws put in the panels
    win.update()
    _wait(app, lambda: painted.count > 0, 30)
    t_shown = time.perf_counter()
    rss_now, rss_peak = _rss_mib()
    panel = win.panels["attention"]
    store = win.run_store
    run = store.shown_run()
    newest = run.n_tokens - 1
    kept = _select_and_time(app, win, newest, panel.layer(), panel.head(), Painted(panel.heat.viewport()))
    result = {
        "what": "reopen a session without the model", "session_file": path, "session_bytes": os.path.getsize(path),
        "model": win.bridge.info.name if win.bridge.info is not None else None,
        "tokens": run.n_tokens, "events": len(run.events),
        "open_s": round(t_shown - t0, 3),  # File → Open session … the window painted with the run
        "replay_done_s": round(opened["t"] - t0, 3),
        "from_process_start_s": round(t_ready + (t_shown - t0) - t_process, 3),
        "window_ready_from_process_start_s": round(t_ready - t_process, 3),
        "replay_slices": job.slices if job is not None else None, "read_s": round(opened["read"] - t0, 3),
        "rss_window_ready_mib": round(rss_ready, 1), "rss_shown_mib": round(rss_now, 1),
        "peak_rss_mib": round(rss_peak, 1),
        "kept_note": run.attention_note(), "attention_status": panel.status.text()[:400],
        "kept_step_selected": kept,
        "load_average_start": load0, "load_average_end": os.getloadavg()[0],
    }
    win.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
