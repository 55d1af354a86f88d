"""Batching lab: batched decode measured on the loaded model, one batch size after another.

The measurement runs in the engine process (engine.labs.batching.bench_batch via bridge.run_batch_bench); rows
arrive one by one through sig_batch_row and are only stored here, then drawn on the app's tick. The roofs of the
roofline plot are this machine's cached measurement (engine.costs.hardware.load_cached) or a catalogue chip the user
picks; nothing is made up when neither is chosen: the measured points are then drawn without a roof.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.guard import guarded
from app.panels.base import Panel, spin_box
from app.theme import (
    BACKGROUND,
    DECODE_COLOR,
    ERROR_COLOR,
    FOREGROUND,
    MUTED,
    RIDGE_COLOR,
    ROOF_COLOR,
    SYSTEM_COLOR,
    log_ticks,
    placeholder,
    roof_points,
    set_number_cell,
    show_empty,
    style_plot,
)
from app.units import fmt_bandwidth, fmt_flops, fmt_fraction
from engine.costs import formulas as costs
from engine.costs.catalog import Hardware, canonical_dtype, hardware_presets
from engine.costs.memory import LabMemory, lab_memory, size
from engine.events import ModelInfo
from engine.formats.discover import memory_available
from engine.protocol import BatchRow, LabDone

FONT_PT = 9
BATCH_CHOICES = (1, 2, 4, 8, 16, 32)
THIS_MACHINE = "this-machine"
NO_ROOF = "__none__"
# The axes before the first run (log10 bounds on the log plots): TPOT in ms and tokens/s, batch 1…32,
# FLOP/byte 0.1…100 and FLOP/s 1 G…10 T; the rows replace them.
EMPTY_TPOT_MS, EMPTY_TOKENS_S = (0.0, 100.0), (0.0, 1000.0)
EMPTY_LOG_TOKENS_S = (0.0, 3.0)
EMPTY_LOG_INTENSITY, EMPTY_LOG_FLOPS = (-1.0, 2.0), (9.0, 13.0)
COLUMNS = ("B", "TPOT ms", "tok/s stream", "tok/s system", "FLOP/byte", "GFLOP/s", "GB/s", "of roof")


def summarize(rows: list[BatchRow], roofs: tuple[float, float] | None = None) -> str:
    """One or two sentences that say what the rows show (plain text, computed from the rows only)."""
    if not rows:
        return ""
    rows = sorted(rows, key=lambda r: r.batch)
    first, last = rows[0], rows[-1]
    if len(rows) == 1:
        text = (f"Only B={first.batch} measured: TPOT {first.tpot_s * 1e3:.1f} ms, "
                f"{first.tokens_per_s_system:.0f} tok/s. Measure more batch sizes to compare.")
    else:
        gain = last.tokens_per_s_system / first.tokens_per_s_system
        change = last.tokens_per_s_per_stream / first.tokens_per_s_per_stream - 1
        per_stream = f"fell by {-change:.0%}" if change < 0 else f"rose by {change:.0%}"
        text = (f"System throughput ×{gain:.1f} from B={first.batch} to B={last.batch} "
                f"({first.tokens_per_s_system:.0f} → {last.tokens_per_s_system:.0f} tok/s) while per-stream speed "
                f"{per_stream} (TPOT {first.tpot_s * 1e3:.1f} → {last.tpot_s * 1e3:.1f} ms).")
        best = max(rows, key=lambda r: r.tokens_per_s_system)
        if best is not last:
            text += f" System throughput peaks at B={best.batch} ({best.tokens_per_s_system:.0f} tok/s)."
    if roofs is not None:
        peak, bw = roofs
        ridge = costs.ridge_point(peak, bw)
        fr = last.achieved_flops / costs.attainable_flops(last.intensity, peak, bw)
        bound = "memory" if last.intensity < ridge else "compute"
        text += (f" At B={last.batch} a step does {last.intensity:.2g} FLOP/byte ({bound}-bound side of the "
                 f"ridge at {ridge:.3g}) and reaches {fmt_fraction(fr)} of the roof.")
    return text


class BatchingPanel(Panel):
    title = "Batching lab"
    object_name = "panel_batching"
    shortcut = "Ctrl+Alt+2"
    subscriptions = {
        "sig_model_loaded": "_on_model_loaded",
        "sig_this_machine": "_on_this_machine",
        "sig_batch_progress": "_on_progress",
        "sig_batch_row": "_on_row",
        "sig_batch_done": "_on_done",
    }
    help_text = (
        "A real measurement, not a formula: the loaded model decodes B random prompts together, for each batch "
        "size you tick, and every decode step is timed. One step reads all the weights once whatever B is, and "
        "produces one token for each of the B sequences. TPOT (ms) is the median step time: every stream waits "
        "that long per token. Per-stream speed = 1 / TPOT and system speed = B / TPOT, in tokens/s. While the "
        "step stays memory-bound, a bigger batch costs little extra time, so system tokens/s climbs almost with "
        "B and per-stream speed barely drops; once the matmuls become the bottleneck, TPOT grows with B and the "
        "gain flattens. Left plot: system tokens/s against TPOT, one point per batch (up and to the right = "
        "more throughput bought with latency). Middle: per-stream and system tokens/s against B. Right: the "
        "roofline, log-log. A step's arithmetic intensity I = FLOPs / bytes moved (FLOP/byte, from engine.costs: "
        "about 2 FLOPs per weight per sequence over the weight and KV-cache bytes), so it grows with B. Filled "
        "dots are achieved FLOP/s = FLOPs per step / measured TPOT; hollow circles are the roof at the same "
        "intensity, min(peak FLOP/s, I × bandwidth), labelled with the fraction of it the run reached. The roofs "
        "are this machine's cached measurement (measure it in the Roofline panel) or a catalogue chip you pick."
    )

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        self.memory_available = memory_available  # bytes available now (a test gives its own)
        super().__init__(bridge, parent)
        self.rows: list[BatchRow] = []
        self.running = False
        self.status = ""
        self.outcome: str = ""  # how the last run ended (engine.protocol.LabOutcome; "" none yet; refused here: failed)
        self.presets: dict[str, Hardware] = hardware_presets()
        self.this_machine: Hardware | None = None
        self._requested: tuple[int, ...] = ()
        self._progress: tuple[float, str] = (0.0, "")
        self._started = False  # the first progress of the current run has arrived
        self._cancel_pending = False
        self._font = QtGui.QFont()
        self._font.setPointSize(FONT_PT)
        self._labels: dict[str, list[pg.TextItem]] = {"tl": [], "roof": []}
        self._build()
        self.refresh_this_machine()
        if bridge.info is not None:
            self._on_model_loaded(bridge.info)
        self._update_buttons()
        self.mark_dirty()

    def _on_this_machine(self, _answer: object) -> None:
        self.refresh_this_machine()  # the engine answered a look-up or measured: the policy's answer may change

    # ---- widgets -------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.batch_boxes: dict[int, QtWidgets.QCheckBox] = {}
        controls = QtWidgets.QHBoxLayout()
        controls.setContentsMargins(0, 0, 0, 0)
        controls.setSpacing(4)
        controls.addWidget(QtWidgets.QLabel("B"))
        for b in BATCH_CHOICES:
            box = QtWidgets.QCheckBox(str(b))
            box.setChecked(True)
            box.setToolTip(f"Measure decode with {b} sequence{'s' if b > 1 else ''} at once")
            self.batch_boxes[b] = box
            controls.addWidget(box)
        self.prompt_spin = spin_box(1, 4096, 32, "Prompt tokens per sequence (one prefill before decoding)")
        self.new_spin = spin_box(2, 1024, 16, "Tokens decoded per sequence; TPOT is the median of their steps")
        controls.addSpacing(6)
        controls.addWidget(QtWidgets.QLabel("prompt"))
        controls.addWidget(self.prompt_spin)
        controls.addWidget(QtWidgets.QLabel("new"))
        controls.addWidget(self.new_spin)
        controls.addStretch(1)
        self.run_button = QtWidgets.QPushButton("Run")
        self.run_button.setToolTip("Measure batched decode at every ticked batch size on the loaded model")
        self.run_button.clicked.connect(lambda: self.run())
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop after the current decode step")
        self.cancel_button.clicked.connect(self.cancel)
        controls.addWidget(self.run_button)
        controls.addWidget(self.cancel_button)

        self.progress = QtWidgets.QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setTextVisible(True)
        self.progress.setFormat("")
        self.progress.setMaximumHeight(16)
        self.roof_combo = QtWidgets.QComboBox()
        self.roof_combo.addItem("Roofs: none (pick a chip)", NO_ROOF)
        for key, hw in self.presets.items():
            self.roof_combo.addItem(f"Roofs: {hw.label}", key)
        self.roof_combo.setToolTip("Whose peak FLOP/s and memory bandwidth draw the roofline")
        self.roof_combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.roof_combo.currentIndexChanged.connect(lambda _i: self.mark_dirty())
        row2 = QtWidgets.QHBoxLayout()
        row2.setContentsMargins(0, 0, 0, 0)
        row2.addWidget(self.progress, 1)
        row2.addWidget(self.roof_combo)

        self.tl_plot = self._plot("TPOT (ms)", "system tokens/s", log=False)
        tl = self.tl_plot.getPlotItem()
        self.tl_note = placeholder(tl)
        self.tl_curve = tl.plot([], [], pen=pg.mkPen(SYSTEM_COLOR, width=1.5), symbol="o", symbolSize=8,
                                symbolBrush=SYSTEM_COLOR, symbolPen=pg.mkPen(BACKGROUND))

        self.speed_plot = self._plot("batch size B", "tokens/s", log=True)
        sp = self.speed_plot.getPlotItem()
        self.speed_note = placeholder(sp)
        self.system_curve = sp.plot([], [], pen=pg.mkPen(SYSTEM_COLOR, width=2), symbol="o", symbolSize=6,
                                    symbolBrush=SYSTEM_COLOR, symbolPen=None)
        self.stream_curve = sp.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=2), symbol="o", symbolSize=6,
                                    symbolBrush=DECODE_COLOR, symbolPen=None)
        # Direct labels at the last points instead of a legend, which would hide the rising system curve.
        self.system_text = pg.TextItem("system", color=SYSTEM_COLOR, anchor=(1, 1))
        self.stream_text = pg.TextItem("per stream", color=DECODE_COLOR, anchor=(1, 0))
        for item in (self.system_text, self.stream_text):
            item.setFont(self._font)
            sp.addItem(item)

        self.roof_plot = self._plot("FLOP/byte", "FLOP/s", log=True)
        rp = self.roof_plot.getPlotItem()
        self.roof_curve = rp.plot([], [], pen=pg.mkPen(ROOF_COLOR, width=2))
        self.ridge_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(RIDGE_COLOR, width=1,
                                                                 style=QtCore.Qt.PenStyle.DotLine))
        rp.addItem(self.ridge_line)
        self.gap_lines = rp.plot([], [], pen=pg.mkPen(MUTED, width=1, style=QtCore.Qt.PenStyle.DashLine),
                                 connect="pairs")
        self.analytic_points = rp.plot([], [], pen=None, symbol="o", symbolSize=11, symbolBrush=None,
                                       symbolPen=pg.mkPen(DECODE_COLOR, width=1.5))
        self.measured_points = rp.plot([], [], pen=None, symbol="o", symbolSize=8, symbolBrush=DECODE_COLOR,
                                       symbolPen=pg.mkPen(BACKGROUND))
        self.roof_note = pg.TextItem("", color=MUTED, anchor=(0, 0), fill=pg.mkBrush(30, 31, 36, 210))
        self.roof_note.setFont(self._font)
        rp.addItem(self.roof_note)

        plots = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        for w in (self.tl_plot, self.speed_plot, self.roof_plot):
            plots.addWidget(w)
        plots.setSizes([230, 210, 260])
        plots.setChildrenCollapsible(False)

        self.table = QtWidgets.QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.verticalHeader().setDefaultSectionSize(18)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.Stretch)
        self.table.horizontalHeader().setMinimumSectionSize(30)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        font = self.table.font()
        font.setPointSize(FONT_PT)
        self.table.setFont(font)
        self.table.horizontalHeader().setFont(font)

        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical)
        split.addWidget(plots)
        split.addWidget(self.table)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        split.setSizes([240, 130])
        split.setChildrenCollapsible(False)

        self.summary = QtWidgets.QLabel("")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        # what the largest ticked batch will hold, said before Run (engine.costs.memory)
        self.memory_note = QtWidgets.QLabel("")
        self.memory_note.setWordWrap(True)
        self.memory_note.setStyleSheet(f"color: {MUTED};")
        for w in (*self.batch_boxes.values(), self.prompt_spin, self.new_spin):
            (w.toggled if isinstance(w, QtWidgets.QCheckBox) else w.valueChanged).connect(
                lambda *_: self.show_memory())
        layout.addLayout(controls)
        layout.addLayout(row2)
        layout.addWidget(self.memory_note)
        layout.addWidget(split, 1)
        layout.addWidget(self.summary)

    def _plot(self, x_label: str, y_label: str, log: bool) -> pg.PlotWidget:
        w = pg.PlotWidget(background=BACKGROUND)
        w.setMinimumSize(150, 120)
        style_plot(w.getPlotItem(), left=(y_label, None), bottom=(x_label, None), log=(log, log), mouse=False)
        return w

    def _label(self, kind: str, i: int, plot: pg.PlotWidget, colour: str) -> pg.TextItem:
        """The i-th text label of a plot, created on first use and reused afterwards."""
        pool = self._labels[kind]
        while len(pool) <= i:
            item = pg.TextItem("", color=colour, anchor=(0, 1))
            item.setFont(self._font)
            plot.getPlotItem().addItem(item)
            pool.append(item)
        return pool[i]

    # ---- state ---------------------------------------------------------------------------------------------------
    def selected_batches(self) -> tuple[int, ...]:
        return tuple(b for b, box in self.batch_boxes.items() if box.isChecked())

    def memory_of(self, batch: int, prompt: int, new: int) -> LabMemory | None:
        """What `batch` sequences of prompt + new positions hold on the loaded model's runtime (None: no model)."""
        info, cfg = self.bridge.info, self.bridge.cfg
        if info is None or cfg is None:
            return None
        return lab_memory(info, cfg, self.bridge.runtime or "torch", batch, prompt + new)

    def refusal(self, batches: tuple[int, ...], prompt: int, new: int) -> str | None:
        """One line naming the first batch whose KV cache would not fit in the memory available now (None: all fit)."""
        available = self.memory_available()
        for b in sorted(batches):
            mem = self.memory_of(b, prompt, new)
            why = mem.refusal(available) if mem is not None else None
            if why is not None:
                return f"{why}: untick it to run the rest"
        return None

    def show_memory(self) -> None:
        batches = self.selected_batches()
        mem = self.memory_of(max(batches), self.prompt_spin.value(), self.new_spin.value()) if batches else None
        self.memory_note.setText("" if mem is None else
                                 f"Batch {mem.n_seq}: {mem.line()}; {size(self.memory_available())} available now")

    def _update_buttons(self) -> None:
        loaded = self.bridge.info is not None
        self.run_button.setEnabled(loaded and not self.running and bool(self.selected_batches()))
        self.cancel_button.setEnabled(self.running)
        for w in (*self.batch_boxes.values(), self.prompt_spin, self.new_spin):
            w.setEnabled(not self.running)
        if not loaded and not self.running:
            self.progress.setFormat("Load a model to measure batched decode")

    def refresh_this_machine(self) -> None:
        """Offer this machine's roofs when engine.costs.hardware's one policy finds a measurement for the model's dtype
        (reading the cache never measures)."""
        info = self.bridge.info
        hw = self.bridge.this_machine(  # the engine's answer; None until it comes (sig_this_machine)
            info.device if info is not None else "cpu", self._model_dtype())
        self.this_machine = hw
        i = self.roof_combo.findData(THIS_MACHINE)
        if hw is None:
            return
        label = "Roofs: this machine (measured)"
        if i < 0:
            self.roof_combo.insertItem(0, label, THIS_MACHINE)
            self.roof_combo.setCurrentIndex(0)
        else:
            self.roof_combo.setItemText(i, label)
        self.mark_dirty()

    @guarded
    def showEvent(self, event: QtGui.QShowEvent) -> None:  # noqa: N802 — Qt's name
        """A measurement taken meanwhile (Roofline panel) shows up when the panel is shown again."""
        self.refresh_this_machine()
        super().showEvent(event)

    def _model_dtype(self) -> str:
        info = self.bridge.info
        try:
            return canonical_dtype(info.dtype) if info is not None else "fp32"
        except ValueError:
            return "fp32"

    def roofs(self) -> tuple[float, float] | None:
        """(peak FLOP/s, bandwidth bytes/s) of the chosen roofs at the loaded model's dtype, or None."""
        key = self.roof_combo.currentData()
        hw = self.this_machine if key == THIS_MACHINE else self.presets.get(key)
        if hw is None:
            return None
        return hw.peak_for(self._model_dtype()), hw.bandwidth_bytes_per_s

    def select_roofs(self, key: str) -> None:
        i = self.roof_combo.findData(key)
        if i < 0:
            raise ValueError(f"unknown roofs {key!r}")
        self.roof_combo.setCurrentIndex(i)

    # ---- commands ------------------------------------------------------------------------------------------------
    def run(self, batches: tuple[int, ...] | None = None, prompt_tokens: int | None = None,
            new_tokens: int | None = None) -> None:
        """Start a measurement (defaults: the ticked batch sizes and the spin boxes)."""
        if self.bridge.info is None or self.running:
            return
        batches = tuple(batches) if batches is not None else self.selected_batches()
        if not batches:
            return
        prompt = int(prompt_tokens if prompt_tokens is not None else self.prompt_spin.value())
        new = int(new_tokens if new_tokens is not None else self.new_spin.value())
        self.prompt_spin.setValue(prompt)  # the controls show what is being measured
        self.new_spin.setValue(new)
        if set(batches) <= set(BATCH_CHOICES):
            for b, box in self.batch_boxes.items():
                box.setChecked(b in batches)
        why = self.refusal(batches, prompt, new)
        if why is not None:  # refused before it starts: nothing is sent to the engine
            self.status, self.outcome = f"failed: {why}", "failed"
            self._progress = (0.0, why)
            self.mark_dirty()
            return
        self.refresh_this_machine()
        self.rows, self._requested = [], batches
        self.running, self._started, self._cancel_pending = True, False, False
        self.status, self.outcome = "", ""
        self._progress = (0.0, "starting…")
        self.bridge.run_batch_bench(batches, prompt, new)
        self._update_buttons()
        self.mark_dirty()

    def cancel(self) -> None:
        if not self.running:
            return
        self.bridge.cancel_batch_bench()
        # The engine clears the cancel flag when the run starts, so a cancel sent before then would be lost:
        # send it again when the first progress of this run arrives.
        self._cancel_pending = not self._started
        self._progress = (self._progress[0], "cancelling…")
        self.mark_dirty()

    # ---- events --------------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        cfg = self.bridge.cfg
        if cfg is not None:
            self.new_spin.setMaximum(max(2, min(1024, cfg.context_length - 1)))
            self.prompt_spin.setMaximum(max(1, min(4096, cfg.context_length - 2)))
        self.rows, self.status, self.outcome = [], "", ""
        self._progress = (0.0, f"{info.name}: ready")
        self.show_memory()
        self.refresh_this_machine()
        self._update_buttons()
        self.mark_dirty()

    @QtCore.Slot(float, str)
    def _on_progress(self, fraction: float, message: str) -> None:
        if not self.running:
            return
        self._started = True
        if self._cancel_pending:
            self._cancel_pending = False
            self.bridge.cancel_batch_bench()
        self._progress = (fraction, message)
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_row(self, row: BatchRow) -> None:
        self.rows.append(row)
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_done(self, done: LabDone) -> None:
        """The run ended (engine.protocol.LabDone): done, cancelled, failed or unsupported on this runtime."""
        self.running, self.outcome = False, done.outcome
        n, asked = len(self.rows), len(self._requested)
        if done.outcome == "done":
            skipped = asked - n
            self.status = (f"done: {n} batch sizes" if not skipped
                           else f"done: {n} of {asked} batch sizes (the rest would not fit in memory)")
            self._progress = (1.0, self.status)
        elif done.outcome == "cancelled":
            self.status = f"cancelled after {n} of {asked} batch sizes"
            self._progress = (self._progress[0], self.status)
        else:
            # unsupported: the runtime's one sentence as it is; failed: said to be a failure
            self.status = done.message if done.outcome == "unsupported" else f"failed: {done.message}"
            self._progress = (self._progress[0], self.status)
        self._update_buttons()
        self.mark_dirty()

    @property
    def failed(self) -> bool:
        """The last run (or its refusal) ended without measuring: the status says why."""
        return self.outcome in ("failed", "unsupported")

    def clear(self) -> None:
        if not self.running:
            self.rows, self.status, self.outcome = [], "", ""
        super().clear()

    # ---- drawing -------------------------------------------------------------------------------------------------
    def draw(self) -> None:
        fraction, message = self._progress
        self.progress.setValue(int(round(1000 * fraction)))
        if message or self.bridge.info is not None:
            self.progress.setFormat(message[:80])
        self.progress.setToolTip(message)
        colour = ERROR_COLOR if self.failed else FOREGROUND
        self.summary.setStyleSheet(f"color: {colour};")
        rows = sorted(self.rows, key=lambda r: r.batch)
        roofs = self.roofs()
        self._draw_table(rows, roofs)
        self._draw_speed(rows)
        self._draw_roofline(rows, roofs)
        if self.failed:
            self.summary.setText(self.status)
        elif rows:
            self.summary.setText(summarize(rows, roofs))
        elif self.bridge.info is None:
            self.summary.setText("Load a model, tick batch sizes and press Run.")
        else:
            self.summary.setText("Tick batch sizes and press Run: each one decodes that many sequences together.")

    def _draw_table(self, rows: list[BatchRow], roofs: tuple[float, float] | None) -> None:
        self.table.setRowCount(len(rows))
        for i, r in enumerate(rows):
            frac = "–" if roofs is None else fmt_fraction(r.achieved_flops / costs.attainable_flops(r.intensity,
                                                                                                 *roofs))
            cells = (f"{r.batch}", f"{r.tpot_s * 1e3:.2f}", f"{r.tokens_per_s_per_stream:.1f}",
                     f"{r.tokens_per_s_system:.1f}", f"{r.intensity:.2f}", f"{r.achieved_flops / 1e9:.2f}",
                     f"{r.achieved_bandwidth / 1e9:.2f}", frac)
            for j, text in enumerate(cells):
                set_number_cell(self.table, i, j, text)

    def _draw_speed(self, rows: list[BatchRow]) -> None:
        b = np.array([r.batch for r in rows], dtype=float)
        tpot_ms = np.array([r.tpot_s * 1e3 for r in rows])
        system = np.array([r.tokens_per_s_system for r in rows])
        stream = np.array([r.tokens_per_s_per_stream for r in rows])
        self.tl_curve.setData(tpot_ms, system)
        self._draw_empty_speed(bool(rows))
        for i, label in enumerate(self._labels["tl"]):
            if i >= len(rows):
                label.setText("")
        for i, r in enumerate(rows):
            label = self._label("tl", i, self.tl_plot, SYSTEM_COLOR)
            label.setText(f"B={r.batch}")
            label.setPos(tpot_ms[i], system[i])
        if rows:
            x_pad = max(np.ptp(tpot_ms) * 0.25, tpot_ms.max() * 0.1)
            self.tl_plot.getPlotItem().getViewBox().setRange(
                xRange=(max(0.0, tpot_ms.min() - x_pad * 0.3), tpot_ms.max() + x_pad),
                yRange=(0.0, system.max() * 1.18), padding=0)
        self.system_curve.setData(b, system)
        self.stream_curve.setData(b, stream)
        sp = self.speed_plot.getPlotItem()
        if rows:
            x_lo, x_hi = math.log10(b.min()) - 0.15, math.log10(b.max()) + 0.15
            both = np.concatenate([system, stream])
            y_lo, y_hi = math.log10(both.min()) - 0.3, math.log10(both.max()) + 0.25  # room for the labels
            sp.getViewBox().setRange(xRange=(x_lo, x_hi), yRange=(y_lo, y_hi), padding=0)
            self.system_text.setPos(math.log10(b[-1]), math.log10(system[-1]) + 0.03)
            self.stream_text.setPos(math.log10(b[-1]), math.log10(stream[-1]) - 0.03)
        self.system_text.setVisible(bool(rows))
        self.stream_text.setVisible(bool(rows))
        if rows:
            sp.getAxis("bottom").setTicks([[(math.log10(v), str(int(v))) for v in b], []])
            sp.getAxis("left").setTicks([log_ticks(y_lo, y_hi), []])

    def _draw_empty_speed(self, has_rows: bool) -> None:
        """Before the first run: real axes (ms, tokens/s, the batch sizes offered) and what will appear."""
        self.tl_note.setVisible(not has_rows)
        self.speed_note.setVisible(not has_rows)
        if has_rows:
            return
        show_empty(self.tl_plot.getPlotItem(), self.tl_note, "Run: one point\nper batch size", EMPTY_TPOT_MS,
                   EMPTY_TOKENS_S)
        sp = self.speed_plot.getPlotItem()
        x = (math.log10(BATCH_CHOICES[0]) - 0.15, math.log10(BATCH_CHOICES[-1]) + 0.15)
        show_empty(sp, self.speed_note, "Run: tokens/s\nby batch size", x,
                   EMPTY_LOG_TOKENS_S)
        sp.getAxis("bottom").setTicks([[(math.log10(b), str(b)) for b in BATCH_CHOICES], []])
        sp.getAxis("left").setTicks([log_ticks(*EMPTY_LOG_TOKENS_S, decades_beyond=2.0), []])

    def _draw_roofline(self, rows: list[BatchRow], roofs: tuple[float, float] | None) -> None:
        rp = self.roof_plot.getPlotItem()
        intensity = np.array([r.intensity for r in rows])
        achieved = np.array([r.achieved_flops for r in rows])
        self.measured_points.setData(intensity, achieved)
        for label in self._labels["roof"][len(rows):]:
            label.setText("")
        if roofs is None:
            self.roof_curve.setData([], [])
            self.analytic_points.setData([], [])
            self.gap_lines.setData([], [])
            self.ridge_line.setVisible(False)
            self.roof_note.setText("no roofs: pick a chip above\n(or measure this machine\nin the Roofline panel)")
            for i, r in enumerate(rows):
                label = self._label("roof", i, self.roof_plot, DECODE_COLOR)
                label.setText(f"B={r.batch}")
                label.setAnchor((0.5, -0.1))
                label.setPos(math.log10(r.intensity), math.log10(r.achieved_flops))
            if rows:
                xs, ys = np.log10(intensity), np.log10(achieved)
                x_range, y_range = (xs.min() - 0.3, xs.max() + 0.3), (ys.min() - 0.6, ys.max() + 0.8)
            else:
                x_range, y_range = EMPTY_LOG_INTENSITY, EMPTY_LOG_FLOPS
            rp.getViewBox().setRange(xRange=x_range, yRange=y_range, padding=0)
            self.roof_note.setPos(x_range[0] + 0.02, y_range[1] - 0.02)
            rp.getAxis("bottom").setTicks([log_ticks(*x_range), []])
            rp.getAxis("left").setTicks([log_ticks(*y_range), []])
            return
        peak, bw = roofs
        ridge = costs.ridge_point(peak, bw)
        roof_at = np.array([costs.attainable_flops(i, peak, bw) for i in intensity])
        lo = min([ridge / 30] + [i / 2 for i in intensity])
        hi = max([ridge * 6] + [i * 3 for i in intensity])
        self.roof_curve.setData(*roof_points(lo, hi, peak, bw))
        self.ridge_line.setVisible(True)
        self.ridge_line.setPos(math.log10(ridge))
        self.analytic_points.setData(intensity, roof_at)
        if rows:
            self.gap_lines.setData(np.repeat(intensity, 2), np.column_stack([achieved, roof_at]).ravel())
        else:
            self.gap_lines.setData([], [])
        x_lo, x_hi = math.log10(lo), math.log10(hi)
        y_hi = math.log10(peak) + 0.5
        # Room under the lowest measured dot for its two-line label.
        y_lo = min([math.log10(costs.attainable_flops(lo, peak, bw))] + [math.log10(a) - 0.7 for a in achieved])
        rp.getViewBox().setRange(xRange=(x_lo, x_hi), yRange=(y_lo, y_hi), padding=0)
        rp.getAxis("bottom").setTicks([log_ticks(x_lo, x_hi), []])
        rp.getAxis("left").setTicks([log_ticks(y_lo, y_hi), []])
        self.roof_note.setText(f"peak {fmt_flops(peak)}\n{fmt_bandwidth(bw)} · ridge {ridge:.3g}")
        self.roof_note.setPos(x_lo + 0.02 * (x_hi - x_lo), y_hi - 0.02 * (y_hi - y_lo))
        for i, r in enumerate(rows):
            label = self._label("roof", i, self.roof_plot, DECODE_COLOR)
            label.setText(f"B={r.batch}\n{fmt_fraction(r.achieved_flops / roof_at[i])}")
            label.setAnchor((0.5, -0.05))  # below the measured dot
            label.setPos(math.log10(r.intensity), math.log10(r.achieved_flops))


PANEL = BatchingPanel
