"""A long generation in the app, as users run it: `python -m benchmarks.longrun [--tokens N] [--model M]
[--after S]` prints one JSON line.

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
- when the autosave file was complete after Finished;
- the load average at the start and at the end (other work on the cores inflates TPOT and the stalls).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

PROMPT = "Write a long story about a lighthouse keeper."
PROBE_MS = 10.0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def opt(name: str, default: str | None) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else default

    n_new = int(opt("--tokens", "2000"))
    model = opt("--model", None)  # default: the app's (SmolLM2-135M)
    after_s = float(opt("--after", "10"))
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    with tempfile.TemporaryDirectory(prefix="ilab-bench-longrun-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        return _measure(model, n_new, after_s)


def _measure(model: str | None, n_new: int, after_s: float) -> int:
    from dataclasses import replace

    import psutil
    from PySide6 import QtCore

    from app import session_io
    from benchmarks.gui import open_window, run_on_watching_autosave, show_every_panel

    app, win = open_window(model)
    if win is None:
        return 1
    show_every_panel(win)
    win.panels["prompt"].set_text(PROMPT)
    gen = win.panels["generation"]
    try:  # a base model (Gemma 3 270M) has no chat template: its prompt goes as plain text
        win.bridge.tokenizer.chat_prompt(PROMPT)
        gen.set_chat(True)
    except ValueError:
        gen.set_chat(False)
    gen.set_max_new_tokens(n_new)
    gen.ignore_eos = True
    win.bridge.set_params(replace(win.bridge.params, temperature=0.0))
    for _ in range(5):
        app.processEvents()

    gui, engine = psutil.Process(), psutil.Process(win.bridge.process.pid)
    tokens = [0]
    kv = [0]
    win.bridge.sig_token.connect(lambda _ev: tokens.__setitem__(0, tokens[0] + 1))
    win.bridge.sig_kv.connect(lambda ev: kv.__setitem__(0, ev.bytes_allocated))
    ticks: list[tuple[float, float, int]] = []  # (time, gap ms, tokens received by then)
    last = [time.perf_counter()]

    def probe() -> None:
        now = time.perf_counter()
        ticks.append((now, (now - last[0]) * 1e3, tokens[0]))
        last[0] = now

    timer = QtCore.QTimer()
    timer.setTimerType(QtCore.Qt.TimerType.PreciseTimer)
    timer.setInterval(int(PROBE_MS))
    timer.timeout.connect(probe)
    finished: dict = {}
    done = QtCore.QEventLoop()
    win.bridge.sig_finished.connect(lambda ev: (finished.setdefault("ev", ev), done.quit()))
    win.bridge.sig_failed.connect(lambda m: (finished.setdefault("error", m), done.quit()))
    rss0 = (gui.memory_info().rss, engine.memory_info().rss)
    load0 = os.getloadavg()[0]
    t_wall = time.time()
    last[0] = time.perf_counter()
    timer.start()
    if not gen.generate():
        return 1
    done.exec()
    t_end = time.perf_counter()
    rss_end = (gui.memory_info().rss, engine.memory_info().rss)
    autosave_s = run_on_watching_autosave(session_io.autosave_path(), t_wall, after_s)
    timer.stop()
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
    decode = np.asarray(fin.step_seconds, dtype=float)
    d10 = max(1, decode.size // 10)
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
        "stall_p99_ms_per_tenth": p99,
        "stall_max_ms_per_tenth": worst_tenth,
        "stall_p99_ms_after": float(np.percentile(stalls[~during], 99)) if np.any(~during) else None,
        "stall_max_ms_after": float(stalls[~during].max(initial=0.0)),
        "stall_max_ms": float(stalls.max(initial=0.0)),
        "tpot_ms_first_tenth": float(decode[:d10].mean() * 1e3) if decode.size else None,
        "tpot_ms_last_tenth": float(decode[-d10:].mean() * 1e3) if decode.size else None,
        "tpot_last_over_first": float(decode[-d10:].mean() / decode[:d10].mean()) if decode.size else None,
        "ttft_ms": fin.ttft_s * 1e3,
        "run_s": float(t_end - (t[0] if t.size else t_end)),
        "autosave_done_after_finished_s": autosave_s,  # None: not written within --after seconds
        "after_s": after_s,
        # other processes on the cores inflate TPOT and the stalls: the 1-minute load average at the start and end
        "load_average_start": load0, "load_average_end": os.getloadavg()[0],
    }
    win.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
