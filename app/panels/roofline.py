"""Roofline: attainable FLOP/s against arithmetic intensity for a chosen machine and dtype, with the engine's
measured prefill and decode steps and the cost model's analytic points for the loaded or a catalogue model at a
chosen batch size and prompt length.

Roofs and costs come from engine.costs (formulas, catalog, hardware); "this machine" is measured in a plain
background thread (never on the GUI thread) and the result comes back through a queued signal.
"""

from __future__ import annotations

import dataclasses
import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.guard import guarded
from app.panels.base import Holder, Panel
from app.theme import (
    BACKGROUND,
    DECODE_COLOR,
    OK_COLOR,
    PREFILL_COLOR,
    RIDGE_COLOR,
    ROOF_COLOR,
    log_ticks,
    roof_points,
    set_data,
    set_ticks,
    style_plot,
)
from app.units import fmt_amount, fmt_bandwidth, fmt_bytes, fmt_flops, fmt_fraction, fmt_kernels
from engine.costs import formulas as costs
from engine.costs.catalog import Hardware, canonical_dtype, hardware_presets, model_presets
from engine.events import ModelInfo, PrefillDone, PromptTokenized, StepCost, TokenSampled
from engine.labs.spec_events import SpecStarted, SpecStep
from engine.model import dtypes
from engine.model.config import ModelConfig
from engine.model.kernel_cache import KERNEL_MODES
from engine.remote.shapes import MeasuredDecode, measured_decode

FONT_PT = 9
TRAIL_POINTS = 256  # decode steps drawn on the roofline at most (see _draw_measured)
THIS_MACHINE = "this-machine"
LOADED = "loaded"  # the model selector's entry for the engine's model (bridge.cfg)
DEFAULT_PROMPT = 512  # prompt length of the analytic points before any prompt arrives
MAX_BATCH = 1024
MAX_PROMPT = 131_072
MAX_WIDEN = 1.5  # decades the x axis may grow on each side to fit the labels
DTYPES = ("fp32", "fp16", "bf16", "int8")
ROOMY_PLOT = 150  # px: a plot this tall labels its analytic points too
SHORT_PANEL = 380  # px: below this height the chip's summary line gives its room to the plot


def decades(lo: float, hi: float, most: int = 10) -> list[tuple[float, str]]:
    """Ticks at whole decades only (the roofline spans many), labelled "1 T", "10 G"."""
    return log_ticks(lo, hi, most, sep=" ", decades_beyond=0.0)


def fmt_intensity(x: float) -> str:
    """Arithmetic intensity for a label: 0.505, 32.7, 2600, 20.5k."""
    if x >= 1e4:
        return f"{x / 1e3:.3g}k"
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}" if x >= 0.01 else f"{x:.2g}"


class RooflinePanel(Panel):
    title = "Roofline"
    object_name = "panel_roofline"
    shortcut = "Alt+8"
    subscriptions = {
        "sig_this_machine": "_on_this_machine",
        "sig_measure_progress": "_on_measure_progress",
        "sig_measure_done": "_on_measure_done",
        "sig_model_loaded": "_on_model_loaded",
        "sig_prompt": "_on_prompt",
        "sig_prefill": "_on_prefill",
        "sig_token": "_on_token",
        "sig_server_connected": "_on_server_connected",
        "sig_server_disconnected": "mark_dirty",
        "sig_spec": "_on_spec",
    }
    help_text = (
        "The roofline model. A step does F floating-point operations and moves B bytes to or from memory; its "
        "arithmetic intensity is I = F / B, in FLOP per byte. A machine with peak compute P (FLOP/s) and memory "
        "bandwidth W (bytes/s) reaches at best attainable = min(P, I · W): the slanted memory roof meets the flat "
        "compute roof at the ridge point I = P / W. Left of the ridge a step waits on memory (memory-bound), "
        "right of it on arithmetic (compute-bound). Decode does about 2 FLOPs per weight and reads every "
        "weight once, so in float32 I ≈ 0.5 FLOP/byte, far left of any ridge: it is memory-bound and its speed "
        "is set by bandwidth. Prefill reuses each weight for every "
        "prompt token, so its intensity grows with the prompt length and it moves toward the compute roof. "
        "Batching B sequences multiplies a decode step's FLOPs by B but reads the weights once, so decode moves "
        "right about B times (less as the KV cache reads grow). Filled dots are the engine's measured steps "
        "(achieved FLOP/s = FLOPs / measured seconds), labelled with their share of the roof at their intensity; "
        "they are shown only for the loaded model. Hollow circles are the cost model's prediction, on the roof, "
        "for the chosen model (the loaded one or a catalogue preset) at the chosen batch, prompt length and dtype: "
        "prefill of the prompt, and decode at the prompt plus the tokens generated so far. 'This machine' is "
        "measured here (memory read and copy bandwidth, matmul throughput, with PyTorch) and cached between runs. "
        "Connected to a server, pick its hardware above (remembered for its URL this session): the star is its "
        "measured decode — mean TPOT from the chunks' arrival times, costed with the model's shapes (its "
        "config.json when vLLM's model directory is readable here, else the catalogue model chosen under Model) "
        "— as achieved bytes/s and FLOP/s; a line below says when the shapes are unknown. A speculative-decoding "
        "run (the Speculative lab) adds its verify passes as green diamonds: one pass of the full model over the "
        "pending token and k guesses reads the weights once for k + 1 positions, so it sits right of a decode "
        "step, about k + 1 times the intensity, for about the time of one step while it is memory-bound."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        c = costs.decode_cost(cfg, 1, weight_dtype=info.dtype)
        if info.decode_weight_bytes > 0:  # the bytes its kernels read (a quantized form's, where one runs)
            c = dataclasses.replace(c, weight_bytes=float(info.decode_weight_bytes))
        return (f"One decode step of {info.name} in {info.dtype} with {fmt_kernels(info.kernels)} at a short "
                f"context: about {fmt_amount(c.flops, 'FLOP')} over {fmt_bytes(c.bytes)} of weights and KV cache, "
                f"I ≈ {c.intensity:.2g} FLOP/byte.")

    sig_measured = QtCore.Signal(object)
    """A measurement of this machine finished (Hardware), in the GUI thread."""

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.presets: dict[str, Hardware] = hardware_presets()
        self.models = model_presets()
        self.measure_kwargs: dict = {}  # e.g. {"quick": True} in tests
        self._measuring: tuple[str, str] | None = None  # (device, dtype) being measured in the engine process
        self._user_chose_hw = False
        # A local run is drawn against the machine it runs on: with auto_measure (the window sets it when it keeps
        # settings), a machine not yet measured is measured once in the background (cached by the engine).
        self.auto_measure = False
        self._auto: tuple[str, str] | None = None  # (device, dtype) to measure once the engine says it has none
        self._prefill: PrefillDone | None = None
        self._decode: list[tuple[float, float]] = []  # (intensity, achieved FLOP/s)
        self._n_prompt = 0
        self._context = 0
        self._server_hw: dict[str, str] = {}  # server URL -> the chip the user picked for it (this session)
        self._server_gaps: list[float] = []  # arrival gaps (s) of the server's decode tokens, this generation
        self._verify: list[tuple[float, float]] = []  # speculative verify passes: (intensity, achieved FLOP/s)
        self._verify_k = 0
        self._verify_decode = 0.0  # intensity of one plain decode step at the last pass's position
        self._info: ModelInfo | None = None  # the model whose run is shown (a session's while one is open)
        self._run_dtype = ""  # its dtype as the dtype box names it ("fp32")
        self._step_weight_bytes = 0.0  # weights the latest measured decode step read (its kernels' own figure)
        self._font = QtGui.QFont()
        self._font.setPointSize(FONT_PT)
        self._build()
        if self.this_machine_roofs() is not None:  # open on "this machine" when a cached measurement exists
            self.hw_combo.setCurrentIndex(0)
        if bridge.info is not None:
            self._on_model_loaded(bridge.info)
        self.mark_dirty()

    # ---- widgets -----------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.hw_combo = QtWidgets.QComboBox()
        self.hw_combo.addItem("This machine (measured)", THIS_MACHINE)
        for key, hw in self.presets.items():
            self.hw_combo.addItem(hw.label, key)
        self.hw_combo.setCurrentIndex(1 if self.presets else 0)
        self.hw_combo.setToolTip("The machine whose roofs are drawn")
        self.hw_combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.hw_combo.setMinimumContentsLength(14)
        self.dtype_combo = QtWidgets.QComboBox()
        self.dtype_combo.addItems(DTYPES)
        self.dtype_combo.setToolTip("The dtype of the compute roof (and of the analytic points' weights)")
        self.kernels_label = QtWidgets.QLabel("")  # the kernel mode the loaded model's steps ran with
        self.kernels_label.setVisible(False)
        self.measure_button = QtWidgets.QPushButton("Measure this machine")
        self.measure_button.setToolTip("Time memory bandwidth and matmul throughput here (a few seconds)")
        self.measure_button.clicked.connect(self.measure)
        self.progress = QtWidgets.QProgressBar()
        self.progress.setRange(0, 100)
        self.progress.setVisible(False)
        self.progress.setMaximumWidth(120)
        self.hw_combo.currentIndexChanged.connect(self._on_hw_changed)
        self.dtype_combo.currentIndexChanged.connect(self._on_dtype_changed)
        row = QtWidgets.QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.hw_combo, 1)
        row.addWidget(self.dtype_combo)
        row.addWidget(self.kernels_label)
        row.addWidget(self.measure_button)
        row.addWidget(self.progress)

        self.model_combo = QtWidgets.QComboBox()
        self.model_combo.addItem("Loaded model", LOADED)
        for key in self.models:
            self.model_combo.addItem(key, key)
        self.model_combo.setToolTip("The model of the hollow analytic points: the loaded one or a catalogue preset")
        self.model_combo.setSizeAdjustPolicy(
            QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_combo.setMinimumContentsLength(14)
        self.batch_spin = QtWidgets.QSpinBox()
        self.batch_spin.setRange(1, MAX_BATCH)
        self.batch_spin.setValue(1)
        self.batch_spin.setPrefix("batch ")
        self.batch_spin.setToolTip("Sequences per step of the analytic points (the engine's measured steps are "
                                   "batch 1)")
        self.prompt_spin = QtWidgets.QSpinBox()
        self.prompt_spin.setRange(1, MAX_PROMPT)
        self.prompt_spin.setValue(DEFAULT_PROMPT)
        self.prompt_spin.setPrefix("prompt ")
        self.prompt_spin.setSuffix(" tok")
        self.prompt_spin.setToolTip("Prompt length of the analytic points (follows each new prompt)")
        self.model_combo.currentIndexChanged.connect(self._on_choice_changed)
        self.batch_spin.valueChanged.connect(self._on_choice_changed)
        self.prompt_spin.valueChanged.connect(self._on_choice_changed)
        row2 = QtWidgets.QHBoxLayout()
        row2.setContentsMargins(0, 0, 0, 0)
        row2.addWidget(self.model_combo, 1)
        row2.addWidget(self.batch_spin)
        row2.addWidget(self.prompt_spin)
        self.hw_label = QtWidgets.QLabel("")
        self.hw_label.setWordWrap(True)
        self.takeaway = QtWidgets.QLabel("")
        self.takeaway.setWordWrap(True)
        self.takeaway.setTextFormat(QtCore.Qt.TextFormat.RichText)

        self.plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.plot.getPlotItem()
        style_plot(pi, left=("attainable FLOP/s", None), bottom=("arithmetic intensity (FLOP/byte)", None),
                   log=(True, True))
        self.roof = pi.plot([], [], pen=pg.mkPen(ROOF_COLOR, width=2.5))
        self.ridge_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(RIDGE_COLOR, width=1,
                                                                 style=QtCore.Qt.PenStyle.DotLine))
        pi.addItem(self.ridge_line)
        self.ridge_text = self._text(ROOF_COLOR, anchor=(0, 1))
        self.roof_text = self._text("#bbbbbb", anchor=(0, 0))
        self.analytic_prefill = pi.plot([], [], pen=None, symbol="o", symbolSize=13, symbolBrush=None,
                                        symbolPen=pg.mkPen(PREFILL_COLOR, width=2))
        self.analytic_decode = pi.plot([], [], pen=None, symbol="o", symbolSize=13, symbolBrush=None,
                                       symbolPen=pg.mkPen(DECODE_COLOR, width=2))
        self.measured_decode = pi.plot([], [], pen=None, symbol="o", symbolSize=7, symbolBrush=DECODE_COLOR,
                                       symbolPen=None)
        self.measured_prefill = pi.plot([], [], pen=None, symbol="o", symbolSize=10, symbolBrush=PREFILL_COLOR,
                                        symbolPen=pg.mkPen(BACKGROUND))
        self.prefill_text = self._text(PREFILL_COLOR, anchor=(0, 1))  # above its point
        self.decode_text = self._text(DECODE_COLOR, anchor=(0, 0))  # below its point: the two never collide
        self.server_point = pi.plot([], [], pen=None, symbol="star", symbolSize=16, symbolBrush=DECODE_COLOR,
                                    symbolPen=pg.mkPen("#ffffff", width=1))
        self.server_text = self._text(DECODE_COLOR, anchor=(0, 1))
        self.verify_points = pi.plot([], [], pen=None, symbol="d", symbolSize=9, symbolBrush=OK_COLOR,
                                     symbolPen=pg.mkPen(BACKGROUND))
        self.verify_text = self._text(OK_COLOR, anchor=(0, 0))
        self.analytic_prefill_text = self._text(PREFILL_COLOR, anchor=(1, 1))  # above the roof, placed in draw()
        self.analytic_decode_text = self._text(DECODE_COLOR, anchor=(1, 1))

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addLayout(row)
        layout.addLayout(row2)
        layout.addWidget(self.hw_label)
        layout.addWidget(self.plot, 1)
        layout.addWidget(Holder(self.takeaway, wrapped=True))  # new figures at every draw

    @guarded
    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:  # noqa: N802 — Qt's name
        super().resizeEvent(event)
        self._fit_height()

    def _fit_height(self) -> None:
        """A short panel (the default window's bottom row) gives the plot the chip's line: the plot's own labels
        name its roofs, and the line stays on the chip menu's tooltip. A message (not measured, cancelled) stays."""
        self.hw_label.setVisible(self.roofs() is None or self.height() >= SHORT_PANEL)
        self.hw_combo.setToolTip(self.hw_label.text())

    def _text(self, colour: str, anchor: tuple[float, float]) -> pg.TextItem:
        item = pg.TextItem("", color=colour, anchor=anchor, fill=pg.mkBrush(27, 27, 27, 190))
        item.setFont(self._font)
        self.plot.getPlotItem().addItem(item)
        return item

    # ---- choices -----------------------------------------------------------------------------------------------
    def show_run_dtype(self, dtype: str, file_type: str) -> None:
        """Select the dtype the loaded model runs in; a quantized file that llama.cpp runs as it is (q4_1, int4, …)
        gets its own entry, priced at the file's bytes per weight, its peak borrowed as engine.model.dtypes says."""
        while self.dtype_combo.count() > len(DTYPES):  # the previous model's own entry
            self.dtype_combo.removeItem(len(DTYPES))
        if dtype not in DTYPES:
            self.dtype_combo.addItem(dtype)
            self.dtype_combo.setItemData(
                len(DTYPES), f"The loaded file's weights ({file_type}), as llama.cpp multiplies them; the peak is "
                f"the first of {', '.join(dtypes.lookup(dtype).peak_fallback)} the chip lists",
                QtCore.Qt.ItemDataRole.ToolTipRole)
        self.dtype_combo.setCurrentText(dtype)

    def dtype(self) -> str:
        return self.dtype_combo.currentText()

    def device(self) -> str:
        info = self.bridge.info
        return info.device if info is not None else "cpu"

    def hardware(self) -> Hardware | None:
        """The machine whose roofs are drawn, or None when this machine has not been measured."""
        key = self.hw_combo.currentData()
        if key != THIS_MACHINE:
            return self.presets[key]
        return self.this_machine_roofs()

    def model_key(self) -> str:
        """LOADED or a catalogue key such as "llama-2-70b"."""
        return self.model_combo.currentData()

    def model_cfg(self):
        """The ModelConfig of the chosen model (None when "loaded model" is chosen and none is loaded)."""
        key = self.model_key()
        return self.bridge.cfg if key == LOADED else self.models[key]

    def model_name(self) -> str:
        key = self.model_key()
        if key != LOADED:
            return key
        info = self._info or self.bridge.info
        return info.name if info is not None else "loaded model"

    def kernels_weight_bytes(self) -> float | None:
        """The weights one decode step of the loaded model reads with the kernels it runs (a quantized form's bytes
        where one runs in place of the float weight): the latest measured step's own figure, else the model's
        (ModelInfo.decode_weight_bytes); None where the analytic point is not that step (a catalogue model, another
        dtype than the run's, a batch above 1) or the figure is unknown."""
        info = self._info
        if info is None or self.model_key() != LOADED or self.batch() != 1 or self.dtype() != self._run_dtype:
            return None
        figure = self._step_weight_bytes or float(info.decode_weight_bytes)
        return figure if figure > 0 else None

    def shows_measured(self) -> bool:
        """Measured points belong to the loaded model: shown only while it is the chosen one."""
        return self.model_key() == LOADED

    def select_model(self, key: str) -> None:
        i = self.model_combo.findData(key)
        if i < 0:
            raise ValueError(f"unknown model {key!r}")
        self.model_combo.setCurrentIndex(i)

    def batch(self) -> int:
        return self.batch_spin.value()

    def prompt_length(self) -> int:
        return self.prompt_spin.value()

    def decode_context(self) -> int:
        """Context of the analytic decode step: the positions the latest decode step attended (the KV cache after
        it), i.e. the prompt plus the tokens generated so far less the newest, which is sampled but not yet fed."""
        generated = max(0, self._context - self._n_prompt) if self._n_prompt else 0
        return max(1, self.prompt_length() + max(0, generated - 1))

    def select_hardware(self, key: str) -> None:
        i = self.hw_combo.findData(key)
        if i < 0:
            raise ValueError(f"unknown hardware {key!r}")
        self.hw_combo.setCurrentIndex(i)

    def this_machine_roofs(self) -> Hardware | None:
        """This machine at the chosen dtype by engine.costs.hardware's one policy, as the engine process answers it
        (None until it has: sig_this_machine then redraws), or None."""
        return self.bridge.this_machine(self.device(), self.dtype())

    def _on_hw_changed(self, _i: int) -> None:
        self._user_chose_hw = True
        if self.bridge.server is not None:  # the server's hardware, remembered for its URL
            self._server_hw[self.bridge.server.url] = self.hw_combo.currentData()
        self.mark_dirty()

    def _on_choice_changed(self, _v: int) -> None:
        self.mark_dirty()

    def _on_dtype_changed(self, _i: int) -> None:
        self.mark_dirty()

    # ---- measuring this machine (in the engine process) ---------------------------------------------------------
    def measure(self) -> None:
        """Measure this machine at the chosen dtype (fp32 for a dtype that cannot be timed), in the engine process:
        torch lives there, and the engine runs it between generations, never beside a decode."""
        if self._measuring is not None:
            return
        dtype = self.dtype() if self.dtype() in dtypes.MEASURABLE else "fp32"
        device = self.device()
        self._measuring = (device, canonical_dtype(dtype))
        self.measure_button.setEnabled(False)
        self.progress.setValue(0)
        self.progress.setVisible(True)
        waiting = " (after the generation)" if self.bridge.state != "idle" else ""
        self.hw_label.setText(f"Measuring this machine ({device}, {dtype}){waiting}…")
        self.bridge.measure_machine(device, dtype, **self.measure_kwargs)

    @property
    def measuring(self) -> bool:
        """A measurement of this machine was asked for and has not ended."""
        return self._measuring is not None

    def cancel_measure(self) -> None:
        """Stop a running measurement (the engine checks between its timed runs)."""
        if self._measuring is not None:
            self.bridge.cancel_measure()

    @QtCore.Slot(float, str)
    def _on_measure_progress(self, fraction: float, message: str) -> None:
        self.progress.setValue(int(round(100 * fraction)))
        self.progress.setFormat(message[:40])
        self.progress.setToolTip(message)

    @QtCore.Slot(object)
    def _on_this_machine(self, answer) -> None:
        """The engine answered a look-up or finished a measurement: (device, dtype, Hardware or None)."""
        device, dtype, hw = answer
        if device != self.device():
            return
        if self._auto == (device, canonical_dtype(dtype)) and hw is None:
            self._auto = None
            self.measure()
        measured = self._measuring == (device, canonical_dtype(dtype)) and hw is not None
        if hw is not None and (measured or (canonical_dtype(dtype) == canonical_dtype(self.dtype())
                                            and not self._user_chose_hw)):
            self.select_hardware(THIS_MACHINE)  # open on it, as on a cached one at start
        if measured:
            self.sig_measured.emit(hw)
        self.mark_dirty()

    @QtCore.Slot(str)
    def _on_measure_done(self, message: str) -> None:
        self._measuring = None
        self.measure_button.setEnabled(True)
        self.progress.setVisible(False)
        if message:
            self.hw_label.setText(message)
        self.mark_dirty()

    # ---- events ------------------------------------------------------------------------------------------------
    def _show_run(self, info: ModelInfo) -> None:
        """The model whose steps are drawn: its dtype selected in the dtype box and, beside it, its kernel mode."""
        try:
            dtype = canonical_dtype(info.dtype)
        except ValueError:
            dtype = "fp32"
        self._info, self._run_dtype, self._step_weight_bytes = info, dtype, 0.0
        self.show_run_dtype(dtype, info.file_type)
        kernels = fmt_kernels(info.kernels)
        what = KERNEL_MODES.get(info.kernels, "saved before the kernel mode was recorded")
        self.kernels_label.setText(kernels)
        self.kernels_label.setToolTip(f"{info.name} ran in {info.dtype} with {kernels}: {what}. Its decode steps "
                                      "are priced at the bytes those kernels read, and so is the analytic decode "
                                      "point at its dtype and batch 1.")
        self.kernels_label.setVisible(True)

    @QtCore.Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        self._show_run(info)
        if self.this_machine_roofs() is not None:
            self.select_hardware(THIS_MACHINE)
        elif self.auto_measure and self.bridge.server is None and not self._user_chose_hw:
            self.select_hardware(THIS_MACHINE)  # the local run's own machine, drawn once measured
            dtype = self.dtype() if self.dtype() in dtypes.MEASURABLE else "fp32"
            if self.bridge.this_machine_answered(self.device(), dtype):
                self.measure()  # the engine already said: not measured
            else:
                self._auto = (self.device(), canonical_dtype(dtype))  # measured when the engine says so
        self.model_combo.setItemText(0, f"Loaded: {info.name}")
        self.model_combo.setItemData(0, f"The loaded model, {info.name}", QtCore.Qt.ItemDataRole.ToolTipRole)
        self.select_model(LOADED)
        self.clear()

    @QtCore.Slot(object)
    def _on_server_connected(self, info) -> None:
        key = self._server_hw.get(info.url)
        if key is not None and self.hw_combo.findData(key) >= 0:
            self.select_hardware(key)
        self._server_gaps = []
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_prompt(self, ev: PromptTokenized) -> None:
        info = self.bridge.info  # a session's while it is replayed; the loaded model's again for a live run
        if info is not None and info is not self._info:
            self._show_run(info)
        self._prefill, self._decode = None, []
        self._server_gaps = []
        self._n_prompt = len(ev.ids)
        self._context = self._n_prompt
        if self._n_prompt:
            self.prompt_spin.setValue(min(self._n_prompt, MAX_PROMPT))
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_prefill(self, ev: PrefillDone) -> None:
        self._prefill = ev
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_token(self, ev: TokenSampled) -> None:
        self._context = max(self._context, ev.position + 1)
        src = self.bridge.run_source
        if src is not None and src.measured_by_server:  # its seconds are chunk arrival gaps, not steps
            if ev.phase == "decode":
                self._server_gaps.append(ev.seconds)  # 0 inside a chunk: the chunk's gap covers its tokens
                self.mark_dirty()
            return
        if ev.phase == "decode" and ev.seconds > 0 and ev.cost.flops > 0:  # a server reports no step cost
            self._decode.append((ev.cost.intensity, ev.cost.flops / ev.seconds))
            self._step_weight_bytes = float(ev.cost.weight_bytes)
            self.mark_dirty()

    @QtCore.Slot(object)
    def _on_spec(self, ev: object) -> None:
        """A speculative-decoding lab run on the loaded model: each verify pass is a measured step of k + 1
        positions (a sweep's runs arrive the same way)."""
        if isinstance(ev, SpecStarted):
            self._verify, self._verify_k = [], ev.k
        elif isinstance(ev, SpecStep) and ev.verify_s > 0 and ev.verify_cost.flops > 0:
            self._verify.append((ev.verify_cost.intensity, ev.verify_cost.flops / ev.verify_s))
            self._verify_decode = ev.decode_cost.intensity
            self.mark_dirty()

    def clear(self) -> None:
        self._prefill, self._decode = None, []
        self._server_gaps = []
        self._verify = []
        super().clear()

    def server_decode(self) -> tuple[MeasuredDecode | None, str]:
        """The connected server's measured decode costed with its model's shapes (its config.json when the engine
        could read it, else the catalogue model chosen under Model), and one line on it: what it is, or what is
        missing. (None, "") unless the run shown came live from a server."""
        server = self.bridge.run_server
        if server is None:
            return None, ""
        cfg, source = server.config, server.config_note
        if cfg is None and self.model_key() != LOADED:
            cfg, source = self.models[self.model_key()], f"shapes of {self.model_key()} as chosen under Model"
        if cfg is None:
            return None, f"Server decode not placed: {server.config_note or 'its model shapes are unknown'}."
        m = measured_decode(cfg, self._context, self._server_gaps, self.dtype())
        if m is None:
            return None, f"Server ({server.model}): generate to place its measured decode rate ({source})."
        return m, (f"Server ({server.model}): measured {m.tokens_per_s:.1f} tok/s (TPOT {m.tpot_s * 1e3:.1f} ms) "
                   f"→ {fmt_bandwidth(m.bytes_per_s)} and {fmt_flops(m.flops_per_s)} achieved at context "
                   f"{self._context}, {self.dtype()} weights ({source}).")

    # ---- numbers -----------------------------------------------------------------------------------------------
    def roofs(self) -> tuple[float, float, float] | None:
        """(peak FLOP/s, bandwidth bytes/s, ridge FLOP/byte) of the chosen machine and dtype."""
        hw = self.hardware()
        if hw is None:
            return None
        peak, bw = hw.peak_for(self.dtype()), hw.bandwidth_bytes_per_s
        return peak, bw, costs.ridge_point(peak, bw)

    def measured_points(self) -> dict[str, tuple[float, float]]:
        """Intensity (FLOP/byte) and achieved FLOP/s of the last prefill and the latest decode step."""
        out = {}
        if self._prefill is not None and self._prefill.seconds > 0:
            c = self._prefill.cost
            out["prefill"] = (c.intensity, c.flops / self._prefill.seconds)
        if self._decode:
            out["decode"] = self._decode[-1]
        return out

    def analytic_costs(self) -> dict[str, StepCost]:
        """The cost model's prefill (prompt length) and decode (prompt + generated so far) of the chosen model,
        at the chosen batch and the roof's dtype."""
        cfg = self.model_cfg()
        if cfg is None:
            return {}
        batch, dtype = self.batch(), self.dtype()
        decode = costs.decode_cost(cfg, self.decode_context(), batch=batch, weight_dtype=dtype)
        kernels = self.kernels_weight_bytes()
        if kernels is not None:  # the bytes the loaded model's kernels read, as its measured steps are priced
            decode = dataclasses.replace(decode, weight_bytes=kernels)
        return {"prefill": costs.prefill_cost(cfg, self.prompt_length(), batch=batch, weight_dtype=dtype),
                "decode": decode}

    # ---- drawing -----------------------------------------------------------------------------------------------
    def draw(self) -> None:
        r = self.roofs()
        hw = self.hardware()
        show_measured = self.shows_measured()
        measured = self.measured_points() if show_measured else {}
        trail = self._decode if show_measured else []
        analytic = self.analytic_costs()
        server, server_line = self.server_decode()
        if r is None or hw is None:
            self.hw_label.setText("This machine has not been measured yet: press “Measure this machine” "
                                  "(a few seconds), or pick a catalogue chip.")
            for item in (self.roof, self.analytic_prefill, self.analytic_decode):
                set_data(item, [], [])
            for t in (self.ridge_text, self.roof_text, self.analytic_prefill_text, self.analytic_decode_text):
                t.setText("")
            self.ridge_line.setVisible(False)
            self._draw_measured(measured, trail, None, 0.0)
            self._draw_server(None, None, 0.0)
            self._draw_verify(self._verify if show_measured else [], None, 0.0)
            self.takeaway.setText(html.escape(server_line, quote=False))
            self._fit_height()
            return
        peak, bw, ridge = r
        src = "measured" if hw.measured else "datasheet"
        self.hw_label.setText(f"{hw.label}: peak {fmt_flops(peak)} ({self.dtype()}), memory {fmt_bandwidth(bw)} "
                              f"— {src}")
        verify = self._verify if show_measured else []
        xs = ([i for _p, (i, _f) in measured.items()] + [c.intensity for c in analytic.values()]
              + [i for i, _f in verify])
        if server is not None:
            xs.append(server.cost.intensity)
        # in quarter decades, as y_lo below: the measured points move a little at every token
        lo = 10.0 ** (math.floor(4 * math.log10(min([0.1] + [x / 3 for x in xs if x > 0]))) / 4)
        hi = 10.0 ** (math.ceil(4 * math.log10(max([ridge * 20, 100.0] + [x * 5 for x in xs]))) / 4)
        ys = ([f for _i, f in measured.values()] + [peak] + [f for _i, f in verify]
              + ([server.flops_per_s] if server is not None else []))
        # at least 2.5 decades (readable ticks), and room under the lowest point for its label
        # (in quarter decades: the measured points move it by a little at every token, and each move re-lays the
        # axis out)
        y_lo = math.floor(4 * min(math.log10(min(ys) / 10), math.log10(peak) - 2.5)) / 4
        y_hi = math.log10(peak * 10)  # a decade of headroom for the ridge label
        if server is not None and server.flops_per_s > 0:  # a wrong chip or model can put it above the roof
            y_hi = max(y_hi, math.log10(server.flops_per_s) + 0.6)
        self.roof_text.setText(f"memory roof {fmt_bandwidth(bw)} · I")
        labels = self._analytic_labels(analytic, ridge)
        labels, lo, hi = self._fit_labels(labels, lo, hi, y_hi - y_lo, peak, bw, ridge)
        set_data(self.roof, *roof_points(lo, hi, peak, bw))
        self.ridge_line.setVisible(True)
        self.ridge_line.setPos(math.log10(ridge))
        self.ridge_text.setText(f"ridge {ridge:.3g} FLOP/B")
        self.ridge_text.setAnchor((0, 0))  # top of the plot, right of the line: clear of the points' labels
        self.ridge_text.setPos(math.log10(ridge), y_hi)
        # the top-left corner: above the slanted roof, clear of the measured points below it
        self.roof_text.setAnchor((0, 0))
        self.roof_text.setPos(math.log10(lo), y_hi)
        self._draw_analytic(labels, peak, bw)
        self._draw_measured(measured, trail, (peak, bw), (math.log10(lo) + math.log10(hi)) / 2)
        self._draw_server(server, (peak, bw), (math.log10(lo) + math.log10(hi)) / 2)
        self._draw_verify(verify, (peak, bw), (math.log10(lo) + math.log10(hi)) / 2)
        pi = self.plot.getPlotItem()
        x_lo, x_hi = math.log10(lo), math.log10(hi)
        pi.getViewBox().setRange(xRange=(x_lo, x_hi), yRange=(y_lo, y_hi), padding=0)
        # no tick label at the very right edge, where it would be cut in half
        set_ticks(pi.getAxis("bottom"), [decades(x_lo, x_hi - 0.03 * (x_hi - x_lo), most=9), []])
        set_ticks(pi.getAxis("left"), [decades(y_lo, y_hi), []])
        self._set_takeaway(ridge, analytic)
        if server_line:
            self.takeaway.setText(self.takeaway.text() + "<br>" + html.escape(server_line, quote=False))
        self._fit_height()

    def _analytic_labels(self, analytic: dict[str, StepCost], ridge: float) -> list[tuple[str, float, str, int]]:
        """(key, intensity, text, side) of each analytic point, side 1 for now (left of the point, above the
        roof, where the roof falls away); `_fit_labels` moves one that would overlap the other."""
        out: list[tuple[str, float, str, int]] = []
        for key in ("prefill", "decode"):
            c = analytic.get(key)
            if c is not None and c.intensity > 0:
                bound = "memory" if c.intensity < ridge else "compute"
                out.append((key, c.intensity, f"{key} ≈ {fmt_intensity(c.intensity)} FLOP/B · {bound}-bound", 1))
        return out

    def _fit_labels(self, labels: list[tuple[str, float, str, int]], lo: float, hi: float, y_span: float,
                    peak: float, bw: float, ridge: float) -> tuple[list[tuple[str, float, str, int]], float, float]:
        """Widen the log x range (lo, hi) so that every analytic label fits inside the plot; when the left
        label of the right point would cover the other point's label, it goes below-right of its point instead
        (side 0: under the roof, which rises or stays flat to the right)."""
        vb = self.plot.getPlotItem().getViewBox()
        width = vb.width() if vb.width() > 100 else 450.0  # not laid out yet (a hidden panel): a typical size
        height = vb.height() if vb.height() > 60 else 180.0
        metrics = QtGui.QFontMetrics(self._font)
        label_decades_y = (metrics.height() + 8) / height * y_span  # a label's height, in decades of FLOP/s
        shares = {key: min(0.8, (metrics.horizontalAdvance(text) + 24) / width) for key, _i, text, _s in labels}
        ridge_share = min(0.8, (metrics.horizontalAdvance(f"ridge {ridge:.3g} FLOP/B") + 16) / width)
        roof_share = min(0.8, (metrics.horizontalAdvance(self.roof_text.textItem.toPlainText()) + 24) / width)
        x_lo, x_hi = math.log10(lo), math.log10(hi)
        out = list(labels)
        for _ in range(5):  # widening one side changes the decades per pixel: settle in a few passes
            if len(out) == 2:
                (k0, i0, t0, _s0), (k1, i1, t1, _s1) = sorted(out, key=lambda lab: lab[1])
                span = x_hi - x_lo
                rise = math.log10(costs.attainable_flops(i1, peak, bw) / costs.attainable_flops(i0, peak, bw))
                crowded = (math.log10(i1) - shares[k1] * span < math.log10(i0) + 0.1 * span
                           and rise < label_decades_y)
                out = [(k0, i0, t0, 1), (k1, i1, t1, 0 if crowded else 1)]
            for key, i, _text, side in out:
                x, share = math.log10(i), shares[key]
                if side == 1:  # x - share·span ≥ x_lo, span = x_hi - x_lo
                    x_lo = min(x_lo, x_hi - (x_hi - x) / (1 - share))
                else:  # x + share·span ≤ x_hi
                    x_hi = max(x_hi, x_lo + (x - x_lo) / (1 - share))
            x_hi = max(x_hi, x_lo + (math.log10(ridge) - x_lo) / (1 - ridge_share))  # the ridge label, right of it
            x_lo = min(x_lo, x_hi - (x_hi - math.log10(ridge)) / (1 - roof_share))  # the roof label, left of it
        # A narrow plot cannot make room for every label: past MAX_WIDEN decades a label may be cut, but the axis
        # stays readable (it once ran from 1e-35 to 1e14 FLOP/byte in a 260-pixel-wide panel).
        x_lo = max(x_lo, math.log10(lo) - MAX_WIDEN)
        x_hi = min(x_hi, math.log10(hi) + MAX_WIDEN)
        # a left label that still does not fit goes below-right of its point, where the plot has room, unless the
        # other label is there already (two labels below-right of two close points would cover each other)
        for n, (key, i, text, side) in enumerate(out):
            if side == 1 and math.log10(i) - shares[key] * (x_hi - x_lo) < x_lo and all(o[3] for o in out):
                out[n] = (key, i, text, 0)
        return out, 10.0**x_lo, 10.0**x_hi

    def _draw_analytic(self, labels: list[tuple[str, float, str, int]], peak: float, bw: float) -> None:
        """Hollow points on the roof, each labelled with its intensity and which roof bounds it."""
        shown = {key for key, *_ in labels}
        for key, item, text in (("prefill", self.analytic_prefill, self.analytic_prefill_text),
                                ("decode", self.analytic_decode, self.analytic_decode_text)):
            if key not in shown:
                set_data(item, [], [])
                text.setText("")
        items = {"prefill": (self.analytic_prefill, self.analytic_prefill_text),
                 "decode": (self.analytic_decode, self.analytic_decode_text)}
        # a short plot has no room for these beside the measured points' labels: the takeaway line below states them
        roomy = self.plot.getPlotItem().getViewBox().height() >= ROOMY_PLOT
        for key, i, label, side in labels:
            item, text = items[key]
            y = costs.attainable_flops(i, peak, bw)
            set_data(item, [i], [y])
            text.setText(label if roomy else "")
            x = math.log10(i)
            if side == 0:
                text.setAnchor((0, 0))
                text.setPos(x + 0.05, math.log10(y) - 0.1)
            else:
                text.setAnchor((side, 1))
                text.setPos(x + (-0.05 if side else 0.05), math.log10(y) + 0.05)

    def _draw_measured(self, measured: dict, trail: list[tuple[float, float]],
                       roofs: tuple[float, float] | None, mid: float) -> None:
        if trail:
            # at most TRAIL_POINTS of the steps, evenly spread and the newest always among them: a long run's
            # thousands of nearly equal points cost a paint per point and add nothing the eye can tell apart
            picks = np.unique(np.linspace(0, len(trail) - 1, min(len(trail), TRAIL_POINTS)).round().astype(int))
            pts = np.array([trail[i] for i in picks])
            set_data(self.measured_decode, pts[:, 0], pts[:, 1])
        else:
            set_data(self.measured_decode, [], [])
        for key, item, text in (("prefill", self.measured_prefill, self.prefill_text),
                                ("decode", None, self.decode_text)):
            p = measured.get(key)
            if p is None:
                if item is not None:
                    set_data(item, [], [])
                text.setText("")
                continue
            i, f = p
            if item is not None:
                set_data(item, [i], [f])
            frac = "" if roofs is None else f", {fmt_fraction(f / costs.attainable_flops(i, *roofs))} of roof"
            text.setText(f"{key} {fmt_intensity(i)} FLOP/B{frac}")  # as the analytic labels (was 2.4e+02)
            right = math.log10(i) <= mid  # label on the side with room
            text.setAnchor((0 if right else 1, 1 if key == "prefill" else 0))
            text.setPos(math.log10(i) + (0.08 if right else -0.08), math.log10(f))

    def _draw_server(self, m: MeasuredDecode | None, roofs: tuple[float, float] | None, mid: float) -> None:
        if m is None or m.flops_per_s <= 0:
            set_data(self.server_point, [], [])
            self.server_text.setText("")
            return
        i, f = m.cost.intensity, m.flops_per_s
        set_data(self.server_point, [i], [f])
        share = None if roofs is None else f / costs.attainable_flops(i, *roofs)
        frac = "" if share is None else f", {fmt_fraction(share)} of roof"
        if share is not None and share > 1:
            frac = f", {share:.3g}× the roof: wrong chip or model?"
        self.server_text.setText(f"server decode {m.tokens_per_s:.0f} tok/s{frac}")
        right = math.log10(i) <= mid
        self.server_text.setAnchor((0 if right else 1, 1))
        self.server_text.setPos(math.log10(i) + (0.08 if right else -0.08), math.log10(f) + 0.05)

    def _draw_verify(self, verify: list[tuple[float, float]], roofs: tuple[float, float] | None,
                     mid: float) -> None:
        if not verify:
            set_data(self.verify_points, [], [])
            self.verify_text.setText("")
            return
        pts = np.array(verify)
        set_data(self.verify_points, pts[:, 0], pts[:, 1])
        i, f = verify[-1]
        frac = "" if roofs is None else f", {fmt_fraction(f / costs.attainable_flops(i, *roofs))} of roof"
        self.verify_text.setText(f"verify k+1={self._verify_k + 1} {fmt_intensity(i)} FLOP/B{frac}")
        right = math.log10(i) <= mid
        self.verify_text.setAnchor((0 if right else 1, 0))
        self.verify_text.setPos(math.log10(i) + (0.08 if right else -0.08), math.log10(f))

    def verify_note(self) -> str:
        """One line on the last speculative run's verify passes ("" when none is shown)."""
        if not self._verify or not self.shows_measured():
            return ""
        i = float(np.median([v[0] for v in self._verify]))
        ratio = f" ({i / self._verify_decode:.1f}× a decode step's {fmt_intensity(self._verify_decode)})" \
            if self._verify_decode > 0 else ""
        return (f"Speculative verify passes (k + 1 = {self._verify_k + 1} positions, {len(self._verify)} passes): "
                f"≈ {fmt_intensity(i)} FLOP/byte{ratio}.")

    def _set_takeaway(self, ridge: float, analytic: dict[str, StepCost]) -> None:
        name = html.escape(self.model_name())
        if "decode" not in analytic:
            self.takeaway.setText(f"Ridge at {ridge:.3g} FLOP/byte: steps left of it are memory-bound. No model "
                                  "is loaded yet: pick a catalogue model for the analytic points.")
            return
        batch = self.batch()
        dec = analytic["decode"].intensity
        if dec < ridge:
            bound = ("still " if batch > 1 else "") + "memory-bound"
        else:
            bound = "compute-bound"
        info = self._info
        if self.model_key() == LOADED and info is not None:  # what ran: its dtype and kernel mode
            ran = f"{info.dtype} · {fmt_kernels(info.kernels)}"
            name += (f" ({html.escape(ran)})" if self.dtype() == self._run_dtype else
                     f" at {html.escape(self.dtype())} weights (it ran {html.escape(ran)})")
        weights = fmt_bytes(analytic["decode"].weight_bytes)
        text = (f"<b>{name}: decode at batch {batch} ≈ {fmt_intensity(dec)} FLOP/byte, {weights} of weights a "
                f"step → {bound} (ridge {ridge:.3g})</b>")
        if "prefill" in analytic:
            pre = analytic["prefill"].intensity
            text += (f"; prefill of {self.prompt_length()} tokens ≈ {fmt_intensity(pre)} FLOP/byte → "
                     f"{'memory' if pre < ridge else 'compute'}-bound")
        text += "."
        if not self.shows_measured():
            text += " Measured points hidden: they belong to the loaded model."
        if self.verify_note():
            text += "<br>" + html.escape(self.verify_note(), quote=False)
        self.takeaway.setText(text)

PANEL = RooflinePanel
