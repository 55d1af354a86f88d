"""A long generation in the app, as users run it: `python -m benchmarks.longrun [--tokens N] [--model M]
[--after S]` prints one JSON line; with --cli, the same run through `python -m engine generate` instead (its TPOT
in the first and the last tenth: what the longer context costs without the app).

The window runs with settings (a temporary settings file named by INFERENCE_LAB_SETTINGS, so the user's own are
never touched; hence the autosave at the end), every dock laid out side by side (benchmarks.gui.show_every_panel),
offscreen unless QT_QPA_PLATFORM says otherwise. One short prompt, greedy, N new tokens with --ignore-eos (the
default model's short chat prompt captures every layer's attention, as the app does below
app.panels.generation.ALL_LAYERS_BELOW prompt tokens). It reports:
- the GUI process's and the engine process's RSS growth from Generate to Finished and to S seconds after it, beside
  the KV cache's allocated bytes at the end (what the engine is expected to grow by);
- the GUI thread's stalls: a 10 ms QTimer probe records the gaps between its ticks, a stall is a gap minus the
  10 ms; p99 in each tenth of the run (by tokens received) and in the S seconds after, and the worst one;
- the app's TPOT (the Finished event's step times) in the first and in the last tenth of the decode steps;
- the GUI process's and the engine process's CPU time per token from Generate to Finished;
- when the autosave file was complete after Finished;
- the load average at the start and at the end (other work on the cores inflates TPOT and the stalls);
- "worst_stalls": the ten longest stalls over STALL_MS, each with the GUI thread's own CPU time in it (near the
  stall: the thread was working; far below it: it waited for a core or for the GIL), the whole GUI process's, how
  many cores the machine kept busy meanwhile (/proc/stat; near the core count: the thread waited for a core) and the
  panels that drew in it.
- after that: step 7/8·N of the live run selected as a click does, then another layer, then another head, each timed
  until the Attention panel has drawn its row (held, kept by the run store, or recomputed from the engine's cache);
- the objects the bridge froze during the run (app.bridge.age_heap) that had become garbage by the end.

With --threads N (or auto, the default), the engine decodes at that setting, as Engine → Decode threads sets it.

With --keep-session FILE.ilab, the run's autosave is copied there (keep it outside the repository: it is large), for
`python -m benchmarks.reopen --open FILE.ilab`.

With --profile-finish, the GUI thread's work from two tokens before the end to 1.5 s after Finished is profiled
(cProfile, wall time: waiting for the GIL counts against the function that waited) and printed to stderr, and so
is selecting step 7/8·N, a layer and a head.

With --stacks, a watcher thread samples the GUI thread's Python stack (sys._current_frames) every few ms while a
tick is late, and the line gains "stall_stacks": for each stall over STALL_MS, when it happened, how long it was and
the stacks seen during it (innermost frames first, with how many samples each). A stack that ends in the event
loop's exec() means Qt's own C++ work (painting, layout) with no Python frame of ours.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

PROMPT = "Write a long story about a lighthouse keeper."
PROBE_MS = 10.0
STALL_MS = 33.0  # the p99 target: a stall longer than this gets its stacks (--stacks)
IDLE_FUNCTIONS = {"wait", "poll", "_poll", "select", "recv", "_recv", "_recv_bytes", "accept", "sleep", "get"}
SAMPLE_S = 0.004  # how often the watcher looks at the GUI thread while a tick is late


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):  # a request for the usage must not start a minutes-long measurement
        print(__doc__)
        return 0

    def opt(name: str, default: str | None) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else default

    n_new = int(opt("--tokens", "2000"))
    model = opt("--model", None)  # default: the app's (SmolLM2-135M)
    if "--cli" in argv:
        return _measure_cli(model, n_new)
    after_s = float(opt("--after", "10"))
    stacks = "--stacks" in argv
    keep = opt("--keep-session", None)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="ilab-bench-longrun-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        return _measure(model, n_new, after_s, stacks, keep, "--profile-finish" in argv, opt("--threads", None))


def _machine_busy_s() -> float | None:
    """Seconds the machine's cores have been busy since boot (/proc/stat's first line; None off Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _tenths(step_seconds: list[float]) -> dict:
    """The mean decode step in the first and in the last tenth of the run, in ms, and their ratio."""
    decode = np.asarray(step_seconds, dtype=float)
    d10 = max(1, decode.size // 10)
    if not decode.size:
        return {"tpot_ms_first_tenth": None, "tpot_ms_last_tenth": None, "tpot_last_over_first": None}
    return {"tpot_ms_first_tenth": float(decode[:d10].mean() * 1e3),
            "tpot_ms_last_tenth": float(decode[-d10:].mean() * 1e3),
            "tpot_last_over_first": float(decode[-d10:].mean() / decode[:d10].mean())}


def _measure_cli(model: str | None, n_new: int) -> int:
    """--cli: the same prompt and tokens through `python -m engine generate` (no captures, no GUI): what the
    attention over a longer context costs by itself."""
    import subprocess

    base = [sys.executable, "-m", "engine", "generate", "--prompt", PROMPT, "--greedy", "--ignore-eos",
            "--max-new-tokens", str(n_new), "--json", *(["--model", model] if model else [])]
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    run = subprocess.run([*base, "--chat"], capture_output=True, text=True)
    chat = run.returncode == 0
    if not chat:  # a base model without a chat template gets its prompt as plain text, as greedy_run does
        run = subprocess.run(base, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "the CLI failed", file=sys.stderr)
        return 1
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps({"cli": True, "model": model or "smollm2", "chat": chat, "tokens": len(out["ids"]),
                      "prompt_tokens": len(out["prompt_ids"]), **_tenths(out["step_seconds"]),
                      "ttft_ms": out["ttft_s"] * 1e3, "run_s": time.perf_counter() - t0,
                      "load_average_start": load0, "load_average_end": os.getloadavg()[0]}))
    return 0


def greedy_run(app, win, n_new: int, chat: bool) -> None:
    """Set the window up for a greedy run of n_new tokens past end-of-text, in chat form where asked and the model
    has a chat template (a base model, such as Gemma 3 270M, gets its prompt as plain text)."""
    from dataclasses import replace

    gen = win.panels["generation"]
    try:
        win.bridge.tokenizer.chat_prompt(PROMPT)
        gen.set_chat(chat)
    except ValueError:
        gen.set_chat(False)
    gen.set_max_new_tokens(n_new)
    gen.ignore_eos = True
    win.bridge.set_params(replace(win.bridge.params, temperature=0.0))
    for _ in range(5):
        app.processEvents()

class StallStacks:
    """Samples the GUI thread's Python stack from another thread while the GUI's probe tick is late.

    `late_since()` returns the time of the last tick; the watcher samples only when that is more than STALL_MS ago,
    so a responsive GUI pays nothing but a wake-up every SAMPLE_S. Samples are keyed by the tick they follow, and
    `take(tick)` hands them over when the next tick arrives."""

    def __init__(self, last_tick: list[float]) -> None:
        import threading

        self._last = last_tick
        self._gui = threading.main_thread().ident
        self._samples: dict[float, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-stacks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import threading
        import traceback

        while not self._stop.wait(SAMPLE_S):
            since = self._last[0]
            if (time.perf_counter() - since) * 1e3 < STALL_MS:
                continue
            frames_now = sys._current_frames()
            frame = frames_now.get(self._gui)
            if frame is None:
                continue
            frames = traceback.extract_stack(frame)[::-1][:14]
            key = " < ".join(f"{os.path.relpath(f.filename)}:{f.lineno}:{f.name}" for f in frames)
            # another Python thread that runs meanwhile (not one waiting on a lock or a pipe) may hold the GIL the
            # GUI thread waits for: its innermost frames join the key
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, other in frames_now.items():
                if ident in (self._gui, threading.get_ident()) or other.f_code.co_name in IDLE_FUNCTIONS:
                    continue
                inner = traceback.extract_stack(other)[::-1][:4]
                key += f" || {names.get(ident, ident)}: " + " < ".join(
                    f"{os.path.relpath(f.filename)}:{f.lineno}:{f.name}" for f in inner)
            per = self._samples.setdefault(since, {})
            per[key] = per.get(key, 0) + 1

    def take(self, tick: float) -> dict[str, int]:
        return self._samples.pop(tick, {})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def time_paints(owner: dict[int, str]) -> dict[str, list[float]]:
    """Time every paint of each panel's plots (pyqtgraph's GraphicsView.paintEvent, wrapped for this process before
    any view exists: PySide binds the override when a view is made): {panel name: [paints, total ms, worst ms,
    resizes]}, the name from `owner` (id of the view → panel name, filled in once the window exists)."""
    import pyqtgraph as pg

    out: dict[str, list[float]] = {}
    resized: list[tuple[float, str]] = []
    out["resized"] = resized  # type: ignore[assignment]  # (time, panel) of each resize
    since_tick: list[tuple[str, float]] = []
    out["since_tick"] = since_tick  # type: ignore[assignment]  # (panel, ms) of the paints since the probe's last tick

    def rec_name(view) -> str:
        return owner.get(id(view), type(view).__name__)
    original = pg.GraphicsView.paintEvent

    def timed(view, ev):
        t = time.perf_counter()
        try:
            return original(view, ev)
        finally:
            ms = (time.perf_counter() - t) * 1e3
            rec = out.setdefault(rec_name(view), [0, 0.0, 0.0, 0])
            rec[0] += 1
            rec[1] += ms
            rec[2] = max(rec[2], ms)
            since_tick.append((rec_name(view), round(ms, 1)))

    original_resize = pg.GraphicsView.resizeEvent

    def counted(view, ev):
        rec = out.setdefault(owner.get(id(view), type(view).__name__), [0, 0.0, 0.0, 0])
        rec[3] += 1  # resizes: a layout change that makes a plot paint again in full
        resized.append((time.perf_counter(), owner.get(id(view), type(view).__name__)))
        return original_resize(view, ev)

    pg.GraphicsView.paintEvent = timed
    pg.GraphicsView.resizeEvent = counted
    return out


def time_live_selection(app, win, step: int, timeout_s: float = 30.0) -> dict:
    """After the run: select `step` of the live run as a click does, then another layer, then another head, and time
    each until the Attention panel has drawn that step's row (held, kept by the run store, or recomputed by the
    engine from its KV cache): {"step", "how", "select_ms", "layer_ms", "head_ms", "engine_recompute_ms": the
    engine's own time for each recompute answered meanwhile (the Attention panel's, the Logit lens panel's),
    "answer_arrived_ms": when each answer reached the GUI thread, after the click}."""
    from PySide6 import QtCore

    att = win.panels["attention"]

    def shown() -> bool:
        return att.row_held(step) or att.recomputed_row() is not None

    def until(t: float, why: str) -> float:
        while not shown():
            # wait in Qt's event loop as the app does, with the GIL released: a busy loop of processEvents() held
            # it, and the bridge's relay thread, reading a large answer from the pipe a chunk at a time, waited for
            # it at every chunk (an 8 MB answer took 0.6 s to arrive)
            app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.WaitForMoreEvents)
            if "cannot be recomputed" in att._recompute_note():  # the engine's one sentence, as the panel shows it
                raise TimeoutError(att._recompute_note())
            if time.perf_counter() - t > timeout_s:
                raise TimeoutError(f"step {step}'s row was not shown within {timeout_s:.0f} s ({why})")
        win.tick_panels(flush=True)
        return round((time.perf_counter() - t) * 1e3, 1)

    engine_s: list[float] = []  # the engine's own seconds for each recompute answered meanwhile
    threads: list[int] = []  # the thread count each ran at
    arrived: list[float] = []  # when each answer reached the GUI thread, ms after the click
    t = time.perf_counter()

    def answered(msg) -> None:
        engine_s.append(round(msg.seconds * 1e3, 1))
        threads.append(msg.threads)
        arrived.append(round((time.perf_counter() - t) * 1e3, 1))

    win.bridge.sig_recomputed.connect(answered)
    win.bridge.select_step(step)
    select_ms = until(t, "select")
    how = "held" if att.row_held(step) else "kept" if att.stored_row(step) is not None else "recomputed"
    t = time.perf_counter()
    att.layer_spin.setValue((att.layer() + 7) % (att.layer_spin.maximum() + 1))
    layer_ms = until(t, "layer")
    t = time.perf_counter()
    att.head_spin.setValue((att.head() + 1) % (att.head_spin.maximum() + 1))
    win.tick_panels(flush=True)
    head_ms = round((time.perf_counter() - t) * 1e3, 1)
    return {"step": step, "how": how, "select_ms": select_ms, "layer_ms": layer_ms, "head_ms": head_ms,
            "engine_recompute_ms": engine_s, "engine_threads": threads, "answer_arrived_ms": arrived}


def _measure(model: str | None, n_new: int, after_s: float, stacks: bool = False, keep: str | None = None,
             profile_finish: bool = False, threads: str | None = None) -> int:
    import psutil
    from PySide6 import QtCore, QtWidgets

    from app import session_io
    from benchmarks.gui import open_window, run_on_watching_autosave, show_every_panel

    owner: dict[int, str] = {}
    paints = time_paints(owner) if stacks else {}
    app, win = open_window(model)
    if win is None:
        return 1
    show_every_panel(win)
    win.panels["prompt"].set_text(PROMPT)
    greedy_run(app, win, n_new, chat=True)
    if threads is not None:  # as Engine → Decode threads does (the window's settings are the benchmark's own)
        win.set_threads("auto" if threads == "auto" else int(threads))

    gui, engine = psutil.Process(), psutil.Process(win.bridge.process.pid)
    tokens = [0]
    kv = [0]
    win.bridge.sig_token.connect(lambda _ev: tokens.__setitem__(0, tokens[0] + 1))
    win.bridge.sig_kv.connect(lambda ev: kv.__setitem__(0, ev.bytes_allocated))
    ticks: list[tuple[float, float, int]] = []  # (time, gap ms, tokens received by then)
    last = [time.perf_counter()]
    # each stall over STALL_MS, every run: the GUI thread's own CPU time in the gap (near the gap: it was working;
    # far below it: it waited, for a core or for the GIL) and the panels that drew in it
    cpu_last = [time.thread_time(), time.process_time(), _machine_busy_s()]
    draws_last = [{name: p.draw_count for name, p in win.panels.items()}]
    stall_log: list[dict] = []
    stall_stacks: list[dict] = []
    sampler: StallStacks | None = None

    def probe() -> None:
        now = time.perf_counter()
        gap = (now - last[0]) * 1e3
        ticks.append((now, gap, tokens[0]))
        cpu = [time.thread_time(), time.process_time(), _machine_busy_s()]
        draws = {name: p.draw_count for name, p in win.panels.items()}
        if gap - PROBE_MS > STALL_MS:
            busy = None if None in (cpu[2], cpu_last[2]) else round((cpu[2] - cpu_last[2]) / (gap / 1e3), 2)
            stall_log.append({"at_s": last[0], "ms": round(gap - PROBE_MS, 1),
                              "gui_thread_cpu_ms": round((cpu[0] - cpu_last[0]) * 1e3, 1),
                              "gui_process_cpu_ms": round((cpu[1] - cpu_last[1]) * 1e3, 1),
                              "machine_busy_cores": busy, "tokens": tokens[0],
                              "drawn": [n for n, c in draws.items() if c != draws_last[0].get(n)]})
        draws_last[0], cpu_last[:] = draws, cpu
        if sampler is not None:
            seen = sampler.take(last[0])
            painted = paints.get("since_tick", [])
            if gap - PROBE_MS > STALL_MS:
                stall_stacks.append({"at_s": last[0], "ms": gap - PROBE_MS, "tokens": tokens[0],
                                     "plots_painted": list(painted),
                                     "stacks": sorted(seen.items(), key=lambda kv: -kv[1])[:4]})
            painted.clear()
        last[0] = now

    hints: dict[str, tuple[int, int]] = {}
    hint_changes: list[tuple[float, str, tuple[int, int], tuple[int, int]]] = []

    def watch_hints() -> None:  # a dock whose minimum size changes lays the whole window out again
        for name, dock in win.docks.items():
            h = dock.minimumSizeHint()
            now = (h.width(), h.height())
            if name in hints and hints[name] != now:
                hint_changes.append((round(time.perf_counter() - t_start, 3), name, hints[name], now))
            hints[name] = now

    hint_timer = QtCore.QTimer()
    hint_timer.setInterval(100)
    hint_timer.timeout.connect(watch_hints)
    timer = QtCore.QTimer()
    timer.setTimerType(QtCore.Qt.TimerType.PreciseTimer)
    timer.setInterval(int(PROBE_MS))
    timer.timeout.connect(probe)
    finished: dict = {}
    done = QtCore.QEventLoop()
    win.bridge.sig_finished.connect(lambda ev: (finished.setdefault("ev", ev), done.quit()))
    win.bridge.sig_failed.connect(lambda m: (finished.setdefault("error", m), done.quit()))
    rss0 = (gui.memory_info().rss, engine.memory_info().rss)
    cpu0 = (sum(gui.cpu_times()[:2]), sum(engine.cpu_times()[:2]))
    load0 = os.getloadavg()[0]
    t_wall = time.time()
    last[0] = time.perf_counter()
    t_start = last[0]
    collections: list[tuple[float, int, float]] = []  # (s from Generate, generation, ms) of each garbage collection
    gc_began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_began[0] = time.perf_counter()
        elif info["generation"] >= 1:
            now = time.perf_counter()
            took = round((now - gc_began[0]) * 1e3, 1)
            collections.append((round(gc_began[0] - t_start, 3), info["generation"], took))

    import gc

    gc.callbacks.append(on_gc)  # every run: a full collection's walk holds the GIL for all it takes
    if stacks:
        hint_timer.start()
        sampler = StallStacks(last)
        owner.update({id(v): name for name, panel in win.panels.items()
                      for v in panel.findChildren(QtWidgets.QGraphicsView)})
        for key in [k for k in paints if k not in ("resized", "since_tick")]:
            del paints[key]
    if profile_finish:  # the GUI thread's work from the last tokens to 1.5 s after Finished, by function
        import cProfile
        import pstats

        prof = cProfile.Profile()

        def on_token_profile(_ev) -> None:
            if tokens[0] == n_new - 2:
                prof.enable()

        def on_finished_profile(_ev) -> None:
            def stop() -> None:
                prof.disable()
                out = io.StringIO()
                st = pstats.Stats(prof, stream=out)
                st.sort_stats("cumulative").print_stats(45)
                st.sort_stats("tottime").print_stats(25)
                print(out.getvalue(), file=sys.stderr)
            QtCore.QTimer.singleShot(1500, stop)

        win.bridge.sig_token.connect(on_token_profile)
        win.bridge.sig_finished.connect(on_finished_profile)
    timer.start()
    if not win.panels["generation"].generate():
        return 1
    done.exec()
    t_end = time.perf_counter()
    rss_end = (gui.memory_info().rss, engine.memory_info().rss)
    cpu_end = (sum(gui.cpu_times()[:2]), sum(engine.cpu_times()[:2]))
    autosave_s = run_on_watching_autosave(session_io.autosave_path(), t_wall, after_s)
    timer.stop()
    gc.callbacks.remove(on_gc)
    # what a full collection would walk now: the tracked objects nobody froze, by type (the largest counts)
    unfrozen: dict[str, int] = {}
    for o in gc.get_objects():
        unfrozen[type(o).__name__] = unfrozen.get(type(o).__name__, 0) + 1
    if sampler is not None:
        sampler.stop()
    rss_after = (gui.memory_info().rss, engine.memory_info().rss)
    if "ev" not in finished:
        print(finished.get("error", "generation failed"), file=sys.stderr)
        return 1
    fin = finished["ev"]
    n = len(fin.ids)
    t = np.array([x[0] for x in ticks])
    stalls = np.maximum(np.array([x[1] for x in ticks]) - PROBE_MS, 0.0)
    got = np.array([x[2] for x in ticks])
    during = t <= t_end
    tenth = np.minimum(got * 10 // max(n, 1), 9)
    p99 = [float(np.percentile(stalls[during & (tenth == k)], 99)) if np.any(during & (tenth == k)) else None
           for k in range(10)]
    worst_tenth = [float(stalls[during & (tenth == k)].max(initial=0.0)) for k in range(10)]
    mib = 1 / 2**20
    result = {
        "model": win.bridge.info.name, "dtype": win.bridge.info.dtype, "tokens": n,
        "prompt_tokens": len(fin.prompt_ids),
        "gui_rss_start_mib": rss0[0] * mib,
        "gui_rss_growth_mib_at_finish": (rss_end[0] - rss0[0]) * mib,
        "gui_rss_growth_mib_after": (rss_after[0] - rss0[0]) * mib,
        "engine_rss_start_mib": rss0[1] * mib,
        "engine_rss_growth_mib_at_finish": (rss_end[1] - rss0[1]) * mib,
        "engine_rss_growth_mib_after": (rss_after[1] - rss0[1]) * mib,
        "kv_cache_allocated_mib": kv[0] * mib,
        # user + system CPU from Generate to Finished, per token received (the GUI's includes this probe's ticks)
        "gui_cpu_ms_per_token": (cpu_end[0] - cpu0[0]) * 1e3 / max(n, 1),
        "engine_cpu_ms_per_token": (cpu_end[1] - cpu0[1]) * 1e3 / max(n, 1),
        "stall_p99_ms_per_tenth": p99,
        "stall_max_ms_per_tenth": worst_tenth,
        "stall_p99_ms_after": float(np.percentile(stalls[~during], 99)) if np.any(~during) else None,
        "stall_max_ms_after": float(stalls[~during].max(initial=0.0)),
        "stall_max_ms": float(stalls.max(initial=0.0)),
        # the full collections from Finished to the end of the S seconds after: (s after Finished, ms)
        "full_collections_after": [(round(t0 - (t_end - t_start), 3), ms) for t0, g, ms in collections
                                   if g == 2 and t0 >= t_end - t_start],
        "unfrozen_objects_after": sum(unfrozen.values()),
        "unfrozen_types_after": dict(sorted(unfrozen.items(), key=lambda kv: -kv[1])[:10]),
        **_tenths(fin.step_seconds),
        "ttft_ms": fin.ttft_s * 1e3,
        "run_s": float(t_end - (t[0] if t.size else t_end)),
        "autosave_done_after_finished_s": autosave_s,  # None: not written within --after seconds
        "after_s": after_s,
        # other processes on the cores inflate TPOT and the stalls: the 1-minute load average at the start and end
        "load_average_start": load0, "load_average_end": os.getloadavg()[0],
        "threads": win.threads_setting(),
    }
    for st in stall_log:
        st["after"] = st["at_s"] > t_end
        st["at_s"] = round(st["at_s"] - t_start, 3)
    result["worst_stalls"] = sorted(stall_log, key=lambda st: -st["ms"])[:10]
    if stacks:  # when (s from Generate; "after": past Finished), how long, and what the GUI thread was doing
        for st in stall_stacks:
            st["after"] = st["at_s"] > t_end
            st["at_s"] = round(st["at_s"] - t_start, 3)
            st["ms"] = round(st["ms"], 1)
        result["stall_stacks"] = stall_stacks
        resized = paints.pop("resized")
        paints.pop("since_tick")
        result["plot_paints"] = {k: [int(v[0]), round(v[1], 1), round(v[2], 1), int(v[3])] for k, v in paints.items()}
        result["dock_min_size_changes"] = hint_changes
        result["gc_collections"] = collections  # the oldest generation's walks hold the GIL for all they take
        result["plot_resizes"] = [(round(t - t_start, 3), name) for t, name in resized if t >= t_start]
    try:
        if profile_finish:
            import cProfile
            import pstats

            with cProfile.Profile() as sel:
                result["select_live_step"] = time_live_selection(app, win, n * 7 // 8)
            out = io.StringIO()
            print("---- selecting a step, a layer, a head", file=out)
            pstats.Stats(sel, stream=out).sort_stats("cumulative").print_stats(40)
            print(out.getvalue(), file=sys.stderr)
        else:
            result["select_live_step"] = time_live_selection(app, win, n * 7 // 8)
    except TimeoutError as e:  # a step not shown (or refused) is a result to print, not a reason to lose the run's
        result["select_live_step"] = {"step": n * 7 // 8, "error": str(e)}
    gc.unfreeze()  # what the bridge froze during the run (app.bridge.age_heap) that has since become garbage
    result["frozen_garbage_objects"] = gc.collect()
    if keep and autosave_s is not None:  # before the close, which removes the autosave (session_io.clean_exit)
        shutil.copyfile(session_io.autosave_path(), keep)
        result["session_file"], result["session_mib"] = keep, os.path.getsize(keep) / 2**20
    win.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
