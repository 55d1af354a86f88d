"""Sessions in the app: record the current run's events, save them as .ilab, open one and replay it into the panels.

Replaying goes through the bridge's own routing (`Bridge.replay`), so every panel receives exactly the signals it
received live, in the same order; no panel needs to know about files. The model is not needed: the session carries
the model's facts, config and tokenizer.

Autosave: after every finished generation the current session is written to `autosave_path()`; a clean exit
removes it, so a file there at start means the app did not close normally, and the window offers to open it.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from PySide6 import QtCore

from app.bridge import Bridge
from app.settings import ENV_FILE
from engine.events import Finished, PromptTokenized, RunStarted
from engine.formats.session_file import SavedSession, load_session, model_identity, same_model, save_session

AUTOSAVE_NAME = "autosave.ilab"
SIGNALS = ("sig_run_started", "sig_prompt", "sig_prompt_scores", "sig_attention", "sig_norms", "sig_lens", "sig_kv",
           "sig_prefill", "sig_token", "sig_finished")


def autosave_path() -> Path:
    """Beside the settings file named by INFERENCE_LAB_SETTINGS (tests), else in the app's data folder."""
    env = os.environ.get(ENV_FILE)
    if env:
        return Path(env).with_name(AUTOSAVE_NAME)
    base = QtCore.QStandardPaths.writableLocation(QtCore.QStandardPaths.StandardLocation.AppDataLocation)
    return Path(base or Path.home() / ".inference-lab") / AUTOSAVE_NAME


class SessionRecorder(QtCore.QObject):
    """Keeps every event of the current generation, in arrival order (a new prompt starts a new record)."""

    sig_finished = QtCore.Signal()
    """A generation finished and its events are complete."""

    def __init__(self, bridge: Bridge, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.events: list = []
        self.replaying = False
        for name in SIGNALS:
            sig = getattr(bridge, name, None)
            if sig is not None:
                sig.connect(self._on_event)

    @QtCore.Slot(object)
    def _on_event(self, ev: object) -> None:
        if isinstance(ev, RunStarted) or (isinstance(ev, PromptTokenized) and self.events
                                          and not isinstance(self.events[-1], RunStarted)):
            self.events = []
        self.events.append(ev)
        if isinstance(ev, Finished) and not self.replaying:
            self.sig_finished.emit()

    def snapshot(self, prompt: str, chat: bool, max_new_tokens: int) -> SavedSession:
        b = self.bridge
        return SavedSession(
            events=list(self.events), prompt=prompt, chat=chat,
            settings={"params": b.params, "max_new_tokens": int(max_new_tokens)},
            model=model_identity(b.info), info=b.info, cfg=b.cfg, tokenizer=b.tokenizer,
        )


def save(path: str | os.PathLike[str], session: SavedSession) -> None:
    """Write a session (OSError with one sentence when the place is not writable)."""
    save_session(path, session)


def open_session(path: str | os.PathLike[str]) -> SavedSession:
    """Read a session (SessionFileError or OSError with one sentence when it cannot)."""
    return load_session(path)


def replay(window, saved: SavedSession) -> str | None:
    """Show a saved session in every panel of `window`; returns a warning sentence (another model) or None.

    Without a loaded model the session's model facts, config and tokenizer stand in for it; with another model
    loaded the panels show the session and the loaded model stays for the next generation.
    """
    bridge: Bridge = window.bridge
    warning = same_model(saved.model, bridge.info)
    loaded = (bridge.info, bridge.cfg, bridge.tokenizer)
    prompt, gen = window.panels.get("prompt"), window.panels.get("generation")
    recorder = getattr(window, "recorder", None)
    if recorder is not None:
        recorder.replaying = True
    try:
        if bridge.info is None or warning:
            if saved.info is not None:
                bridge.info, bridge.cfg = saved.info, saved.cfg
                bridge.tokenizer = saved.tokenizer if saved.tokenizer is not None else bridge.tokenizer
                bridge.sig_model_loaded.emit(saved.info)
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
            bridge.params = params
            bridge.sig_params.emit(params)
        for ev in saved.events:
            bridge.replay(ev)
        branches = window.panels.get("branches")
        if branches is not None and saved.branches:
            branches.restore(saved.branches)
    finally:
        if recorder is not None:
            recorder.replaying = False
        if warning and loaded[0] is not None:
            bridge.info, bridge.cfg, bridge.tokenizer = loaded
    return warning


def describe(saved: SavedSession) -> str:
    """One line about a session: model, prompt length, tokens generated."""
    fin = next((e for e in reversed(saved.events) if isinstance(e, Finished)), None)
    n = len(fin.ids) if fin is not None else 0
    name = saved.model.get("name") or (asdict(saved.info)["name"] if saved.info is not None else "?")
    return f"{name}: {n} tokens generated from a {len(saved.prompt)}-character prompt"


# ---- the window's side: menu actions, save/open with messages, autosave ---------------------------------------
def install(window) -> None:
    """Give a MainWindow its recorder, File → Save session… / Open session…, and the autosave."""
    from PySide6 import QtGui

    window.recorder = SessionRecorder(window.bridge, window)
    window.recorder.sig_finished.connect(lambda: autosave(window))
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


def current_session(window) -> SavedSession:
    prompt, gen = window.panels.get("prompt"), window.panels.get("generation")
    text = prompt.text() if prompt is not None else (gen.text() if gen is not None else "")
    chat = prompt.chat() if prompt is not None else (gen.chat() if gen is not None else False)
    max_new = gen.max_tokens.value() if gen is not None else 0
    saved = window.recorder.snapshot(text, chat, max_new)
    branches = window.panels.get("branches")
    if branches is not None and len(branches.branches) > 1:
        saved.branches = branches.export()
    return saved


def save_session_to(window, path: str | os.PathLike[str]) -> bool:
    """Save the current session; a failure shows its sentence and keeps everything as it was."""
    try:
        save(path, current_session(window))
    except (OSError, TypeError) as e:
        window.show_error(str(e), title="Save failed", box=window.interactive)
        return False
    window.set_message(f"Session saved to {path}")
    return True


def open_session_from(window, path: str | os.PathLike[str]) -> bool:
    """Open a .ilab file into every panel; a file that cannot be read shows why and changes nothing."""
    try:
        saved = open_session(path)
    except (OSError, ValueError) as e:
        window.show_error(str(e), title="Open failed", box=window.interactive)
        return False
    warning = replay(window, saved)
    window.tick_panels(flush=True)
    if warning:
        window.show_error(f"{Path(path).name}: {warning}", title="A session from another model",
                           box=window.interactive)
    else:
        window.last_error = ""
        window.set_message(f"Opened {Path(path).name} ({describe(saved)})")
    return True


def autosave(window) -> None:
    """Write the current session where the next start looks for it (only for windows that keep settings)."""
    if window.settings is None:
        return
    path = autosave_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save(path, current_session(window))
    except (OSError, TypeError) as e:
        window.set_message(f"Autosave failed: {e}", error=True)


def clean_exit(window) -> None:
    """A normal close: the autosave is no longer needed (it exists to survive crashes)."""
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
        open_session_from(window, path)


def _save_dialog(window) -> None:
    from PySide6 import QtWidgets

    path, _ = QtWidgets.QFileDialog.getSaveFileName(
        window, "Save session", str(Path.home() / "session.ilab"), "Inference Lab sessions (*.ilab)")
    if path:
        if not path.endswith(".ilab"):
            path += ".ilab"
        save_session_to(window, path)


def _open_dialog(window) -> None:
    from PySide6 import QtWidgets

    path, _ = QtWidgets.QFileDialog.getOpenFileName(
        window, "Open session", str(Path.home()), "Inference Lab sessions (*.ilab);;All files (*)")
    if path:
        open_session_from(window, path)
