"""The guided tour: the course text's claims, one step each, made and measured on the loaded model.

The steps are data (resources/tour.json: title, claim, the text's own figure, the panels to show, the actions to
run, the figure to measure). This module runs them: `TourController` lays out each step's panels (only those, large,
beside a card with the step's text), drives the existing panels and labs through their public methods, waits for
their events (never a sleep), and computes the step's figure from what the run reported — the tokenizer, ModelInfo,
the Finished event, the KV cache's growth, the machine measured by the roofline, the labs' results. Nothing measured
is written in the step file: the file quotes only the text's own figures.

Leaving (Leave, Esc, closing the window) at any step restores the dock layout (QMainWindow.saveState), the prompt,
the sampling settings and every lab control the tour touched, exactly as they were.
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from PySide6 import QtCore, QtGui, QtWidgets

from app import theme
from app.guard import guarded

TOUR_FILE = "tour.json"
OFFERED = "tour/offered"  # QSettings key: the tour was offered once on a first start
CARD_WIDTH = 400  # the step card's width (px): readable at 1366 × 768 beside one or two large panels


# ---- the step file --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    id: str
    title: str
    claim: str
    text_says: str
    panels: tuple[str, ...]
    arrange: str  # "rows" (stacked) or "columns" (side by side)
    actions: tuple[dict, ...]
    figure: str
    agrees: str
    disagrees: str


def load_steps(text: str | None = None) -> tuple[str, list[Step]]:
    """(intro, steps) from resources/tour.json (or from `text`); ValueError naming the first bad step."""
    raw = json.loads(text if text is not None else resources.files("resources").joinpath(TOUR_FILE).read_text("utf-8"))
    steps = []
    for i, s in enumerate(raw["steps"]):
        try:
            step = Step(id=s["id"], title=s["title"], claim=s["claim"], text_says=s["text_says"],
                        panels=tuple(s["panels"]), arrange=s.get("arrange", "rows"),
                        actions=tuple(s.get("actions", ())), figure=s["figure"], agrees=s["agrees"],
                        disagrees=s["disagrees"])
        except KeyError as e:
            raise ValueError(f"tour step {i + 1} has no {e.args[0]!r}") from None
        if step.arrange not in ("rows", "columns"):
            raise ValueError(f"tour step {step.id}: arrange must be rows or columns, not {step.arrange!r}")
        if not step.panels:
            raise ValueError(f"tour step {step.id} shows no panel")
        steps.append(step)
    return raw.get("intro", ""), steps


@dataclass
class Figure:
    """A step's measurement: `value` (the number the test checks is finite), `here` (the sentence beside the
    text's figure) and whether this machine agrees with the text (None: nothing to compare)."""

    value: float
    here: str
    agrees: bool | None = None


# ---- what the tour records of the live run -------------------------------------------------------------------------
@dataclass
class Record:
    prompt: Any = None  # PromptTokenized
    prefill: Any = None  # PrefillDone
    last_decode: Any = None  # the last decode TokenSampled
    last_logits: Any = None  # the last TokenSampled that captured its logits
    kv: Any = None  # the last KVCacheGrew
    finished: Any = None  # Finished
    batch_rows: dict = field(default_factory=dict)  # batch → BatchRow (of the tour's last batching run)
    sched: dict = field(default_factory=dict)  # policy → SchedSummary
    spec: Any = None  # SpecFinished
    why: Any = None  # ExperimentDone
    failure: str = ""


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _fmt_bytes(b: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:,.0f} B"


def _need(value: Any, what: str) -> Any:
    if value is None:
        raise LookupError(what)
    return value


# ---- the figures: name → how to compute it from the live run -----------------------------------------------------
def fig_words_per_token(t: TourController) -> Figure:
    text = t.window.panels["prompt"].text()
    tok = _need(t.window.bridge.tokenizer, "no tokenizer loaded")
    n_tokens = len(tok.encode(text).ids)
    words = len(text.split())
    value = words / n_tokens
    return Figure(value, f"this prompt: {words} words in {n_tokens} tokens = <b>{value:.2f}</b> words per token",
                  0.6 <= value <= 0.9)


def fig_kv_bytes_per_token(t: TourController) -> Figure:
    info = _need(t.window.bridge.info, "no model loaded")
    kv = _need(t.rec.kv, "the run reported no KV cache growth")
    per_value = info.kv_bytes_per_token / (2 * info.n_layers * info.n_kv_heads * info.head_dim)
    measured = kv.bytes_used / max(1, kv.n_tokens)
    return Figure(measured, (
        f"{info.name}: 2 · {info.n_layers} · {info.n_kv_heads} · {info.head_dim} · {per_value:g} B = "
        f"<b>{info.kv_bytes_per_token:,} bytes</b> per token; the engine's cache holds {_fmt_bytes(kv.bytes_used)} "
        f"for {kv.n_tokens} tokens = <b>{measured:,.0f}</b> bytes per token"),
        abs(measured - info.kv_bytes_per_token) <= 0.01 * info.kv_bytes_per_token)


def fig_prefill_vs_decode(t: TourController) -> Figure:
    fin = _need(t.rec.finished, "the generation did not finish")
    pre = _need(t.rec.prefill, "the run reported no prefill")
    if fin.tpot_s <= 0:
        raise LookupError("the run made only one token")
    per_prompt = pre.seconds / max(1, pre.n_tokens)
    ratio = fin.tpot_s / per_prompt
    return Figure(ratio, (
        f"prefill: {pre.n_tokens} tokens in {_fmt_s(pre.seconds)} (TTFT {_fmt_s(fin.ttft_s)}) = "
        f"{_fmt_s(per_prompt)} per token; decode: TPOT <b>{_fmt_s(fin.tpot_s)}</b>, one token per pass — a decode "
        f"token costs <b>{ratio:.1f} ×</b> a prompt token"), ratio >= 2)


def fig_tpot_floor(t: TourController) -> Figure:
    fin = _need(t.rec.finished, "the generation did not finish")
    tok = _need(t.rec.last_decode, "the run had no decode step")
    hw = _need(t.machine(), "this machine has not been measured")
    bw = hw.bandwidth_bytes_per_s
    floor = tok.cost.bytes / bw
    ratio = fin.tpot_s / floor
    return Figure(ratio, (
        f"a decode step reads {_fmt_bytes(tok.cost.bytes)}; this machine's measured bandwidth is "
        f"{bw / 1e9:.1f} GB/s, so the floor is <b>{_fmt_s(floor)}</b>; measured TPOT <b>{_fmt_s(fin.tpot_s)}</b> "
        f"(<b>{ratio:.2f} ×</b> the floor)"), ratio <= 2.5)


def _batch_rows(t: TourController) -> tuple[Any, Any]:
    rows = t.rec.batch_rows
    if 1 not in rows or 8 not in rows:
        raise LookupError("the batching lab did not measure batch 1 and batch 8")
    return rows[1], rows[8]


def fig_batch_gain(t: TourController) -> Figure:
    one, eight = _batch_rows(t)
    gain = eight.tokens_per_s_system / one.tokens_per_s_system
    here = (f"batch 1: {one.tokens_per_s_system:.1f} tok/s; batch 8: {eight.tokens_per_s_system:.1f} tok/s for the "
            f"system = <b>{gain:.2f} ×</b> batch 1")
    roofs = t.window.panels["batching"].roofs()
    if roofs is not None and roofs[1] > 0:
        ridge = roofs[0] / roofs[1]
        bound = "compute-bound" if eight.intensity >= ridge else "still memory-bound"
        here += (f"; at batch 8 a step does {eight.intensity:.1f} FLOP per byte against this machine's ridge of "
                 f"{ridge:.1f}: <b>{bound}</b>")
    return Figure(gain, here, gain >= 4)


def fig_stream_vs_system(t: TourController) -> Figure:
    one, eight = _batch_rows(t)
    slower = one.tokens_per_s_per_stream / eight.tokens_per_s_per_stream
    ratio = eight.tokens_per_s_system / eight.tokens_per_s_per_stream
    return Figure(ratio, (
        f"batch 8: each stream {eight.tokens_per_s_per_stream:.1f} tok/s (1 / TPOT of {_fmt_s(eight.tpot_s)}), the "
        f"system <b>{eight.tokens_per_s_system:.1f} tok/s</b> ({ratio:.1f} streams' worth); one stream alone ran at "
        f"{one.tokens_per_s_per_stream:.1f} tok/s, so batching made each stream <b>{slower:.2f} ×</b> slower"),
        slower <= 2)


def fig_latency(t: TourController) -> Figure:
    fin = _need(t.rec.finished, "the generation did not finish")
    n = len(fin.ids)
    predicted = fin.ttft_s + (n - 1) * fin.tpot_s
    if fin.total_s <= 0:
        raise LookupError("the run reported no total time")
    ratio = predicted / fin.total_s
    return Figure(ratio, (
        f"TTFT {_fmt_s(fin.ttft_s)} + ({n} − 1) · {_fmt_s(fin.tpot_s)} = <b>{_fmt_s(predicted)}</b>; measured "
        f"end to end <b>{_fmt_s(fin.total_s)}</b> (the formula is {ratio:.1%} of it; {_fmt_s(fin.outside_steps_s)} "
        "went outside the timed steps)"), abs(1 - ratio) <= 0.1)


def fig_sampling_share(t: TourController) -> Figure:
    from engine.run.refunnel import funnel_stages

    tok = _need(t.rec.last_logits, "no step captured its logits")
    params = tok.params if tok.params is not None else t.window.bridge.params
    best = math.inf
    for _ in range(5):  # the fastest of a few: the funnel's own cost, not a pause of the GUI thread
        t0 = time.perf_counter()
        funnel_stages(tok.logits, params, None)
        best = min(best, time.perf_counter() - t0)
    share = best / tok.seconds
    return Figure(share, (
        f"the funnel (temperature, top-k, top-p over {tok.logits.shape[-1]:,} logits, engine.run.refunnel) takes "
        f"<b>{_fmt_s(best)}</b>; the step it belongs to took {_fmt_s(tok.seconds)}: <b>{share:.1%}</b> of a step"),
        share <= 0.1)


def fig_continuous_gain(t: TourController) -> Figure:
    st, co = t.rec.sched.get("static"), t.rec.sched.get("continuous")
    if st is None or co is None:
        raise LookupError("the scheduling lab did not summarise both policies")
    ratio = st.ttft.p50 / co.ttft.p50 if co.ttft.p50 > 0 else math.inf
    return Figure(ratio, (
        f"{co.n_requests} requests: median TTFT static <b>{_fmt_s(st.ttft.p50)}</b>, continuous "
        f"<b>{_fmt_s(co.ttft.p50)}</b> ({ratio:.2f} ×); system {st.system_tokens_per_s:.1f} against "
        f"{co.system_tokens_per_s:.1f} tok/s; mean decode batch {st.mean_decode_batch:.2f} against "
        f"{co.mean_decode_batch:.2f}"), ratio > 1.05)


def fig_paged_fit(t: TourController) -> Figure:
    co = t.rec.sched.get("continuous")
    if co is None:
        raise LookupError("the scheduling lab did not summarise continuous batching")
    ratio = co.contiguous_bytes_per_request / co.paged_bytes_per_request
    return Figure(ratio, (
        f"a running request held <b>{_fmt_bytes(co.paged_bytes_per_request)}</b> in pages on average against "
        f"<b>{_fmt_bytes(co.contiguous_bytes_per_request)}</b> reserved contiguously: the same memory holds "
        f"<b>{ratio:.2f} ×</b> as many requests (the lab's {_fmt_bytes(co.kv_budget_bytes)} budget: "
        f"{co.fits_paged} paged against {co.fits_contiguous} contiguous); peak {_fmt_bytes(co.peak_paged_bytes)} "
        f"paged against {_fmt_bytes(co.peak_contiguous_bytes)} reserved"), ratio > 1.05)


def fig_speculative_gain(t: TourController) -> Figure:
    fin = _need(t.rec.spec, "the speculative lab did not finish")
    per_pass = (len(fin.ids) - 1) / max(1, fin.n_passes)
    accepted = int(fin.accepted_by_position.sum())
    drafted = int(fin.drafted_by_position.sum())
    here = (f"k = {fin.k} ({fin.source_label}): {accepted} of {drafted} guesses kept, <b>{per_pass:.2f}</b> tokens "
            f"per full pass; {fin.tokens_per_s:.1f} tok/s")
    if fin.baseline_tokens_per_s > 0:
        speedup = fin.tokens_per_s / fin.baseline_tokens_per_s
        here += f" against plain decoding's {fin.baseline_tokens_per_s:.1f}: <b>{speedup:.2f} ×</b>"
        return Figure(per_pass, here, speedup > 1)
    return Figure(per_pass, here, None)


def fig_induction_head(t: TourController) -> Figure:
    done = _need(t.rec.why, "the Why experiment did not finish")
    if done.result is None:
        raise LookupError(done.failure or "the Why experiment did not finish")
    import numpy as np

    m = np.asarray(done.result["scores"]["induction"], dtype=float)
    layer, head = np.unravel_index(int(np.nanargmax(m)), m.shape)
    score = float(m[layer, head])
    return Figure(score, (
        f"strongest induction head: layer {layer}, head {head}, with <b>{score:.2f}</b> of its attention on the "
        f"token after the earlier copy ({m.shape[0]} layers × {m.shape[1]} heads scored in {done.seconds:.1f} s)"),
        score >= 0.3)


FIGURES: dict[str, Callable[[TourController], Figure]] = {
    "words_per_token": fig_words_per_token, "kv_bytes_per_token": fig_kv_bytes_per_token,
    "prefill_vs_decode": fig_prefill_vs_decode, "tpot_floor": fig_tpot_floor, "batch_gain": fig_batch_gain,
    "stream_vs_system": fig_stream_vs_system, "latency": fig_latency, "sampling_share": fig_sampling_share,
    "continuous_gain": fig_continuous_gain, "paged_fit": fig_paged_fit, "speculative_gain": fig_speculative_gain,
    "induction_head": fig_induction_head,
}
ACTIONS = ("prompt", "preview", "generate", "sampling", "measure_machine", "batching", "schedule", "speculate",
           "why_heads")


# ---- the card ------------------------------------------------------------------------------------------------------
class TourCard(QtWidgets.QWidget):
    """The step's text, the text's figure beside the measured one, and Back / Next / Leave."""

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("tour_card")
        outer = QtWidgets.QVBoxLayout(self)
        outer.setContentsMargins(10, 8, 10, 8)
        self.counter = QtWidgets.QLabel()
        self.counter.setStyleSheet(f"color: {theme.MUTED};")
        self.title = QtWidgets.QLabel()
        font = self.title.font()
        font.setPointSizeF(font.pointSizeF() * 1.35)
        font.setBold(True)
        self.title.setFont(font)
        self.title.setWordWrap(True)
        self.body = QtWidgets.QLabel()
        self.body.setWordWrap(True)
        self.body.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.body.setAlignment(QtCore.Qt.AlignmentFlag.AlignTop | QtCore.Qt.AlignmentFlag.AlignLeft)
        self.body.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        scroll = QtWidgets.QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(self.body)
        self.status = QtWidgets.QLabel()
        self.status.setWordWrap(True)
        self.status.setStyleSheet(f"color: {theme.MUTED};")
        buttons = QtWidgets.QHBoxLayout()
        self.back_button = QtWidgets.QPushButton("◀ Back")
        self.next_button = QtWidgets.QPushButton("Next ▶")
        self.leave_button = QtWidgets.QPushButton("Leave (Esc)")
        self.next_button.setDefault(True)
        for b in (self.back_button, self.next_button, self.leave_button):
            buttons.addWidget(b)
        outer.addWidget(self.counter)
        outer.addWidget(self.title)
        outer.addWidget(scroll, 1)
        outer.addWidget(self.status)
        outer.addLayout(buttons)
        self.setMinimumWidth(CARD_WIDTH - 40)

    def show_step(self, index: int, count: int, step: Step, figure: Figure | None, status: str) -> None:
        self.counter.setText(f"The course, on the live model · step {index + 1} of {count}")
        self.title.setText(step.title)
        esc = html.escape
        parts = [f"<p style='font-size:11pt'>{esc(step.claim)}</p>",
                 f"<p><b>The text:</b> {esc(step.text_says)}</p>"]
        if figure is not None:
            parts.append(f"<p><b>Here:</b> {figure.here}</p>")
            if figure.agrees is not None:
                colour = theme.MUTED if figure.agrees else theme.WARNING_COLOR
                mark = "✓ as the text says." if figure.agrees else "≠ this machine disagrees."
                note = step.agrees if figure.agrees else step.disagrees
                parts.append(f"<p><span style='color:{colour}'><b>{mark}</b></span> {esc(note)}</p>")
        self.body.setText("".join(parts))
        self.status.setText(status)
        self.back_button.setEnabled(index > 0)
        self.next_button.setText("Finish" if index == count - 1 else "Next ▶")


# ---- the controller -------------------------------------------------------------------------------------------------
@dataclass
class Saved:
    """What the tour changes and gives back on leaving."""

    state: QtCore.QByteArray
    size: QtCore.QSize
    floating: dict  # dock name → its geometry, for the docks the user had floating
    prompt: str
    chat: bool
    gen_text: str
    gen_chat: bool
    max_new_tokens: int
    ignore_eos: bool
    params: Any
    labs: dict


class TourController(QtCore.QObject):
    sig_step_ready = QtCore.Signal(int)
    """A step's actions ran and its figure was computed (or could not be: `failure`)."""
    sig_left = QtCore.Signal()
    """The tour ended and the window is as it was."""

    def __init__(self, window: QtWidgets.QMainWindow, steps: list[Step] | None = None) -> None:
        super().__init__(window)
        self.window = window
        self.intro, loaded = load_steps()
        self.steps = steps if steps is not None else loaded
        self.index = -1
        self.active = False
        self.busy = False
        self.rec = Record()
        self.figures: dict[int, Figure] = {}
        self.failures: dict[int, str] = {}
        self.unsupported: dict[int, str] = {}  # step → the runtime's sentence: it cannot run that lab at all
        self.saved: Saved | None = None
        self.closing_state: QtCore.QByteArray | None = None  # the user's layout, when the window closed on the tour
        self._run = 0  # bumps on every step start and on leaving: a stale callback sees another number
        self._waits: list[tuple[QtCore.SignalInstance, Callable]] = []
        self.card = TourCard()
        self.dock = QtWidgets.QDockWidget("Tour", window)
        self.dock.setObjectName("tour_dock")
        self.dock.setWidget(self.card)
        self.dock.setFeatures(QtWidgets.QDockWidget.DockWidgetFeature.NoDockWidgetFeatures)
        self.dock.hide()
        window.removeDockWidget(self.dock)
        self.card.back_button.clicked.connect(self.back)
        self.card.next_button.clicked.connect(self.next)
        self.card.leave_button.clicked.connect(self.leave)
        b = window.bridge
        # what the tour records and watches, attached only while it is open: a closed tour costs the run nothing
        self._recorders = ((b.sig_prompt, self._on_prompt), (b.sig_prefill, self._on_prefill),
                           (b.sig_token, self._on_token), (b.sig_kv, self._on_kv), (b.sig_finished, self._on_finished),
                           (b.sig_batch_row, self._on_batch_row), (b.sig_sched, self._on_sched),
                           (b.sig_spec, self._on_spec), (b.sig_why_done, self._on_why))

    def _attach(self, on: bool) -> None:
        """Record the run's events and watch Esc and the window's Close while the tour is open (on), or stop."""
        app = QtWidgets.QApplication.instance()
        for sig, slot in self._recorders:
            if on:
                sig.connect(slot)
            else:
                sig.disconnect(slot)
        for target in (app, self.window):
            if on:
                target.installEventFilter(self)
            else:
                target.removeEventFilter(self)

    # ---- recording ----
    def _on_prompt(self, ev: Any) -> None:
        self.rec.prompt = ev

    def _on_prefill(self, ev: Any) -> None:
        self.rec.prefill = ev

    def _on_token(self, ev: Any) -> None:
        if ev.phase == "decode":
            self.rec.last_decode = ev
        if ev.logits is not None:
            self.rec.last_logits = ev

    def _on_kv(self, ev: Any) -> None:
        self.rec.kv = ev

    def _on_finished(self, ev: Any) -> None:
        self.rec.finished = ev

    def _on_batch_row(self, row: Any) -> None:
        self.rec.batch_rows[row.batch] = row

    def _on_sched(self, ev: Any) -> None:
        from engine.labs.schedule_events import SchedPlan, SchedSummary

        if isinstance(ev, SchedPlan):
            self.rec.sched = {}
        elif isinstance(ev, SchedSummary):
            self.rec.sched[ev.policy] = ev

    def _on_spec(self, ev: Any) -> None:
        from engine.labs.spec_events import SpecFinished

        if isinstance(ev, SpecFinished):
            self.rec.spec = ev

    def _on_why(self, done: Any) -> None:
        self.rec.why = done

    def machine(self) -> Any:
        """This machine's measured roofs for the loaded model's dtype (the roofline's), or None."""
        return self.window.panels["roofline"].this_machine_roofs() or self._measured_fp32()

    def _measured_fp32(self) -> Any:
        roof = self.window.panels["roofline"]
        return self.window.bridge.this_machine(roof.device(), "fp32")

    # ---- starting and leaving ----
    def start(self, index: int = 0) -> None:
        """Open the tour at step `index` (0-based), remembering what to give back on leaving."""
        if not self.active:
            self.saved = self._snapshot()
            self.active = True
            self._attach(True)
            self.window.addDockWidget(QtCore.Qt.DockWidgetArea.RightDockWidgetArea, self.dock)
            self.dock.show()
        self.go(index)

    def start_when_loaded(self, index: int = 0) -> None:
        """Open the tour at step `index` once the model has loaded (at once when it already has)."""
        b = self.window.bridge
        if b.info is not None:
            self.start(index)
            return

        def go(_info: Any) -> None:
            b.sig_model_loaded.disconnect(go)
            self.start(index)

        b.sig_model_loaded.connect(go)

    def go(self, index: int) -> None:
        if not self.active or not 0 <= index < len(self.steps):
            return
        self._stop_running()
        self.index = index
        self._run += 1
        self._layout(self.steps[index])
        self._show(f"Running: {self._describe(self.steps[index])}…")
        self.busy = True
        self._set_buttons()
        self._when_idle(lambda run=self._run: self._run_actions(run, 0))

    @guarded
    def next(self) -> None:
        if self.busy:
            return
        if self.index >= len(self.steps) - 1:
            self.leave()
        else:
            self.go(self.index + 1)

    @guarded
    def back(self) -> None:
        if not self.busy and self.index > 0:
            self.go(self.index - 1)

    @guarded
    def leave(self) -> None:
        """End the tour: stop what it started, and give back the layout, the prompt and the settings."""
        if not self.active:
            return
        self.active, self.busy = False, False
        self._attach(False)
        self._run += 1
        self._drop_waits()
        self._stop_running()
        w = self.window
        self.dock.hide()
        w.removeDockWidget(self.dock)
        if self.saved is not None:
            self._give_back(self.saved)
        self.saved = None
        self.index = -1
        self.sig_left.emit()

    # ---- Esc, and closing the window while on tour ----
    @guarded(default=False)
    def eventFilter(self, obj: QtCore.QObject, event: QtCore.QEvent) -> bool:  # noqa: N802 — Qt's name
        if not self.active:
            return False
        kind = event.type()
        if obj is self.window and kind == QtCore.QEvent.Type.Close:
            # the window saves its settings next: the user's layout as it was (restoreState's layout would only
            # settle after this event), not the tour's
            self.closing_state = self.saved.state if self.saved is not None else None
            self.leave()
        elif (kind in (QtCore.QEvent.Type.ShortcutOverride, QtCore.QEvent.Type.KeyPress)
              and event.key() == QtCore.Qt.Key.Key_Escape and isinstance(obj, QtWidgets.QWidget)
              and obj.window() is self.window):
            QtCore.QTimer.singleShot(0, self.leave)
        return False

    # ---- snapshot ----
    def _snapshot(self) -> Saved:
        w, p = self.window, self.window.panels
        prompt, gen = p["prompt"], p["generation"]
        batching, sched, spec, why = p.get("batching"), p.get("scheduling"), p.get("speculative"), p.get("why")
        labs: dict[str, Any] = {}
        if batching is not None:
            labs["batching"] = (batching.selected_batches(), batching.prompt_spin.value(), batching.new_spin.value())
        if sched is not None:
            labs["scheduling"] = sched.config()
        if spec is not None:
            labs["speculative"] = (spec.prompt_edit.toPlainText(), spec.k_spin.value(), spec.tokens_spin.value(),
                                   spec.source_combo.currentIndex(), spec.sweep_box.isChecked())
        if why is not None:
            labs["why"] = (why.mode(), why.repeat_spin.value())
        floating = {n: d.geometry() for n, d in w.docks.items() if d.isFloating()}
        return Saved(state=w.saveState(), size=w.size(), floating=floating, prompt=prompt.text(), chat=prompt.chat(),
                     gen_text=gen.text(), gen_chat=gen.chat(), max_new_tokens=gen.max_tokens.value(),
                     ignore_eos=gen.ignore_eos, params=w.bridge.params, labs=labs)

    def _give_back(self, s: Saved) -> None:
        w, p = self.window, self.window.panels
        prompt, gen = p["prompt"], p["generation"]
        prompt.set_text(s.prompt)
        prompt.set_chat(s.chat)
        gen.set_chat(s.gen_chat)
        if gen.text() != s.gen_text:
            gen.set_text(s.gen_text)
        gen.set_max_new_tokens(s.max_new_tokens)
        gen.ignore_eos = s.ignore_eos
        if w.bridge.params != s.params:
            w.bridge.set_params(s.params)
        if "batching" in s.labs:
            batches, n_prompt, n_new = s.labs["batching"]
            lab = p["batching"]
            for b, box in lab.batch_boxes.items():
                box.setChecked(b in batches)
            lab.prompt_spin.setValue(n_prompt)
            lab.new_spin.setValue(n_new)
        if "scheduling" in s.labs:
            _set_sched(p["scheduling"], s.labs["scheduling"])
        if "speculative" in s.labs:
            text, k, tokens, source, sweep = s.labs["speculative"]
            lab = p["speculative"]
            lab.prompt_edit.setPlainText(text)
            lab.k_spin.setValue(k)
            lab.tokens_spin.setValue(tokens)
            lab.source_combo.setCurrentIndex(source)
            lab.sweep_box.setChecked(sweep)
        if "why" in s.labs:
            mode, repeat = s.labs["why"]
            p["why"].set_mode(mode)
            p["why"].repeat_spin.setValue(repeat)
        w.resize(s.size)  # the tour's layout may have asked for another size: the user's, then the user's docks
        w.restoreState(s.state)
        w.restoreState(s.state)  # the first pass lays the docks out; the second gets every splitter's sizes exact
        for name, geometry in s.floating.items():
            w.docks[name].setGeometry(geometry)

    # ---- layout ----
    def _layout(self, step: Step) -> None:
        """Only the step's panels, large, left of the card."""
        w = self.window
        shown = [w.docks[name] for name in step.panels if name in w.docks]
        for name, dock in w.docks.items():
            if name not in step.panels:
                w.removeDockWidget(dock)  # out of the layout (a hidden tab would leave its tab bar behind)
        area = QtCore.Qt.DockWidgetArea.LeftDockWidgetArea
        orientation = (QtCore.Qt.Orientation.Vertical if step.arrange == "rows" else
                       QtCore.Qt.Orientation.Horizontal)
        for i, dock in enumerate(shown):
            dock.setFloating(False)
            if i == 0:
                w.addDockWidget(area, dock)
            else:
                w.splitDockWidget(shown[i - 1], dock, orientation)
            dock.show()
        w.addDockWidget(QtCore.Qt.DockWidgetArea.RightDockWidgetArea, self.dock)
        self.dock.show()
        if self.saved is not None:
            w.resize(self.saved.size)  # docks taken out of a crowded layout must not grow the window
        titles = {d.windowTitle() for d in shown}
        for bar in w.findChildren(QtWidgets.QTabBar):
            if bar.parent() is w and not titles & {bar.tabText(i) for i in range(bar.count())}:
                bar.hide()  # the tab bar of a group the step took apart (restoreState brings it back)
        width = max(w.width(), 800)
        card = min(CARD_WIDTH + 40, width // 3)
        w.resizeDocks([shown[0], self.dock], [width - card, card], QtCore.Qt.Orientation.Horizontal)
        if len(shown) > 1:
            span = w.height() if step.arrange == "rows" else width - card
            w.resizeDocks(shown, [span // len(shown)] * len(shown), orientation)

    # ---- running a step ----
    def _describe(self, step: Step) -> str:
        return ", ".join(_ACTION_WORDS.get(a["do"], a["do"]) for a in step.actions) or "nothing to run"

    def _show(self, status: str) -> None:
        step = self.steps[self.index]
        self.card.show_step(self.index, len(self.steps), step, self.figures.get(self.index), status)

    def _set_buttons(self) -> None:
        self.card.next_button.setEnabled(not self.busy)
        self.card.back_button.setEnabled(not self.busy and self.index > 0)

    def _engine_busy(self) -> bool:
        p = self.window.panels
        gen = p["generation"]
        labs = (p.get(name) for name in ("batching", "scheduling", "speculative", "why"))
        return (gen.state != "idle" or p["roofline"].measuring
                or any(getattr(lab, "running", None) not in (None, False) for lab in labs))

    def _when_idle(self, then: Callable[[], None]) -> None:
        """Call `then` once nothing the tour could start is running (checked on each state change and lab end)."""
        if not self._engine_busy():
            QtCore.QTimer.singleShot(0, then)
            return
        b = self.window.bridge
        run = self._run

        def check(*_a: Any) -> None:
            if run != self._run:
                return
            if not self._engine_busy():
                self._drop_waits()
                QtCore.QTimer.singleShot(0, then)

        for sig in (b.sig_state, b.sig_batch_done, b.sig_sched_done, b.sig_spec_done, b.sig_why_done,
                    b.sig_measure_done, b.sig_finished):
            self._wait(sig, check)

    def _wait(self, sig: QtCore.SignalInstance, slot: Callable) -> None:
        sig.connect(slot)
        self._waits.append((sig, slot))

    def _drop_waits(self) -> None:
        waits, self._waits = self._waits, []
        for sig, slot in waits:
            try:
                sig.disconnect(slot)
            except (RuntimeError, TypeError):
                pass

    def _stop_running(self) -> None:
        """Stop a generation or lab the tour started (it is moving on or leaving)."""
        self._drop_waits()
        p = self.window.panels
        gen = p["generation"]
        if gen.state != "idle":
            gen.stop()
        for name in ("batching", "scheduling", "why"):
            lab = p.get(name)
            if lab is not None and getattr(lab, "running", None) not in (None, False):
                lab.cancel()
        spec = p.get("speculative")
        if spec is not None and spec.running:
            self.window.bridge.cancel_lab()
        if p["roofline"].measuring:
            p["roofline"].cancel_measure()

    @guarded
    def _run_actions(self, run: int, i: int) -> None:
        if run != self._run:
            return
        step = self.steps[self.index]
        if i >= len(step.actions):
            self._finish_step(run)
            return
        action = step.actions[i]
        self._drop_waits()

        def done(failure: str = "", unsupported: bool = False) -> None:
            if run != self._run:
                return
            self._drop_waits()
            if unsupported:
                self.unsupported[self.index] = failure
            if failure:
                self.rec.failure = failure
                self._finish_step(run, failure)
            else:
                QtCore.QTimer.singleShot(0, lambda: self._run_actions(run, i + 1))

        getattr(self, f"_do_{action['do']}")(action, done)

    def _finish_step(self, run: int, failure: str = "") -> None:
        if run != self._run:
            return
        if not failure:
            self.unsupported.pop(self.index, None)
        self.busy = False
        if not failure:
            try:
                self.figures[self.index] = FIGURES[self.steps[self.index].figure](self)
                self.failures.pop(self.index, None)
            except (LookupError, ZeroDivisionError) as e:
                failure = str(e) or type(e).__name__
        if failure:
            self.figures.pop(self.index, None)
            self.failures[self.index] = failure
            runtime = self.window.bridge.runtime or "this runtime"
            what = (f"{runtime} cannot run this step's lab" if self.index in self.unsupported
                    else "Could not measure")
            self._show(f"<span style='color:{theme.WARNING_COLOR}'>{what}: {html.escape(failure)}</span>")
        else:
            self._show("Measured on the loaded model, just now. Next ▶ goes on; Esc leaves.")
        self._set_buttons()
        self.sig_step_ready.emit(self.index)

    # ---- the actions ----
    def _do_prompt(self, a: dict, done: Callable[..., None]) -> None:
        p = self.window.panels
        p["prompt"].set_text(a["text"])
        chat = bool(a.get("chat", False))
        p["prompt"].set_chat(chat)
        p["generation"].set_chat(chat)
        done()

    def _do_preview(self, _a: dict, done: Callable[..., None]) -> None:
        """The next-token preview of the prompt shown (the model's top candidates, one forward pass)."""
        preview = self.window.panels.get("preview")
        if preview is None:
            done()
            return
        self._wait(self.window.bridge.sig_preview, lambda _r: done())
        preview.request_now()

    def _do_sampling(self, a: dict, done: Callable[..., None]) -> None:
        b = self.window.bridge
        knobs = {k: a[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed") if k in a}
        b.set_params(replace(b.params, **knobs))
        done()

    def _do_generate(self, a: dict, done: Callable[..., None]) -> None:
        w = self.window
        gen = w.panels["generation"]
        if a.get("greedy", True):
            w.bridge.set_params(replace(w.bridge.params, temperature=0.0))
        gen.set_max_new_tokens(int(a.get("tokens", 16)))
        gen.ignore_eos = True  # exactly the step's tokens (the user's choice comes back on leaving)
        self.rec.finished = self.rec.prefill = self.rec.last_decode = self.rec.kv = None
        self._wait(w.bridge.sig_finished, lambda _ev: done())
        self._wait(w.bridge.sig_failed, lambda msg: done(msg or "the generation failed"))
        if not gen.generate():
            done("the generation could not start")

    def _do_measure_machine(self, _a: dict, done: Callable[..., None]) -> None:
        roof = self.window.panels["roofline"]
        b = self.window.bridge
        from engine.model import dtypes

        dtype = roof.dtype() if roof.dtype() in dtypes.MEASURABLE else "fp32"
        if b.this_machine(roof.device(), dtype) is not None:
            done()
            return
        if not b.this_machine_answered(roof.device(), dtype):  # the engine has not said yet: ask again when it has
            self._wait(b.sig_this_machine, lambda _answer: self._do_measure_machine(_a, done))
            return
        self._show("Measuring this machine's memory bandwidth and peak FLOP/s (once; kept for later starts)…")
        self._wait(b.sig_measure_done, lambda msg: done() if b.this_machine(roof.device(), dtype) is not None
                   else done(msg or "the measurement of this machine did not finish"))
        if not roof.measuring:
            roof.measure()

    def _do_batching(self, a: dict, done: Callable[..., None]) -> None:
        batches = tuple(a.get("batches", (1, 8)))
        if all(b in self.rec.batch_rows for b in batches):
            done()  # measured by an earlier step of this tour
            return
        lab = self.window.panels["batching"]
        b = self.window.bridge
        self.rec.batch_rows = {}
        self._wait(b.sig_batch_done, lambda d: _lab_done(d, done))
        lab.run(batches, int(a.get("prompt", 16)), int(a.get("new", 8)))
        if not lab.running:
            done(lab.status or "the batching lab could not start")

    def _do_schedule(self, a: dict, done: Callable[..., None]) -> None:
        from engine.labs.schedule_events import SchedConfig

        lab = self.window.panels["scheduling"]
        knobs = {k: v for k, v in a.items() if k != "do"}
        if "rate" in knobs and knobs["rate"] <= 0:
            knobs["rate"] = math.inf
        cfg = replace(SchedConfig(), policy="both", **knobs)
        if set(self.rec.sched) >= {"static", "continuous"} and self._sched_cfg == cfg:
            done()  # the same run, from an earlier step
            return
        b = self.window.bridge
        self.rec.sched, self._sched_cfg = {}, cfg
        _set_sched(lab, cfg)
        self._wait(b.sig_sched_done, lambda d: _lab_done(d, done))
        lab.run()
        if not lab.running:
            done(lab.status or "the scheduling lab could not start")

    _sched_cfg: Any = None

    def _do_speculate(self, a: dict, done: Callable[..., None]) -> None:
        lab = self.window.panels["speculative"]
        b = self.window.bridge
        lab.prompt_edit.setPlainText(a["text"])
        lab.k_spin.setValue(int(a.get("k", 4)))
        lab.tokens_spin.setValue(int(a.get("tokens", 16)))
        i = lab.source_combo.findData(a.get("source", "lookup"))
        if i >= 0:
            lab.source_combo.setCurrentIndex(i)
        lab.sweep_box.setChecked(False)
        self.rec.spec = None
        self._wait(b.sig_spec_done, lambda d: _lab_done(d, done))
        if not lab.run():
            done("the speculative lab could not start")

    def _do_why_heads(self, a: dict, done: Callable[..., None]) -> None:
        panel = self.window.panels["why"]
        b = self.window.bridge
        panel.set_mode("heads")
        panel.repeat_spin.setValue(int(a.get("repeat", 12)))
        self.rec.why = None
        self._wait(b.sig_why_done, lambda d: done() if d.result is not None else
                   done(d.failure or "the experiment did not finish", unsupported=d.unsupported))
        if not panel.run():
            done("the Why panel could not start its experiment")


_ACTION_WORDS = {
    "prompt": "typing the prompt", "preview": "asking the model for the next token",
    "generate": "generating on the loaded model", "sampling": "setting the sampling knobs",
    "measure_machine": "finding this machine's measured bandwidth", "batching": "running the batching lab",
    "schedule": "running the scheduling lab", "speculate": "running the speculative-decoding lab",
    "why_heads": "scoring every head (Why panel)",
}


def _lab_done(d: Any, done: Callable[..., None]) -> None:
    """A lab's LabDone: go on, or say why not (`unsupported`: the runtime cannot run it at all)."""
    if d.ok:
        done()
    else:
        done(d.message or f"the lab was {d.outcome}", unsupported=d.outcome == "unsupported")


def _set_sched(lab: QtWidgets.QWidget, cfg: Any) -> None:
    """Put a SchedConfig into the scheduling lab's controls (what its Run then measures)."""
    for spin, value in ((lab.requests_spin, cfg.n_requests), (lab.rate_spin, 0.0 if math.isinf(cfg.rate) else cfg.rate),
                        (lab.burst_spin, cfg.burstiness), (lab.prompt_spin, cfg.prompt_len),
                        (lab.output_spin, cfg.output_len), (lab.batch_spin, cfg.max_batch),
                        (lab.page_spin, cfg.page_size)):
        spin.setValue(value)
    lab.policy_combo.setCurrentIndex(max(0, lab.policy_combo.findData(cfg.policy)))


# ---- installing it in the window -------------------------------------------------------------------------------------
def install(window: QtWidgets.QMainWindow) -> TourController:
    """Help → Tour, and the offer on a first start (once: remembered in the settings)."""
    tour = TourController(window)
    window.tour = tour
    menu = getattr(window, "help_menu", None)
    if menu is not None:
        action = QtGui.QAction("&Tour: the course, on the live model", window)
        action.triggered.connect(lambda: tour.start(0))
        first = menu.actions()[0] if menu.actions() else None
        menu.insertAction(first, action)
        window.tour_action = action
    settings = getattr(window, "settings", None)
    if settings is not None and getattr(window, "interactive", False) and not settings.store.value(OFFERED):
        window.bridge.sig_model_loaded.connect(_offer_once(window, tour))
    return tour


def _offer_once(window: QtWidgets.QMainWindow, tour: TourController) -> Callable[[Any], None]:
    def offer(_info: Any) -> None:
        if window.bridge.replaying:
            return  # a session being opened, not a model loaded: wait for a real load
        window.bridge.sig_model_loaded.disconnect(offer)
        window.settings.store.setValue(OFFERED, True)  # offered once: remembered when it is shown, not before
        window.settings.sync()
        box = QtWidgets.QMessageBox(QtWidgets.QMessageBox.Icon.Question, "A tour of the course",
                                    "Take the tour? Twelve short steps make each claim of the course text on this "
                                    "model and measure it on this machine. Esc leaves at any step, and Help → Tour "
                                    "brings it back.", QtWidgets.QMessageBox.StandardButton.Yes
                                    | QtWidgets.QMessageBox.StandardButton.No, window)
        box.setModal(False)
        box.setAttribute(QtCore.Qt.WidgetAttribute.WA_DeleteOnClose)
        box.accepted.connect(lambda: tour.start(0))
        box.show()
        window.tour_offer = box

    return offer


def step_count() -> int:
    return len(load_steps()[1])


__all__ = ["ACTIONS", "FIGURES", "Figure", "Step", "TourCard", "TourController", "install", "load_steps",
           "step_count"]
