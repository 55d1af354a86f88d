"""Scheduling lab: static against continuous batching on the loaded model, and a paged KV cache against a
contiguous one.

The lab runs in the engine process (engine.labs.scheduler.schedule); its events (engine.labs.schedule_events:
SchedPlan, SchedStep, SchedRequestDone, SchedSummary) reach this panel through `on_event`, which only stores them.
Pressing Run emits `sig_run_requested(SchedConfig)` and Cancel `sig_cancel_requested()`; whoever owns the engine
(the bridge) starts and stops the run, and its end comes to `finish` as an engine.protocol.LabDone (done,
cancelled, failed or unsupported on this runtime). Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from app.bridge import Bridge
from app.panels.base import Bars, Panel, spin_box
from app.theme import (
    BACKGROUND,
    DECODE_COLOR,
    ERROR_COLOR,
    FOREGROUND,
    MUTED,
    PREFILL_COLOR,
    SYSTEM_COLOR,
    placeholder,
    set_number_cell,
    show_empty,
    style_plot,
)
from app.units import fmt_bytes
from engine.costs import formulas as costs
from engine.costs.memory import LabMemory, lab_memory, size
from engine.events import ModelInfo
from engine.formats.discover import memory_available
from engine.labs.schedule_events import (
    POLICIES,
    SchedConfig,
    SchedPlan,
    SchedRequestDone,
    SchedStep,
    SchedSummary,
)
from engine.model.config import ModelConfig
from engine.protocol import LabDone

FONT_PT = 9
QUEUED_COLOR = "#5a6070"
MIB = 2**20
ROWS = (  # (label, how to read it from a summary)
    ("TTFT p50 (ms)", lambda s: s.ttft.p50 * 1e3), ("TTFT p90 (ms)", lambda s: s.ttft.p90 * 1e3),
    ("TTFT p99 (ms)", lambda s: s.ttft.p99 * 1e3), ("TPOT p50 (ms)", lambda s: s.tpot.p50 * 1e3),
    ("TPOT p99 (ms)", lambda s: s.tpot.p99 * 1e3), ("E2E p50 (s)", lambda s: s.e2e.p50),
    ("E2E p90 (s)", lambda s: s.e2e.p90), ("E2E p99 (s)", lambda s: s.e2e.p99),
    ("system tok/s", lambda s: s.system_tokens_per_s), ("per-stream tok/s", lambda s: s.stream_tokens_per_s),
    ("mean decode batch", lambda s: s.mean_decode_batch),
    ("peak KV paged (MiB)", lambda s: s.peak_paged_bytes / MIB),
    ("peak KV contiguous (MiB)", lambda s: s.peak_contiguous_bytes / MIB),
    ("fit in budget: paged", lambda s: s.fits_paged), ("fit in budget: contiguous", lambda s: s.fits_contiguous),
)


def summarize(summaries: dict[str, SchedSummary]) -> str:
    """One or two sentences comparing the policies (plain text, from the summaries only)."""
    if not summaries:
        return ""
    if len(summaries) == 1:
        (s,) = summaries.values()
        return (f"{s.policy}: p99 TTFT {s.ttft.p99 * 1e3:,.0f} ms, p99 E2E {s.e2e.p99:.2f} s, "
                f"{s.system_tokens_per_s:.1f} tok/s for the system. Run both policies to compare.")
    st, co = summaries["static"], summaries["continuous"]
    text = (f"Same arrivals: continuous batching gives p99 TTFT {co.ttft.p99 * 1e3:,.0f} ms against "
            f"{st.ttft.p99 * 1e3:,.0f} ms for static, p99 E2E {co.e2e.p99:.2f} s against {st.e2e.p99:.2f} s, and "
            f"{co.system_tokens_per_s:.1f} against {st.system_tokens_per_s:.1f} system tok/s "
            f"(mean decode batch {co.mean_decode_batch:.1f} against {st.mean_decode_batch:.1f}).")
    text += (f" Paging holds {co.paged_bytes_per_request / MIB:.2f} MiB per running request against a contiguous "
             f"reservation of {co.contiguous_bytes_per_request / MIB:.2f} MiB: {co.fits_paged} requests fit in "
             f"{co.kv_budget_bytes / MIB:.1f} MiB instead of {co.fits_contiguous}.")
    return text


class _Gantt:
    """One policy's requests over time: queued, prefill, decode bars, one row per request."""

    def __init__(self, plot: pg.PlotWidget) -> None:
        self.plot = plot
        pi = plot.getPlotItem()
        pi.getViewBox().invertY(True)
        self.bars = {}
        for state, colour in (("queued", QUEUED_COLOR), ("prefill", PREFILL_COLOR), ("decode", DECODE_COLOR)):
            self.bars[state] = Bars(x0=[0], y=[0], height=0.8, width=[0], brush=colour, pen=None)
            pi.addItem(self.bars[state])
        self.note = placeholder(pi)

    def set(self, state: str, y: np.ndarray, x0: np.ndarray, x1: np.ndarray) -> None:
        keep = x1 > x0
        if not keep.any():
            self.bars[state].setOpts(x0=[0], y=[0], width=[0], height=0.8)
            return
        self.bars[state].setOpts(x0=x0[keep], y=y[keep], width=(x1 - x0)[keep], height=0.8)


class SchedulingPanel(Panel):
    title = "Scheduling lab"
    object_name = "panel_scheduling"
    shortcut = "Ctrl+Alt+4"
    subscriptions = {"sig_model_loaded": "_on_model_loaded", "sig_sched": "on_event", "sig_sched_done": "finish",
                     "sig_serve_metrics": "_on_served_metrics", "sig_serve_done": "_on_served_done"}
    help_text = (
        "Serving many users at once, measured on the loaded model. Requests arrive at random (a rate in requests "
        "per second; burstiness 1 is a Poisson process, smaller values bunch arrivals together), each with its own "
        "prompt and output length, and the same arrivals are served twice. Static batching waits until a batch is "
        "full (or nobody else is coming), then runs it until its longest request ends: finished requests leave "
        "empty seats and newcomers wait for the next batch. Continuous batching fills a free seat at the next "
        "step, so the batch stays full and nobody waits for a stranger's long answer. Every step is a real "
        "forward pass whose time is measured; the clock only skips the idle gaps between arrivals. A joining "
        "request gets its own prefill step, and the running requests pause during it. Top: each request over "
        "time, grey while queued, amber during its prefill, blue while decoding. TTFT = first token − arrival, "
        "TPOT = (E2E − TTFT) / (tokens − 1), E2E = last token − arrival; system tokens/s counts every request's "
        "tokens over the whole run, per-stream tokens/s is 1 / TPOT. Bottom right: KV memory over time. A "
        "contiguous cache must reserve the longest possible request for every running request, because it "
        "cannot know when one will stop; a paged cache hands out pages of a few positions as a request grows "
        "and takes them back when it ends, so it wastes less than one page per request and the same memory "
        "holds more requests, which is why vLLM pages its cache. When the Load lab has driven a real server, the "
        "line at the bottom puts the KV cache use that server reported (its /metrics, scraped during the run) "
        "beside this lab's: a paging server's use follows the requests running, as the paged curve here does."
    )

    sig_run_requested = QtCore.Signal(object)
    """The user pressed Run: start engine.labs.scheduler.schedule with this SchedConfig."""
    sig_cancel_requested = QtCore.Signal()
    """The user pressed Cancel: make the run's should_stop() true."""

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        self.memory_available = memory_available  # bytes available now (a test gives its own)
        super().__init__(bridge, parent)
        self.plan: SchedPlan | None = None
        self._base = SchedConfig()
        self.running = False
        self.status = ""  # what the summary line says of the last run's end
        self.outcome = ""  # how it ended (engine.protocol.LabOutcome; "" while none has; refused here: failed)
        # the Load lab's last run against a real server: (server, peak KV use 0–1, running at that peak, peak
        # use per running request), None until one reports its KV cache use
        self.served: tuple[str, float, float, float] | None = None
        self._served_over = True  # the last load run ended: the next scrape starts a new one
        self._reset()
        self._build()
        self.sig_run_requested.connect(bridge.schedule)  # the engine process runs it on the loaded model
        self.sig_cancel_requested.connect(bridge.cancel_lab)
        self._update_buttons()
        self.mark_dirty()

    def _reset(self) -> None:
        # per policy: request id → [admitted, first token, end of its last step]
        self.live: dict[str, dict[int, list[float]]] = {p: {} for p in POLICIES}
        self.memory: dict[str, list[tuple[float, float, float, float]]] = {p: [] for p in POLICIES}
        self.now: dict[str, float] = {}  # each policy's clock at its latest step
        self.done: dict[str, dict[int, SchedRequestDone]] = {p: {} for p in POLICIES}
        self.summaries: dict[str, SchedSummary] = {}

    # ---- widgets -------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        d = SchedConfig()
        self.requests_spin = spin_box(1, 256, d.n_requests, "Requests in the run")
        self.rate_spin = QtWidgets.QDoubleSpinBox()
        self.rate_spin.setRange(0.0, 1000.0)
        self.rate_spin.setDecimals(1)
        self.rate_spin.setValue(d.rate)
        self.rate_spin.setSpecialValueText("all at once")
        self.rate_spin.setToolTip("Arrival rate in requests per second (0: every request at t = 0)")
        self.burst_spin = QtWidgets.QDoubleSpinBox()
        self.burst_spin.setRange(0.1, 10.0)
        self.burst_spin.setSingleStep(0.1)
        self.burst_spin.setValue(d.burstiness)
        self.burst_spin.setToolTip("Gamma shape of the gaps between arrivals: 1 = Poisson, < 1 burstier, > 1 evener")
        self.prompt_spin = spin_box(1, 2048, d.prompt_len, "Mean prompt tokens (each request ±50%)")
        self.output_spin = spin_box(1, 1024, d.output_len, "Mean output tokens (each request ±50%, no EOS)")
        self.batch_spin = spin_box(1, 64, d.max_batch, "Most requests decoded together")
        self.page_spin = spin_box(1, 256, d.page_size, "Positions per KV page")
        self.policy_combo = QtWidgets.QComboBox()
        for key, label in (("both", "both policies"), ("static", "static only"), ("continuous", "continuous only")):
            self.policy_combo.addItem(label, key)
        # the knobs on a grid of rows: the panel shares a column with the other labs
        controls = QtWidgets.QGridLayout()
        controls.setContentsMargins(0, 0, 0, 0)
        controls.setHorizontalSpacing(4)
        controls.setVerticalSpacing(2)
        knobs = (("requests", self.requests_spin), ("rate/s", self.rate_spin), ("burstiness", self.burst_spin),
                 ("prompt", self.prompt_spin), ("output", self.output_spin), ("max batch", self.batch_spin),
                 ("page", self.page_spin))
        for i, (label, w) in enumerate(knobs):
            controls.addWidget(QtWidgets.QLabel(label), i // 3, 2 * (i % 3))
            controls.addWidget(w, i // 3, 2 * (i % 3) + 1)
        self.run_button = QtWidgets.QPushButton("Run")
        self.run_button.setToolTip("Serve these requests on the loaded model under each policy")
        self.run_button.clicked.connect(lambda: self.run())
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop after the current step")
        self.cancel_button.clicked.connect(self.cancel)
        buttons = QtWidgets.QHBoxLayout()
        for w in (self.policy_combo, self.run_button, self.cancel_button):
            buttons.addWidget(w)
        controls.addLayout(buttons, 2, 2, 1, 4)
        controls.setColumnStretch(6, 1)

        self.gantts: dict[str, _Gantt] = {}
        gantt_box = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical)
        for policy in POLICIES:
            w = self._plot(f"{policy} batching", "request", "time (s)")
            self.gantts[policy] = _Gantt(w)
            gantt_box.addWidget(w)
        self.gantts["continuous"].plot.setXLink(self.gantts["static"].plot)

        self.mem_plot = self._plot("KV memory", "MiB", "time (s)")
        mp = self.mem_plot.getPlotItem()
        mp.addLegend(offset=(5, 5), labelTextSize=f"{FONT_PT}pt")
        self.mem_note = placeholder(mp)
        self.contiguous_curve = mp.plot([], [], pen=pg.mkPen(SYSTEM_COLOR, width=1.5,
                                                             style=QtCore.Qt.PenStyle.DashLine),
                                        name="contiguous reserved")
        self.paged_curve = mp.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=1.5), name="paged allocated")
        self.used_curve = mp.plot([], [], pen=pg.mkPen(FOREGROUND, width=1), name="in use")
        self.mem_combo = QtWidgets.QComboBox()
        for policy in reversed(POLICIES):
            self.mem_combo.addItem(f"memory of {policy}", policy)
        self.mem_combo.currentIndexChanged.connect(lambda _i: self.mark_dirty())

        self.table = QtWidgets.QTableWidget(len(ROWS), len(POLICIES))
        self.table.setHorizontalHeaderLabels(list(POLICIES))
        self.table.setVerticalHeaderLabels([label for label, _ in ROWS])
        self.table.verticalHeader().setDefaultSectionSize(18)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.Stretch)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        font = self.table.font()
        font.setPointSize(FONT_PT)
        self.table.setFont(font)

        right = QtWidgets.QWidget()
        rl = QtWidgets.QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(self.table, 3)
        rl.addWidget(self.mem_combo)
        rl.addWidget(self.mem_plot, 2)
        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        split.addWidget(gantt_box)
        split.addWidget(right)
        split.setSizes([420, 300])
        split.setChildrenCollapsible(False)

        self.progress = QtWidgets.QLabel("")
        self.progress.setStyleSheet(f"color: {MUTED};")
        self.summary = QtWidgets.QLabel("")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        self.memory_note = QtWidgets.QLabel("")  # what the run will hold, said before Run (engine.costs.memory)
        self.memory_note.setWordWrap(True)
        self.memory_note.setStyleSheet(f"color: {MUTED};")
        layout.addLayout(controls)
        layout.addWidget(self.memory_note)
        layout.addWidget(self.progress)
        layout.addWidget(split, 1)
        layout.addWidget(self.summary)
        self.served_note = QtWidgets.QLabel("")
        self.served_note.setWordWrap(True)
        self.served_note.setStyleSheet(f"color: {MUTED};")
        self.served_note.setVisible(False)
        layout.addWidget(self.served_note)

    def _plot(self, title: str, y_label: str, x_label: str) -> pg.PlotWidget:
        w = pg.PlotWidget(background=BACKGROUND)
        w.setMinimumSize(160, 110)
        style_plot(w.getPlotItem(), left=(y_label, None), bottom=(x_label, None), mouse=False)
        w.getPlotItem().setTitle(title, size=f"{FONT_PT}pt", color=MUTED)
        return w

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        kv = costs.kv_cache_dtype(info)  # llama.cpp's cache is float16 under quantized weights
        per = costs.kv_bytes_per_token(cfg, kv)
        page = self.page_spin.value() if hasattr(self, "page_spin") else SchedConfig().page_size
        return (f"For {info.name} with a {kv} KV cache, one position of every request holds 2 · {cfg.n_layers} "
                f"layers · {cfg.n_kv_heads} KV heads · {cfg.head_dim} · {costs.bytes_per_value(kv):g} bytes = "
                f"{fmt_bytes(per)}, so a page of {page} positions is {fmt_bytes(per * page)}.")

    # ---- commands ------------------------------------------------------------------------------------------------
    def config(self) -> SchedConfig:
        rate = self.rate_spin.value()
        return replace(self._base, policy=self.policy_combo.currentData(), n_requests=self.requests_spin.value(),
                       rate=rate if rate > 0 else math.inf, burstiness=self.burst_spin.value(),
                       prompt_len=self.prompt_spin.value(), output_len=self.output_spin.value(),
                       max_batch=self.batch_spin.value(), page_size=self.page_spin.value())

    def _show_config(self, cfg: SchedConfig) -> None:
        """The controls show what is being measured (a run may come from elsewhere than the Run button)."""
        self._base = cfg  # settings without a control (seed, range ratio, budget) carry over to the next run
        for spin, value in ((self.requests_spin, cfg.n_requests), (self.rate_spin, 0.0 if math.isinf(cfg.rate)
                            else cfg.rate), (self.burst_spin, cfg.burstiness), (self.prompt_spin, cfg.prompt_len),
                            (self.output_spin, cfg.output_len), (self.batch_spin, cfg.max_batch),
                            (self.page_spin, cfg.page_size)):
            spin.setValue(value)
        self.policy_combo.setCurrentIndex(max(0, self.policy_combo.findData(cfg.policy)))

    def run(self) -> None:
        """Ask for a run with the controls' settings (the owner of the engine starts it)."""
        if self.bridge.info is None or self.running:
            return
        cfg = self.config()
        try:
            cfg.validate(self.bridge.cfg.context_length if self.bridge.cfg is not None else None)
        except ValueError as e:
            self.status, self.outcome = f"failed: {e}", "failed"
            self.mark_dirty()
            return
        mem = self.memory_of(cfg)
        why = mem.refusal(self.memory_available(), f"{mem.n_seq} sequences") if mem is not None else None
        if why is not None:  # refused before it starts: nothing is sent to the engine
            self.status, self.outcome = f"failed: {why}", "failed"
            self.mark_dirty()
            return
        self.plan, self.running, self.status, self.outcome = None, True, "", ""
        self._reset()
        self._update_buttons()
        self.sig_run_requested.emit(cfg)
        self.mark_dirty()

    def memory_of(self, cfg: SchedConfig) -> LabMemory | None:
        """What a run holds: each policy's page pool of max_batch requests of up to the longest length."""
        info, mcfg = self.bridge.info, self.bridge.cfg
        if info is None or mcfg is None:
            return None
        return lab_memory(info, mcfg, self.bridge.runtime or "torch", len(cfg.policies()) * cfg.max_batch,
                          cfg.longest(), pooled=True, page_size=cfg.page_size)

    def memory_line(self) -> str:
        mem = self.memory_of(self.config())
        if mem is None:
            return ""
        return (f"{len(self.config().policies())} policies × {self.config().max_batch} requests: {mem.line()}; "
                f"{size(self.memory_available())} available now")

    def cancel(self) -> None:
        if self.running:
            self.sig_cancel_requested.emit()
            self.status = "cancelling…"
            self.mark_dirty()

    @QtCore.Slot(object)
    def finish(self, done: LabDone) -> None:
        """The run ended (engine.protocol.LabDone). Its last summary has already said "done"; a failure after it
        (none is expected) still says so."""
        if not self.running and done.ok:
            return
        self.running, self.outcome = False, done.outcome
        self.status = {"done": "done", "cancelled": "cancelled", "failed": f"failed: {done.message}"}.get(
            done.outcome, done.message)  # unsupported: the runtime's one sentence as it is
        self._update_buttons()
        self.mark_dirty()

    def _update_buttons(self) -> None:
        self.run_button.setEnabled(self.bridge.info is not None and not self.running)
        self.cancel_button.setEnabled(self.running)

    @QtCore.Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        self._update_buttons()
        self.mark_dirty()

    # ---- events --------------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def on_event(self, ev: object) -> None:
        """Store one event of the lab (engine.labs.schedule_events); drawn on the next tick."""
        if isinstance(ev, SchedPlan):
            self.plan, self.running = ev, True
            self._reset()
            self._show_config(ev.config)
            self._update_buttons()
        elif isinstance(ev, SchedStep):
            live = self.live[ev.policy]
            end = ev.start_s + ev.step_s
            for rid in ev.request_ids:
                times = live.setdefault(rid, [ev.start_s, end, end])
                times[2] = end
            self.now[ev.policy] = end
            self.memory[ev.policy].append((end, ev.used_bytes, ev.paged_bytes, ev.contiguous_bytes))
        elif isinstance(ev, SchedRequestDone):
            self.done[ev.policy][ev.request_id] = ev
        elif isinstance(ev, SchedSummary):
            self.summaries[ev.policy] = ev
            if self.plan is not None and set(self.summaries) >= set(self.plan.policies):
                self.finish(LabDone("sched"))  # every policy summarised: the lab's end needs no more
        else:
            return
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_served_metrics(self, item: object) -> None:
        """The Load lab scraped its server's /metrics: keep the peak KV cache use it reported."""
        m = item.metrics
        if m.kv_usage is None:
            return
        if self._served_over:
            self.served, self._served_over = None, False
        server = self.bridge.server
        name = f"{server.kind} ({server.model})" if server is not None else "the server"
        running = m.running or 0.0
        per = m.kv_usage / running if running > 0 else 0.0
        if self.served is None:
            self.served = (name, m.kv_usage, running, per)
        else:
            _n, peak, at, best = self.served
            if m.kv_usage >= peak:
                peak, at = m.kv_usage, running
            self.served = (name, peak, at, max(best, per))
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_served_done(self, _done: LabDone) -> None:
        self._served_over = True

    def served_text(self) -> str:
        """The server's reported KV cache use beside this lab's (plain text; "" before the Load lab ran)."""
        if self.served is None:
            return ""
        name, peak, at, per = self.served
        text = (f"A real server beside it: {name} reported its KV cache at most {peak:.1%} in use during the Load "
                f"lab's last run, with {at:.0f} requests running then ({per:.2%} of its cache per running request "
                f"at most).")
        co = self.summaries.get("continuous")
        if co is not None and co.kv_budget_bytes > 0:
            text += (f" Here, continuous batching's paged cache peaked at {co.peak_paged_bytes / MIB:.2f} MiB, "
                     f"{co.peak_paged_bytes / co.kv_budget_bytes:.1%} of the lab's {co.kv_budget_bytes / MIB:.1f} MiB "
                     f"budget, against {co.peak_contiguous_bytes / co.kv_budget_bytes:.1%} reserved contiguously.")
        return text

    def clear(self) -> None:
        if not self.running:
            self.plan, self.status, self.outcome = None, "", ""
            self._reset()
        super().clear()

    # ---- drawing -------------------------------------------------------------------------------------------------
    def draw(self) -> None:
        self.memory_note.setText(self.memory_line())
        plan = self.plan
        horizon = max(self.now.values(), default=0.0)
        n = len(plan.requests) if plan is not None else self.requests_spin.value()
        for policy, g in self.gantts.items():
            self._draw_gantt(policy, g, horizon, n)
        self._draw_table()
        self._draw_memory()
        if plan is not None and self.running:
            steps = {p: len(m) for p, m in self.memory.items() if m}
            self.progress.setText("running: " + ", ".join(
                f"{p} {len(self.done[p])}/{n} done, {s} steps" for p, s in steps.items()) if steps else "warming up…")
        elif plan is not None:
            self.progress.setText(f"{plan.dtype} on {plan.device} · prefill: {plan.prefill_mode} · "
                                  f"{plan.kv_bytes_per_position:,.0f} B per position")
        else:
            self.progress.setText("" if self.bridge.info is not None else "Load a model to run the lab")
        served = self.served_text()
        self.served_note.setText(served)
        self.served_note.setVisible(bool(served))
        failed = self.outcome in ("failed", "unsupported")
        self.summary.setStyleSheet(f"color: {ERROR_COLOR if failed else FOREGROUND};")
        if failed or self.outcome == "cancelled" or (self.running and self.status):
            self.summary.setText(self.status)
        elif self.summaries:
            self.summary.setText(summarize(self.summaries))
        else:
            self.summary.setText("Set the workload and press Run: the same requests are served by static and by "
                                 "continuous batching, every step a real forward pass.")

    def _draw_gantt(self, policy: str, g: _Gantt, horizon: float, n: int) -> None:
        plan, live = self.plan, self.live[policy]
        now = self.now.get(policy)
        pi = g.plot.getPlotItem()
        if plan is None or now is None:
            for state in g.bars:
                g.set(state, np.zeros(0), np.zeros(0), np.zeros(0))
            if plan is None:
                text = "Run: one row per request,\nqueued · prefill · decode"
            else:
                text = "waiting for its turn" if policy in plan.policies else "not in this run"
            show_empty(pi, g.note, text, (0.0, max(horizon, 1.0)), (-0.5, max(n, 1) - 0.5))
            return
        g.note.setVisible(False)
        ids = np.array([r.request_id for r in plan.requests], dtype=float)
        arrival = np.array([r.arrival_s for r in plan.requests])
        times = np.array([live.get(r.request_id, [np.nan] * 3) for r in plan.requests], dtype=float)  # (n, 3)
        admitted = np.where(np.isnan(times[:, 0]), now, times[:, 0])
        g.set("queued", ids, arrival, np.minimum(admitted, now))
        started = ~np.isnan(times[:, 0])
        g.set("prefill", ids[started], times[started, 0], times[started, 1])
        g.set("decode", ids[started], times[started, 1], times[started, 2])
        pi.getViewBox().setRange(xRange=(0.0, max(horizon, 1e-3)), yRange=(-0.5, len(ids) - 0.5), padding=0.02)

    def _draw_table(self) -> None:
        for j, policy in enumerate(POLICIES):
            s = self.summaries.get(policy)
            for i, (_label, read) in enumerate(ROWS):
                value = read(s) if s is not None else None
                text = "–" if value is None or (isinstance(value, float) and math.isnan(value)) else (
                    f"{value:,}" if isinstance(value, int) else f"{value:,.2f}")
                set_number_cell(self.table, i, j, text)

    def _draw_memory(self) -> None:
        rows = self.memory[self.mem_combo.currentData()]
        mp = self.mem_plot.getPlotItem()
        self.mem_note.setVisible(not rows)
        if not rows:
            for c in (self.used_curve, self.paged_curve, self.contiguous_curve):
                c.setData([], [])
            show_empty(mp, self.mem_note, "Run: KV memory in use,\npaged and contiguous", (0.0, 1.0), (0.0, 1.0))
            return
        m = np.array(rows)  # (steps, 4): time, used, paged, contiguous
        t = np.concatenate([[0.0], m[:, 0]])
        for curve, col in ((self.used_curve, 1), (self.paged_curve, 2), (self.contiguous_curve, 3)):
            curve.setData(t, np.concatenate([[0.0], m[:, col] / MIB]), stepMode="right")
        mp.getViewBox().setRange(xRange=(0.0, t[-1]), yRange=(0.0, max(m[:, 3].max(), m[:, 2].max()) / MIB * 1.1),
                                 padding=0.02)


PANEL = SchedulingPanel
