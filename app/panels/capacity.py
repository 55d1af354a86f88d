"""Capacity estimator: will a model fit on a chip, and how fast can it prefill and decode there?

Every number on this panel comes from engine.costs.estimate.estimate(); the panel only chooses the inputs, formats the
outputs with units and sweeps the batch size for the plot. Pure arithmetic, so it runs on the GUI thread.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.guard import guarded
from app.panels.base import Panel
from app.theme import (
    BACKGROUND,
    DECODE_COLOR,
    ERROR_COLOR,
    MUTED,
    OK_COLOR,
    SYSTEM_COLOR,
    WARNING_COLOR,
    log_ticks,
    style_plot,
)
from app.units import fmt_bandwidth, fmt_bytes, fmt_flops, fmt_rate, fmt_seconds
from engine.costs.catalog import Hardware, hardware_presets, model_presets
from engine.costs.estimate import estimate
from engine.events import ModelInfo
from engine.model.config import ModelConfig

FONT_PT = 9
LOADED = "__loaded__"
THIS_MACHINE = "this-machine"
DTYPES = (("fp32", "fp32"), ("fp16 / bf16", "fp16"), ("int8", "int8"), ("int4", "int4"))
SWEEP_MAX_BATCH = 256
SEED_EXAMPLE = {"model": "llama-2-70b", "hardware": "h100-sxm", "dtype": "fp16", "context": 4096, "batch": 1}


def sweep_batches(max_batch: int = SWEEP_MAX_BATCH, points: int = 48) -> np.ndarray:
    """Batch sizes 1…max_batch spaced evenly on a log axis (integers, no repeats)."""
    return np.unique(np.round(np.logspace(0, math.log10(max_batch), points)).astype(int))


class CapacityPanel(Panel):
    title = "Capacity"
    object_name = "panel_capacity"
    shortcut = "Ctrl+Alt+1"
    subscriptions = {
        "sig_model_loaded": "_on_model_loaded",
        "sig_this_machine": "_on_this_machine",
        "sig_server_connected": "_on_server_connected",
        "sig_server_disconnected": "_on_server_connected",
        "sig_prompt": "_on_prompt",
        "sig_token": "_on_token",
        "sig_serve_run": "_on_serve_run",
    }
    help_text = (
        "A back-of-the-envelope serving calculator: pick a model, a chip, a number format, a context length and a "
        "batch, and it tells you whether the model fits and how fast it can run there at best. Memory: weights = "
        "parameters × bytes per value (fp32 4, fp16/bf16 2, int8 1, int4 0.5 bytes); the KV cache adds "
        "2 · layers · KV heads · head dim · bytes per value per token, times context × batch. Weights plus cache "
        "must fit in the chip's memory (activations and framework overhead are ignored, so treat 'fits' as "
        "optimistic). Speed uses the roofline: a step takes at least FLOPs / peak FLOP/s and at least bytes moved / "
        "memory bandwidth (bytes/s). One decode step reads every weight once and the cache of every sequence, "
        "and does about 2 FLOPs per parameter per sequence, so its arithmetic intensity (FLOP per byte) is tiny "
        "next to the chip's ridge point (peak / bandwidth): decode is memory-bound, and TPOT floor = bytes per step "
        "/ bandwidth, in seconds. Per-stream speed = 1 / TPOT, system speed = batch / TPOT (tokens/s): batching "
        "shares one weight read among many sequences. TTFT is one prompt's prefill alone on the chip. The plot "
        "sweeps the batch from 1 to 256: TPOT rises slowly (the cache grows) while system tokens/s climbs almost "
        "in proportion. Connected to a server, 'TPOT measured' is the server's own: the mean gap between its "
        "decode tokens in the last generation (batch 1), and each Load lab level's mean TPOT and system tokens/s "
        "at its concurrency — drawn as stars next to the estimate for the model and chip chosen here."
    )

    @staticmethod
    def seed_help() -> str:
        """The seed example in numbers, computed by engine.costs.estimate like every figure of the panel."""
        r = estimate(SEED_EXAMPLE["model"], SEED_EXAMPLE["hardware"], SEED_EXAMPLE["dtype"],
                     SEED_EXAMPLE["context"], SEED_EXAMPLE["batch"])
        fits = ("and it fits" if r["fits"] else
                f"and it does not even fit in one {fmt_bytes(r['memory_bytes'], digits=0)} chip")
        return (f"The seed example ({r['model']}, {r['dtype']}, {r['hardware_label']} at "
                f"{fmt_bandwidth(r['bandwidth_bytes_per_s'])}): about {fmt_bytes(r['decode_bytes'], digits=0)} "
                f"read per token gives a floor of {fmt_seconds(r['tpot_floor_s'])}, about "
                f"{r['tokens_per_s_per_stream']:.0f} tokens/s, {fits}.")

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        return self.seed_help()

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.models: dict[str, ModelConfig] = model_presets()
        self.hardware: dict[str, Hardware] = hardware_presets()
        self.result: dict[str, Any] | None = None  # the latest estimate() output
        self.error = ""
        self.sweep: dict[str, np.ndarray] = {}
        self._server_gaps: list[float] = []  # arrival gaps (s) of the server's decode tokens, last generation
        self._server_runs: list[tuple[int, float, float]] = []  # Load lab: (concurrency, mean TPOT ms, system tok/s)
        self._font = QtGui.QFont()
        self._font.setPointSize(FONT_PT)
        self._building = True
        self._build()
        self.refresh_this_machine()
        if bridge.cfg is not None:
            self._on_model_loaded(bridge.info)
        self._building = False
        self.set_seed_example()
        if bridge.info is None:
            self.help_text = f"{type(self).help_text} {self.seed_help()}"

    def _on_this_machine(self, _answer: object) -> None:
        self.refresh_this_machine()  # the engine answered a look-up or measured: the policy's answer may change

    # ---- widgets -------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.model_combo = QtWidgets.QComboBox()
        for key, cfg in self.models.items():
            self.model_combo.addItem(cfg.name, key)
        self.model_combo.setToolTip("Catalogue model, or the model loaded in the app")
        self.hw_combo = QtWidgets.QComboBox()
        for key, hw in self.hardware.items():
            self.hw_combo.addItem(hw.label, key)
        self.hw_combo.setToolTip("Catalogue chip (vendor datasheet), or this machine as measured")
        for combo in (self.model_combo, self.hw_combo):
            combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(9)  # the panel shares the labs' column: keep it narrow
        self.dtype_combo = QtWidgets.QComboBox()
        for text, key in DTYPES:
            self.dtype_combo.addItem(text, key)
        self.dtype_combo.setToolTip("Number format of the weights and of the KV cache")
        self.context_spin = self._spin(1, 1_048_576, 4096, "Tokens each sequence holds (prompt + output)")
        self.batch_spin = self._spin(1, 65_536, 1, "Sequences decoded together in one step")
        self.prompt_spin = self._spin(1, 1_048_576, 512, "Prompt length for the TTFT estimate (at most the context)")
        self.seed_button = QtWidgets.QPushButton("Seed example")
        self.seed_button.setToolTip("Llama-2-70B, H100 SXM, fp16, context 4096, batch 1")
        self.seed_button.clicked.connect(self.set_seed_example)
        for combo in (self.model_combo, self.hw_combo, self.dtype_combo):
            combo.currentIndexChanged.connect(self._on_input_changed)
        for spin in (self.context_spin, self.batch_spin, self.prompt_spin):
            spin.valueChanged.connect(self._on_input_changed)
        self.dtype_combo.currentIndexChanged.connect(lambda _i: self.refresh_this_machine())

        inputs = QtWidgets.QGridLayout()
        inputs.setContentsMargins(0, 0, 0, 0)
        inputs.setHorizontalSpacing(6)
        inputs.setVerticalSpacing(3)
        inputs.addWidget(QtWidgets.QLabel("Model"), 0, 0)
        inputs.addWidget(self.model_combo, 0, 1)
        inputs.addWidget(QtWidgets.QLabel("Chip"), 0, 2)
        inputs.addWidget(self.hw_combo, 0, 3)
        inputs.addWidget(QtWidgets.QLabel("dtype"), 0, 4)
        inputs.addWidget(self.dtype_combo, 0, 5)
        inputs.addWidget(QtWidgets.QLabel("Context"), 1, 0)
        inputs.addWidget(self.context_spin, 1, 1)
        inputs.addWidget(QtWidgets.QLabel("Batch"), 1, 2)
        inputs.addWidget(self.batch_spin, 1, 3)
        inputs.addWidget(QtWidgets.QLabel("Prompt"), 1, 4)
        inputs.addWidget(self.prompt_spin, 1, 5)
        inputs.addWidget(self.seed_button, 0, 6, 2, 1)
        inputs.setColumnStretch(1, 2)
        inputs.setColumnStretch(3, 3)

        self.fits_label = QtWidgets.QLabel("")
        self.fits_label.setWordWrap(True)
        self.fits_label.setTextFormat(QtCore.Qt.TextFormat.RichText)

        # One row per output of estimate(): a caption and a selectable value.
        self.values: dict[str, QtWidgets.QLabel] = {}
        grid = QtWidgets.QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(1)
        rows = (
            ("params", "parameters"), ("weights", "weights"), ("kv_token", "KV cache per token"),
            ("kv_total", "KV cache total"), ("max_batch", "largest batch"), ("max_context", "longest context"),
            ("intensity", "decode intensity"), ("ridge", "ridge point"), ("tpot_floor", "TPOT floor"),
            ("tpot", "TPOT (roofline)"), ("per_stream", "tokens/s per stream"), ("system", "tokens/s system"),
            ("ttft", "TTFT estimate"), ("measured", "TPOT measured"),
        )
        self.captions: dict[str, QtWidgets.QLabel] = {}
        for r, (key, caption) in enumerate(rows):
            cap = QtWidgets.QLabel(caption)
            cap.setStyleSheet(f"color: {MUTED};")
            val = QtWidgets.QLabel("–")
            val.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
            grid.addWidget(cap, r, 0, QtCore.Qt.AlignmentFlag.AlignLeft)
            grid.addWidget(val, r, 1, QtCore.Qt.AlignmentFlag.AlignLeft)
            self.captions[key], self.values[key] = cap, val
        grid.setColumnStretch(1, 1)
        grid.setRowStretch(len(rows), 1)
        results = QtWidgets.QWidget()
        results.setLayout(grid)
        results.setSizePolicy(QtWidgets.QSizePolicy.Policy.Minimum, QtWidgets.QSizePolicy.Policy.Preferred)
        self.values["system"].setStyleSheet(f"color: {SYSTEM_COLOR}; font-weight: bold;")
        self.values["tpot_floor"].setStyleSheet(f"color: {DECODE_COLOR}; font-weight: bold;")

        self.hw_label = QtWidgets.QLabel("")
        self.hw_label.setWordWrap(True)
        self.hw_label.setStyleSheet(f"color: {MUTED};")

        self._build_plot()
        body = QtWidgets.QHBoxLayout()
        body.setContentsMargins(0, 0, 0, 0)
        body.addWidget(results, 0)
        body.addWidget(self.plot, 1)

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(4)
        layout.addLayout(inputs)
        layout.addWidget(self.fits_label)
        layout.addLayout(body, 1)
        layout.addWidget(self.hw_label)

    def _spin(self, lo: int, hi: int, value: int, tip: str) -> QtWidgets.QSpinBox:
        s = QtWidgets.QSpinBox()
        s.setRange(lo, hi)
        s.setValue(value)
        s.setGroupSeparatorShown(True)
        s.setKeyboardTracking(False)  # typing "4096" is one change, not four
        s.setToolTip(tip)
        return s

    def _build_plot(self) -> None:
        """TPOT floor (left axis, ms) and system tokens/s (right axis) against batch, both log-scaled."""
        self.plot = pg.PlotWidget(background=BACKGROUND)
        self.plot.setMinimumWidth(220)
        pi = self.plot.getPlotItem()
        style_plot(pi, left=("TPOT ms: floor ─, roofline ┄", None), bottom=("batch size", None),
                   right=("system tokens/s", None), log=(True, True), mouse=False,
                   colors={"left": DECODE_COLOR, "right": SYSTEM_COLOR})
        pi.getAxis("bottom").setTicks([[(math.log10(b), str(b)) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)], []])
        self.tpot_curve = pi.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=2))
        # The roofline estimate, max(compute, memory): it leaves the floor once a step turns compute-bound.
        self.tpot_estimate_curve = pi.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=1.5,
                                                                style=QtCore.Qt.PenStyle.DashLine))
        # The second y axis: its own ViewBox, x-linked to the main one, kept on top of it on every resize.
        self.vb2 = pg.ViewBox()
        self.vb2.setMouseEnabled(False, False)
        pi.scene().addItem(self.vb2)
        pi.getAxis("right").linkToView(self.vb2)
        pi.getAxis("right").setLogMode(False, True)
        self.vb2.setXLink(pi.getViewBox())
        self.system_curve = pg.PlotDataItem([], [], pen=pg.mkPen(SYSTEM_COLOR, width=2))
        self.system_curve.setLogMode(True, True)
        self.vb2.addItem(self.system_curve)
        self.current_tpot = pi.plot([], [], pen=None, symbol="o", symbolSize=9, symbolBrush=DECODE_COLOR,
                                    symbolPen=pg.mkPen(BACKGROUND))
        self.current_system = pg.PlotDataItem([], [], pen=None, symbol="o", symbolSize=9, symbolBrush=SYSTEM_COLOR,
                                              symbolPen=pg.mkPen(BACKGROUND))
        self.current_system.setLogMode(True, True)
        self.vb2.addItem(self.current_system)
        self.measured_tpot = pi.plot([], [], pen=None, symbol="star", symbolSize=13, symbolBrush=DECODE_COLOR,
                                     symbolPen=pg.mkPen("#ffffff", width=1))
        self.measured_system = pg.PlotDataItem([], [], pen=None, symbol="star", symbolSize=13,
                                               symbolBrush=SYSTEM_COLOR, symbolPen=pg.mkPen("#ffffff", width=1))
        self.measured_system.setLogMode(True, True)
        self.vb2.addItem(self.measured_system)
        self.batch_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(MUTED, width=1, style=QtCore.Qt.PenStyle.DotLine))
        pi.addItem(self.batch_line)
        self.limit_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(ERROR_COLOR, width=1.5,
                                                                 style=QtCore.Qt.PenStyle.DashLine))
        pi.addItem(self.limit_line)
        self.limit_text = pg.TextItem("", color=ERROR_COLOR, anchor=(1, 0))
        self.limit_text.setFont(self._font)
        pi.addItem(self.limit_text)
        pi.getViewBox().sigResized.connect(self._sync_views)

    def _sync_views(self) -> None:
        self.vb2.setGeometry(self.plot.getPlotItem().getViewBox().sceneBoundingRect())
        self.vb2.linkedViewChanged(self.plot.getPlotItem().getViewBox(), self.vb2.XAxis)

    # ---- choices -------------------------------------------------------------------------------------------------
    def refresh_this_machine(self) -> None:
        """Offer "this machine" when engine.costs.hardware's one policy finds a measurement for the chosen dtype
        (reading the cache never measures)."""
        info = self.bridge.info
        hw = self.bridge.this_machine(  # the engine's answer; None until it comes (sig_this_machine)
            info.device if info is not None else "cpu", self.dtype())
        i = self.hw_combo.findData(THIS_MACHINE)
        if hw is None:
            if i >= 0 and self.hw_combo.currentIndex() != i:
                self.hw_combo.removeItem(i)
                self.hardware.pop(THIS_MACHINE, None)
            return
        changed = self.hardware.get(THIS_MACHINE) != hw
        self.hardware[THIS_MACHINE] = hw
        if i < 0:
            self.hw_combo.insertItem(0, f"This machine (measured): {hw.label}", THIS_MACHINE)
        elif changed and self.hw_combo.currentIndex() == i and not self._building:
            self.recompute()

    @guarded
    def showEvent(self, event: QtGui.QShowEvent) -> None:  # noqa: N802 — Qt's name
        """A measurement taken meanwhile (Roofline panel) shows up when the panel is shown again."""
        self.refresh_this_machine()
        super().showEvent(event)

    def model_config(self) -> ModelConfig:
        key = self.model_combo.currentData()
        if key == LOADED and self.bridge.cfg is not None:
            return self.bridge.cfg
        return self.models[key]

    def chip(self) -> Hardware:
        return self.hardware[self.hw_combo.currentData()]

    def dtype(self) -> str:
        return self.dtype_combo.currentData()

    def select(self, *, model: str | None = None, hardware: str | None = None, dtype: str | None = None,
               context: int | None = None, batch: int | None = None, prompt: int | None = None) -> None:
        """Set several inputs at once and recompute once (keys as in the catalogues, dtype as in DTYPES)."""
        self._building = True
        try:
            for combo, key in ((self.model_combo, model), (self.hw_combo, hardware), (self.dtype_combo, dtype)):
                if key is None:
                    continue
                i = combo.findData(key)
                if i < 0:
                    raise ValueError(f"unknown choice {key!r}")
                combo.setCurrentIndex(i)
            for spin, value in ((self.context_spin, context), (self.batch_spin, batch), (self.prompt_spin, prompt)):
                if value is not None:
                    spin.setValue(int(value))
        finally:
            self._building = False
        self.recompute()

    def set_seed_example(self) -> None:
        """The seed's worked example: Llama-2-70B in fp16 on an H100 SXM, context 4096, batch 1."""
        self.select(**SEED_EXAMPLE)

    # ---- events --------------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_model_loaded(self, info: ModelInfo | None) -> None:
        cfg = self.bridge.cfg
        if cfg is None:
            return
        i = self.model_combo.findData(LOADED)
        text = f"{cfg.name} (loaded)"
        if i < 0:
            self.model_combo.insertItem(0, text, LOADED)
        else:
            self.model_combo.setItemText(i, text)
        self.refresh_this_machine()
        if self.model_combo.currentData() == LOADED:
            self.recompute()

    @QtCore.Slot(object)
    def _on_server_connected(self, _info: object = None) -> None:
        self._server_gaps, self._server_runs = [], []
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_prompt(self, _ev: object) -> None:
        self._server_gaps = []
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_token(self, ev: object) -> None:
        src = self.bridge.run_source
        if src is not None and src.measured_by_server and ev.phase == "decode":
            self._server_gaps.append(ev.seconds)  # 0 inside a chunk: the chunk's gap covers its tokens
            self.mark_dirty()

    @QtCore.Slot(object)
    def _on_serve_run(self, run: dict) -> None:
        if run.get("completed") and run.get("mean_tpot_ms"):
            self._server_runs.append((int(run["concurrency"] or 1), float(run["mean_tpot_ms"]),
                                      float(run["output_throughput"])))
            self.mark_dirty()

    def measured_tpot_s(self) -> float | None:
        """The server's mean TPOT in its last generation (None before one with two or more timed tokens)."""
        total = sum(self._server_gaps)
        return total / len(self._server_gaps) if self._server_gaps and total > 0 else None

    def measured_points(self) -> list[tuple[float, float, float | None]]:
        """(batch, TPOT ms, system tok/s or None) the server measured: its last generation, then Load lab levels."""
        pts: list[tuple[float, float, float | None]] = []
        tpot = self.measured_tpot_s()
        if tpot is not None:
            pts.append((1.0, tpot * 1e3, None))
        pts += [(float(c), t, s) for c, t, s in self._server_runs]
        return pts

    def _on_input_changed(self, *_args: object) -> None:
        if not self._building:
            self.recompute()

    # ---- numbers -------------------------------------------------------------------------------------------------
    def recompute(self) -> None:
        """Run estimate() for the current inputs and the batch sweep of the plot; the widgets update on draw()."""
        context = self.context_spin.value()
        if self.prompt_spin.value() > context:
            self._building = True
            self.prompt_spin.setValue(context)
            self._building = False
        cfg, hw, dtype = self.model_config(), self.chip(), self.dtype()
        try:
            self.result = estimate(cfg, hw, dtype, context, self.batch_spin.value(), self.prompt_spin.value())
            self.error = ""
        except (KeyError, ValueError) as e:
            self.result, self.error = None, str(e)
        self.sweep = {}
        if self.result is not None:
            batches = sweep_batches()
            rows = [estimate(cfg, hw, dtype, context, int(b), self.prompt_spin.value()) for b in batches]
            self.sweep = {
                "batch": batches.astype(float),
                "tpot_floor_ms": np.array([r["tpot_floor_s"] * 1e3 for r in rows]),
                "tpot_ms": np.array([r["tpot_estimate_s"] * 1e3 for r in rows]),
                "system": np.array([r["tokens_per_s_system"] for r in rows]),
            }
        self.mark_dirty()

    # ---- drawing -------------------------------------------------------------------------------------------------
    def draw(self) -> None:
        r = self.result
        if r is None:
            self.fits_label.setText(f"<span style='color:{ERROR_COLOR}'>{self.error}</span>")
            for v in self.values.values():
                v.setText("–")
            for item in (self.tpot_curve, self.tpot_estimate_curve, self.system_curve, self.current_tpot,
                         self.current_system, self.measured_tpot, self.measured_system):
                item.setData([], [])
            return
        self._draw_numbers(r)
        self._draw_plot(r)

    def _draw_numbers(self, r: dict[str, Any]) -> None:
        mem, total = r["memory_bytes"], r["total_bytes"]
        if r["fits"]:
            fits = (f"<b style='color:{OK_COLOR}'>✔ Fits</b>: weights + KV cache = {fmt_bytes(total)} of "
                    f"{fmt_bytes(mem)} ({total / mem:.0%})")
        else:
            chips = math.ceil(total / mem)
            fits = (f"<b style='color:{ERROR_COLOR}'>✘ Does not fit</b>: weights + KV cache = {fmt_bytes(total)}, "
                    f"the chip has {fmt_bytes(mem)} (needs the memory of ≥ {chips} such chips)")
        if r["context_exceeds_model"]:
            fits += (f"<br><span style='color:{WARNING_COLOR}'>context {r['context']:,} is past the model's "
                     f"{r['model_context_length']:,} positions</span>")
        self.fits_label.setText(fits)

        bound = "memory-bound" if r["memory_bound_decode"] else "compute-bound"
        pbound = "compute-bound" if r["compute_bound_prefill"] else "memory-bound"
        limit = "model's limit" if r["max_context_limited_by"] == "model" else "memory"
        v = self.values
        v["params"].setText(f"{r['n_params'] / 1e9:,.3f} B" if r["n_params"] >= 1e9
                            else f"{r['n_params'] / 1e6:,.1f} M")
        v["weights"].setText(f"{fmt_bytes(r['weights_bytes'])}  ({r['dtype']})")
        v["kv_token"].setText(fmt_bytes(r["kv_bytes_per_token"]))
        v["kv_total"].setText(f"{fmt_bytes(r['kv_bytes'])}  ({r['context']:,} tokens × {r['batch']:,})")
        v["max_batch"].setText(f"{r['max_batch_at_context']:,} at context {r['context']:,}")
        v["max_context"].setText(f"{r['max_context_at_batch']:,} at batch {r['batch']:,} ({limit})")
        v["intensity"].setText(f"{r['arithmetic_intensity']:,.2f} FLOP/byte → {bound}")
        v["ridge"].setText(f"{r['ridge_point']:,.1f} FLOP/byte")
        v["tpot_floor"].setText(f"{r['tpot_floor_s'] * 1e3:,.2f} ms  ({fmt_bytes(r['decode_bytes'])} / step)")
        v["tpot"].setText(fmt_seconds(r["tpot_estimate_s"]))
        v["per_stream"].setText(fmt_rate(r["tokens_per_s_per_stream"]))
        v["system"].setText(fmt_rate(r["tokens_per_s_system"]))
        v["ttft"].setText(f"{fmt_seconds(r['ttft_estimate_s'])}  ({r['prompt_tokens']:,} tokens, {pbound})")
        server, tpot = self.bridge.run_server, self.measured_tpot_s()
        if server is None:
            v["measured"].setText("– (File → Connect to server…)")
        elif tpot is None:
            v["measured"].setText(f"– (generate on {server.model} to measure it)")
        else:
            v["measured"].setText(f"{tpot * 1e3:,.2f} ms  ({server.model} on the server, batch 1, "
                                  f"{len(self._server_gaps)} tokens)")
        self.values["measured"].setStyleSheet(f"color: {DECODE_COLOR};" if tpot is not None else "")
        colour = OK_COLOR if r["fits"] else ERROR_COLOR
        for key in ("weights", "kv_total"):
            self.captions[key].setStyleSheet(f"color: {colour};")
        src = "measured here" if r["hardware_measured"] else r["hardware_source"]
        self.hw_label.setText(f"{r['hardware_label']}: {fmt_flops(r['peak_flops'])} ({r['dtype']}), "
                              f"{fmt_bandwidth(r['bandwidth_bytes_per_s'])}, {fmt_bytes(r['memory_bytes'])} — {src}")
        self.hw_label.setToolTip(r["hardware_source"])

    def _draw_plot(self, r: dict[str, Any]) -> None:
        s = self.sweep
        b = s["batch"]
        self.tpot_curve.setData(b, s["tpot_floor_ms"])
        self.tpot_estimate_curve.setData(b, s["tpot_ms"])
        self.system_curve.setData(b, s["system"])
        batch = r["batch"]
        self.current_tpot.setData([batch], [r["tpot_floor_s"] * 1e3])
        self.current_system.setData([batch], [r["tokens_per_s_system"]])
        pts = self.measured_points()
        self.measured_tpot.setData([p[0] for p in pts], [p[1] for p in pts])
        sys_pts = [p for p in pts if p[2]]
        self.measured_system.setData([p[0] for p in sys_pts], [p[2] for p in sys_pts])
        x_lo, x_hi = -0.05, math.log10(max(SWEEP_MAX_BATCH, batch)) + 0.05
        pi = self.plot.getPlotItem()
        self.batch_line.setPos(math.log10(batch))
        tp = self._log_range(np.concatenate([s["tpot_floor_ms"], s["tpot_ms"], [p[1] for p in pts]]))
        sy = self._log_range(np.concatenate([s["system"], [r["tokens_per_s_system"]], [p[2] for p in sys_pts]]))
        pi.getViewBox().setRange(xRange=(x_lo, x_hi), yRange=tp, padding=0)
        self.vb2.setRange(yRange=sy, padding=0)
        pi.getAxis("left").setTicks([log_ticks(*tp), []])
        pi.getAxis("right").setTicks([log_ticks(*sy), []])
        max_batch = r["max_batch_at_context"]
        if max_batch < 1 or max_batch < SWEEP_MAX_BATCH:
            x = math.log10(max(max_batch, 1))
            self.limit_line.setVisible(True)
            self.limit_line.setPos(x)
            self.limit_text.setText("nothing fits" if max_batch < 1 else f"memory full\nB > {max_batch:,}")
            self.limit_text.setAnchor((0, 0) if max_batch < 1 or x < 0.6 * x_hi else (1, 0))
            self.limit_text.setPos(x, tp[1])
        else:
            self.limit_line.setVisible(False)
            self.limit_text.setText("")
        self._sync_views()

    @staticmethod
    def _log_range(values: np.ndarray) -> tuple[float, float]:
        """A log10 range around the values, at least a factor 2 wide so a flat curve is not blown up."""
        lo, hi = math.log10(float(np.min(values))), math.log10(float(np.max(values)))
        mid, half = (lo + hi) / 2, max((hi - lo) / 2, math.log10(2) / 2)
        return mid - half * 1.1, mid + half * 1.1


PANEL = CapacityPanel
