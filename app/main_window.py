"""The main window: one dock per panel, the menus, the status bar, the shared draw timer and the settings.

The window shows at once; the model loads in the engine process while a progress bar runs in the status bar.
Closing the window stops the engine process and the bridge's relay thread before anything is destroyed.
"""

from __future__ import annotations

import collections
import html
import importlib
import logging
import os
import time
import zlib
from pathlib import Path

from PySide6 import QtCore, QtGui, QtWidgets

from app import exports, session_io, theme, tour
from app.bridge import Bridge
from app.guard import guarded, report, reporter
from app.panels import GROUPS, PANEL_MODULES
from app.panels.base import Panel, PanelFrame
from app.settings import Settings
from app.units import fmt_kernels
from engine.model.kernel_cache import DEFAULT_MODE, KERNEL_MODES

log = logging.getLogger(__name__)

DRAW_INTERVAL_MS = 33  # the shared draw timer: about 30 Hz (each panel also has its own max_fps)
DRAWS_PER_TICK = 1
# While the engine generates, the GUI shares the machine's cores with it. Drawing and painting (Qt paints the window
# after the draw timer, and pyqtgraph's own updates add paints of their own) may then take at most this fraction of
# one core per core the machine has beyond the engine's first, measured over the last GATE_WINDOW_S; past it the draw
# timer skips its turn (BENCHMARKS.md, "The app against the CLI"). Idle, only each panel's own budget applies.
GENERATING_GUI_SHARE = 0.12
GATE_WINDOW_S = 1.0
# …and, whatever a draw costs, the panels together redraw at most this often while it generates: the rate they had
# when issue 50 was filed. A cheaper draw then leaves the engine its core instead of coming back as more redraws
# (BENCHMARKS.md, "What the GUI thread pays for a redraw"). A small burst lets a tick that found nothing to draw pass
# its turn on.
GENERATING_REDRAWS_PER_S = 16.0
REDRAW_BURST = 2.0
DEFAULT_SIZE = (1600, 1000)
_Area = QtCore.Qt.DockWidgetArea
# Default layout: the live run in three rows (the top and bottom areas own the corners, so they span the whole
# width); its closer looks as tabs beside the panel they belong with; the labs and the server as one tab stack in a
# column of their own on the right, tabs on top, so each lab's name is in sight.
PLACEMENT = {
    "prompt": _Area.TopDockWidgetArea, "preview": _Area.TopDockWidgetArea, "sampling": _Area.TopDockWidgetArea,
    "generation": _Area.LeftDockWidgetArea, "attention": _Area.RightDockWidgetArea,
    "kv_cache": _Area.BottomDockWidgetArea, "timeline": _Area.BottomDockWidgetArea,
    "roofline": _Area.BottomDockWidgetArea,
}
TAB_WITH = {"lens": "attention", "branches": "timeline", "constrain": "sampling"}  # panel → the one it sits behind
# Engine → Decode kernel mode: each mode's menu entry (its tooltip: KERNEL_MODES' sentence)
KERNEL_LABELS = {"exact": "&Exact", "file": "&File's quantized blocks", "fast": "F&ast"}


def _cores() -> int:
    """Cores the engine may use (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def discover_panels() -> list[tuple[str, type[Panel]]]:
    """(module name, panel class) for every module of PANEL_MODULES that exists, in registry order."""
    found = []
    for name in PANEL_MODULES:
        module_name = f"app.panels.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:  # the panel exists but one of its imports is missing: that is a bug
                raise
            log.warning("panel module %s is missing; its dock is skipped", module_name)
            continue
        found.append((name, module.PANEL))
    return found


class MainWindow(QtWidgets.QMainWindow):
    sig_closed = QtCore.Signal()
    """The window closed and the engine process has stopped."""
    _generating = False  # read by event(), which Qt calls from inside QMainWindow.__init__

    def __init__(self, model: str | None = None, *, persist: bool = True, load: bool = True,
                 interactive: bool = True, device: str = "auto", dtype: str = "auto",
                 kernels: str | None = None) -> None:
        """`persist`: read and write QSettings; `interactive`: errors may also open message boxes; `kernels`: the
        kernel mode models load in (None: the remembered one, else exact)."""
        super().__init__()
        self.setWindowTitle("Inference Lab")
        self.setObjectName("main_window")
        self.setDockNestingEnabled(True)
        self.settings = Settings() if persist else None
        self.interactive = interactive
        self.device, self.dtype = device, dtype
        if kernels is not None and kernels not in KERNEL_MODES:
            raise ValueError(f"unknown kernel mode {kernels!r} (choose {', '.join(KERNEL_MODES)})")
        self.kernels = kernels or (self.settings.kernels() if self.settings is not None else DEFAULT_MODE)
        self.last_error = ""
        self.draw_errors: dict[str, str] = {}  # panel module → the last exception its draw() raised
        self._closed = False
        self._next_panel = 0  # round-robin start of the next draw tick
        self._generating = False  # the engine is decoding: drawing and painting keep within GENERATING_GUI_SHARE
        self._gui_busy: collections.deque[tuple[float, float]] = collections.deque()  # (start, seconds) of each
        self._redraw_credit, self._credit_at = REDRAW_BURST, 0.0  # redraws allowed now while generating, and when
        self._model_request: str | None = None
        self._engine_lost = None  # the bridge's last EngineLost
        self._first_show = True
        self._restored_layout = False

        self.bridge = Bridge(self)
        if self.settings is not None:
            self.bridge.set_params(self.settings.sampling_params())

        self.panels: dict[str, Panel] = {}
        self.docks: dict[str, QtWidgets.QDockWidget] = {}
        for name, cls in discover_panels():
            panel = cls(self.bridge)
            dock = QtWidgets.QDockWidget(cls.title, self)
            dock.setObjectName(cls.object_name)
            dock.setWidget(PanelFrame(panel))
            dock.visibilityChanged.connect(panel.came_into_view)  # a tabbed-away panel draws when shown
            dock.setWhatsThis(cls.help_text)
            dock.setFeatures(dock.features() | QtWidgets.QDockWidget.DockWidgetFeature.DockWidgetFloatable)
            self.panels[name] = panel
            self.docks[name] = dock
        self._layout_version = zlib.crc32(",".join(d.objectName() for d in self.docks.values()).encode())
        self._build_default_layout()
        if "roofline" in self.panels:
            self.panels["roofline"].auto_measure = self.settings is not None  # as a user runs it, not in tests
        self._wire_panels()
        self._build_menus()
        self._build_status_bar()
        session_io.install(self)  # recorder, File → Save/Open session, autosave
        exports.install(self)  # View → Export panel, File → Export data, right-click on a panel
        tour.install(self)  # Help → Tour: the course text's claims, measured on the loaded model

        self.bridge.sig_load_progress.connect(self._on_load_progress)
        self.bridge.sig_model_loaded.connect(self._on_model_loaded)
        self.bridge.sig_load_failed.connect(self._on_load_failed)
        self.bridge.sig_failed.connect(self._on_failed)
        self.bridge.sig_state.connect(self._on_state)
        reporter().sig_error.connect(self._on_callback_error)
        self.bridge.sig_server_connected.connect(self._on_server_connected)
        self.bridge.sig_server_failed.connect(self._on_server_failed)
        self.bridge.sig_serving_progress.connect(self._on_serving_progress)
        self.bridge.sig_server_disconnected.connect(self._on_server_disconnected)
        self.bridge.sig_serving_done.connect(self._on_serving_done)
        self.bridge.sig_engine_lost.connect(self._on_engine_lost)
        self.bridge.sig_engine_restarted.connect(self._on_engine_restarted)
        self.bridge.sig_run_started.connect(self._on_run_started)

        self.draw_timer = QtCore.QTimer(self)
        self.draw_timer.setInterval(DRAW_INTERVAL_MS)
        self.draw_timer.timeout.connect(self.tick_panels)
        self.draw_timer.start()

        self.resize(*DEFAULT_SIZE)
        self._restore()
        if self.settings is not None:
            self.bridge.set_params(self.bridge.params)  # the engine and the sampling panel get the restored knobs
        if load:
            self.load_model(model if model is not None else self._stored_model())

    # ---- construction ----
    def _build_default_layout(self) -> None:
        last: dict[QtCore.Qt.DockWidgetArea, QtWidgets.QDockWidget] = {}
        for name, dock in self.docks.items():
            area = PLACEMENT.get(name)
            if area is None:
                continue
            if area in last:
                self.splitDockWidget(last[area], dock, QtCore.Qt.Orientation.Horizontal)
            else:
                self.addDockWidget(area, dock)
            last[area] = dock
        right = last.get(_Area.RightDockWidgetArea)
        self.setTabPosition(_Area.RightDockWidgetArea, QtWidgets.QTabWidget.TabPosition.North)
        # the labs' column first (splitting a dock that is already a tab would pull it out of its tabs), then the tabs
        rest = [n for n in self.docks if n not in PLACEMENT and n not in TAB_WITH]
        labs = self.docks[rest[0]] if rest else None
        if labs is not None:
            if right is not None:
                self.splitDockWidget(right, labs, QtCore.Qt.Orientation.Horizontal)
            else:
                self.addDockWidget(_Area.RightDockWidgetArea, labs)
            for name in rest[1:]:
                self.tabifyDockWidget(labs, self.docks[name])
        for name, host in TAB_WITH.items():
            if name in self.docks and host in self.docks:
                self.tabifyDockWidget(self.docks[host], self.docks[name])
        for name in (*TAB_WITH.values(), *rest[:1]):
            if name in self.docks:
                self.docks[name].raise_()  # the group's first panel in front of its tabs

    def _apply_default_sizes(self) -> None:
        rows = [[d for n, d in self.docks.items() if PLACEMENT.get(n) == a]
                for a in (_Area.TopDockWidgetArea, _Area.BottomDockWidgetArea)]
        h = max(self.height(), 600)
        for row, frac in zip(rows, (0.28, 0.33), strict=True):
            if row:
                self.resizeDocks(row, [int(h * frac)] * len(row), QtCore.Qt.Orientation.Vertical)
                self.resizeDocks(row, [self.width() // len(row)] * len(row), QtCore.Qt.Orientation.Horizontal)
        middle = [self.docks[n] for n in ("generation", "attention") if n in self.docks]
        if len(middle) == 2:
            self.resizeDocks(middle, [int(self.width() * 0.45), int(self.width() * 0.55)],
                             QtCore.Qt.Orientation.Horizontal)

    def _wire_panels(self) -> None:
        prompt, preview, gen = (self.panels.get(n) for n in ("prompt", "preview", "generation"))
        if prompt is not None:
            for target in (preview, gen):
                if target is not None:
                    prompt.sig_text_changed.connect(target.set_text)
                    prompt.sig_chat_changed.connect(target.set_chat)
            if gen is not None:
                gen.sig_chat_changed.connect(prompt.set_chat)
                gen.chat_box.hide()  # one Chat toggle in the window: the Prompt panel's; Generation follows it
        elif gen is not None and preview is not None:
            gen.sig_chat_changed.connect(preview.set_chat)
        why, attention = self.panels.get("why"), self.panels.get("attention")
        if why is not None and attention is not None:
            why.sig_show_head.connect(self.show_head)

    def show_head(self, layer: int, head: int) -> None:
        """Show a layer and head in the Attention panel, brought to the front (a click in the Why panel)."""
        attention = self.panels.get("attention")
        if attention is None:
            return
        attention.show_head(layer, head)
        self.docks["attention"].show()
        self.docks["attention"].raise_()

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = self.file_menu = bar.addMenu("&File")
        self.open_action = file_menu.addAction("&Open model…", self._open_model_dialog)
        self.open_action.setShortcut(QtGui.QKeySequence("Ctrl+O"))
        file_menu.addAction("Open model &folder…", self._open_model_folder_dialog)
        self.pick_action = file_menu.addAction("Open model from &list…", self._open_model_picker)
        self.pick_action.setShortcut(QtGui.QKeySequence("Ctrl+M"))
        self.connect_action = file_menu.addAction("&Connect to server…", self._connect_dialog)
        self.serve_action = file_menu.addAction("Ser&ve this model (llama.cpp, on this machine)", self.serve_model)
        self.serve_action.setToolTip("Start llama.cpp's server for the loaded model on 127.0.0.1 and connect to it; "
                                     "it stops when you disconnect or close the app")
        self.disconnect_action = file_menu.addAction("&Disconnect from server", self.disconnect_server)
        self.disconnect_action.setEnabled(False)
        self.export_action = file_menu.addAction("&Export timeline…", self._export_timeline_dialog)
        self.export_action.setShortcut(QtGui.QKeySequence("Ctrl+E"))
        self.export_action.setEnabled("timeline" in self.panels)
        file_menu.addSeparator()
        quit_action = file_menu.addAction("&Quit", self.close)
        quit_action.setShortcut(QtGui.QKeySequence("Ctrl+Q"))

        view = self.view_menu = bar.addMenu("&View")
        self.view_actions: dict[str, QtGui.QAction] = {}
        self.view_groups: list[QtWidgets.QMenu] = []
        for group, names in GROUPS:
            sub = QtWidgets.QMenu(group, view)
            view.addMenu(sub)
            self.view_groups.append(sub)
            for name in names:
                if name not in self.docks:
                    continue
                action = self.docks[name].toggleViewAction()
                action.setText(self.panels[name].title)
                if self.panels[name].shortcut:
                    action.setShortcut(QtGui.QKeySequence(self.panels[name].shortcut))
                sub.addAction(action)
                self.view_actions[name] = action
        view.addSeparator()
        view.addAction("&Reset layout", self.reset_layout)

        engine_menu = self.engine_menu = bar.addMenu("&Engine")
        threads_menu = engine_menu.addMenu("Decode &threads")
        self.threads_group = QtGui.QActionGroup(self)
        stored = self.settings.threads() if self.settings is not None else "auto"
        for choice in ["auto", *range(1, _cores() + 1)]:
            label = "&Auto: fewer when other programs hold the cores" if choice == "auto" else f"&{choice}"
            action = threads_menu.addAction(label)
            action.setCheckable(True)
            action.setChecked(choice == stored)
            action.setData(choice)
            self.threads_group.addAction(action)
        self.threads_group.triggered.connect(lambda a: self.set_threads(a.data()))
        kernels_menu = engine_menu.addMenu("Decode kernel &mode")
        kernels_menu.setToolTipsVisible(True)
        self.kernels_group = QtGui.QActionGroup(self)
        for mode, label in KERNEL_LABELS.items():
            action = kernels_menu.addAction(label)
            action.setCheckable(True)
            action.setChecked(mode == self.kernels)
            action.setData(mode)
            action.setToolTip(f"{mode}: {KERNEL_MODES[mode]}")
            self.kernels_group.addAction(action)
        self.kernels_group.triggered.connect(lambda a: self.set_kernels(a.data()))
        engine_menu.addAction("Decode &kernels…", self._kernels_dialog)

        help_menu = self.help_menu = bar.addMenu("&Help")
        help_action = help_menu.addAction("&Panels", self.show_panel_help)
        help_action.setShortcut(QtGui.QKeySequence("F1"))
        help_menu.addAction("&About Inference Lab", self._about)

    def _build_status_bar(self) -> None:
        sb = self.statusBar()
        self.message = QtWidgets.QLabel("Starting…")
        self.message.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.progress = QtWidgets.QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setMaximumWidth(220)
        self.progress.setTextVisible(True)
        self.progress.hide()
        self.model_label = QtWidgets.QLabel("no model")
        self.model_label.setStyleSheet(f"color: {theme.MUTED};")
        sb.addWidget(self.message, 1)
        sb.addWidget(self.progress)
        sb.addPermanentWidget(self.model_label)
        self.server_label = QtWidgets.QLabel("")
        self.server_label.setStyleSheet(f"color: {theme.ACCENT};")
        self.server_label.hide()
        sb.addPermanentWidget(self.server_label)

    # ---- model ----
    def _stored_model(self) -> str | None:
        path = self.settings.model_path() if self.settings is not None else ""
        return path if path and Path(path).exists() else None

    def threads_setting(self) -> int | str:
        checked = self.threads_group.checkedAction()
        return checked.data() if checked is not None else "auto"

    def set_threads(self, setting: int | str) -> None:
        """Decode threads for the engine, from the next step on; remembered."""
        for action in self.threads_group.actions():
            action.setChecked(action.data() == setting)
        self.bridge.set_threads(setting)
        if self.settings is not None:
            self.settings.save_threads(setting)

    def set_kernels(self, mode: str, reload: bool = True) -> None:
        """The kernel mode models load in (engine.model.kernel_cache.KERNEL_MODES); remembered. With `reload`, a
        model loaded on torch in another mode is loaded again in this one (after asking, in an interactive window:
        a load takes seconds, and a first one in a mode measures its kernels)."""
        if mode not in KERNEL_MODES:
            raise ValueError(f"unknown kernel mode {mode!r} (choose {', '.join(KERNEL_MODES)})")
        for action in self.kernels_group.actions():
            action.setChecked(action.data() == mode)
        self.kernels = mode
        if self.settings is not None:
            self.settings.save_kernels(mode)
        if not reload:
            return
        asked, pending = self.bridge.last_load, self.bridge.pending_load
        if pending is not None:  # a load on its way: sent again in this mode (llama.cpp ignores the mode)
            if pending.kernels != mode:
                self.bridge.reload_in(mode)
            return
        info = self.bridge.info
        if info is None or self.bridge.runtime != "torch" or (asked.kernels if asked else info.kernels) == mode:
            return  # nothing loaded on torch, or it was loaded in this mode already
        if self.interactive:
            answer = QtWidgets.QMessageBox.question(
                self, "Load the model again?",
                f"{info.name} runs with {fmt_kernels(info.kernels)} now. Load it again with {mode} kernels "
                f"({KERNEL_MODES[mode]})?\n\nNo keeps it as it is; the next model you open loads in {mode} mode.")
            if answer != QtWidgets.QMessageBox.StandardButton.Yes:
                self.set_message(f"Kernel mode {mode}: the next model load uses it; {info.name} keeps "
                                 f"{fmt_kernels(info.kernels)}.")
                return
        # the same model, device, dtype and runtime as it was loaded with (a crash's reload on torch included)
        self.progress.setValue(0)
        self.progress.show()
        self.set_message(f"Loading {info.name} again ({mode} kernels)…")
        if not self.bridge.reload_in(mode):
            self.load_model(self._model_request)

    def load_model(self, path: str | None = None) -> None:
        """Load a model in the engine process (None = the default model), in the window's kernel mode; progress
        shows in the status bar."""
        self._model_request = str(path) if path else None
        self.progress.setValue(0)
        self.progress.show()
        name = Path(path).name if path else "the default model"
        self.set_message(f"Loading {name} ({self.kernels} kernels)…")
        self.bridge.set_threads(self.threads_setting())
        self.bridge.load_model(self._model_request, device=self.device, dtype=self.dtype, kernels=self.kernels)

    def _open_model_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(
            self, "Open model", self._dialog_dir(), "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load_model(path)

    def _open_model_picker(self) -> None:
        from app.model_picker import ModelPicker

        picker = ModelPicker(self, dtype=self.dtype, kernels=self.kernels)
        if picker.exec() and picker.chosen is not None:
            path, dtype = picker.chosen
            if dtype != self.dtype:
                self.dtype = dtype  # the user agreed to bfloat16 for a model that does not fit otherwise
            self.set_kernels(picker.kernels(), reload=False)  # remembered, as the Engine menu's choice
            self.load_model(path)

    def _open_model_folder_dialog(self) -> None:
        path = QtWidgets.QFileDialog.getExistingDirectory(
            self, "Open a Hugging Face model folder (config.json + safetensors)", self._dialog_dir())
        if path:
            self.load_model(path)

    # ---- remote server ----
    def connect_server(self, url: str, api_key: str | None = None) -> None:
        """Generate on an OpenAI-compatible server from now on (the key is kept in memory only)."""
        self.set_message(f"Connecting to {url}…")
        self.bridge.connect_server(url, api_key)

    def serve_model(self) -> None:
        """Serve the loaded model from this machine and connect to it: the Load lab then works without a terminal."""
        self.progress.setValue(0)
        self.progress.show()
        self.set_message("Starting llama.cpp's server for the loaded model…")
        self.bridge.serve_model()

    @QtCore.Slot(float, str)
    def _on_serving_progress(self, fraction: float, message: str) -> None:
        self.progress.show()
        self.progress.setValue(int(round(100 * fraction)))
        self.set_message(message)

    @QtCore.Slot(str)
    def _on_serving_done(self, message: str) -> None:
        self.progress.hide()
        if message:
            self.show_error(f"Could not serve the model: {message}", title="Serve this model", box=self.interactive)

    def disconnect_server(self) -> None:
        self.bridge.disconnect_server()
        self.disconnect_action.setEnabled(False)
        self.server_label.hide()
        self.set_message("Disconnected: generations run on the local model again.")

    def _kernels_dialog(self) -> None:
        from app.kernels_dialog import KernelsDialog

        KernelsDialog(self).exec()

    def _connect_dialog(self) -> None:
        from app.connect_dialog import ConnectDialog

        server = self.bridge.server
        dlg = ConnectDialog(server.url if server is not None else "", self)
        if dlg.exec() == QtWidgets.QDialog.DialogCode.Accepted and dlg.url():
            self.connect_server(dlg.url(), dlg.api_key())

    @QtCore.Slot(object)
    def _on_server_connected(self, info) -> None:
        self.last_error = ""
        self.disconnect_action.setEnabled(True)
        self.server_label.setText(f"server: {info.kind} · {info.model} · {info.url}")
        self.server_label.setToolTip("A server gives no attention maps, residual norms or per-step costs; "
                                     "those panels keep the local model's or stay empty.")
        self.server_label.show()
        self.set_message(f"Connected to {info.kind} at {info.url} ({info.model}). Generations run there; "
                          "attention and residuals are not available from a server.")

    @QtCore.Slot()
    def _on_server_disconnected(self) -> None:
        self.disconnect_action.setEnabled(False)
        self.server_label.hide()

    @QtCore.Slot(str)
    def _on_server_failed(self, message: str) -> None:
        self.show_error(message, title="Could not connect to the server", box=True)

    def _dialog_dir(self) -> str:
        return str(Path(self._model_request).parent) if self._model_request else str(Path.home())

    @QtCore.Slot(float, str)
    def _on_load_progress(self, fraction: float, message: str) -> None:
        self.progress.show()
        self.progress.setValue(int(round(100 * fraction)))
        self.set_message(f"Loading model: {message}")

    def _show_model_label(self, info) -> None:
        """The status bar's model: name, size, dtype, the kernel mode it runs in (or ran in: a session) and device."""
        params = f"{info.n_params / 1e6:.0f}M" if info.n_params < 1e9 else f"{info.n_params / 1e9:.1f}B"
        kernels = fmt_kernels(info.kernels)
        self.model_label.setText(
            f"{info.name} · {params} params · {info.n_layers} layers · {info.dtype} · {kernels} on {info.device}")
        what = KERNEL_MODES.get(info.kernels, "the session was saved before the kernel mode was recorded")
        self.model_label.setToolTip(f"{info.path}\n{kernels}: {what}")

    @QtCore.Slot(object)
    def _on_model_loaded(self, info) -> None:
        self.progress.hide()
        self.last_error = ""
        self._show_model_label(info)
        cached = " (from the weight cache)" if info.from_cache else ""
        self.set_message(f"Loaded {info.name} in {info.load_s:.1f} s{cached}. Type a prompt and press Ctrl+Enter.")
        if self.settings is not None:
            self.settings.save_model_path(self._model_request or "")

    @QtCore.Slot(object)
    def _on_run_started(self, _ev) -> None:
        """A live run: the status bar names the model (and kernel mode) it runs on again, after a session of
        another model or mode was shown."""
        if not self.bridge.replaying and self.bridge.info is not None:
            self._show_model_label(self.bridge.info)

    @QtCore.Slot(str)
    def _on_load_failed(self, message: str) -> None:
        self.progress.hide()
        self.show_error(f"{message}. Use File → Open model… to pick another .gguf file or model folder.",
                         title="The model could not be loaded", box=True)

    @QtCore.Slot(str)
    def _on_failed(self, message: str) -> None:
        self.show_error(message, title="Generation failed", box=False)

    @QtCore.Slot(object)
    def _on_engine_lost(self, lost) -> None:
        self.progress.hide()
        self._engine_lost = lost
        self.show_error(lost.message, title="The engine stopped", box=False)

    @QtCore.Slot(object)
    def _on_engine_restarted(self, info) -> None:
        cause = self._engine_lost.cause if self._engine_lost is not None else ""
        self.show_error(f"{cause} A new engine has {info.name} loaded again; the run so far is kept.",
                        title="The engine stopped", box=False)

    @QtCore.Slot(str)
    def _on_callback_error(self, message: str) -> None:
        """A Qt callback raised (caught at its boundary, logged): say so, and carry on."""
        self.last_error = message
        self.set_message(f"⚠ internal error, logged; the app carries on: {message}", error=True)

    @QtCore.Slot(str)
    def _on_state(self, state: str) -> None:
        self._generating = state == "generating"
        self._gui_busy.clear()  # each run's share starts from its own paints
        self._redraw_credit, self._credit_at = REDRAW_BURST, time.perf_counter()
        if state == "generating":  # a new run: the previous one's error no longer describes the app
            self.last_error = ""
            self.set_message("Generating…")
        elif state == "paused":
            self.set_message("Paused between two tokens: Step (F10) runs one more, Resume goes on.")
        elif state == "idle" and not self.last_error:
            self.set_message("Ready.")

    def set_message(self, text: str, error: bool = False) -> None:
        self.message.setStyleSheet(f"color: {theme.ERROR_COLOR};" if error else "")
        self.message.setText(text)

    def show_error(self, message: str, title: str, box: bool) -> None:
        self.last_error = message
        self.set_message(f"⚠ {message}", error=True)
        if box and self.interactive:
            mb = QtWidgets.QMessageBox(QtWidgets.QMessageBox.Icon.Warning, title, message,
                                       QtWidgets.QMessageBox.StandardButton.Ok, self)
            mb.setModal(False)
            mb.setAttribute(QtCore.Qt.WidgetAttribute.WA_DeleteOnClose)
            mb.show()
            self.error_box = mb

    # ---- drawing ----
    @QtCore.Slot()
    @guarded
    def tick_panels(self, flush: bool = False) -> None:
        """The shared draw timer: dirty panels repaint from their stored data (flush: all now, no rate limit).

        At most DRAWS_PER_TICK panels draw per tick, taking turns, so one tick (and the paint that follows it)
        stays short and the window keeps answering while the engine uses both cores.
        """
        names = list(self.panels)
        if not flush and (self._over_budget() or not self._redraw_allowed()):
            return  # the panels stay dirty: a later tick draws their latest data
        t = time.perf_counter()
        start = self._next_panel % len(names) if names else 0
        drawn = 0
        for name in names[start:] + names[:start]:
            panel = self.panels[name]
            if not flush and drawn >= DRAWS_PER_TICK:
                break
            before = panel.draw_count
            try:
                panel.flush() if flush else panel.tick()
            except Exception as e:  # noqa: BLE001 — one broken panel must not stop the others from painting
                self.draw_errors[name] = f"{type(e).__name__}: {e}"
                report(f"the {panel.title} panel's draw", e)
            if panel.draw_count != before:
                drawn += 1
                self._next_panel = names.index(name) + 1
        if drawn and self._generating:
            self._gui_busy.append((t, time.perf_counter() - t))
            self._redraw_credit -= drawn

    @guarded(default=False)
    def event(self, event: QtCore.QEvent) -> bool:
        """Time every paint of the window (Qt paints all dirty widgets in one UpdateRequest): the draw gate's input
        while generating, and charged to the panels that drew since the last paint, in equal shares."""
        if event.type() != QtCore.QEvent.Type.UpdateRequest:
            return super().event(event)
        t = time.perf_counter()
        try:
            return super().event(event)
        finally:
            spent = time.perf_counter() - t
            if self._generating:  # idle, nothing piles up
                self._gui_busy.append((t, spent))
            drawn = [p for p in self.panels.values() if p.paint_due]
            for panel in drawn:
                panel.charge_paint(spent / len(drawn))

    def _redraw_allowed(self) -> bool:
        """Idle, or generating with a redraw left within GENERATING_REDRAWS_PER_S (credit earned at that rate, up to
        REDRAW_BURST)."""
        if not self._generating:
            return True
        now = time.perf_counter()
        self._redraw_credit = min(REDRAW_BURST,
                                  self._redraw_credit + (now - self._credit_at) * GENERATING_REDRAWS_PER_S)
        self._credit_at = now
        return self._redraw_credit >= 1.0

    def _over_budget(self) -> bool:
        """Generating, and drawing plus painting took more than the GUI's share of the last GATE_WINDOW_S."""
        if not self._generating:
            return False
        now = time.perf_counter()
        while self._gui_busy and self._gui_busy[0][0] < now - GATE_WINDOW_S:
            self._gui_busy.popleft()
        busy = sum(d for _t, d in self._gui_busy)
        return busy > GENERATING_GUI_SHARE * max(1, _cores() - 1) * GATE_WINDOW_S

    # ---- timeline export ----
    def export_timeline(self, path: str) -> bool:
        """Save the timeline panel as PNG or SVG (by extension); a failure shows its message and returns False."""
        panel = self.panels.get("timeline")
        if panel is None or not hasattr(panel, "export"):
            self.show_error("there is no timeline panel to export", title="Export failed", box=self.interactive)
            return False
        try:
            panel.export(str(path))
        except (OSError, ValueError) as e:
            self.show_error(f"could not export the timeline to {path}: {e}", title="Export failed",
                             box=self.interactive)
            return False
        self.set_message(f"Timeline saved to {path}")
        return True

    def _export_timeline_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(
            self, "Export timeline", str(Path.home() / "timeline.png"), "PNG image (*.png);;SVG drawing (*.svg)")
        if path:
            self.export_timeline(path)

    # ---- view ----
    def reset_layout(self) -> None:
        for dock in self.docks.values():
            dock.setFloating(False)
            self.removeDockWidget(dock)
        self._build_default_layout()
        for dock in self.docks.values():
            dock.show()
        self._apply_default_sizes()

    def show_panel_help(self) -> None:
        parts = ["<h2>The panels</h2>"]
        for group, names in GROUPS:
            parts.append(f"<h2>{html.escape(group)}</h2>")
            for name in names:
                panel, action = self.panels.get(name), self.view_actions.get(name)
                if panel is None:
                    continue
                keys = action.shortcut().toString() if action is not None else ""
                keys = f" <span style='color:{theme.MUTED}'>({keys})</span>" if keys else ""
                parts.append(f"<h3>{html.escape(panel.title)}{keys}</h3><p>{html.escape(panel.help_text)}</p>")
        dialog = QtWidgets.QDialog(self)
        dialog.setWindowTitle("Inference Lab — panels")
        dialog.setAttribute(QtCore.Qt.WidgetAttribute.WA_DeleteOnClose)
        browser = QtWidgets.QTextBrowser(dialog)
        browser.setHtml("".join(parts))
        layout = QtWidgets.QVBoxLayout(dialog)
        layout.addWidget(browser)
        dialog.resize(640, 720)
        dialog.show()
        self.help_dialog = dialog

    def _about(self) -> None:
        QtWidgets.QMessageBox.about(
            self, "About Inference Lab",
            "<b>Inference Lab</b><br>Watch LLM inference happen, step by step, on a real model on your own "
            "machine: tokens, prefill and decode, the KV cache, attention, sampling and timing.")

    # ---- settings ----
    def _restore(self) -> None:
        s = self.settings
        prompt, gen = self.panels.get("prompt"), self.panels.get("generation")
        if s is None:
            return
        geometry = s.geometry()
        if geometry is not None:
            self.restoreGeometry(geometry)
        state = s.window_state(self._layout_version)
        if state is not None:
            self._restored_layout = bool(self.restoreState(state))
        if prompt is not None:
            prompt.set_chat(s.chat())
            prompt.set_text(s.prompt_text())
        if gen is not None:
            gen.set_chat(s.chat())
            gen.set_max_new_tokens(s.max_new_tokens())
            if prompt is None:
                gen.set_text(s.prompt_text())
        if "steer" in self.panels:
            self.panels["steer"].restore_settings(s.steer())

    def save_settings(self) -> None:
        s = self.settings
        if s is None:
            return
        tour = getattr(self, "tour", None)
        state = getattr(tour, "closing_state", None) or self.saveState()  # closed on the tour: the user's layout
        s.save_window(self.saveGeometry(), state, self._layout_version)
        prompt, gen = self.panels.get("prompt"), self.panels.get("generation")
        text = prompt.text() if prompt is not None else (gen.text() if gen is not None else "")
        chat = prompt.chat() if prompt is not None else (gen.chat() if gen is not None else True)
        max_new = gen.max_tokens.value() if gen is not None else s.max_new_tokens()
        s.save_session(text, chat, max_new)
        s.save_sampling_params(self.bridge.params)
        if "steer" in self.panels:
            s.save_steer(self.panels["steer"].settings_state())
        s.sync()

    # ---- lifetime ----
    @guarded
    def showEvent(self, event: QtGui.QShowEvent) -> None:  # noqa: N802 — Qt's name
        super().showEvent(event)
        if self._first_show:
            self._first_show = False
            if not self._restored_layout:
                self._apply_default_sizes()

    def shutdown(self) -> bool:
        """Save settings, stop the draw timer, the engine process and the relay thread (waits for the current token)."""
        if self._closed:
            return True
        self._closed = True
        self.save_settings()
        self.draw_timer.stop()
        session_io.clean_exit(self)
        ok = self.bridge.shutdown(timeout_ms=10_000)
        while not ok:  # a model load cannot be interrupted: wait for it rather than destroy a running thread
            log.warning("the relay thread is still busy; waiting for it to finish")
            ok = self.bridge.worker_thread.wait(5_000)
        return ok

    @guarded
    def closeEvent(self, event: QtGui.QCloseEvent) -> None:  # noqa: N802 — Qt's name
        self.shutdown()
        event.accept()
        self.sig_closed.emit()
