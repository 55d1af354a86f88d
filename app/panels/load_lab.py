"""Load lab: a bounded load benchmark against the connected server (engine.remote.loadlab, in the engine process).

For each concurrency level it sends a fixed number of streamed requests (at most that many in flight, all at once
or at a request rate with gamma arrivals) and measures, per request, TTFT, TPOT, ITL and end-to-end latency with
`vllm bench serve`'s definitions. Rows arrive through sig_serve_run and are only stored here, then drawn on the tick.
While a level runs, its point is drawn live from the requests finished so far (sig_serve_request), summarised with
the same code as the finished row (engine.remote.loadlab.summarize), so the plots move with every request.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from app import theme
from app.bridge import Bridge
from app.panels.base import Panel, spin_box
from engine.protocol import LabDone

COLUMNS = ("conc.", "ok", "fail", "tok/s system", "tok/s stream", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
           "ITL p99", "E2EL p99", "req/s", "goodput")
SERIES = (("median_ttft_ms", "TTFT p50", theme.PREFILL_COLOR, QtCore.Qt.PenStyle.SolidLine),
          ("p99_ttft_ms", "TTFT p99", theme.PREFILL_COLOR, QtCore.Qt.PenStyle.DashLine),
          ("median_tpot_ms", "TPOT p50", theme.DECODE_COLOR, QtCore.Qt.PenStyle.SolidLine),
          ("p99_tpot_ms", "TPOT p99", theme.DECODE_COLOR, QtCore.Qt.PenStyle.DashLine),
          ("p99_itl_ms", "ITL p99", theme.OK_COLOR, QtCore.Qt.PenStyle.DotLine))


def parse_levels(text: str) -> list[int]:
    """"1,2,4,8" -> [1, 2, 4, 8]; ValueError with the reason otherwise."""
    try:
        levels = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"concurrency levels are whole numbers separated by commas, not {text!r}") from None
    if not levels or any(c < 1 or c > 256 for c in levels):
        raise ValueError("concurrency levels must be between 1 and 256")
    return levels


def summarize(runs: list[dict]) -> str:
    """One sentence on what the runs show, from their own numbers."""
    ok = [r for r in runs if r.get("completed")]
    if not ok:
        return ""
    if len(ok) == 1:
        r = ok[0]
        return (f"Concurrency {r['concurrency']}: {r['output_throughput']:.0f} tok/s for the system, "
                f"{r['per_stream_tokens_per_s']:.0f} per stream. Add levels to see the trade-off.")
    a, b = ok[0], ok[-1]
    gain = b["output_throughput"] / a["output_throughput"] if a["output_throughput"] else math.nan
    return (f"From {a['concurrency']} to {b['concurrency']} requests in flight the server's output rose ×{gain:.1f} "
            f"({a['output_throughput']:.0f} → {b['output_throughput']:.0f} tok/s) while each stream went from "
            f"{a['per_stream_tokens_per_s']:.0f} to {b['per_stream_tokens_per_s']:.0f} tok/s and TTFT p99 from "
            f"{a['p99_ttft_ms']:.0f} to {b['p99_ttft_ms']:.0f} ms.")


class LoadLabPanel(Panel):
    title = "Load lab"
    object_name = "panel_load_lab"
    shortcut = "Ctrl+Alt+5"
    subscriptions = {
        "sig_server_connected": "_on_connected", "sig_serve_progress": "_on_progress",
        "sig_serve_request": "_on_request", "sig_serve_run": "_on_run", "sig_serve_done": "_on_done",
        "sig_serve_metrics": "_on_metrics", "sig_server_disconnected": "_on_disconnected",
        "sig_serving_progress": "_on_serving_progress", "sig_serving_done": "_on_serving_done",
        "sig_model_loaded": "_on_model_ready",
    }
    help_text = (
        "A bounded load test of the connected server (File → Connect to server…), measured like `vllm bench "
        "serve`. For each concurrency level C, N streamed requests are sent with at most C in flight (or at a "
        "request rate, with gamma-distributed gaps: burstiness 1 = Poisson). Per request: TTFT = time to the "
        "first chunk with text; ITL = gaps between chunks; E2EL = the whole request; TPOT = (E2EL − TTFT) / "
        "(output tokens − 1), in ms. Per level: output throughput = output tokens / duration (tok/s for the "
        "system) and per-stream speed = 1 / mean TPOT. Left: system tok/s against per-stream tok/s, one point "
        "per level — batching buys system throughput with each stream's speed. Middle: latency percentiles "
        "against C. The level still running is drawn hollow from the requests finished so far and moves with "
        "every request. Right: the server's own KV-cache usage and queue (from /metrics) during the run. SLO "
        "TTFT/TPOT/E2EL (ms, 0 = none): goodput counts the requests per second that met every SLO set. Every run "
        "is bounded by its request count and a time limit; Cancel stops it at once. Export writes JSON or CSV. Each "
        "request's own timeline is in the Requests panel; with 'server spans' on, a vLLM started with "
        "--otlp-traces-endpoint http://127.0.0.1:4318/v1/traces (and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
        "http/protobuf) adds its own queue, prefill and decode times to each request."
    )

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.runs: list[dict] = []
        self.requests = 0
        self.levels: list[int] = []
        self.level_requests: list = []  # RequestResults of the level still running
        self._cfg: dict = {}
        self.metrics: list[tuple[float, float | None, float | None, float | None]] = []  # t, kv, running, waiting
        self.running = False
        self.outcome = ""  # how the last run ended (engine.protocol.LabOutcome; "" while none has)
        self.status = "Connect to a server (File → Connect to server…) or press Serve this model, then Run."
        self.progress_value = 0.0
        self._t_offset = 0.0
        self._starting = False  # Serve this model: a server is starting
        self._build()
        self._update_buttons()
        self.mark_dirty()

    # ---- widgets ---------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        row = QtWidgets.QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        self.levels_edit = QtWidgets.QLineEdit("1,2,4,8")
        self.levels_edit.setMaximumWidth(110)
        self.levels_edit.setToolTip("Concurrency levels: requests in flight at once, one run per level")
        self.prompts_spin = spin_box(1, 1000, 8, "Requests sent per level")
        self.tokens_spin = spin_box(1, 4096, 32, "Tokens generated per request (the server ignores EOS)")
        self.rate_spin = spin_box(0, 1000, 0, "Request rate, requests/s (0 = all at once)", decimals=1)
        self.burst_spin = spin_box(0.1, 10, 1.0, "Burstiness: gamma shape of the gaps (1 = Poisson)", decimals=1)
        self.limit_spin = spin_box(1, 3600, 60, "Time limit per level, seconds")
        # the knobs on a grid of two rows: the panel shares a column with the other labs
        grid = QtWidgets.QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        for i, (label, w) in enumerate((("C", self.levels_edit), ("N", self.prompts_spin), ("new", self.tokens_spin),
                                        ("rate", self.rate_spin), ("burst", self.burst_spin),
                                        ("limit s", self.limit_spin))):
            grid.addWidget(QtWidgets.QLabel(label), i // 3, 2 * (i % 3))
            grid.addWidget(w, i // 3, 2 * (i % 3) + 1)
        row.addLayout(grid)
        row.addStretch(1)
        # SLOs and the buttons on a further row
        row2 = QtWidgets.QHBoxLayout()
        row2.setContentsMargins(0, 0, 0, 0)
        row2.addWidget(QtWidgets.QLabel("SLO ms"))
        self.slo_spins = {}
        for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2EL")):
            spin = spin_box(0, 1e6, 0, f"{name} SLO in ms for goodput (0 = no SLO on {name})", decimals=3)
            spin.setPrefix(f"{name} ")
            spin.setSpecialValueText(f"{name} off")
            spin.setMinimumWidth(105)
            self.slo_spins[key] = spin
            row2.addWidget(spin)
        self.spans_check = QtWidgets.QCheckBox("server spans on port")
        self.spans_check.setToolTip(
            "Receive the server's OpenTelemetry spans (OTLP/HTTP) on 127.0.0.1 and show its queue, prefill and decode "
            "for each request in the Requests panel. Start vLLM with --otlp-traces-endpoint "
            "http://127.0.0.1:PORT/v1/traces and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf")
        self.spans_port = spin_box(1024, 65535, 4318, "The span receiver's port (OTLP/HTTP's usual one is 4318)")
        # what the server itself reports, beside the client's measurements: a row of its own (the panel's width)
        row_server = QtWidgets.QHBoxLayout()
        row_server.setContentsMargins(0, 0, 0, 0)
        row_server.addWidget(self.spans_check)
        row_server.addWidget(self.spans_port)
        self.kv_check = QtWidgets.QCheckBox("KV events on port")
        self.kv_check.setToolTip(
            "Subscribe to vLLM's KV-cache events (ZeroMQ) on 127.0.0.1 and draw its prefix cache's blocks in the "
            "Server KV blocks panel. Start vLLM with --kv-events-config '{\"enable_kv_cache_events\": true, "
            "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:PORT\"}'")
        self.kv_port = spin_box(1024, 65535, 5557, "The KV-event subscriber's port (vLLM's default is 5557)")
        row_server.addWidget(self.kv_check)
        row_server.addWidget(self.kv_port)
        self.shared_check = QtWidgets.QCheckBox("shared prefixes")
        self.shared_check.setToolTip(
            "Send prompts in 4 groups, each a ~400-token system prompt with different questions (the prompts "
            "fleet-bench sends): a prefix cache, and a router that routes by it (the Fleet panel), then matter")
        row_server.addWidget(self.shared_check)
        row_server.addStretch(1)
        row2.addStretch(1)
        self.run_button = QtWidgets.QPushButton("Run")
        self.run_button.clicked.connect(lambda: self.run())
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.export_button = QtWidgets.QPushButton("Export…")
        self.export_button.clicked.connect(self._export_dialog)
        self.serve_button = QtWidgets.QPushButton("Serve this model")
        self.serve_button.setToolTip("No server yet? Start llama.cpp's server for the loaded model on 127.0.0.1 and "
                                     "connect to it (it stops when you disconnect or close the app)")
        self.serve_button.clicked.connect(self.serve_model)
        row3 = QtWidgets.QHBoxLayout()
        row3.setContentsMargins(0, 0, 0, 0)
        for b in (self.serve_button, self.run_button, self.cancel_button, self.export_button):
            row3.addWidget(b)
        row3.addStretch(1)

        self.progress = QtWidgets.QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setMaximumHeight(14)
        self.progress.setTextVisible(False)
        self.status_label = QtWidgets.QLabel()
        self.status_label.setWordWrap(True)

        pg.setConfigOptions(antialias=True)
        self.plots = pg.GraphicsLayoutWidget()
        self.plots.setBackground(theme.BACKGROUND)
        p1 = self.tput_plot = self.plots.addPlot(title="system vs per-stream tok/s")
        p1.setLabel("bottom", "per-stream tok/s")
        p1.setLabel("left", "system tok/s")
        p1.showGrid(x=True, y=True, alpha=0.2)
        self.tput_curve = p1.plot([], [], pen=pg.mkPen(theme.ACCENT, width=2), symbol="o", symbolSize=8,
                                  symbolBrush=theme.ACCENT)
        self.tput_live = p1.plot([], [], pen=None, symbol="o", symbolSize=10, symbolPen=pg.mkPen(theme.ACCENT, width=2),
                                 symbolBrush=None)
        self.tput_labels: list[pg.TextItem] = []
        p2 = self.lat_plot = self.plots.addPlot(title="latency vs concurrency")
        p2.setLabel("bottom", "requests in flight")
        p2.setLabel("left", "ms")
        p2.setLogMode(x=True, y=True)
        p2.showGrid(x=True, y=True, alpha=0.2)
        p2.addLegend(offset=(5, 5), labelTextSize="8pt")
        self.lat_curves = {}
        for key, name, color, style in SERIES:
            self.lat_curves[key] = p2.plot([], [], name=name, pen=pg.mkPen(color, width=2, style=style),
                                           symbol="o", symbolSize=5, symbolBrush=color)
        p3 = self.server_plot = self.plots.addPlot(title="server: KV cache % and queue")
        p3.setLabel("bottom", "s")
        p3.setLabel("left", "KV % · requests")
        p3.showGrid(x=True, y=True, alpha=0.2)
        p3.addLegend(offset=(5, 5), labelTextSize="8pt")
        self.kv_curve = p3.plot([], [], name="KV used %", pen=pg.mkPen(theme.WARNING_COLOR, width=2))
        self.running_curve = p3.plot([], [], name="running", pen=pg.mkPen(theme.DECODE_COLOR, width=1.5))
        self.waiting_curve = p3.plot([], [], name="waiting", pen=pg.mkPen(theme.ERROR_COLOR, width=1.5))

        self.table = QtWidgets.QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.tabs = QtWidgets.QTabWidget()
        self.tabs.addTab(self.plots, "Plots")
        self.tabs.addTab(self.table, "Table")

        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(row)
        lay.addLayout(row2)
        lay.addLayout(row_server)
        lay.addLayout(row3)
        lay.addWidget(self.progress)
        lay.addWidget(self.status_label)
        lay.addWidget(self.tabs, 1)

    def _update_buttons(self) -> None:
        connected = self.bridge.server is not None
        self.run_button.setEnabled(connected and not self.running)
        self.serve_button.setVisible(not connected)
        self.serve_button.setEnabled(not self._starting and self.bridge.info is not None)
        self.cancel_button.setEnabled(self.running)
        self.export_button.setEnabled(bool(self.runs))

    # ---- actions -------------------------------------------------------------------------------------------------
    def config(self) -> dict:
        rate = float(self.rate_spin.value())
        slo = {k: float(s.value()) for k, s in self.slo_spins.items() if s.value() > 0}
        return {"slo_ms": slo or None, "concurrency": parse_levels(self.levels_edit.text()),
                "num_prompts": int(self.prompts_spin.value()),
                "max_new_tokens": int(self.tokens_spin.value()), "request_rate": rate or None,
                "burstiness": float(self.burst_spin.value()), "time_limit_s": float(self.limit_spin.value()),
                "spans_port": int(self.spans_port.value()) if self.spans_check.isChecked() else None,
                "kv_events_port": int(self.kv_port.value()) if self.kv_check.isChecked() else None,
                "prompt_set": "shared_prefix" if self.shared_check.isChecked() else None}

    def run(self, config: dict | None = None) -> bool:
        if self.bridge.server is None:
            self.status = "Connect to a server first (File → Connect to server…)."
            self.mark_dirty()
            return False
        try:
            cfg = config or self.config()
        except ValueError as e:
            self.status = f"⚠ {e}"
            self.mark_dirty()
            return False
        self.runs, self.metrics, self.requests, self.level_requests = [], [], 0, []
        self.levels, self._cfg = list(cfg["concurrency"]), dict(cfg)
        self.running, self.progress_value, self.outcome = True, 0.0, ""
        self._t_offset, self._last_t = 0.0, 0.0
        self.status = f"Running {len(cfg['concurrency'])} levels × {cfg['num_prompts']} requests…"
        self.bridge.run_serve_bench(cfg)
        self._update_buttons()
        self.mark_dirty()
        return True

    def cancel(self) -> None:
        if self.running:
            self.bridge.cancel_serve_bench()
            self.status = "Cancelling…"
            self.mark_dirty()

    def export(self, path: str) -> None:
        """Write the runs as JSON (`vllm bench serve`'s keys) or CSV, by the file's extension."""
        from engine.remote.loadlab import to_csv

        server = self.bridge.server
        with open(path, "w", encoding="utf-8") as f:
            if path.lower().endswith(".csv"):
                f.write(to_csv(self.runs))
            else:
                json.dump({"server": server.to_dict() if server is not None else None, "runs": self.runs}, f,
                          indent=2)

    def saved_results(self) -> dict:
        """The last run's levels (and the settings they ran with) as plain data for a session file."""
        return {"runs": [dict(r) for r in self.runs], "config": dict(self._cfg)}

    def restore_results(self, saved: object) -> str:
        """Show the levels a session holds (replacing the panel's); "" or one sentence on what was skipped."""
        from engine.remote.loadlab import CSV_FIELDS

        def number(v: object) -> bool:
            return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))

        runs = saved.get("runs") if isinstance(saved, dict) else None
        cfg = saved.get("config") if isinstance(saved, dict) else None
        good = [r for r in runs if isinstance(r, dict) and all(number(r.get(k)) for k in CSV_FIELDS)
                and number(r.get("completed")) and r.get("completed") is not None] if isinstance(runs, list) else []
        if self.running:
            return "a load run is going on: the session's load-lab results are not shown"
        self.runs, self.level_requests, self.metrics = good, [], []
        self._cfg = cfg if isinstance(cfg, dict) else {}
        self.levels = [r.get("concurrency") for r in good]
        skipped = (len(runs) - len(good)) if isinstance(runs, list) else 1
        msg = f"{skipped} saved load-lab level(s) skipped: not a level's figures" if skipped else ""
        self.status = f"⚠ {msg}" if msg else (summarize(self.runs) or "")
        self.mark_dirty()
        return msg

    def _export_dialog(self) -> None:
        path, _ = QtWidgets.QFileDialog.getSaveFileName(self, "Export load-lab results", "load-lab.json",
                                                        "JSON (*.json);;CSV (*.csv)")
        if path:
            try:
                self.export(path)
                self.status = f"Saved {path}."
            except OSError as e:
                self.status = f"⚠ could not save {path}: {e.strerror or e}"
            self.mark_dirty()

    # ---- slots (store only) ------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_connected(self, info) -> None:
        self.status = f"Connected to {info.kind} ({info.model}). Pick levels and Run."
        self._update_buttons()
        self.mark_dirty()

    def serve_model(self) -> None:
        """Start a server for the loaded model (the engine process starts it and connects)."""
        self._starting = True
        self.status = "Starting llama.cpp's server for the loaded model…"
        self.bridge.serve_model()
        self._update_buttons()
        self.mark_dirty()

    @QtCore.Slot(float, str)
    def _on_serving_progress(self, fraction: float, message: str) -> None:
        self.status = f"{message}…"
        self.mark_dirty()

    @QtCore.Slot(str)
    def _on_serving_done(self, message: str) -> None:
        self._starting = False
        if message:
            self.status = f"⚠ Could not serve the model: {message}"
        self._update_buttons()
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_model_ready(self, _info: object) -> None:
        self._update_buttons()

    @QtCore.Slot()
    def _on_disconnected(self) -> None:
        self.status = "Not connected: connect to a server (File → Connect to server…) or serve this model."
        self._update_buttons()
        self.mark_dirty()

    @QtCore.Slot(float, str)
    def _on_progress(self, fraction: float, message: str) -> None:
        self.progress_value = fraction
        self.status = f"Running: {message}."
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_request(self, r) -> None:
        self.requests += 1
        self.level_requests.append(r)
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_run(self, run: dict) -> None:
        self.runs.append(run)
        self.level_requests = []
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_metrics(self, item) -> None:
        if not self.running:
            return
        t, m = item.t, item.metrics
        if self.metrics and t + self._t_offset < self.metrics[-1][0]:
            self._t_offset = self.metrics[-1][0]  # each level restarts its clock: keep the time axis running on
        self.metrics.append((t + self._t_offset, m.kv_usage, m.running, m.waiting))
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_done(self, done: LabDone) -> None:
        """The run ended (engine.protocol.LabDone): the levels measured stay, whatever the outcome."""
        self.running, self.outcome = False, done.outcome
        if done.outcome == "done":
            self.progress_value = 1.0
            self.status = summarize(self.runs) or "Done."
        elif done.outcome == "cancelled":
            self.status = f"Stopped: cancelled after {len(self.runs)} of {len(self.levels)} levels."
        else:
            self.status = f"⚠ {done.message or f'the load lab {done.outcome}'}"
        self._update_buttons()
        self.mark_dirty()

    # ---- drawing -------------------------------------------------------------------------------------------------
    def live_run(self) -> dict | None:
        """The level still running, summarised from its requests finished so far (None when there are none)."""
        ok = [r for r in self.level_requests if getattr(r, "ok", False)]
        if not self.running or not ok or len(self.runs) >= len(self.levels):
            return None
        from engine.remote.loadlab import summarize as summarize_requests

        duration = max(r.start_s + r.e2el_s for r in ok)  # the clock of the level, up to its last finished request
        rate = self._cfg.get("request_rate") or math.inf
        d = summarize_requests(self.level_requests, duration, self.levels[len(self.runs)], rate,
                               float(self._cfg.get("burstiness", 1.0)), self._cfg.get("slo_ms")).to_dict()
        d["so_far"] = len(self.level_requests)
        return d

    def draw(self) -> None:
        self.progress.setValue(int(self.progress_value * 1000))
        self.status_label.setText(self.status)
        runs = [r for r in self.runs if r.get("completed")]
        live = self.live_run()
        xs = np.array([r["per_stream_tokens_per_s"] for r in runs], dtype=float)
        ys = np.array([r["output_throughput"] for r in runs], dtype=float)
        self.tput_curve.setData(xs, ys)
        if live is not None:
            self.tput_live.setData([live["per_stream_tokens_per_s"]], [live["output_throughput"]])
        else:
            self.tput_live.setData([], [])
        for item in self.tput_labels:
            self.tput_plot.removeItem(item)
        self.tput_labels = []
        n = int(self._cfg.get("num_prompts", 0))
        points = runs + ([live] if live is not None else [])
        x_right = max((r["per_stream_tokens_per_s"] for r in points), default=0.0)
        for r in points:
            so_far = f" ({r['so_far']}/{n} so far)" if "so_far" in r else ""
            # the rightmost point's label goes to its left, inside the plot
            right = len(points) > 1 and r["per_stream_tokens_per_s"] >= x_right
            t = pg.TextItem(f"C={r['concurrency']}{so_far}", color=theme.FOREGROUND, anchor=(1 if right else 0, 1))
            t.setPos(r["per_stream_tokens_per_s"], r["output_throughput"])
            self.tput_plot.addItem(t)
            self.tput_labels.append(t)
        lat_runs = runs + ([live] if live is not None else [])
        cs = np.array([r["concurrency"] or 1 for r in lat_runs], dtype=float)
        for key, curve in self.lat_curves.items():
            vals = np.array([max(r[key], 1e-3) for r in lat_runs], dtype=float)
            curve.setData(cs, vals)
        if self.metrics:
            m = np.array([[t, np.nan if kv is None else 100 * kv, np.nan if ru is None else ru,
                           np.nan if wa is None else wa] for t, kv, ru, wa in self.metrics], dtype=float)
            self.kv_curve.setData(m[:, 0], m[:, 1], connect="finite")
            self.running_curve.setData(m[:, 0], m[:, 2], connect="finite")
            self.waiting_curve.setData(m[:, 0], m[:, 3], connect="finite")
        else:
            for c in (self.kv_curve, self.running_curve, self.waiting_curve):
                c.setData([], [])
        self.table.setRowCount(len(self.runs))
        with theme.filling(self.table):
            for i, r in enumerate(self.runs):
                cells = (r["concurrency"], r["completed"], r["failed"], f"{r['output_throughput']:.1f}",
                         f"{r['per_stream_tokens_per_s']:.1f}", f"{r['median_ttft_ms']:.0f}",
                         f"{r['p99_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f}", f"{r['p99_tpot_ms']:.1f}",
                         f"{r['p99_itl_ms']:.1f}", f"{r['p99_e2el_ms']:.0f}", f"{r['request_throughput']:.2f}",
                         "" if r.get("goodput") is None else f"{r['goodput']:.2f}")
                for j, v in enumerate(cells):
                    item = QtWidgets.QTableWidgetItem(str(v))
                    item.setTextAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
                    self.table.setItem(i, j, item)
        self._update_buttons()

    def clear(self) -> None:
        """A new generation does not clear the load runs: they belong to the server, not to the prompt."""
        self.mark_dirty()


PANEL = LoadLabPanel
