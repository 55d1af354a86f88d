"""What the GUI thread pays per panel: `python -m benchmarks.gui_replay [--tokens N] [--every K] [--rounds R]
[--only PANEL]` prints one JSON line.

It records one real generation's engine messages (SmolLM2, greedy, the prompt of `benchmarks.gui`, every panel on
screen as there), then replays them into the same window ROUNDS times with the engine idle: each message goes through
the bridge as it came, and after every K tokens the shared draw timer draws one panel (the next in turn, as the live
window does) and the window paints. So the figures hold only the GUI thread's own work, at the live cadence (about
two tokens per redraw on two cores), without the engine's competition for the cores that makes `benchmarks.gui`'s
figures swing from run to run; a change to a panel can be weighed by running this before and after it, alternately.

Reported: the GUI thread's CPU per token over the replay (least and median of the rounds) and its part in handling
the messages; per panel its draws and the CPU of its draw and of the paint that followed, per draw. `--only PANEL`
draws that panel alone (every K tokens).

`--labels` instead times, after the recorded run, each word-wrapped label on screen: CPU of a new text and the event
loop's turn after it (the layout and paint it causes), against a repaint of the same label alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0

    def arg(name: str, default: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else default

    n_tokens, every, rounds = int(arg("--tokens", "256")), float(arg("--every", "2")), int(arg("--rounds", "5"))
    only = arg("--only", "") or None
    labels = "--labels" in argv
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ilab-bench-replay-") as settings_dir:
        os.environ["INFERENCE_LAB_SETTINGS"] = os.path.join(settings_dir, "inference-lab.ini")
        out = _measure(n_tokens, every, rounds, only, labels)
    if out is None:
        return 1
    print(json.dumps(out))
    return 0


def _record(app, win, n_tokens: int) -> list | None:
    """One greedy generation of n_tokens, every message the engine sent for it, in order."""
    from dataclasses import replace

    from PySide6 import QtCore

    from benchmarks import gui

    messages: list = []

    class Recorder(QtCore.QObject):
        @QtCore.Slot(object)
        def got(self, msg: object) -> None:
            messages.append(msg)

    recorder = Recorder()
    win.bridge.relay.sig_raw.connect(recorder.got, QtCore.Qt.ConnectionType.QueuedConnection)
    win.panels["prompt"].set_text(gui.PROMPT)
    gen = win.panels["generation"]
    gen.set_chat(True)
    gen.set_max_new_tokens(n_tokens)
    gen.ignore_eos = True
    win.bridge.set_params(replace(win.bridge.params, temperature=0.0))
    done = QtCore.QEventLoop()
    failed: list[str] = []
    win.bridge.sig_finished.connect(lambda _ev: done.quit())
    win.bridge.sig_failed.connect(lambda m: (failed.append(str(m)), done.quit()))
    for _ in range(5):
        app.processEvents()
    if not gen.generate():
        return None
    done.exec()
    for _ in range(20):
        app.processEvents()
    win.bridge.relay.sig_raw.disconnect(recorder.got)
    if failed:
        print(f"the generation failed: {failed[0]}", file=sys.stderr)
        return None
    return messages


def _measure(n_tokens: int, every: float, rounds: int, only: str | None, labels: bool = False) -> dict | None:
    from benchmarks import gui
    from engine.events import Finished, TokenSampled

    app, win = gui.open_window(None)
    if win is None:
        return None
    gui.show_every_panel(win)
    for _ in range(10):
        app.processEvents()
    messages = _record(app, win, n_tokens)
    if not messages:
        return None
    if labels:
        return _label_costs(app, win)
    if only is not None and only not in win.panels:
        print(f"no panel named {only!r} (there are: {', '.join(win.panels)})", file=sys.stderr)
        return None

    def parts(msg: object) -> list:
        return msg if isinstance(msg, list) else [msg]

    end = next(i for i, m in enumerate(messages) if any(isinstance(x, Finished) for x in parts(m)))
    draw_s: dict[str, float] = defaultdict(float)
    paint_s: dict[str, float] = defaultdict(float)
    draws: dict[str, int] = defaultdict(int)
    per_token, events_per_token = [], []
    for _ in range(rounds):
        win._generating = True  # noqa: SLF001 — as while the engine decodes: the panels' generating paths
        t0, events_s, tokens, credit = time.thread_time(), 0.0, 0, 0.0
        for msg in messages[:end]:
            t = time.thread_time()
            win.bridge._on_raw(msg)  # noqa: SLF001 — the bridge's own entry for each message
            events_s += time.thread_time() - t
            k = sum(isinstance(x, TokenSampled) for x in parts(msg))
            tokens += k
            credit += k / every
            while credit >= 1.0:
                credit -= 1.0
                for p in win.panels.values():  # the cadence is K tokens a redraw, not the wall clock
                    p._next_draw = 0.0  # noqa: SLF001
                before = {name: p.draw_count for name, p in win.panels.items()}
                t = time.thread_time()
                if only is not None:
                    win.panels[only].flush()
                else:
                    win._redraw_credit, win._gui_busy = 1.0, type(win._gui_busy)()  # noqa: SLF001
                    win.tick_panels()
                t_draw = time.thread_time() - t
                drawn = [name for name, p in win.panels.items() if p.draw_count != before[name]]
                t = time.thread_time()
                app.processEvents()
                t_paint = time.thread_time() - t
                for name in drawn:
                    draws[name] += 1
                    draw_s[name] += t_draw / len(drawn)
                    paint_s[name] += t_paint / len(drawn)
        per_token.append((time.thread_time() - t0) / tokens * 1e3)
        events_per_token.append(events_s / tokens * 1e3)
        for msg in messages[end:]:
            win.bridge._on_raw(msg)  # noqa: SLF001
        app.processEvents()
    win.close()
    from benchmarks.steer_llamacpp import machine

    ordered = sorted(per_token)
    return {
        "tokens": tokens, "every_tokens": every, "rounds": rounds, "only": only,
        "gui_thread_ms_per_token_min": ordered[0], "gui_thread_ms_per_token_median": ordered[len(ordered) // 2],
        "events_ms_per_token_median": sorted(events_per_token)[len(events_per_token) // 2],
        "panels": {name: {"draws": draws[name], "draw_ms": draw_s[name] / draws[name] * 1e3,
                          "paint_ms": paint_s[name] / draws[name] * 1e3}
                   for name in sorted(draws, key=lambda n: -(draw_s[n] + paint_s[n]))},
        "machine": machine(),
    }


def _label_costs(app, win, n: int = 30) -> dict:
    """ms of CPU per new text (and the event loop's turn after it) for each word-wrapped label on screen."""
    from PySide6 import QtWidgets

    from benchmarks.steer_llamacpp import machine

    out = {}
    for name, panel in win.panels.items():
        for i, label in enumerate(panel.findChildren(QtWidgets.QLabel)):
            if not (label.isVisible() and label.wordWrap()):
                continue
            text = label.text()
            for k in range(3):
                label.setText(f"{text} {k}")
                app.processEvents()
            t = time.thread_time()
            for k in range(n):
                label.setText(f"{text} {k % 7}")
                app.processEvents()
            new_text = (time.thread_time() - t) / n * 1e3
            t = time.thread_time()
            for _ in range(n):
                label.update()
                app.processEvents()
            repaint = (time.thread_time() - t) / n * 1e3
            label.setText(text)
            app.processEvents()
            out[f"{name}[{i}]"] = {"new_text_ms": new_text, "repaint_ms": repaint, "text": text[:60]}
    win.close()
    return {"labels": dict(sorted(out.items(), key=lambda kv: -kv[1]["new_text_ms"])), "machine": machine()}


if __name__ == "__main__":
    sys.exit(main())
