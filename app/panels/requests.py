"""Requests: the Load lab's requests as a Gantt, one row each (engine.remote.timeline draws nothing, it lays out).

Each row: sent at its left end, waiting (queued and prefilled: the client cannot split the two) until the first
token, then decoding, with one tick per chunk coloured by the gap before it (its inter-token latency). Where the
server exports spans, a thin bar under the row shows its own queue, prefill and decode. Click a row (or a table
line) for that request's tokens and timings. The requests arrive through sig_serve_request and are only stored here,
then drawn on the tick; a new run's first request clears the last run's.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app import theme
from app.bridge import Bridge
from app.panels.base import Bars, Panel
from engine.remote import timeline

MAX_TICKS = 60_000  # chunk ticks drawn at most (a long run's rows keep all theirs; only the drawing thins them)
SEGMENT_COLORS = {"waiting": theme.PREFILL_COLOR, "decode": theme.DECODE_COLOR, "failed": theme.ERROR_COLOR}
# the server's phases: the same hues, darker, so the thin bar under a row reads as another account of it
SERVER_COLORS = {"queue": theme.MUTED, "prefill": "#9a6a24", "decode": "#2c7399"}
TABLE = (("#", "number"), ("C", "concurrency"), ("ok", "ok"), ("sent s", "sent_s"), ("TTFT ms", "ttft_ms"),
         ("TPOT ms", "tpot_ms"), ("E2EL ms", "e2el_ms"), ("out", "output_tokens"), ("ITL max ms", "itl_max_ms"),
         ("srv queue", "server_queue_ms"), ("srv prefill", "server_prefill_ms"), ("srv TTFT", "server_ttft_ms"),
         ("srv E2EL", "server_e2el_ms"), ("id", "request_id"))
ROW_HEIGHT = 0.7  # of a row's 1.0: the client bar; the server's phases sit under it
SERVER_GAP = 0.04  # between the client's bar and the server's


def itl_colors(itl_s: np.ndarray, median_s: float) -> np.ndarray:
    """RGBA per gap: green at or under the run's median ITL, to red at 4 × the median and beyond."""
    if not len(itl_s):
        return np.zeros((0, 4), dtype=np.ubyte)
    x = np.clip((itl_s / median_s - 1.0) / 3.0, 0.0, 1.0) if median_s > 0 else np.zeros(len(itl_s))
    lo, hi = np.array([158, 206, 106]), np.array([247, 118, 142])
    rgb = lo[None, :] * (1 - x[:, None]) + hi[None, :] * x[:, None]
    return np.concatenate([rgb, np.full((len(x), 1), 255)], axis=1).astype(np.ubyte)


class RequestsPanel(Panel):
    title = "Requests"
    object_name = "panel_requests"
    shortcut = "Ctrl+Alt+8"
    subscriptions = {"sig_serve_request": "_on_request", "sig_serve_done": "_on_done",
                     "sig_serve_spans": "_on_spans"}
    help_text = (
        "Every request of the Load lab's last run as a row of a Gantt chart, in the order they were sent, on one "
        "time axis (s since the first was sent). Amber: waiting for the first token — queued, then the prompt's "
        "prefill (from the client the two cannot be told apart); blue: decoding, to the last token. TTFT is the "
        "amber part and E2EL the whole bar, the same figures the Load lab's table summarises. Each tick is one "
        "chunk of tokens arriving, coloured by the gap before it (its inter-token latency, ITL): green at the run's "
        "median ITL, red at four times it — stalls show where the server batched a new prompt's prefill with the "
        "running decodes. With a server that exports OpenTelemetry spans, a thin bar under each row is the "
        "server's own account: queue (grey), prefill (dark amber), decode (dark blue). Click a row for its tokens "
        "and timings. Export writes the requests as CSV, JSON (with every chunk's time) or a Perfetto trace "
        "(ui.perfetto.dev)."
    )

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.requests: list = []  # engine.remote.loadlab.RequestResult, as they finished
        self.bars: list[timeline.Bar] = []
        self.selected: int | None = None
        self._plain: list[dict] | None = None  # saved_results(), made once per change (every autosave asks)
        self._run_over = True  # the next request starts a new run
        self.span_problems: list[str] = []  # what the span receiver met (one line each)
        self.span_endpoint = ""
        self.status = "Run the Load lab: each request it sends shows here as a row."
        self._build()
        self.mark_dirty()

    def _build(self) -> None:
        self.status_label = QtWidgets.QLabel()
        self.status_label.setWordWrap(True)
        self.export_button = QtWidgets.QPushButton("Export…")
        self.export_button.clicked.connect(self._export_dialog)
        top = QtWidgets.QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.status_label, 1)
        top.addWidget(self.export_button)

        self.plot_widget = pg.PlotWidget(background=theme.BACKGROUND)
        p = self.plot = self.plot_widget.getPlotItem()
        p.setLabel("bottom", "s since the first request was sent")
        p.setLabel("left", "request")
        p.invertY(True)
        p.showGrid(x=True, y=False, alpha=0.2)
        self.segment_items = {}
        for kind in ("waiting", "decode", "failed"):
            item = Bars(x0=[], x1=[], y0=[], height=[], brush=SEGMENT_COLORS[kind], pen=None)
            p.addItem(item)
            self.segment_items[kind] = item
        self.server_items = {}
        for kind in ("queue", "prefill", "decode"):
            item = Bars(x0=[], x1=[], y0=[], height=[], brush=SERVER_COLORS[kind], pen=None)
            p.addItem(item)
            self.server_items[kind] = item
        self.ticks = pg.ScatterPlotItem(size=7, symbol="|", pxMode=True)
        p.addItem(self.ticks)
        self.highlight = Bars(x0=[], x1=[], y0=[], height=[], brush=None,
                                         pen=pg.mkPen(theme.ACCENT, width=2))
        p.addItem(self.highlight)
        self.plot_widget.scene().sigMouseClicked.connect(self._clicked)

        self.table = QtWidgets.QTableWidget(0, len(TABLE))
        self.table.setHorizontalHeaderLabels([h for h, _ in TABLE])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._table_selected)

        self.detail = QtWidgets.QPlainTextEdit()
        self.detail.setReadOnly(True)
        self.detail.setFont(QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont))
        self.detail.setPlaceholderText("Click a request for its tokens and timings.")

        lower = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        lower.addWidget(self.table)
        lower.addWidget(self.detail)
        lower.setSizes([500, 300])
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical)
        split.addWidget(self.plot_widget)
        split.addWidget(lower)
        split.setSizes([400, 200])
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(split, 1)

    # ---- slots (store only) ---------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_request(self, r) -> None:
        if self._run_over:
            self.requests, self.selected, self._run_over, self.span_problems = [], None, False, []
        self.requests.append(r)
        self._plain = None
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_spans(self, notice) -> None:
        """A level's requests again, with the server's spans: each replaces the one it was."""
        again = {(r.concurrency, r.index, r.request_id): r for r in notice.results}
        self.requests = [again.get((r.concurrency, r.index, r.request_id), r) for r in self.requests]
        self.span_problems = list(notice.problems)
        self.span_endpoint = notice.endpoint
        self._plain = None
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_done(self, _done) -> None:
        self._run_over = True
        self.mark_dirty()

    # ---- selection ------------------------------------------------------------------------------------------------
    def _clicked(self, event) -> None:
        if event.button() != QtCore.Qt.MouseButton.LeftButton:
            return
        vb = self.plot.getViewBox()
        if not vb.sceneBoundingRect().contains(event.scenePos()):
            return
        y = vb.mapSceneToView(event.scenePos()).y()
        self.select(int(math.floor(y + 0.5)))

    def _table_selected(self) -> None:
        rows = {i.row() for i in self.table.selectedItems()}
        if len(rows) == 1:
            n = rows.pop()
            if n != self.selected:
                self.select(n)

    def select(self, number: int | None) -> None:
        """Show request `number` (its row on the Gantt) in the detail; None or out of range: none."""
        if number is None or not 0 <= number < len(self.bars or timeline.bars(self.requests)):
            number = None
        self.selected = number
        self.mark_dirty()

    def detail_text(self, number: int) -> str:
        """Request `number`'s timings and each chunk's arrival, ITL and text."""
        bars = self.bars or timeline.bars(self.requests)
        b = bars[number]
        r = b.result
        lines = [f"request #{b.number} (level C={r.concurrency}, request {r.index} of its level)"
                 + (f", id {r.request_id}" if r.request_id else ""),
                 f"sent at {b.t0_s:.3f} s; " + (f"TTFT {b.ttft_s * 1e3:.1f} ms, E2EL {b.e2el_s * 1e3:.1f} ms, "
                                                f"TPOT {r.tpot_s * 1e3:.2f} ms, {r.output_tokens} tokens out, "
                                                f"{r.prompt_tokens} in" if r.ok else f"failed: {r.error}")]
        s = r.server
        if b.server:
            lines.append("server: " + ", ".join(f"{k} {(e - a) * 1e3:.1f} ms" for k, a, e in b.server)
                         + f"; its TTFT {s.ttft_s * 1e3:.1f} ms, E2EL {s.e2el_s * 1e3:.1f} ms"
                         if s.ttft_s is not None and s.e2el_s is not None else "")
            gaps = timeline.delivery(r)
            if gaps is not None:
                lines.append(f"the server's first token reached the client {gaps[0] * 1e3:.1f} ms after the server "
                             f"made it, its last {gaps[1] * 1e3:.1f} ms after; its engine saw the request "
                             f"{b.server[0][1] * 1e3:.1f} ms after it was sent")
        lines.append("")
        lines.append(f"{'chunk':>5} {'at ms':>9} {'ITL ms':>8} {'tok':>4}  text")
        times = b.token_times_s
        for k, t in enumerate(times):
            gap = f"{(t - times[k - 1]) * 1e3:8.1f}" if k else f"{'':>8}"
            n = r.chunk_tokens[k] if k < len(r.chunk_tokens) else 1
            text = r.pieces[k] if k < len(r.pieces) else ""
            lines.append(f"{k:>5} {t * 1e3:9.1f} {gap} {n:>4}  {json.dumps(text, ensure_ascii=False)}")
        if r.timeline_cut:
            lines.append(f"… the timeline keeps the first {len(times)} chunks")
        return "\n".join(lines)

    # ---- exports and sessions -------------------------------------------------------------------------------------
    def export(self, path: str) -> None:
        """CSV (one row per request), a Perfetto trace (a name ending in .perfetto.json or .trace.json) or JSON."""
        low = path.lower()
        with open(path, "w", encoding="utf-8") as f:
            if low.endswith(".csv"):
                f.write(timeline.to_csv(self.requests))
            elif low.endswith((".perfetto.json", ".trace.json")):
                json.dump(timeline.perfetto(self.requests), f)
            else:
                json.dump(timeline.to_json(self.requests), f, indent=1, allow_nan=False)

    def _export_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(
            self, "Export the requests", "requests.csv",
            "CSV, one row per request (*.csv);;JSON with every chunk (*.json);;Perfetto trace (*.perfetto.json)")
        if path:
            try:
                self.export(path)
                self.status = f"Saved {path}."
            except OSError as e:
                self.status = f"⚠ could not save {path}: {e.strerror or e}"
            self.mark_dirty()

    def saved_results(self) -> list[dict]:
        """The requests as plain data for a session file."""
        if self._plain is None:
            self._plain = [timeline.to_plain(r) for r in self.requests]
        return self._plain

    def restore_results(self, saved: object) -> str:
        """Show the requests a session holds (replacing the panel's); "" or one sentence on what was skipped."""
        self.requests, msg = timeline.restore(saved)
        self.selected, self._run_over, self._plain = None, True, None
        self.status = f"⚠ {msg}" if msg else ""
        self.mark_dirty()
        return msg

    # ---- drawing --------------------------------------------------------------------------------------------------
    def draw(self) -> None:
        self.bars = bars = timeline.bars(self.requests)
        ok = [b for b in bars if b.result.ok]
        if bars and not self.status.startswith(("⚠", "Saved")):
            spans = (f", {sum(1 for b in bars if b.server)} with the server's spans (from {self.span_endpoint})"
                     if self.span_endpoint else "")
            trouble = f" Span receiver: {'; '.join(self.span_problems[:3])}." if self.span_problems else ""
            self.status = f"{len(bars)} requests, {len(ok)} complete{spans}. Click one for its tokens.{trouble}"
        self.status_label.setText(self.status)
        self.export_button.setEnabled(bool(bars))
        for kind, item in self.segment_items.items():
            segs = [(b.number, b.t0_s + a, b.t0_s + e) for b in bars for k, a, e in b.segments if k == kind]
            self._set_bars(item, segs, -ROW_HEIGHT / 2, ROW_HEIGHT)
        for kind, item in self.server_items.items():
            segs = [(b.number, b.t0_s + a, b.t0_s + e) for b in bars for k, a, e in b.server if k == kind]
            self._set_bars(item, segs, ROW_HEIGHT / 2 + SERVER_GAP, 1 - ROW_HEIGHT - SERVER_GAP)
        itls = [b.itl_s for b in ok]
        all_itl = np.concatenate(itls) if itls else np.zeros(0)
        median = float(np.median(all_itl)) if len(all_itl) else 0.0
        xs, ys, colors = [], [], []
        for b in ok:
            t = b.token_times_s[1:]
            xs.append(b.t0_s + t)
            ys.append(np.full(len(t), float(b.number)))
            colors.append(itl_colors(b.itl_s, median))
        if xs and sum(map(len, xs)):
            x, y, c = np.concatenate(xs), np.concatenate(ys), np.concatenate(colors)
            step = max(1, math.ceil(len(x) / MAX_TICKS))
            self.ticks.setData(x=x[::step], y=y[::step], brush=[pg.mkBrush(*rgba) for rgba in c[::step]],
                               pen=[pg.mkPen(*rgba[:3]) for rgba in c[::step]])
        else:
            self.ticks.setData([], [])
        if self.selected is not None and self.selected < len(bars):
            b = bars[self.selected]
            end = max(e for _, _, e in b.segments)
            self._set_bars(self.highlight, [(b.number, b.t0_s, b.t0_s + end)], -0.5, 1.0)
            self.detail.setPlainText(self.detail_text(self.selected))
        else:
            self._set_bars(self.highlight, [], -0.5, 1.0)
            self.detail.setPlainText("")
        table = timeline.rows(self.requests)
        self.table.blockSignals(True)
        self.table.setRowCount(len(table))
        with theme.filling(self.table):
            for i, row in enumerate(table):
                for j, (_, key) in enumerate(TABLE):
                    v = row[key]
                    text = "" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
                    item = QtWidgets.QTableWidgetItem(text)
                    item.setData(QtCore.Qt.ItemDataRole.UserRole, v)
                    self.table.setItem(i, j, item)
        if self.selected is not None and self.selected < len(table):
            self.table.selectRow(self.selected)
        else:
            self.table.clearSelection()
        self.table.blockSignals(False)

    @staticmethod
    def _set_bars(item: pg.BarGraphItem, segs: list[tuple[int, float, float]], dy: float, h: float) -> None:
        if not segs:
            item.setOpts(x0=np.zeros(0), x1=np.zeros(0), y0=np.zeros(0), height=np.zeros(0))
            return
        a = np.asarray(segs, dtype=float)
        item.setOpts(x0=a[:, 1], x1=a[:, 2], y0=a[:, 0] + dy, height=np.full(len(a), h))

    def clear(self) -> None:
        """A new generation does not clear the requests: they belong to the server's load run."""
        self.mark_dirty()


PANEL = RequestsPanel
