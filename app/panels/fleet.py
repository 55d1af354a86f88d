"""Fleet: a router (vllm-router) and its vLLM replicas, replica by replica, and which replica served each request.

Name the router's URL (its replicas come from its own listing) or a fleet config file (JSON or TOML: the router, and
each replica with the loopback port its OpenTelemetry spans go to, which is how a request is attributed to the
replica that served it). To compare routing policies, start one router per policy in front of the same replicas and
drive each from the Load lab in turn: a row per router, with its TTFT p50. The engine process scrapes each replica's
/metrics once a second (FleetStatus through sig_fleet); the Load lab drives the requests (sig_serve_request). Both
are only stored here, then drawn on the tick.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from app import theme
from app.bridge import Bridge
from app.panels.base import Bars, Panel
from engine.remote.fleet import p50
from engine.remote.spans import matches

COLUMNS = ("replica", "waiting", "running", "KV use", "prefix hits", "tokens/s", "done", "served here")
MAX_REQUESTS = 256  # rows of the requests table (the newest)
MAX_RUN = 4096  # requests kept per router for its TTFT p50
ROUTER_COLUMNS = ("Load lab drove", "completed", "TTFT p50 ms", "served by")
BAR = (79, 176, 224)  # theme.DECODE_COLOR


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = "{:g}") -> str:
    return "–" if x is None else fmt.format(x)


def replica_of(request_id: str, served: dict[str, str]) -> str | None:
    """The replica that served a response, by the engine request id its span carries ("<response id>-0")."""
    if not request_id:
        return None
    hit = served.get(request_id) or served.get(f"{request_id}-0")
    if hit is not None:
        return hit
    return next((name for sid, name in served.items() if matches(sid, request_id)), None)


def _set_rows(table: QtWidgets.QTableWidget, rows: list) -> None:
    """Rows of texts into a table, its columns fitted to them once."""
    table.setRowCount(len(rows))
    with theme.filling(table):
        for i, row in enumerate(rows):
            for j, text in enumerate(row):
                table.setItem(i, j, QtWidgets.QTableWidgetItem(text))


def _fit(table: QtWidgets.QTableWidget, at_least: int = 1) -> None:
    """The table as tall as its header and rows (at least `at_least` rows' worth)."""
    rows = sum(table.rowHeight(i) for i in range(table.rowCount()))
    rows = max(rows, at_least * table.verticalHeader().defaultSectionSize())
    table.setFixedHeight(table.horizontalHeader().height() + rows + 2 * table.frameWidth() + 2)


class FleetPanel(Panel):
    title = "Fleet"
    object_name = "panel_fleet"
    shortcut = "Ctrl+Alt+0"
    subscriptions = {"sig_fleet": "_on_fleet", "sig_serve_request": "_on_request"}
    help_text = (
        "Several vLLM replicas behind a router (vllm-router). Each replica keeps its own queue (waiting, running), "
        "its own KV cache and its own prefix cache, so where the router sends a request decides whether its prompt's "
        "beginning is already cached there. Round-robin spreads requests evenly; cache-aware sends a prompt where "
        "its prefix was seen before. Name the router (its replicas from its listing) or a fleet config whose "
        "replicas name a spans_port (start each with --otlp-traces-endpoint http://127.0.0.1:PORT/v1/traces): a "
        "request's span arrives at the port of the replica that served it. Point the Load lab at the router to "
        "drive it; each of its requests is listed with its replica. Bars: requests each replica served; dots: its KV "
        "use (the tallest bar's height is 100%). To compare routing policies, run one router per "
        "policy in front of the same replicas and drive each in turn: each gets a row with its TTFT p50."
    )

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.status = None  # engine.protocol.FleetStatus, the latest
        self.served: dict[str, str] = {}  # engine request id -> replica name
        self.requests: list = []  # the Load lab's RequestResult, the newest MAX_REQUESTS
        # every Load-lab request's TTFT (ms, None: failed) and response id by the server it went to: one router per
        # routing policy in front of the same replicas, each driven in turn, compare side by side
        self.by_router: dict[str, list[tuple[float | None, str]]] = {}
        self.source = QtWidgets.QLineEdit()
        self.source.setPlaceholderText("router URL (http://127.0.0.1:30000) or fleet config (.toml / .json)")
        self.watch_button = QtWidgets.QPushButton("Watch")
        self.stop_button = QtWidgets.QPushButton("Stop")
        self.watch_button.clicked.connect(self.watch)
        self.source.returnPressed.connect(self.watch)
        self.stop_button.clicked.connect(self.stop_watching)
        self.status_label = QtWidgets.QLabel("Name a router or a fleet config and press Watch.")
        self.status_label.setWordWrap(True)
        self.table = QtWidgets.QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.plot = pg.PlotWidget()
        self.plot.setBackground(theme.BACKGROUND)
        self.plot.setLabel("left", "requests served")
        self.plot.setMouseEnabled(False, False)
        self.bars = Bars(x=[], height=[], width=0.6, brush=pg.mkBrush(*BAR))
        self.plot.addItem(self.bars)
        self.kv = pg.ScatterPlotItem(size=10, brush=pg.mkBrush(224, 160, 64))  # KV use, on the right axis' scale
        self.plot.addItem(self.kv)
        self.routers = QtWidgets.QTableWidget(0, len(ROUTER_COLUMNS))
        self.routers.setHorizontalHeaderLabels(ROUTER_COLUMNS)
        self.routers.verticalHeader().setVisible(False)
        self.routers.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.routers.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.req_table = QtWidgets.QTableWidget(0, 4)
        self.req_table.setHorizontalHeaderLabels(("request", "replica", "TTFT ms", "tokens"))
        self.req_table.verticalHeader().setVisible(False)
        self.req_table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.req_table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        top = QtWidgets.QHBoxLayout()
        top.addWidget(self.source, 1)
        top.addWidget(self.watch_button)
        top.addWidget(self.stop_button)
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        split.addWidget(self.plot)
        split.addWidget(self.req_table)
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.status_label)
        for t in (self.table, self.routers):  # as tall as their rows (_fit): the plot and the requests get the rest
            t.setVerticalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        lay.addWidget(self.table)
        lay.addWidget(self.routers)
        lay.addWidget(split, 1)
        self.mark_dirty()

    # ---- commands ----
    def watch(self) -> None:
        src = self.source.text().strip()
        if src:
            self.status, self.served = None, {}
            self.status_label.setText(f"Watching {src} …")
            self.bridge.watch_fleet(src)

    def stop_watching(self) -> None:
        self.bridge.watch_fleet("")
        self.status_label.setText("Not watching.")

    # ---- arrivals: store, draw later ----
    @QtCore.Slot(object)
    def _on_fleet(self, notice) -> None:
        self.status = notice
        self.served = {str(i): str(n) for i, n in notice.served}
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_request(self, result) -> None:
        self.requests.append(result)
        del self.requests[:-MAX_REQUESTS]
        server = self.bridge.server  # the ServerInfo the Load lab drove (None: this machine)
        runs = self.by_router.setdefault(server.url if server is not None else "this machine", [])
        runs.append((result.ttft_s * 1e3 if result.ok else None, result.request_id))
        del runs[:-MAX_RUN]
        self.mark_dirty()

    # ---- drawing ----
    def summary(self) -> str:
        s = self.status
        if s is None:
            return self.status_label.text()
        if s.error:
            return f"⚠ {s.error}"
        ok = [f for f in s.replicas if not f.error]
        attributed = sum(1 for r in self.requests if replica_of(r.request_id, self.served))
        lines = [f"Router {s.router}: {len(ok)} of {len(s.replicas)} replicas answering; {len(self.served)} "
                 f"requests attributed by their spans"
                 + (f", {attributed} of the Load lab's last {len(self.requests)}" if self.requests else "") + "."]
        trouble = [f"{f.name}: {f.error}" for f in s.replicas if f.error] + list(s.problems)
        if trouble:
            lines.append("⚠ " + "; ".join(trouble[:3]))
        return "\n".join(lines)

    def rows(self) -> list[tuple[str, ...]]:
        """The replicas table as text, one tuple per replica (what draw puts in the cells)."""
        if self.status is None:
            return []
        counts: dict[str, int] = {}
        for name in self.served.values():
            counts[name] = counts.get(name, 0) + 1
        return [(f.name + ("" if not f.error else " ⚠"), _num(f.waiting), _num(f.running), _pct(f.kv_usage),
                 _pct(f.prefix_hit_rate), _num(f.tokens_per_s, "{:.1f}"), _num(f.requests_done),
                 str(counts.get(f.name, 0))) for f in self.status.replicas]

    def request_rows(self) -> list[tuple[str, ...]]:
        out = []
        for r in reversed(self.requests):
            name = replica_of(r.request_id, self.served)
            out.append((str(r.index), name or "–", f"{r.ttft_s * 1e3:.1f}" if r.ok else r.error[:40],
                        str(r.output_tokens)))
        return out

    def router_rows(self) -> list[tuple[str, ...]]:
        """One row per server the Load lab drove: requests, TTFT p50 and how they split over the replicas."""
        out = []
        for url, runs in self.by_router.items():
            ttft = [t for t, _ in runs if t is not None]
            split: dict[str, int] = {}
            for _, rid in runs:
                name = replica_of(rid, self.served)
                if name is not None:
                    split[name] = split.get(name, 0) + 1
            med = p50(ttft)
            out.append((url, f"{len(ttft)} of {len(runs)}", "–" if med is None else f"{med:.1f}",
                        ", ".join(f"{k} {v}" for k, v in sorted(split.items())) or "–"))
        return out

    def draw(self) -> None:
        self.status_label.setText(self.summary())
        rows = self.rows()
        _set_rows(self.table, rows)
        served = np.array([int(r[-1]) for r in rows], dtype=float)
        x = np.arange(len(rows), dtype=float)
        self.bars.setOpts(x=x, height=served, width=0.6)
        kv = [f.kv_usage for f in self.status.replicas] if self.status is not None else []
        top = max(1.0, float(served.max()) if len(served) else 1.0)
        self.kv.setData(x=[xi for xi, k in zip(x, kv, strict=True) if k is not None],
                        y=[k * top for k in kv if k is not None])  # KV use drawn as a fraction of the tallest bar
        self.plot.getAxis("bottom").setTicks([[(float(i), r[0]) for i, r in enumerate(rows)]])
        self.plot.setXRange(-0.7, max(0.7, len(rows) - 0.3), padding=0)
        self.plot.setYRange(0, top * 1.1, padding=0)
        _fit(self.table)
        _set_rows(self.routers, self.router_rows())
        _fit(self.routers)
        _set_rows(self.req_table, self.request_rows())

    def clear(self) -> None:
        """A new generation does not clear the fleet."""
        self.mark_dirty()


PANEL = FleetPanel
