"""Start Inference Lab: `python -m app`, `inference-lab`, or `make run`.

With --screenshot or --export-timeline it runs headless: it opens the window offscreen, loads the model, types the
prompt, generates, lets every panel paint that generation, saves the files, prints their paths and exits.
Exit codes: 0 done, 1 the model failed to load, the generation failed or the engine process died, 2 bad arguments or
output paths.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

SCREENSHOT_EXTS = (".png",)
TIMELINE_EXTS = (".png", ".svg")
SESSION_EXTS = (".ilab",)
HEADLESS_SIZE = (1600, 1000)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="inference-lab", description="Watch LLM inference live on a real model.")
    p.add_argument("--model", help="a .gguf file or a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", help="start with this prompt (headless: the prompt to generate from)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N", help="tokens to generate")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--greedy", action="store_true", help="temperature 0: always take the most likely token")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    from engine.model.kernel_cache import KERNEL_MODES

    p.add_argument("--kernels", choices=list(KERNEL_MODES), default=None,
                   help="the torch runtime's kernel mode (default: the one chosen in the Engine menu, else exact): "
                        + "; ".join(f"{k}: {v}" for k, v in KERNEL_MODES.items()))
    p.add_argument("--url", help="generate on an OpenAI-compatible server (vLLM, llama.cpp), e.g. http://127.0.0.1:8000;"
                   " the API key, if any, is read from $INFERENCE_LAB_API_KEY")
    p.add_argument("--load-lab", metavar="C1,C2,…", help="headless, with --url: after the generation run the Load "
                   "lab at these concurrency levels (8 requests each) and show it in the screenshot")
    p.add_argument("--why", choices=("heads", "ablate", "patch", "attribute"), help="headless: after the generation "
                   "run this experiment of the Why panel with its default inputs and show it in the screenshot")
    p.add_argument("--tour", type=int, metavar="N", help="open the guided tour at step N (with --screenshot: load the "
                   "model, run step N's actions, wait for its measured figure, save the picture and exit)")
    p.add_argument("--size", metavar="WxH", help="headless: the window's size, e.g. 1366x768 (default 1600x1000)")
    p.add_argument("--screenshot", metavar="OUT.png", help="headless: save a PNG of the whole window and exit")
    p.add_argument("--export-timeline", metavar="OUT.png|.svg", help="headless: save the timeline and exit")
    p.add_argument("--timeout", type=float, default=600.0, help="headless: give up after this many seconds")
    p.add_argument("--lens", action="store_true", help="capture the logit lens of every step (Logit lens panel)")
    p.add_argument("--regex", help="constrain the output to this regular expression (Constrain output panel)")
    p.add_argument("--open-session", metavar="FILE.ilab", help="open a saved session (no model needed to show it)")
    p.add_argument("--save-session", metavar="OUT.ilab", help="headless: generate, save the session and exit")
    args = p.parse_args(argv)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if args.tour is not None:
        from app.tour import step_count

        if not 1 <= args.tour <= step_count():
            p.error(f"--tour: the tour has steps 1 to {step_count()}")
    if args.size is not None and not re.fullmatch(r"[1-9]\d{2,4}x[1-9]\d{2,4}", args.size.lower()):
        p.error(f"--size {args.size}: give it as WIDTHxHEIGHT, e.g. 1366x768")
    return args


def check_output_path(option: str, path: str, exts: tuple[str, ...]) -> str | None:
    """One sentence saying why `path` cannot be written, or None when it looks fine."""
    p = Path(path).expanduser()
    if p.suffix.lower() not in exts:
        return f"{option} {path}: unknown file type {p.suffix or '(none)'!r}; use {' or '.join(exts)}"
    if p.is_dir():
        return f"{option} {path}: that is a directory, not a file name"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"{option} {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return f"{option} {path}: cannot write there (permission denied)"
    return None


def _fail(message: str, code: int) -> int:
    print(f"inference-lab: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    headless = bool(args.screenshot or args.export_timeline or args.save_session)
    for option, path, exts in (("--screenshot", args.screenshot, SCREENSHOT_EXTS),
                               ("--export-timeline", args.export_timeline, TIMELINE_EXTS),
                               ("--save-session", args.save_session, SESSION_EXTS)):
        if path:
            problem = check_output_path(option, path, exts)
            if problem:
                return _fail(problem, 2)
    if args.open_session and not Path(args.open_session).expanduser().is_file():
        return _fail(f"--open-session {args.open_session}: no such file", 2)
    if headless and not args.prompt and not args.open_session and not args.tour:
        return _fail("--screenshot, --export-timeline and --save-session need --prompt or --open-session", 2)
    if headless:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from PySide6 import QtWidgets

    from app.theme import apply_theme

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([sys.argv[0]])
    import logging

    from app.guard import install_excepthook

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    install_excepthook()  # an exception in a slot or timer is logged and shown, never fatal
    app.setOrganizationName("InferenceLab")
    app.setApplicationName("Inference Lab")
    apply_theme(app)

    from app.main_window import MainWindow

    if headless:
        return _run_headless(app, args)
    window = MainWindow(args.model, device=args.device, kernels=args.kernels)
    _apply_args(window, args)
    if args.url:
        window.connect_server(args.url)
    window.show()
    if args.tour:
        window.tour.start_when_loaded(args.tour - 1)
    if args.open_session:
        _open_when_loaded(window, str(Path(args.open_session).expanduser()))
    _close_on_ctrl_c(window)
    return app.exec()


def _open_when_loaded(window, path: str) -> None:
    """Open a session once the model has loaded (or failed to): a model arriving later would clear the panels."""
    from app import session_io

    def go(*_args) -> None:
        for sig in (window.bridge.sig_model_loaded, window.bridge.sig_load_failed):
            sig.disconnect(go)
        session_io.open_session_from(window, path)

    window.bridge.sig_model_loaded.connect(go)
    window.bridge.sig_load_failed.connect(go)


def _close_on_ctrl_c(window) -> None:
    """Ctrl+C in the terminal closes the window the normal way (settings saved, engine stopped)."""
    import signal

    from PySide6 import QtCore

    signal.signal(signal.SIGINT, lambda *_: window.close())
    signal.signal(signal.SIGTERM, lambda *_: window.close())
    # Python runs signal handlers only between bytecodes: a short timer gives it the chance while Qt waits.
    window._signal_timer = QtCore.QTimer(window)
    window._signal_timer.timeout.connect(lambda: None)
    window._signal_timer.start(200)


def _apply_args(window, args: argparse.Namespace) -> None:
    from dataclasses import replace

    prompt, gen = window.panels.get("prompt"), window.panels.get("generation")
    if args.prompt is not None and prompt is not None:
        prompt.set_text(args.prompt)
    if args.chat:
        for panel in (prompt, gen):
            if panel is not None:
                panel.set_chat(True)
    if args.max_new_tokens is not None and gen is not None:
        gen.set_max_new_tokens(args.max_new_tokens)
    lens = window.panels.get("lens")
    if args.lens and lens is not None:
        window.docks["lens"].show()  # the lens is computed while its panel is on screen: in front of its tab group
        window.docks["lens"].raise_()
        lens.set_capture(True)
    constrain = window.panels.get("constrain")
    if args.regex is not None and constrain is not None:
        constrain.set_constraint("regex", args.regex)
    if args.seed is not None or args.greedy:
        params = window.bridge.params
        if args.greedy:
            params = replace(params, temperature=0.0)
        if args.seed is not None:
            params = replace(params, seed=args.seed)
        window.bridge.set_params(params)


def _quiet_qt_messages() -> None:
    """Headless runs print one line per problem: drop the offscreen platform's harmless chatter."""
    from PySide6 import QtCore

    noise = ("propagateSizeHints",)

    def handler(mode, context, message: str) -> None:
        if any(n in message for n in noise):
            return
        sys.stderr.write(message + "\n")

    QtCore.qInstallMessageHandler(handler)


def _run_headless(app, args: argparse.Namespace) -> int:
    from PySide6 import QtCore

    from app.main_window import MainWindow

    _quiet_qt_messages()

    from app import session_io

    replay_only = bool(args.open_session) and not args.prompt
    window = MainWindow(args.model, persist=False, interactive=False, device=args.device, load=not replay_only,
                        kernels=args.kernels)
    if "roofline" in window.panels and not replay_only:
        window.panels["roofline"].auto_measure = True  # the picture of a local run shows the machine it ran on
    size = tuple(int(v) for v in args.size.lower().split("x")) if args.size else HEADLESS_SIZE
    window.resize(*size)
    window.show()
    outcome: dict[str, object] = {}
    deadline = time.monotonic() + args.timeout

    def finish(code: int, message: str | None = None) -> None:
        if "code" in outcome:
            return
        outcome["code"] = code
        if message:
            print(f"inference-lab: {message}", file=sys.stderr)
        app.exit(code)

    def on_loaded(_info) -> None:
        if args.tour:  # the tour's step runs its own actions; its figure measured, the picture is taken
            window.tour.sig_step_ready.connect(lambda _i: (window.resize(*size), QtCore.QTimer.singleShot(0, save)))
            window.tour.start(args.tour - 1)
            return
        if args.url and window.bridge.server is None:
            window.connect_server(args.url)  # generate once connected
            return
        _apply_args(window, args)
        prompt = window.panels.get("prompt")
        if prompt is not None:
            prompt.set_text(args.prompt)
        gen = window.panels["generation"]
        if not prompt:
            gen.set_text(args.prompt)
        if not gen.generate():
            finish(1, "could not start the generation")

    def settle(rounds: int = 4) -> None:
        """Let the shared draw timer and pyqtgraph's deferred layouts run so every panel shows this run."""
        for _ in range(rounds):
            end = time.monotonic() + 0.06
            while time.monotonic() < end:
                app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 20)
            window.tick_panels(flush=True)

    def on_finished(_ev) -> None:
        if args.tour:
            return  # the tour's own step decides when its figure is in
        if args.load_lab and "load_lab" not in outcome:
            outcome["load_lab"] = True
            run_load_lab()
            return
        if args.why and "why" not in outcome:
            outcome["why"] = True
            run_why()
            return
        # The generation owned the KV cache; now the preview runs on the same prompt and shows the reuse.
        preview = window.panels.get("preview")
        if preview is None or preview.result is not None:
            QtCore.QTimer.singleShot(0, save)
            return
        window.bridge.sig_preview.connect(lambda _r: QtCore.QTimer.singleShot(0, save))
        QtCore.QTimer.singleShot(10_000, save)  # a preview that never comes must not hold the picture back
        preview.request_now()  # runs once the engine is idle again

    def run_load_lab() -> None:
        from app.panels.load_lab import parse_levels

        lab = window.panels.get("load_lab")
        if lab is None or window.bridge.server is None:
            finish(1, "--load-lab needs --url and the Load lab panel")
            return
        try:
            levels = parse_levels(args.load_lab)
        except ValueError as e:
            finish(2, str(e))
            return
        window.docks["load_lab"].show()
        window.docks["load_lab"].raise_()
        window.bridge.sig_serve_done.connect(lambda done: QtCore.QTimer.singleShot(0, save) if done.ok else
                                             finish(1, done.message or f"the load lab was {done.outcome}"))
        lab.run({"concurrency": levels, "num_prompts": 8, "max_new_tokens": args.max_new_tokens or 32,
                 "request_rate": None, "burstiness": 1.0, "time_limit_s": 120.0})

    def run_why() -> None:
        panel = window.panels.get("why")
        if panel is None:
            finish(1, "--why needs the Why panel")
            return
        window.docks["why"].show()
        window.docks["why"].raise_()
        panel.set_mode(args.why)

        def done(ev) -> None:
            if ev.result is None:
                finish(1, ev.failure or f"the {args.why} experiment did not finish")
            else:
                QtCore.QTimer.singleShot(0, save)

        window.bridge.sig_why_done.connect(done)
        if not panel.run():
            finish(2, f"--why {args.why}: the panel's inputs cannot run")

    def save() -> None:
        if "saving" in outcome:
            return
        roof = window.panels.get("roofline")
        if roof is not None and roof.measuring and "measured" not in outcome:
            # the local run's own machine is being measured (it waited for the generation): show it, not a chip
            outcome["measured"] = True
            window.bridge.sig_measure_done.connect(lambda _m: QtCore.QTimer.singleShot(0, save))
            QtCore.QTimer.singleShot(30_000, save)  # a measurement that never ends must not hold the picture back
            return
        outcome["saving"] = True
        settle()
        outputs = []
        if args.screenshot:
            path = str(Path(args.screenshot).expanduser())
            if not window.grab().save(path, "PNG"):
                finish(1, f"could not write the screenshot to {path}")
                return
            outputs.append(("screenshot", path))
        if args.export_timeline:
            path = str(Path(args.export_timeline).expanduser())
            if not window.export_timeline(path):
                finish(1, window.last_error)
                return
            outputs.append(("timeline", path))
        if args.save_session:
            path = str(Path(args.save_session).expanduser())
            if not session_io.save_session_to(window, path):
                finish(1, window.last_error)
                return
            outputs.append(("session", path))
        for kind, path in outputs:
            print(f"{kind}: {path}")
        finish(0)

    def check_deadline() -> None:
        if time.monotonic() > deadline:
            finish(1, f"timed out after {args.timeout:.0f} s")

    if not replay_only:
        window.bridge.sig_model_loaded.connect(on_loaded)
        window.bridge.sig_load_failed.connect(lambda msg: finish(1, msg))
        window.bridge.sig_server_connected.connect(on_loaded)
        window.bridge.sig_server_failed.connect(lambda msg: finish(1, msg))
        window.bridge.sig_failed.connect(lambda msg: finish(1, msg))
        window.bridge.sig_engine_lost.connect(lambda lost: finish(1, lost.message))  # its run did not end
        window.bridge.sig_finished.connect(on_finished)
    watchdog = QtCore.QTimer(window)
    watchdog.timeout.connect(check_deadline)
    watchdog.start(500)
    if replay_only:
        def open_and_save() -> None:
            try:
                opened = session_io.open_session_from(window, str(Path(args.open_session).expanduser()))
            except Exception as e:  # noqa: BLE001 — a slot's exception is only logged: say it and exit, never wait
                finish(1, " ".join(f"{args.open_session} cannot be shown ({type(e).__name__}: {e})".split()))
                return
            if opened:
                save()
            else:
                finish(1, window.last_error)

        QtCore.QTimer.singleShot(0, open_and_save)
    code = app.exec()
    watchdog.stop()
    window.close()
    return int(outcome.get("code", code))


if __name__ == "__main__":
    sys.exit(main())
