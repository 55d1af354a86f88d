"""Timeline: where the time of one generation went — one bar for the prefill (its time is TTFT), then one bar per
decode step — with TTFT, TPOT (mean, p50, p90), tokens/s and the latency formula next to the measured total.
The statistics are the plot's title, so they land in an exported PNG or SVG too.

A draw costs the same at step 8,000 as at step 80: the bars are one item with one brush (pyqtgraph then draws
every rectangle in one call; a brush and a pen per bar drew them one by one in Python), the prefill's colour and
the selected step's outline are one bar each on top, and the steps' times are kept in arrays that grow as tokens
arrive.
"""

from __future__ import annotations

import html
import os

import numpy as np
import pyqtgraph as pg
import pyqtgraph.exporters  # noqa: F401  (registers pg.exporters)
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.panels.base import Bars, Panel
from app.theme import (
    ACCENT,
    BACKGROUND,
    COUNT_STEPS,
    DECODE_COLOR,
    FOREGROUND,
    MUTED,
    PREFILL_COLOR,
    placeholder,
    set_title,
    show_empty,
    stepped_bound,
    style_plot,
)
from app.units import fmt_bytes, fmt_kernels
from engine.costs import formulas as costs
from engine.events import Finished, ModelInfo, PromptTokenized, TokenSampled
from engine.model.config import ModelConfig

FONT_PT = 9
EXPORT_WIDTH = 1600
EXPORT_FORMATS = (".png", ".svg")
EMPTY_STEPS = (-0.6, 16.6)  # the axes before the first generation: 16 steps of up to 100 ms
EMPTY_SECONDS = (0.0, 0.1)


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 1.0 else f"{seconds:,.2f} s"


BARS_PER_PIXEL = 2  # past this many steps per pixel of the plot's width, neighbouring steps share a bar


def bars_for(steps: np.ndarray, secs: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray, float | np.ndarray]:
    """(x, height, width) of the bars for these steps: one bar a step while they are at most `most`, else groups of
    neighbouring steps as one bar each, as tall as the group's longest step (a stall stays visible). A plot cannot
    show more bars than its pixels, and painting thousands of them cost the GUI thread more the longer the run."""
    n = len(steps)
    if n <= most:
        return steps, secs, 0.8
    k = -(-n // most)  # steps per bar
    m = -(-n // k)
    padded = np.full(m * k, -np.inf)
    padded[:n] = secs
    first = steps[::k]
    last = steps[np.minimum(np.arange(m) * k + k - 1, n - 1)]
    return (first + last) / 2, padded.reshape(m, k).max(axis=1), (last - first) + 0.8


class TimelinePanel(Panel):
    title = "Timeline"
    object_name = "panel_timeline"
    shortcut = "Alt+7"
    subscriptions = {
        "sig_prompt": "_on_prompt",
        "sig_token": "_on_token",
        "sig_finished": "_on_finished",
        "sig_step_selected": "_on_step_selected",
        "sig_server_metrics": "_on_server_metrics",
    }
    help_text = (
        "Where the time goes. The first bar is the prefill: the whole prompt in one forward pass, which also "
        "yields the first token. Its duration is the time to first token (TTFT), and it grows with the prompt "
        "length. Every later bar is one decode step: one forward pass for one new token. Its duration is the time "
        "per output token (TPOT), shown as the mean, the median (p50) and the 90th percentile (p90). The speed "
        "one stream feels is 1 / TPOT tokens per second. The total a user waits for n tokens is latency = TTFT + "
        "(n − 1) · TPOT, shown next to the measured total. Each decode step streams every weight plus the KV "
        "cache from memory, so TPOT is set mostly by memory bandwidth, not by arithmetic. Click a bar to select "
        "that step in every panel; Export saves the plot with its numbers as PNG or SVG."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        # the bytes its kernels read (a quantized form's where one runs), else every weight at its dtype
        weights = info.decode_weight_bytes or costs.step_weight_bytes(cfg, info.dtype, rows=1)
        text = (f"On {info.name} in {info.dtype} with {fmt_kernels(info.kernels)} each decode step streams about "
                f"{fmt_bytes(weights)} of weights, "
                f"plus {fmt_bytes(costs.kv_bytes_per_token(cfg, info.dtype))} of KV cache per token of context")
        if not cfg.n_local_layers:
            return text + "."
        w = cfg.sliding_window  # past the window only the global layers' keys and values keep growing
        beyond = costs.kv_bytes(cfg, info.dtype, w + 1)[0] - costs.kv_bytes(cfg, info.dtype, w)[0]
        return (text + f" up to {w:,} tokens; beyond that its {cfg.n_local_layers} local layers read only their "
                f"window, so each further token adds {fmt_bytes(beyond)} (its {cfg.n_global_layers} global "
                f"layer{'s' if cfg.n_global_layers != 1 else ''}).")

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self._seconds: dict[int, float] = {}
        self._x, self._h, self._n = np.zeros(0), np.zeros(0), 0
        self._finished: Finished | None = None
        self._selected: int | None = None
        self._stepped = False
        self._run_info: ModelInfo | None = None  # the model the shown run ran on: its name, dtype and kernel mode
        self._font = QtGui.QFont()
        self._font.setPointSize(FONT_PT)
        self._build()
        self.server_metrics = None  # engine.remote.metrics.ServerMetrics: the server's own TTFT/ITL means
        self.mark_dirty()

    def _build(self) -> None:
        self.plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.plot.getPlotItem()
        style_plot(pi, left=("time", "s"), bottom=("step (0 = prefill)", None), grid=(False, True))
        self.bars = Bars(x=[], height=[], width=0.8, brush=DECODE_COLOR, pen=None)
        pi.addItem(self.bars)
        self.prefill_bar = Bars(x=[], height=[], width=0.8, brush=PREFILL_COLOR, pen=None)
        pi.addItem(self.prefill_bar)
        self.selected_bar = Bars(x=[], height=[], width=0.8, brush=None, pen=pg.mkPen(ACCENT, width=2.5))
        pi.addItem(self.selected_bar)
        # the mean's dashed line is keyed in the title (stats_text), not labelled in the plot where bars of about
        # the mean's height would run through the label
        self.tpot_line = pg.InfiniteLine(angle=0, pen=pg.mkPen(ACCENT, width=1, style=QtCore.Qt.PenStyle.DashLine))
        self.tpot_line.setVisible(False)
        pi.addItem(self.tpot_line)
        self.empty_note = placeholder(pi)
        self.plot.scene().sigMouseClicked.connect(self._on_clicked)
        self.export_button = QtWidgets.QPushButton("Export…")
        self.export_button.setToolTip("Save this timeline as PNG or SVG")
        self.export_button.clicked.connect(self._export_dialog)
        self.hint = QtWidgets.QLabel("Click a bar to select that step.")
        row = QtWidgets.QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.hint, 1)
        row.addWidget(self.export_button)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addWidget(self.plot, 1)
        layout.addLayout(row)

    # ---- events ------------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_prompt(self, _ev: PromptTokenized) -> None:
        self.clear()
        self._run_info = self.bridge.info  # a session's facts while it is replayed (app.session_io.replay)

    @QtCore.Slot(object)
    def _on_token(self, ev: TokenSampled) -> None:
        if ev.step == self._n and ev.step not in self._seconds:  # the next step, as they arrive: append
            if self._n == len(self._x):
                self._x = np.resize(self._x, 2 * self._n + 64)
                self._h = np.resize(self._h, 2 * self._n + 64)
            self._x[self._n], self._h[self._n] = ev.step, ev.seconds
            self._n += 1
        else:
            self._n = -1  # out of order: the arrays are rebuilt from the dict at the next draw
        self._seconds[ev.step] = ev.seconds
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_finished(self, ev: Finished) -> None:
        self._finished = ev
        self.mark_dirty()

    @QtCore.Slot(int)
    def _on_step_selected(self, step: int) -> None:
        self._selected = step
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_server_metrics(self, item) -> None:
        self.server_metrics = item.metrics
        self.mark_dirty()

    def clear(self) -> None:
        self._seconds, self._finished, self._selected = {}, None, None
        self._stepped = False  # the plot's bounds follow this run in steps (stepped_bound), not the empty plot's
        self._x, self._h, self._n = np.zeros(0), np.zeros(0), 0  # steps and seconds in step order, `_n` of them
        super().clear()

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, seconds) in step order."""
        if self._n < 0:
            steps = sorted(self._seconds)
            self._x = np.asarray(steps, dtype=float)
            self._h = np.asarray([self._seconds[k] for k in steps], dtype=float)
            self._n = len(steps) if steps == list(range(len(steps))) else -1
            return self._x, self._h
        return self._x[: self._n], self._h[: self._n]

    def _on_clicked(self, event) -> None:
        if event.button() != QtCore.Qt.MouseButton.LeftButton or not self._seconds:
            return
        vb = self.plot.getPlotItem().getViewBox()
        if not vb.sceneBoundingRect().contains(event.scenePos()):
            return
        step = int(round(vb.mapSceneToView(event.scenePos()).x()))
        if step in self._seconds:
            self.bridge.select_step(step)

    # ---- statistics ----------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """TTFT, TPOT mean/p50/p90, tokens/s, the formula's latency and the measured total (0 until finished)."""
        steps, secs = self._arrays()
        ttft = self._seconds.get(0, 0.0)
        decode = secs[steps > 0]
        if self._finished is not None:
            ttft = self._finished.ttft_s
            decode = np.asarray(self._finished.step_seconds, dtype=float)
        tpot = float(decode.mean()) if decode.size else 0.0
        n = 1 + decode.size
        return {
            "ttft_s": ttft,
            "tpot_s": tpot,
            "tpot_p50_s": float(np.percentile(decode, 50)) if decode.size else 0.0,
            "tpot_p90_s": float(np.percentile(decode, 90)) if decode.size else 0.0,
            "tokens_per_s": 1.0 / tpot if tpot > 0 else 0.0,
            "n_tokens": n,
            "latency_formula_s": ttft + (n - 1) * tpot,
            "measured_total_s": self._finished.total_s if self._finished is not None else 0.0,
        }

    def stats_text(self) -> str:
        if not self._seconds:
            return "Generate to see the timeline"
        s = self.stats()
        measured = (f"measured {fmt_s(s['measured_total_s'])}" if self._finished is not None else "running…")
        outside = self._finished.outside_steps_s if self._finished is not None else 0.0
        # where the rest of the measured total went, never left for the reader to wonder about
        outside_line = (f"<br>of which {fmt_s(outside)} outside the steps (captures, logit lens)"
                        if outside >= 0.01 * max(s["measured_total_s"], 1e-9) else "")
        measured = measured.replace(" ", "&nbsp;")  # a narrow dock wraps between phrases, not inside them
        return (  # short lines, so the title fits a narrow dock (a test holds it to 340 px)
            self._ran_on()
            + f"<span style='color:{PREFILL_COLOR}'>■</span> TTFT <b>{fmt_s(s['ttft_s'])}</b> &nbsp; "
            f"<span style='color:{DECODE_COLOR}'>■</span> TPOT <b>{fmt_s(s['tpot_s'])}</b> &nbsp; "
            f"<b>{s['tokens_per_s']:.1f}&nbsp;tok/s</b><br>"
            f"TPOT p50 {fmt_s(s['tpot_p50_s'])} · p90 {fmt_s(s['tpot_p90_s'])}"
            + (f" · <span style='color:{ACCENT}'><b>- - -</b></span>&nbsp;mean" if s["tpot_s"] > 0 else "")
            + f"<br>TTFT + {s['n_tokens'] - 1}·TPOT = <b>{fmt_s(s['latency_formula_s'])}</b> · {measured}"
            + outside_line + self._server_line()
        )

    def _ran_on(self) -> str:
        """The header's first line: what computed these times, the model's dtype and kernel mode ("" for a
        server's run, which _server_line names, or a run whose model is not known)."""
        src, info = self.bridge.run_source, self._run_info
        if info is None or (src is not None and src.measured_by_server):
            return ""
        text = html.escape(f"{info.name} · {info.dtype} · {fmt_kernels(info.kernels)} on {info.device}", quote=False)
        return f"<span style='color:{MUTED}'>{text}</span><br>"

    def _server_line(self) -> str:
        """On a server: bars are chunk arrival gaps (0 for the later tokens of a chunk), beside its own means."""
        src, server = self.bridge.run_source, self.bridge.run_server
        if src is None or not src.measured_by_server:
            return ""
        m = self.server_metrics if server is not None else None
        own = ("" if m is None or m.mean_ttft_s is None else
               f" · its /metrics since start: TTFT {fmt_s(m.mean_ttft_s)}, ITL {fmt_s(m.mean_itl_s or 0.0)}")
        return f"<br>{server.kind if server is not None else src.name}: times from chunk arrivals{own}"

    # ---- drawing -----------------------------------------------------------------------------------------------
    def draw(self) -> None:
        steps, secs = self._arrays()
        x, h, w = bars_for(steps, secs, max(1, BARS_PER_PIXEL * self.plot.width()))
        self.bars.setOpts(x=x, height=h, width=w)
        for bar, step in ((self.prefill_bar, 0), (self.selected_bar, self._selected)):
            t = self._seconds.get(step) if step is not None else None
            bar.setOpts(x=[step] if t is not None else [], height=[t] if t is not None else [], width=0.8)
        s = self.stats()
        self.tpot_line.setVisible(s["tpot_s"] > 0)
        self.tpot_line.setPos(s["tpot_s"])
        pi = self.plot.getPlotItem()
        set_title(pi, self.stats_text(), self.plot.width(), size=f"{FONT_PT}pt", color=FOREGROUND)
        if len(steps):
            self.empty_note.setVisible(False)
            # the steps' axis grows in steps; the seconds' axis fits the longest bar, which seldom changes
            x1 = stepped_bound(steps.max() + 0.6, pi.getViewBox().viewRange()[0][1] if self._stepped else None,
                               headroom=1.0, steps=COUNT_STEPS)
            self._stepped = True
            pi.getViewBox().setRange(xRange=(-0.6, x1), yRange=(0, secs.max() * 1.08), padding=0)
        else:
            self._stepped = False
            show_empty(pi, self.empty_note, "Generate: one bar for the prefill (its time is TTFT),\n"
                       "then one bar per decode step (TPOT)", EMPTY_STEPS, EMPTY_SECONDS)

    def bar_data(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, seconds) of the bars shown (on a run longer than the plot has pixels for, each bar is the
        longest step of its group: bars_for)."""
        return np.asarray(self.bars.opts["x"], dtype=float), np.asarray(self.bars.opts["height"], dtype=float)

    # ---- export ------------------------------------------------------------------------------------------------
    def export(self, path: str) -> None:
        """Write the timeline (with its statistics) as PNG or SVG, chosen by the extension.

        Raises ValueError for another extension and OSError when the folder is missing or not writable.
        """
        path = os.fspath(path)
        ext = os.path.splitext(path)[1].lower()
        if ext not in EXPORT_FORMATS:
            raise ValueError(f"cannot export the timeline as {ext or 'a file without extension'!r}: "
                             f"use a name ending in .png or .svg")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise OSError(f"cannot export the timeline: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise OSError(f"cannot export the timeline: {path} is not writable")
        if os.path.isdir(path):
            raise OSError(f"cannot export the timeline: {path} is a folder")
        self.draw()
        pi = self.plot.getPlotItem()
        old = pi.geometry()
        small = old.width() < 600 or old.height() < 300
        if small:  # never laid out on screen (headless): give the plot a sensible size to render at
            pi.setGeometry(QtCore.QRectF(0, 0, 1000, 520))
            pi.layout.activate()
        try:
            if ext == ".png":
                exporter = pg.exporters.ImageExporter(pi)
                exporter.parameters()["width"] = max(EXPORT_WIDTH, 1200)
                exporter.parameters()["background"] = pg.mkColor(BACKGROUND)
            else:
                exporter = pg.exporters.SVGExporter(pi)
            exporter.export(path)
        finally:
            if small:
                pi.setGeometry(old)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise OSError(f"cannot export the timeline: nothing was written to {path}")

    def _export_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, "Export timeline", "timeline.png",
                                                        "PNG image (*.png);;SVG drawing (*.svg)")
        if not path:
            return
        try:
            self.export(path)
        except (OSError, ValueError) as e:
            QtWidgets.QMessageBox.warning(self, "Export timeline", str(e))


PANEL = TimelinePanel
