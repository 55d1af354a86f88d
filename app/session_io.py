"""Sessions in the app: save the window's runs as .ilab, open one and replay it into the panels, the autosave.

The runs are the window's run store (app.run_store): the recorder, the Branches panel and the exports all read it.
Saving takes a cheap snapshot on the GUI thread (references to the frozen events and their arrays, shared
read-only) and writes the file in one writer thread; opening reads the file in that thread, then replays it on the
GUI thread. The writer runs one job at a time, in order; a newer autosave replaces one still waiting. The
tokenizer is serialised once per loaded tokenizer, not per save.

Replaying goes through the bridge's own routing (`replay_events`: Bridge.replay), so every panel receives exactly
the signals it received live, in the same order; no panel needs to know about files. The model is not needed: the
session carries the model's facts, config and tokenizer.

Autosave: after every finished generation the session is written to `autosave_path()`; a clean exit waits for the
writer and removes the file, so a file there at start means the app did not close normally, and the window offers
to open it.
"""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PySide6 import QtCore, QtWidgets

from app.bridge import age_heap
from app.guard import guarded
from app.run_store import RunStore
from app.settings import ENV_FILE
from engine.events import Finished, Steered
from engine.session_file import (
    SavedSession,
    load_session,
    model_identity,
    same_model,
    save_session,
)

AUTOSAVE_NAME = "autosave.ilab"
AUTOSAVE_AFTER_MS = 300  # from a run's end to its autosave: the window's last draws first (install)
AUTOSAVE_WAIT_MS = 1000  # …and while a panel has not drawn the run's end yet, up to this long after it


def autosave_path() -> Path:
    """Beside the settings file named by INFERENCE_LAB_SETTINGS (tests), else in the app's data folder."""
    env = os.environ.get(ENV_FILE)
    if env:
        return Path(env).with_name(AUTOSAVE_NAME)
    base = QtCore.QStandardPaths.writableLocation(QtCore.QStandardPaths.StandardLocation.AppDataLocation)
    return Path(base or Path.home() / ".inference-lab") / AUTOSAVE_NAME


SLICE_S = 0.010  # GUI-thread time a replay takes before the event loop turns again (paints, input, Esc)


def replay_events(bridge, events: list, store: RunStore | None = None) -> None:
    """Send saved events through the bridge's routing, as if they had just arrived (the store does not record
    them again), all at once: for short lists; a session or a branch goes through `Replay`, in slices."""
    if store is None:
        for ev in events:
            bridge.replay(ev)
        return
    with store.replay():
        for ev in events:
            bridge.replay(ev)


class Replay(QtCore.QObject):
    """Work on the GUI thread (loading a session's runs into the store, sending a run's events through the
    bridge) done in slices of about SLICE_S, one per turn of the event loop, with progress in the status bar.

    Esc cancels: the panels then show the run up to the event reached, as they would a run stopped there. A live
    generation starting cancels it too; so does a newer replay. `done(completed)` runs once at the end.

    The panels draw once, at the end (or at the cancel), not on the window's draw timer meanwhile: a long run's
    panels cost the more a draw the longer the run, and each draw of a half-replayed run only delayed the whole.
    """

    def __init__(self, window, work: Iterator[int], total: int, what: str,
                 done: Callable[[bool], None] | None = None) -> None:
        super().__init__(window)
        self.window, self.work, self.total, self.what, self._done = window, work, max(1, total), what, done
        self.reached = 0  # units of work done (events loaded, then events replayed)
        self.slices = 0
        self.active = False
        self._paused: QtCore.QTimer | None = None  # the window's draw timer, stopped while this runs
        self.completed = False
        self._timer = QtCore.QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self._slice)

    def start(self) -> Replay:
        old = getattr(self.window, "replay_job", None)
        if old is not None:
            old.cancel()
            old.deleteLater()
        self.window.replay_job = self
        self.active = True
        timer = getattr(self.window, "draw_timer", None)
        self._paused = timer if timer is not None and timer.isActive() else None
        if self._paused is not None:
            self._paused.stop()
        QtWidgets.QApplication.instance().installEventFilter(self)
        self.window.bridge.sig_state.connect(self._on_state)
        self.window.progress.setValue(0)
        self.window.progress.show()
        self._say()
        self._timer.start()
        return self

    def finish_now(self) -> None:
        """Do the rest at once (headless callers and tests that need the panels filled before going on)."""
        if not self.active:
            return
        self._timer.stop()
        try:
            with self.window.run_store.replay():
                for reached in self.work:
                    self.reached = reached
        except Exception:
            self.work.close()
            self._end(False)
            raise
        self._end(True)

    def cancel(self) -> None:
        if not self.active:
            return
        self._timer.stop()
        self.work.close()
        self._end(False)

    @QtCore.Slot()
    @guarded
    def _slice(self) -> None:
        if not self.active:
            return
        self.slices += 1
        t0 = time.perf_counter()
        try:
            with self.window.run_store.replay():
                while time.perf_counter() - t0 < SLICE_S:
                    self.reached = next(self.work)
        except StopIteration:
            self._end(True)
            return
        except Exception:
            self.work.close()
            self._end(False)
            raise  # the guard logs it and shows it in the status bar
        self._say()
        self._timer.start()

    def _say(self) -> None:
        self.window.progress.setValue(int(100 * min(self.reached, self.total) / self.total))
        self.window.set_message(f"{self.what}: {min(self.reached, self.total):,} of {self.total:,} events (Esc "
                                "cancels)")

    def _end(self, completed: bool) -> None:
        self.active, self.completed = False, completed
        QtWidgets.QApplication.instance().removeEventFilter(self)
        try:
            self.window.bridge.sig_state.disconnect(self._on_state)
        except (RuntimeError, TypeError):
            pass
        self.window.progress.hide()
        if completed:
            self.window.set_message(f"{self.what}: done.")
        else:
            self.window.set_message(f"{self.what}: stopped at event {self.reached:,} of {self.total:,}; the panels "
                                    "show the run up to there.")
        self.window.tick_panels(flush=True)
        # What the replay made (a session's runs in the store, the panels' copies) is kept for as long as the window
        # shows it: left in the collector's generations, the first full collection after an open walked all of it
        # while holding the GIL, as a live run's objects would without the bridge's age_heap.
        age_heap()
        if self._paused is not None:
            self._paused.start()
            self._paused = None
        done, self._done, self.work = self._done, None, iter(())  # what they hold (a run's events) may go now
        if done is not None:
            done(completed)

    @QtCore.Slot(str)
    def _on_state(self, state: str) -> None:
        if state != "idle":  # a live generation: its events must not mix with replayed ones
            self.cancel()

    @guarded(default=False)
    def eventFilter(self, obj: QtCore.QObject, event: QtCore.QEvent) -> bool:  # noqa: N802 — Qt's name
        if (event.type() in (QtCore.QEvent.Type.ShortcutOverride, QtCore.QEvent.Type.KeyPress)
                and event.key() == QtCore.Qt.Key.Key_Escape and self.active):
            self.cancel()
        return False


def replay_run(window, events: list, what: str, done: Callable[[bool], None] | None = None) -> Replay:
    """Send a stored run's events into the panels in slices (a branch switch)."""
    bridge, n = window.bridge, len(events)

    def work() -> Iterator[int]:
        for i, ev in enumerate(events, 1):
            bridge.replay(ev)
            yield i

    return Replay(window, work(), n, what, done).start()


def finish_replay(window) -> None:
    """Complete the replay in progress at once, if any."""
    job = getattr(window, "replay_job", None)
    if job is not None:
        job.finish_now()


# ---- the tokenizer, serialised once ---------------------------------------------------------------------------
class TokenizerFiles:
    """A tokenizer's saved files, in memory: session_file writes them with `.save(folder)` as it would the
    tokenizer's own."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def save(self, directory: str | os.PathLike[str]) -> None:
        for name, data in self.files.items():
            (Path(directory) / name).write_bytes(data)


_tok_lock = threading.Lock()
_tok_cache: list = [None, None]  # [the tokenizer, its TokenizerFiles]: one loaded model at a time


def tokenizer_files(tokenizer, model_path: str = "") -> TokenizerFiles | None:
    """The tokenizer's files, the first time they are asked for (the writer thread asks): read from the engine's
    tokenizer cache of the model file when it has one, else serialised. Serialising holds the GIL throughout (a
    large vocabulary such as Gemma's takes about a second): the GUI thread would freeze that long."""
    if tokenizer is None or isinstance(tokenizer, TokenizerFiles):
        return tokenizer
    with _tok_lock:
        if _tok_cache[0] is not tokenizer:
            files = _cached_tokenizer_files(model_path)
            if files is None:
                files = _files_from_child(model_path, tokenizer)
            if files is None:
                with tempfile.TemporaryDirectory() as td:
                    tokenizer.save(td)
                    files = {f.name: f.read_bytes() for f in sorted(Path(td).iterdir()) if f.is_file()}
            _tok_cache[:] = [tokenizer, TokenizerFiles(files)]
        return _tok_cache[1]


def _files_from_child(model_path: str, tokenizer) -> dict[str, bytes] | None:
    """The model file's tokenizer written by a child process (its own GIL: this process's GUI thread keeps running
    while it serialises), or None when there is no model file or the child's tokenizer is not this one."""
    import subprocess
    import sys

    if not model_path or not Path(model_path).exists():
        return None
    code = ("import sys; from engine.tokenizer.load import load_tokenizer; "
            "load_tokenizer(sys.argv[1]).save(sys.argv[2])")
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as td:
        try:
            done = subprocess.run([sys.executable, "-c", code, model_path, td], cwd=root, capture_output=True,
                                  timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        files = {f.name: f.read_bytes() for f in sorted(Path(td).iterdir()) if f.is_file()}
    return files if _same_tokenizer(files, tokenizer) else None


def _same_tokenizer(files: dict[str, bytes], tokenizer) -> bool:
    """The files hold `tokenizer`'s vocabulary: every token's bytes, in order (a model file changed since it was
    loaded would not)."""
    import io

    import numpy as np

    from engine.tokenizer.cache import CACHE_BYTES

    try:
        with io.BytesIO(files[CACHE_BYTES]) as f:
            lengths = np.load(f)
            blob = np.load(f)
        return np.array_equal(lengths, tokenizer._lengths) and blob.tobytes() == b"".join(tokenizer._token_bytes)
    except (KeyError, ValueError, OSError, AttributeError):
        return False


def _cached_tokenizer_files(model_path: str) -> dict[str, bytes] | None:
    from engine.tokenizer.cache import CACHE_META
    from engine.tokenizer.load import tokenizer_cache_dir

    try:
        path = Path(model_path)
        cdir = tokenizer_cache_dir(path) if model_path and path.is_file() else None
        if cdir is None or not (cdir / CACHE_META).is_file():  # the metadata is written last: complete
            return None
        return {f.name: f.read_bytes() for f in sorted(cdir.iterdir()) if f.is_file() and not f.name.endswith(".tmp")}
    except OSError:
        return None


# ---- the snapshot (GUI thread) ----------------------------------------------------------------------------------
def snapshot(window) -> SavedSession:
    """The window's session as references to its runs' events (cheap: no array is copied, no file is read).

    `model` is left for the writer to fill in (hashing the weights file the first time takes a while).
    """
    store: RunStore = window.run_store
    bridge = window.bridge
    prompt, gen = window.panels.get("prompt"), window.panels.get("generation")
    text = prompt.text() if prompt is not None else (gen.text() if gen is not None else "")
    chat = prompt.chat() if prompt is not None else (gen.chat() if gen is not None else False)
    max_new = gen.max_tokens.value() if gen is not None else 0
    shown = store.shown_run()
    why = window.panels.get("why")
    extra = {"why": why.saved_results()} if why is not None and why.saved_results() else {}
    lab, requests = window.panels.get("load_lab"), window.panels.get("requests")
    if lab is not None and lab.runs:  # the Load lab's last run: its levels' figures and each request's timeline
        extra["load_lab"] = lab.saved_results()
    if requests is not None and requests.requests:
        extra["load_requests"] = requests.saved_results()
    return SavedSession(
        events=store.events(), prompt=text, chat=chat,
        settings={"params": bridge.params, "max_new_tokens": int(max_new), **extra},
        info=bridge.info, cfg=bridge.cfg, tokenizer=bridge.tokenizer,
        branches=store.records() if len(store.runs) > 1 else [],
        dropped=list(shown.dropped) if shown is not None and shown.dropped else None,
    )


def current_session(window) -> SavedSession:
    """The window's session, complete (the model's identity included): for callers that write it themselves."""
    s = snapshot(window)
    s.model = model_identity(s.info)
    return s


def write(path: str | os.PathLike[str], session: SavedSession) -> None:
    """Write a snapshot (any thread): OSError or TypeError with one sentence when it cannot."""
    if not session.model and session.info is not None:
        session.model = model_identity(session.info)
    session.tokenizer = tokenizer_files(session.tokenizer, session.info.path if session.info is not None else "")
    save_session(path, session)


# ---- the writer thread ------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Job:
    """One file to write or read in the writer thread; `done` runs on the GUI thread with (result, error)."""

    kind: str  # "save", "autosave", "open" or "warm" (a live run's tokenizer files made ahead of its autosave)
    path: Path
    session: SavedSession | None = None
    info: object = None  # open: the loaded model's facts, to compare with the session's
    done: Callable[[object, str | None], None] | None = None
    result: object = None
    error: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    handled: bool = False

    def run(self) -> None:
        if self.kind == "open":
            saved = load_session(self.path)
            self.result = (saved, same_model(saved.model, self.info))
        elif self.kind == "warm":
            if self.session.tokenizer is not None:  # ready before the run ends: its autosave does not wait for it
                tokenizer_files(self.session.tokenizer, self.session.info.path if self.session.info else "")
        else:
            if self.kind == "autosave":
                self.path.parent.mkdir(parents=True, exist_ok=True)
            # The writer makes an object per array it refers to (tens of thousands for a long run), enough to start
            # the collector's full walks, and each walk of every object the window holds kept the GIL from the GUI
            # thread for as long as it took (BENCHMARKS.md, "The writer's collections"); frozen, what exists now is
            # left out of them (app.bridge.age_heap freezes a live run's objects the same way).
            gc.freeze()
            write(self.path, self.session)


class SessionWriter(QtCore.QObject):
    """One worker thread that writes and reads session files, one job at a time, in order of request."""

    sig_done = QtCore.Signal(object)  # a Job, emitted from the worker thread; received in the GUI thread

    def __init__(self, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self._lock = threading.Lock()
        self._pending: list[Job] = []
        self._thread: threading.Thread | None = None
        self.closed = False  # the window exited cleanly: no more autosaves
        self.sig_done.connect(self._on_done, QtCore.Qt.ConnectionType.QueuedConnection)
        self._later = QtCore.QTimer(self)  # a request to submit after a while (later): one at a time, the newest
        self._later.setSingleShot(True)
        self._later.timeout.connect(self._submit_later)
        self._later_fn: Callable[[], object] | None = None
        self.waiting = False  # wait() is calling the later request now: it must submit, not wait any longer

    def later(self, fn: Callable[[], object], ms: int) -> None:
        """Call `fn` (which submits a job) in `ms` ms on the GUI thread, replacing a call still waiting; wait()
        calls it at once, and wait(cancel_autosave=True) drops it."""
        self._later_fn = fn
        self._later.start(ms)

    def _submit_later(self) -> None:
        fn, self._later_fn = self._later_fn, None
        if fn is not None:
            fn()

    def submit(self, job: Job) -> Job:
        """Queue a job (GUI thread); a new autosave replaces one still waiting, a new warm-up likewise."""
        with self._lock:
            if job.kind in ("autosave", "warm"):
                self._pending = [j for j in self._pending if j.kind != job.kind]
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="inference-lab-sessions", daemon=True)
                self._thread.start()
        return job

    def busy(self) -> bool:
        with self._lock:
            return self._thread is not None or self._later.isActive()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                job = self._pending.pop(0)
            try:
                job.run()
            except (OSError, ValueError, TypeError) as e:  # one sentence from session_file
                job.error = str(e)
            except Exception as e:  # noqa: BLE001 — a writer that dies would leave every later save waiting
                job.error = f"{type(e).__name__}: {e}"
            job.finished.set()
            self.sig_done.emit(job)

    def wait(self, job: Job | None = None, cancel_autosave: bool = False) -> None:
        """Block until `job` (None: every job) is done; cancel_autosave drops an autosave not yet started."""
        if self._later.isActive():
            self._later.stop()
            if cancel_autosave:
                self._later_fn = None
            else:
                self.waiting = True
                try:
                    self._submit_later()
                finally:
                    self.waiting = False
        with self._lock:
            if cancel_autosave:
                self._pending = [j for j in self._pending if j.kind not in ("autosave", "warm")]
            thread = self._thread
        if job is not None:
            job.finished.wait()
        elif thread is not None:
            thread.join()

    @QtCore.Slot(object)
    def _on_done(self, job: Job) -> None:
        self.finish(job)

    @staticmethod
    def finish(job: Job) -> None:
        """Report a done job on the GUI thread, once."""
        if job.handled:
            return
        job.handled = True
        if job.done is not None:
            job.done(job.result, job.error)


# ---- the window's side: menu actions, save/open with messages, autosave -----------------------------------------
def install(window) -> None:
    """Give a MainWindow its run store, the session writer, File → Save session… / Open session…, the autosave."""
    from PySide6 import QtGui

    window.run_store = RunStore(window.bridge, window)
    window.session_writer = SessionWriter(window)
    # A run's end first lets the window draw its last state (every panel draws at Finished), then autosaves: the
    # writer's encoding, in this process, would take turns with those draws for the GIL (a paint calls back into
    # Python dozens of times, waiting each time for the writer's turn to end: BENCHMARKS.md, "The GIL's turns").
    window.run_store.sig_finished.connect(lambda _id: _draw_then_autosave(window))
    window.run_store.sig_run_updated.connect(lambda run_id: _warm(window, run_id))
    window.replay_job = None
    for panel in window.panels.values():
        attach = getattr(panel, "attach_store", None)
        if attach is not None:
            attach(window.run_store)
    menu = window.file_menu
    anchor = next((a for a in reversed(menu.actions()) if a.isSeparator()), None)
    save_action = QtGui.QAction("&Save session…", window)
    save_action.setShortcut(QtGui.QKeySequence("Ctrl+S"))
    save_action.triggered.connect(lambda: _save_dialog(window))
    open_action = QtGui.QAction("Open &session…", window)
    open_action.setShortcut(QtGui.QKeySequence("Ctrl+Shift+O"))
    open_action.triggered.connect(lambda: _open_dialog(window))
    for action in (save_action, open_action):
        menu.insertAction(anchor, action) if anchor is not None else menu.addAction(action)
    window.save_session_action, window.open_session_action = save_action, open_action
    window.autosave_offer = None
    path = autosave_path()
    if window.settings is not None and path.is_file():
        window.autosave_offer = path

        def offer(*_args) -> None:
            for sig in (window.bridge.sig_model_loaded, window.bridge.sig_load_failed):
                try:
                    sig.disconnect(offer)
                except (RuntimeError, TypeError):
                    pass
            _offer_autosave(window, path)

        window.bridge.sig_model_loaded.connect(offer)
        window.bridge.sig_load_failed.connect(offer)


def replay(window, saved: SavedSession, warning: str | None = None, wait: bool = True,
           done: Callable[[bool], None] | None = None) -> Replay:
    """Show a saved session in every panel of `window` (GUI thread); `warning`: it is from another model.

    Without a loaded model the session's model facts, config and tokenizer stand in for it; with another model
    loaded, or the same one running otherwise (another dtype, kernel mode or device: what its numbers were measured
    with), the panels show the session's and the loaded model stays for the next generation. The runs are loaded
    and the shown one replayed in slices (`Replay`); `wait`: all of it before returning. `done(completed)` runs
    at the end.
    """
    bridge = window.bridge
    store: RunStore = window.run_store
    loaded = (bridge.info, bridge.cfg, bridge.tokenizer)
    prompt, gen = window.panels.get("prompt"), window.panels.get("generation")
    ran_otherwise = (saved.info is not None and loaded[0] is not None
                     and _how_it_ran(saved.info) != _how_it_ran(loaded[0]))

    def put_back() -> None:
        if (warning or ran_otherwise) and loaded[0] is not None:
            bridge.show_model(*loaded, announce=False)

    try:
        if bridge.info is None or warning or ran_otherwise:
            if saved.info is not None:
                bridge.show_model(saved.info, saved.cfg, saved.tokenizer)
        for panel in (prompt, gen):
            if panel is not None:
                panel.set_chat(saved.chat)
        if prompt is not None:
            prompt.set_text(saved.prompt)
        elif gen is not None:
            gen.set_text(saved.prompt)
        if gen is not None and "max_new_tokens" in saved.settings:
            gen.set_max_new_tokens(int(saved.settings["max_new_tokens"]))
        params = saved.settings.get("params")
        if params is not None:
            bridge.set_params(params)
    except BaseException:
        put_back()
        raise
    if saved.branches:
        records, shown = saved.branches, next((i for i, r in enumerate(saved.branches) if r.get("shown")), None)
    else:
        records, shown = [{"name": "run 1", "events": saved.events, "dropped": saved.dropped}], None
    n_load = sum(len(r.get("events", [])) for r in records)
    n_shown = len(records[shown if shown is not None else -1].get("events", []))

    def work() -> Iterator[int]:
        yield from store.loading(records, shown)
        for i, ev in enumerate(store.events(), 1):
            bridge.replay(ev)
            yield n_load + i

    def end(completed: bool) -> None:
        try:
            why = window.panels.get("why")
            if why is not None:  # the why-experiments' results the session kept (none: the panel is cleared)
                why.restore_results(saved.settings.get("why"))
            for name, key in (("load_lab", "load_lab"), ("requests", "load_requests")):
                panel = window.panels.get(name)
                if panel is not None and key in saved.settings:  # none kept: a live server's runs stay
                    panel.restore_results(saved.settings[key])
            steer = window.panels.get("steer")
            vector = next((e for e in store.events() if isinstance(e, Steered) and e.directions is not None), None)
            if steer is not None and vector is not None:  # the shown run's steering vector, back in its panel
                steer.adopt(vector)
        finally:
            put_back()
        if done is not None:
            done(completed)

    job = Replay(window, work(), n_load + n_shown, "Opening the session", end).start()
    if wait:
        job.finish_now()
    return job


def _how_it_ran(info) -> tuple:
    """What a model's numbers were measured with besides the model itself: dtype, kernel mode and device."""
    return info.dtype, getattr(info, "kernels", ""), info.device


def describe(saved: SavedSession) -> str:
    """One line about a session: model, prompt length, tokens generated."""
    fin = next((e for e in reversed(saved.events) if isinstance(e, Finished)), None)
    n = len(fin.ids) if fin is not None else 0
    name = saved.model.get("name") or (asdict(saved.info)["name"] if saved.info is not None else "?")
    return f"{name}: {n} tokens generated from a {len(saved.prompt)}-character prompt"


def save_session_to(window, path: str | os.PathLike[str], wait: bool = True) -> bool:
    """Save the window's session in the writer thread; `wait`: block until written (the headless CLI, tests) and
    return whether it was, else return at once (True) and report when done. A failure shows its sentence and
    keeps everything as it was."""
    path = Path(path)

    def done(_result, error: str | None) -> None:
        if error:
            window.show_error(error, title="Save failed", box=window.interactive)
        else:
            window.set_message(f"Session saved to {path}")

    job = window.session_writer.submit(Job("save", path, snapshot(window), done=done))
    if not wait:
        window.set_message(f"Saving the session to {path}…")
        return True
    window.session_writer.wait(job)
    SessionWriter.finish(job)
    return job.error is None


def open_session_from(window, path: str | os.PathLike[str], wait: bool = True) -> bool:
    """Open a .ilab file into every panel: read in the writer thread, replayed on the GUI thread. A file that
    cannot be read shows why and changes nothing. `wait`: block until shown and return whether it was, else
    return at once (True)."""
    path = Path(path)
    job = Job("open", path, info=window.bridge.info,
              done=lambda result, error: _opened(window, path, result, error, wait))
    window.session_writer.submit(job)
    if not wait:
        window.set_message(f"Opening {path.name}…")
        return True
    window.session_writer.wait(job)
    SessionWriter.finish(job)
    return job.error is None


def _opened(window, path: Path, result, error: str | None, wait: bool = True) -> None:
    if error:
        window.show_error(error, title="Open failed", box=window.interactive)
        return
    saved, warning = result

    def shown(completed: bool) -> None:
        if warning:
            window.show_error(f"{path.name}: {warning}", title="A session from another model",
                              box=window.interactive)
        elif completed:
            window.last_error = ""
            window.set_message(f"Opened {path.name} ({describe(saved)})")

    replay(window, saved, warning, wait=wait, done=shown)


def _warm(window, run_id: int) -> None:
    """At a live run's first token, have the writer thread make the tokenizer's files (the first time for this
    tokenizer), so that the autosave at the run's end does not wait for them."""
    store: RunStore = window.run_store
    writer: SessionWriter = window.session_writer
    if window.settings is None or writer.closed or run_id != store.recording:
        return
    run = store.run(run_id)
    if run is None or run.finished is not None or run.n_tokens != 1:
        return
    bridge = window.bridge
    writer.submit(Job("warm", autosave_path(), SavedSession(tokenizer=bridge.tokenizer, info=bridge.info)))


def _draw_then_autosave(window) -> None:
    """At a run's end: every panel draws its last state at its next turn, not when its rate limit would let it (up to
    a second later, in the middle of the autosave); the autosave starts AUTOSAVE_AFTER_MS later, or once no panel has
    anything left to draw, at most AUTOSAVE_WAIT_MS after the end."""
    deadline = time.monotonic() + AUTOSAVE_WAIT_MS / 1e3

    def when_drawn() -> None:
        undrawn = [p for p in window.panels.values() if p.dirty]
        if undrawn and not window.session_writer.waiting and time.monotonic() < deadline:
            for panel in undrawn:  # new data since (the run's last events): drawn at once too
                panel.draw_soon()
            window.session_writer.later(when_drawn, 50)
            return
        autosave(window)

    for panel in window.panels.values():
        panel.draw_soon()
    window.session_writer.later(when_drawn, AUTOSAVE_AFTER_MS)


def autosave(window) -> None:
    """Write the session where the next start looks for it (only for windows that keep settings), in the writer
    thread; a newer autosave replaces one still waiting."""
    if window.settings is None or window.session_writer.closed:
        return

    def done(_result, error: str | None) -> None:
        if error:
            window.set_message(f"Autosave failed: {error}", error=True)

    window.session_writer.submit(Job("autosave", autosave_path(), snapshot(window), done=done))


def clean_exit(window) -> None:
    """A normal close: wait for the writer (an autosave not yet started is dropped), then remove the autosave,
    which exists to survive crashes."""
    writer = getattr(window, "session_writer", None)
    if writer is not None:
        writer.closed = True  # a run's end that still arrives while the engine stops writes no new autosave
        writer.wait(cancel_autosave=True)
    if window.settings is not None:
        autosave_path().unlink(missing_ok=True)


def _offer_autosave(window, path: Path) -> None:
    from PySide6 import QtWidgets

    if not window.interactive or not path.is_file():
        return
    answer = QtWidgets.QMessageBox.question(
        window, "Restore the last session?",
        "Inference Lab did not close normally last time. Open the session it saved automatically?")
    if answer == QtWidgets.QMessageBox.StandardButton.Yes:
        open_session_from(window, path, wait=False)


def _save_dialog(window) -> None:
    from PySide6 import QtWidgets

    path, _ = QtWidgets.QFileDialog.getSaveFileName(
        window, "Save session", str(Path.home() / "session.ilab"), "Inference Lab sessions (*.ilab)")
    if path:
        if not path.endswith(".ilab"):
            path += ".ilab"
        save_session_to(window, path, wait=False)


def _open_dialog(window) -> None:
    from PySide6 import QtWidgets

    path, _ = QtWidgets.QFileDialog.getOpenFileName(
        window, "Open session", str(Path.home()), "Inference Lab sessions (*.ilab);;All files (*)")
    if path:
        open_session_from(window, path, wait=False)
