"""Steering: build a direction in the residual stream from contrast pairs, or load one, and add it while generating.

Build, Load… and Save… each send one SteerVector through the bridge (the engine process reads the model and the
files); a build's progress arrives as sig_steer_progress and every end as one SteerReady (sig_steer_done). With
"Steer generations" ticked, every later generation carries the vector (bridge.options.set_steer); the scale slider
changes it between two tokens of a running one (SetSteerScale, at most every SCALE_SEND_MS while it is dragged, and
its last value always). The plot shows the scale the shown run was steered at, token by token, from its Steered
events, live or replayed. Nothing here imports torch.
"""

from __future__ import annotations

import html
import re

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from app.bridge import Bridge
from app.panels.base import Panel, reserve_lines
from app.settings import DEFAULT_STEER_PAIRS, SteerSettings
from app.theme import ACCENT, BACKGROUND, ERROR_COLOR, MUTED, OK_COLOR, placeholder, show_empty, style_plot
from app.units import fmt_bytes
from engine.events import ModelInfo, RunStarted, Steered, TokenSampled, layers_text
from engine.model.config import ModelConfig
from engine.protocol import Steer, SteerReady
from engine.why.steer import check_layers  # torch-free: numpy only

SCALE_STEPS = 10  # slider ticks per unit of scale: 0.1 apart (a mean vector over many layers acts below 1)
SCALE_MAX = 10.0
SCALE_SEND_MS = 100  # while the slider is dragged, the scale goes to the engine at most this often
MAX_PAIRS = 512  # engine.why.steer.MAX_PAIRS
FILTER = "Control vector (*.gguf);;All files (*)"


def default_layers(n_layers: int) -> tuple[int, ...]:
    """The middle third of a model's blocks, within those a control vector can hold (1 … n_layers − 1)."""
    lo = max(1, n_layers // 3)
    hi = max(lo, min(n_layers - 1, 2 * n_layers // 3 - 1))
    return tuple(range(lo, hi + 1))


def parse_layers(text: str, n_layers: int) -> tuple[int, ...]:
    """"10-19", "10–19", "8, 10 12" → blocks in order; ValueError with one sentence on anything else, or on a block
    a control vector cannot hold (0, or past the model's last)."""
    out: list[int] = []
    for part in filter(None, re.split(r"[,\s;]+", text.strip())):
        m = re.fullmatch(r"(\d+)(?:[-–](\d+))?", part)
        if m is None:
            raise ValueError(f"{part!r} is not a layer or a range of layers (e.g. 10–19)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > 4096:
            raise ValueError(f"{part!r} is not a range of layers")
        out.extend(range(lo, hi + 1))
    return tuple(check_layers(out, n_layers))


def scale_text(scale: float) -> str:
    return f"× {scale:+.1f}".replace("-", "−")


class SteerPanel(Panel):
    title = "Steering"
    object_name = "panel_steer"
    shortcut = "Ctrl+Alt+7"
    help_text = (
        "Steering pushes the model along one direction of its residual stream while it writes. Contrast pairs "
        "define the direction: each pair is two texts that differ in one quality (cheerful against gloomy). Build "
        "runs both texts of every pair through the loaded model and reads the residual stream after each chosen "
        "block at the last token; mean takes the average of positive minus negative over the pairs (what the "
        "steering-vectors library computes), PCA the first principal component of those differences, signed so "
        "that positives lie above their negatives (what repeng does). With Steer generations ticked, every forward "
        "pass of the next generations adds scale × that direction to those blocks' output at every position. The "
        "slider acts between two tokens of a running generation: the very next token is computed at the new scale, "
        "while the keys and values already in the KV cache keep the scale they were made with. A mean vector holds "
        "the whole gap between the pairs, added at every chosen layer, so a fraction of 1 already moves a model "
        "far (too far, and it only repeats itself); a PCA vector has length 1 and needs larger scales. A steered "
        "run is "
        "named after its vector, layers and scales (Branches panel, sessions), and the plot shows its scale token "
        "by token. Load… and Save… read and write llama.cpp's control-vector GGUF (llama-cli --control-vector, "
        "repeng's export), which can hold blocks 1 to L − 1. Steering needs the local model (torch or llama.cpp); "
        "a server refuses it."
    )
    subscriptions = {
        "sig_steer_progress": "_on_progress", "sig_steer_done": "_on_done", "sig_steered": "_on_steered",
        "sig_run_started": "_on_run_started", "sig_token": "_on_token", "sig_model_loaded": "_on_model_loaded",
        "sig_failed": "_on_failed", "sig_state": "_on_state",
    }

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.vector: Steer | None = None  # the vector built or loaded (at scale 1)
        self.norms: tuple[float, ...] = ()
        self.building: int | None = None  # request id of the build in progress
        self._requests: dict[int, str] = {}  # request id → action, for the requests not answered yet
        self._progress = (0.0, "")
        self._status, self._status_kind = "", ""  # a sentence, and "error", "ok" or "" (muted)
        self._run: list[tuple[int, float]] = []  # (step, scale) of the shown run's Steered events
        self._run_label = ""
        self._last_step = -1  # the shown run's newest token
        self._sent_scale: float | None = None  # the scale last sent to the engine
        self._build()
        self.restore_settings(SteerSettings())
        self.mark_dirty()

    # ---- construction ----
    def _build(self) -> None:
        self.pairs = QtWidgets.QTableWidget(0, 2)
        self.pairs.setHorizontalHeaderLabels(["Positive", "Negative"])
        self.pairs.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.Stretch)
        self.pairs.verticalHeader().setDefaultSectionSize(20)
        self.pairs.setToolTip("Contrast pairs: two texts that differ in the quality to steer towards (positive) "
                              "and away from (negative). Double-click a cell to edit it.")
        self.add_button = QtWidgets.QPushButton("+")
        self.add_button.setToolTip("Add a pair")
        self.remove_button = QtWidgets.QPushButton("−")
        self.remove_button.setToolTip("Remove the selected pairs")
        self.layers = QtWidgets.QLineEdit()
        self.layers.setToolTip("The blocks whose output is read and steered, e.g. 10–19 or 8, 10, 12 (from 0; a "
                               "control vector holds blocks 1 to L − 1)")
        self.method = QtWidgets.QComboBox()
        self.method.addItem("mean", "mean")
        self.method.addItem("PCA", "pca")
        self.method.setToolTip("mean: the average difference over the pairs; PCA: its first principal component")
        self.build_button = QtWidgets.QPushButton("Build")
        self.build_button.setToolTip("Build the vector from the pairs on the loaded model")
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.progress_bar = QtWidgets.QProgressBar()
        self.progress_bar.setRange(0, 1000)
        self.progress_bar.setFormat("")
        self.load_button = QtWidgets.QPushButton("Load…")
        self.load_button.setToolTip("Load a control vector (.gguf), checked against the loaded model")
        self.save_button = QtWidgets.QPushButton("Save…")
        self.save_button.setToolTip("Save the vector as a llama.cpp control vector (.gguf)")
        self.on_box = QtWidgets.QCheckBox("Steer generations")
        self.on_box.setEnabled(False)  # until there is a vector (draw keeps these in step)
        self.save_button.setEnabled(False)
        self.on_box.setToolTip("Add the vector × scale in every forward pass of the next generations")
        self.slider = QtWidgets.QSlider(QtCore.Qt.Orientation.Horizontal)
        self.slider.setRange(int(-SCALE_MAX * SCALE_STEPS), int(SCALE_MAX * SCALE_STEPS))
        self.slider.setSingleStep(1)
        self.slider.setPageStep(SCALE_STEPS)
        self.slider.setToolTip("The scale the vector is multiplied by; while a generation runs, the next token "
                               "already uses it")
        self.scale_label = QtWidgets.QLabel(scale_text(0.0))
        self.scale_label.setMinimumWidth(self.scale_label.fontMetrics().horizontalAdvance("× −10.0 "))
        self.vector_label = QtWidgets.QLabel("")
        self.vector_label.setWordWrap(True)
        self.vector_label.setTextFormat(QtCore.Qt.TextFormat.RichText)
        reserve_lines(self.vector_label, 2)
        self.status = QtWidgets.QLabel("")
        self.status.setWordWrap(True)
        self.status.setTextFormat(QtCore.Qt.TextFormat.RichText)
        reserve_lines(self.status, 2)
        self.plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.plot.getPlotItem()
        style_plot(pi, left=("scale", None), bottom=("token (step)", None), mouse=False)
        self.curve = pi.plot([], [], pen=pg.mkPen(ACCENT, width=2), stepMode="center")
        self.empty_note = placeholder(pi)
        self.plot.setMinimumHeight(90)

        self._scale_timer = QtCore.QTimer(self)
        self._scale_timer.setSingleShot(True)
        self._scale_timer.setInterval(SCALE_SEND_MS)
        self._scale_timer.timeout.connect(self._send_scale)

        pair_buttons = QtWidgets.QVBoxLayout()
        pair_buttons.addWidget(self.add_button)
        pair_buttons.addWidget(self.remove_button)
        pair_buttons.addStretch(1)
        pairs_row = QtWidgets.QHBoxLayout()
        pairs_row.addWidget(self.pairs, 1)
        pairs_row.addLayout(pair_buttons)
        build_row = QtWidgets.QHBoxLayout()
        build_row.addWidget(QtWidgets.QLabel("Layers"))
        build_row.addWidget(self.layers, 1)
        build_row.addWidget(self.method)
        build_row.addWidget(self.build_button)
        build_row.addWidget(self.cancel_button)
        build_row.addWidget(self.progress_bar, 1)
        file_row = QtWidgets.QHBoxLayout()
        file_row.addWidget(self.load_button)
        file_row.addWidget(self.save_button)
        file_row.addWidget(self.vector_label, 1)
        steer_row = QtWidgets.QHBoxLayout()
        steer_row.addWidget(self.on_box)
        steer_row.addWidget(self.slider, 1)
        steer_row.addWidget(self.scale_label)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(pairs_row, 2)
        layout.addLayout(build_row)
        layout.addLayout(file_row)
        layout.addLayout(steer_row)
        layout.addWidget(self.status)
        layout.addWidget(self.plot, 2)

        self.add_button.clicked.connect(lambda: self.add_pair("", ""))
        self.remove_button.clicked.connect(self._remove_selected)
        self.build_button.clicked.connect(self.build)
        self.cancel_button.clicked.connect(self.cancel)
        self.load_button.clicked.connect(self._load_dialog)
        self.save_button.clicked.connect(self._save_dialog)
        self.on_box.toggled.connect(self._on_toggled)
        self.slider.valueChanged.connect(self._on_slider)

    # ---- reading and setting the knobs ----
    def pair_list(self) -> list[tuple[str, str]]:
        """The pairs in the table whose two texts are both filled in."""
        out = []
        for row in range(self.pairs.rowCount()):
            texts = [(self.pairs.item(row, c).text() if self.pairs.item(row, c) is not None else "") for c in (0, 1)]
            if texts[0].strip() and texts[1].strip():
                out.append((texts[0], texts[1]))
        return out

    def set_pairs(self, pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> None:
        self.pairs.setRowCount(0)
        for positive, negative in pairs[:MAX_PAIRS]:
            self.add_pair(positive, negative)

    def add_pair(self, positive: str, negative: str) -> None:
        row = self.pairs.rowCount()
        self.pairs.insertRow(row)
        self.pairs.setItem(row, 0, QtWidgets.QTableWidgetItem(positive))
        self.pairs.setItem(row, 1, QtWidgets.QTableWidgetItem(negative))

    def _remove_selected(self) -> None:
        for row in sorted({i.row() for i in self.pairs.selectedIndexes()}, reverse=True):
            self.pairs.removeRow(row)

    @property
    def scale(self) -> float:
        return self.slider.value() / SCALE_STEPS

    @property
    def scale_sent(self) -> float | None:
        """The scale last sent to the engine (None: steering is off)."""
        return self._sent_scale

    def set_scale(self, scale: float) -> None:
        """Move the slider (as a user would: a running steered generation follows from its next token)."""
        self.slider.setValue(int(round(max(-SCALE_MAX, min(SCALE_MAX, float(scale))) * SCALE_STEPS)))

    def set_on(self, on: bool) -> None:
        self.on_box.setChecked(bool(on))

    def settings_state(self) -> SteerSettings:
        """What the settings remember of this panel (app.settings)."""
        return SteerSettings(scale=self.scale, layers=self.layers.text().strip(),
                             pairs=tuple(self.pair_list()) or DEFAULT_STEER_PAIRS,
                             method=self.method.currentData())

    def restore_settings(self, s: SteerSettings) -> None:
        self.set_pairs(s.pairs)
        self.layers.setText(s.layers)
        self.method.setCurrentIndex(max(0, self.method.findData(s.method)))
        self.set_scale(s.scale)
        cfg = self.bridge.cfg
        if cfg is not None:
            self._fit_model(cfg)

    # ---- commands ----
    def build(self) -> bool:
        """Build a vector from the pairs at the layers on the loaded model; False (and a sentence) when it cannot
        start."""
        cfg = self.bridge.cfg
        try:
            if cfg is None:
                raise ValueError("load a model first")
            if self.building is not None:
                raise ValueError("a vector is being built: wait for it, or Cancel")
            pairs = self.pair_list()
            if not pairs:
                raise ValueError("give at least one contrast pair (both texts)")
            method = self.method.currentData()
            if method == "pca" and len(pairs) < 2:
                raise ValueError("PCA needs at least two pairs")
            layers = parse_layers(self.layers.text() or layers_text(default_layers(cfg.n_layers)), cfg.n_layers)
        except ValueError as e:
            self._say(str(e), "error")
            return False
        self.building = self.bridge.steer_vector("build", pairs=tuple(pairs), layers=layers, method=method)
        self._requests[self.building] = "build"
        self._progress = (0.0, "starting")
        waits = " (it starts when the generation ends)" if self.bridge.state != "idle" else ""
        self._say(f"Building from {len(pairs)} pair{'s' if len(pairs) != 1 else ''} at layers "
                  f"{layers_text(layers)}{waits}…", "")
        return True

    def cancel(self) -> None:
        if self.building is not None:
            self.bridge.cancel_steer()
            self._progress = (self._progress[0], "cancelling…")
            self.mark_dirty()

    def load_file(self, path: str) -> int:
        """Load a control-vector file in the engine process (checked against the loaded model)."""
        rid = self.bridge.steer_vector("load", path=str(path))
        self._requests[rid] = "load"
        self._say(f"Loading {html.escape(str(path))}…", "")
        return rid

    def save_file(self, path: str) -> int | None:
        """Save the vector as a llama.cpp control vector; None (and a sentence) when there is none."""
        if self.vector is None:
            self._say("build or load a vector first", "error")
            return None
        rid = self.bridge.steer_vector("save", vector=self.vector, path=str(path))
        self._requests[rid] = "save"
        return rid

    def _load_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self, "Load control vector", "", FILTER)
        if path:
            self.load_file(path)

    def _save_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, "Save control vector", "steering.gguf", FILTER)
        if path:
            self.save_file(path)

    def adopt(self, ev: Steered) -> bool:
        """Take the vector a run was steered with (its first Steered event: an opened session's) as this panel's,
        at its scale, with steering off until ticked; False when the event holds no vector."""
        if ev.directions is None:
            return False
        self.vector, self.norms = Steer(ev.name, ev.layers, ev.directions), tuple(
            float(np.linalg.norm(d)) for d in ev.directions)
        self.set_on(False)
        self.set_scale(ev.scale)
        self.layers.setText(layers_text(ev.layers))
        self._say(f"The session's vector is back ({html.escape(ev.name)}): tick Steer generations to use it.", "ok")
        self._apply()
        return True

    @QtCore.Slot(bool)
    def _on_toggled(self, on: bool) -> None:
        self._say("The next generations are steered; the slider also acts on a running one, from its next token."
                  if on else "Off: the next generations run unsteered (a steered one running now goes on at × 0).",
                  "")
        self._apply()

    def _apply(self) -> None:
        """Tell the bridge what the next generations carry (and a steered one running now its scale)."""
        on = self.on_box.isChecked() and self.vector is not None
        self.bridge.options.set_steer(self.vector.at(self.scale) if on else None)
        self._sent_scale = self.scale if on else None
        self.mark_dirty()

    @QtCore.Slot(int)
    def _on_slider(self, _value: int) -> None:
        self.scale_label.setText(scale_text(self.scale))
        self.bridge.options.set_steer_scale(self.scale, live=False)  # the next generation starts at it, whatever
        if not self._scale_timer.isActive():  # the first move goes at once, later ones at most every SCALE_SEND_MS
            self._send_scale()
            self._scale_timer.start()

    def _send_scale(self) -> None:
        if self.bridge.options.steer is not None and self.scale != self._sent_scale:
            self.bridge.options.set_steer_scale(self.scale)
            self._sent_scale = self.scale
            self.mark_dirty()

    # ---- bridge slots: store, mark dirty ----
    @QtCore.Slot(float, str)
    def _on_progress(self, fraction: float, message: str) -> None:
        if self.building is not None:
            self._progress = (float(fraction), str(message))
            self.mark_dirty()

    @QtCore.Slot(object)
    def _on_done(self, m: SteerReady) -> None:
        action = self._requests.pop(m.request_id, None)
        if m.action == "build" and (m.request_id == self.building or action is None):
            self.building = None  # (action None: the engine died during a build, its id not known)
        if action is None and m.action != "build":
            return
        verb = {"build": "Build", "load": "Loading", "save": "Saving"}[m.action]
        if m.cancelled:
            self._say(f"{verb} cancelled.", "")
        elif not m.ok:
            self._say(f"{verb} failed: {html.escape(m.error)}", "error")
        elif m.action == "save":
            self._say(f"Saved to {html.escape(m.path)}.", "ok")
        else:
            self.vector, self.norms = m.steer, m.norms
            if m.action == "build" and self.layers.text().strip() == "":
                self.layers.setText(layers_text(m.steer.layers))
            self._say(f"{'Built' if m.action == 'build' else 'Loaded'} in {m.seconds:.1f} s."
                      + (" The next generations are steered with it." if self.on_box.isChecked() else
                         " Tick Steer generations to use it."), "ok")
            self._apply()
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_run_started(self, _ev: RunStarted) -> None:
        self._run, self._run_label, self._last_step = [], "", -1
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_steered(self, ev: Steered) -> None:
        if ev.layers:
            self._run_label = ev.label
        self._run.append((int(ev.step), float(ev.scale)))
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_token(self, ev: TokenSampled) -> None:
        if self._run:  # only a steered run is plotted
            self._last_step = int(ev.step)
            self.mark_dirty()

    @QtCore.Slot(object)
    def _on_model_loaded(self, _info: ModelInfo) -> None:
        if self.bridge.cfg is not None:
            self._fit_model(self.bridge.cfg)
        self.mark_dirty()

    @QtCore.Slot(str)
    def _on_failed(self, message: str) -> None:
        if "steer" in message:  # the engine refused a steered generation (a server, a vector for another model)
            self._say(html.escape(message), "error")

    @QtCore.Slot(str)
    def _on_state(self, _state: str) -> None:
        self.mark_dirty()

    def _fit_model(self, cfg: ModelConfig) -> None:
        """A model was loaded: layers that do not fit it go back to its default, and a vector made for another
        width or depth is let go."""
        try:
            parse_layers(self.layers.text(), cfg.n_layers)
        except ValueError:
            self.layers.setText(layers_text(default_layers(cfg.n_layers)))
        v = self.vector
        if v is not None and (v.directions.shape[1] != cfg.d_model or v.layers[-1] >= cfg.n_layers):
            self.vector, self.norms = None, ()
            self.set_on(False)
            self._say(f"The vector was made for a model of width {v.directions.shape[1]}; this one's is "
                      f"{cfg.d_model}: build or load another.", "error")
        self._apply()

    def _say(self, text: str, kind: str) -> None:
        self._status, self._status_kind = text, kind
        self.mark_dirty()

    # ---- drawing ----
    def draw(self) -> None:
        building = self.building is not None
        self.build_button.setEnabled(not building and self.bridge.cfg is not None)
        self.cancel_button.setEnabled(building)
        self.save_button.setEnabled(self.vector is not None)
        self.on_box.setEnabled(self.vector is not None)
        self.progress_bar.setValue(int(1000 * self._progress[0]) if building else 0)
        self.progress_bar.setFormat(self._progress[1].replace("%", "%%") if building else "")
        v = self.vector
        if v is None:
            self.vector_label.setText(f"<span style='color:{MUTED}'>No vector yet: Build one from the pairs, or "
                                      "Load… a control vector.</span>")
        else:
            norms = f"; |v| {min(self.norms):.3g}–{max(self.norms):.3g}" if self.norms else ""
            self.vector_label.setText(f"<b>{html.escape(v.name)}</b> at layer{'s' if len(v.layers) > 1 else ''} "
                                      f"{layers_text(v.layers)}, width {v.directions.shape[1]}{norms}")
        colour = {"error": ERROR_COLOR, "ok": OK_COLOR}.get(self._status_kind, MUTED)
        status = f"<span style='color:{colour}'>{self._status}</span>" if self._status else ""
        if self._run:
            now = self._run[-1][1]
            status += (("<br>" if status else "") + f"Shown run: steered by {html.escape(self._run_label)}"
                       + (f", now {scale_text(now)}" if len(self._run) > 1 else "") + ".")
        self.status.setText(status)
        self._draw_plot()

    def _draw_plot(self) -> None:
        pi = self.plot.getPlotItem()
        if not self._run:
            self.curve.setData([], [])
            show_empty(pi, self.empty_note, "A steered run's scale, token by token, appears here.",
                       (0.0, 16.0), (-SCALE_MAX, SCALE_MAX))
            return
        self.empty_note.setVisible(False)
        steps = [s for s, _ in self._run]
        end = max(self._last_step, steps[-1]) + 1
        xs = np.array([*steps, end], dtype=float)  # stepMode="center": one more edge than values
        ys = np.array([sc for _, sc in self._run], dtype=float)
        self.curve.setData(xs, ys)
        lo, hi = min(-1.0, float(ys.min()) - 1), max(1.0, float(ys.max()) + 1)
        pi.getViewBox().setRange(xRange=(0.0, max(float(end), 8.0)), yRange=(lo, hi), padding=0.02)

    def clear(self) -> None:
        self._run, self._run_label, self._last_step = [], "", -1
        self.mark_dirty()

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        layers = default_layers(cfg.n_layers)
        n = len(layers) * cfg.d_model
        return (f"{info.name} has {cfg.n_layers} blocks with a residual stream {cfg.d_model} wide: its default "
                f"layers, the middle third, are {layers_text(layers)}, a vector of {len(layers)} × {cfg.d_model} = "
                f"{n:,} numbers ({fmt_bytes(4 * n)} in float32), and a build runs 2 forward passes per pair.")


PANEL = SteerPanel
