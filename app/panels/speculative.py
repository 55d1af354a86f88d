"""Speculative decoding: per full pass the drafted tokens, kept (green) or rejected (red), and the model's own token;
tokens gained per pass; acceptance by draft position; the speedup over plain decoding, and speedup against k after a
sweep. Fed by `on_spec_event` with the events of engine.labs.speculative (engine.labs.spec_events, no torch)."""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from app.bridge import Bridge
from app.panels.base import Bars, Panel, reserve_lines
from app.theme import (
    ACCENT,
    BACKGROUND,
    DECODE_COLOR,
    ERROR_COLOR,
    FOREGROUND,
    MUTED,
    OK_COLOR,
    placeholder,
    show_empty,
    style_plot,
    visible_whitespace,
)
from app.units import fmt_amount, fmt_bytes
from engine.costs import formulas as costs
from engine.costs.memory import LabMemory, lab_memory
from engine.events import Failed, ModelInfo
from engine.labs.spec_events import (
    SpecBaseline,
    SpecFinished,
    SpecPrefilled,
    SpecStarted,
    SpecStep,
    SweepPoint,
    SweepStarted,
)
from engine.model.config import ModelConfig
from engine.protocol import LabDone, Speculate

DEFAULT_PROMPT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
                  "    return a * b\n\ndef div(a, b):\n")
STRIP_PASSES = 40  # passes shown in the token strip (the newest last); the plots keep every pass
HELP_K, HELP_CONTEXT = 4, 512  # the verify pass the model-specific help sentence prices
EARLY_EXIT_REFUSED = ("Early exit needs the model's own first layers, which the {runtime} runtime runs as one graph: "
                      "load the model on the torch runtime to draft with them.")


class SpeculativePanel(Panel):
    title = "Speculative decoding"
    object_name = "panel_speculative"
    shortcut = "Ctrl+Alt+3"
    subscriptions = {"sig_spec": "on_spec_event", "sig_spec_done": "_on_done", "sig_model_loaded": "_offer_sources",
                     "sig_engine_restarted": "_offer_sources"}
    help_text = (
        "Speculative decoding attacks the one-token-per-pass rhythm of decode. A cheap drafter guesses the next k "
        "tokens: prompt lookup copies what followed the last matching n-gram of the text so far, early exit asks "
        "the model's own first J layers (the logit lens), a draft model asks a smaller model with the same "
        "vocabulary. Then the full model runs once over the pending token plus the k guesses, a small prefill of "
        "k + 1 positions, and so scores every guess at once. The guesses are kept up to the first one the model "
        "disagrees with, and the model's own token from that position is kept too: 1 to k + 1 tokens per full "
        "pass. The keys and values of rejected guesses are dropped from the KV cache. Greedy output is exactly "
        "what plain greedy decoding gives; when sampling, a guess is kept with probability min(1, p/q) and a "
        "rejection is redrawn from max(0, p − q), which keeps every token distributed as the model's own p. "
        "Why is checking k + 1 tokens about as costly as generating one? A decode step is memory-bound: almost "
        "all its time goes into streaming every weight from memory once, and the arithmetic units wait. A pass "
        "over k + 1 positions streams the same weights once and does k + 1 times the arithmetic, which the step "
        "had to spare, so it takes about as long, until k + 1 approaches the hardware's ridge point (FLOPs per "
        "byte). The gain is tokens per pass divided by the cost of a pass plus drafting: the bars on the left "
        "show tokens per pass (green: accepted guesses, blue: the model's own token), the middle how often the "
        "guess at each position survives, and the title the measured tokens/s against plain decoding of the "
        "same prompt."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        n, context = HELP_K + 1, min(HELP_CONTEXT, cfg.context_length - HELP_K)
        verify = costs.prefill_cost(cfg, n, start=context - 1, weight_dtype=info.dtype, all_logits=True)
        decode = costs.decode_cost(cfg, context, weight_dtype=info.dtype)
        return (f"On {info.name} in {info.dtype} at {context} tokens of context, one decode step moves "
                f"{fmt_bytes(decode.bytes)} for {fmt_amount(decode.flops, 'FLOP')}; a verify pass over {n} positions "
                f"(k = {HELP_K}) moves {fmt_bytes(verify.bytes)} ({verify.bytes / decode.bytes:.2f}×) for "
                f"{fmt_amount(verify.flops, 'FLOP')} ({verify.flops / decode.flops:.1f}×).")

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.running = False
        self.outcome = ""  # how the last run ended (engine.protocol.LabOutcome; "" while none has)
        self._sweep_started: SweepStarted | None = None
        self._sweep: list[SweepPoint] = []
        self._build()
        self._offer_sources()
        self.clear()

    def _build(self) -> None:
        self.prompt_edit = QtWidgets.QPlainTextEdit(DEFAULT_PROMPT)
        self.prompt_edit.setMaximumHeight(64)
        self.prompt_edit.setToolTip("The prompt to continue (text that repeats itself suits prompt lookup)")
        self.k_spin = QtWidgets.QSpinBox()
        self.k_spin.setRange(1, 8)
        self.k_spin.setValue(4)
        self.k_spin.setPrefix("k ")
        self.k_spin.setToolTip("Tokens drafted per full pass")
        self.source_combo = QtWidgets.QComboBox()
        for label, key in (("prompt lookup", "lookup"), ("early exit (half the layers)", "early-exit")):
            self.source_combo.addItem(label, key)
        self.source_combo.setToolTip("Where the guesses come from")
        self.tokens_spin = QtWidgets.QSpinBox()
        self.tokens_spin.setRange(1, 1024)
        self.tokens_spin.setValue(64)
        self.tokens_spin.setPrefix("new ")
        self.sweep_box = QtWidgets.QCheckBox("sweep k = 1…8")
        self.tokens_spin.valueChanged.connect(lambda _v: self.mark_dirty())  # the memory line before a run
        self.prompt_edit.textChanged.connect(self.mark_dirty)
        self.run_button = QtWidgets.QPushButton("Run")
        self.run_button.setToolTip("Speculate on the loaded model, then decode the same prompt plainly to compare")
        self.run_button.clicked.connect(lambda: self.run())
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.bridge.cancel_lab)
        self.cancel_button.setEnabled(False)
        self.source_combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.source_combo.setMinimumContentsLength(10)
        controls = QtWidgets.QGridLayout()  # two rows: the panel shares a column with the other labs
        controls.setContentsMargins(0, 0, 0, 0)
        controls.addWidget(self.prompt_edit, 0, 0, 1, 4)
        for i, w in enumerate((self.k_spin, self.source_combo, self.tokens_spin, self.sweep_box)):
            controls.addWidget(w, 1, i)
        buttons = QtWidgets.QVBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        controls.addLayout(buttons, 0, 4, 2, 1)
        self.summary = QtWidgets.QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(QtCore.Qt.TextFormat.RichText)
        reserve_lines(self.summary, 3)  # what the run did, its speed against plain decoding, the memory it takes
        self.strip = QtWidgets.QTextBrowser()
        self.strip.setMinimumHeight(90)

        self.pass_plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.pass_plot.getPlotItem()
        style_plot(pi, left=("tokens per full pass", None), bottom=("pass", None), grid=(False, True))
        self.accepted_bars = Bars(x=[], height=[], width=0.8, brush=OK_COLOR, pen=None)
        self.own_bars = Bars(x=[], y0=[], height=[], width=0.8, brush=DECODE_COLOR, pen=None)
        pi.addItem(self.accepted_bars)
        pi.addItem(self.own_bars)
        self.pass_note = placeholder(pi)

        self.position_plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.position_plot.getPlotItem()
        style_plot(pi, left=("accepted / drafted", None), bottom=("draft position", None), grid=(False, True))
        self.position_bars = Bars(x=[], height=[], width=0.7, brush=OK_COLOR, pen=None)
        pi.addItem(self.position_bars)
        self.position_note = placeholder(pi)

        self.sweep_plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.sweep_plot.getPlotItem()
        style_plot(pi, left=("speedup", None), bottom=("k (tokens drafted per pass)", None))
        self.sweep_curve = pg.PlotDataItem([], [], pen=pg.mkPen(ACCENT, width=2), symbol="o", symbolSize=7,
                                           symbolBrush=ACCENT, symbolPen=None)
        pi.addItem(self.sweep_curve)
        self.parity = pg.InfiniteLine(pos=1.0, angle=0, pen=pg.mkPen(MUTED, style=QtCore.Qt.PenStyle.DashLine))
        pi.addItem(self.parity)
        self.sweep_note = placeholder(pi)

        plots = QtWidgets.QHBoxLayout()
        for w in (self.pass_plot, self.position_plot, self.sweep_plot):
            plots.addWidget(w, 1)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addLayout(controls)
        layout.addWidget(self.summary)
        layout.addWidget(self.strip, 1)
        layout.addLayout(plots, 2)

    def _offer_sources(self, _info: object = None) -> None:
        """Offer early-exit drafting only where it can run: it reads the model's own first layers, which only the
        torch runtime runs one by one (the engine refuses it elsewhere; this says so before Run, not after)."""
        runtime = self.bridge.runtime  # from the engine's Loaded notice; "" before a model is loaded
        item = self.source_combo.model().item(self.source_combo.findData("early-exit"))
        usable = runtime in ("", "torch")
        item.setEnabled(usable)
        item.setToolTip("" if usable else EARLY_EXIT_REFUSED.format(runtime=runtime))
        if not usable and self.source_combo.currentData() == "early-exit":
            self.source_combo.setCurrentIndex(self.source_combo.findData("lookup"))

    # ---- running -------------------------------------------------------------------------------------------------
    def run(self) -> bool:
        """Ask the engine for a run (or a sweep) with the settings shown; greedy, so its tokens can be compared."""
        text = self.prompt_edit.toPlainText()
        if not text.strip() or self.bridge.info is None:
            self._failed = "Load a model and type a prompt first."
            self.mark_dirty()
            return False
        self.clear()
        self._sweep_started, self._sweep = None, []
        self.running, self.outcome = True, ""
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.bridge.speculate(Speculate(text=text, k=self.k_spin.value(), source=self.source_combo.currentData(),
                                        max_new_tokens=self.tokens_spin.value(), sweep=self.sweep_box.isChecked()))
        return True

    @QtCore.Slot(object)
    def _on_done(self, done: LabDone) -> None:
        """The run ended (engine.protocol.LabDone): what it measured stays; a failure or a refusal (early-exit
        drafting on llama.cpp) is said in its one sentence instead."""
        self.running, self.outcome = False, done.outcome
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        if done.outcome in ("failed", "unsupported"):
            self._failed = done.message or f"the speculative-decoding lab {done.outcome}"
        self.mark_dirty()

    # ---- events ------------------------------------------------------------------------------------------------
    def on_spec_event(self, ev: object) -> None:
        """Store one event of engine.labs.speculative (speculate or sweep); drawing waits for the tick."""
        if isinstance(ev, SpecStarted):
            self.clear()
            self._started = ev
            self._drafted = np.zeros(ev.k, np.int64)
            self._accepted = np.zeros(ev.k, np.int64)
        elif isinstance(ev, SpecPrefilled):
            self._prefill = ev
        elif isinstance(ev, SpecStep):
            self._steps.append(ev)
            self._drafted[:len(ev.drafted)] += 1
            self._accepted[:ev.n_accepted] += 1
        elif isinstance(ev, SpecBaseline):
            self._baseline = ev
        elif isinstance(ev, SpecFinished):
            self._finished = ev
        elif isinstance(ev, SweepStarted):
            self._sweep_started, self._sweep = ev, []
        elif isinstance(ev, SweepPoint):
            self._sweep.append(ev)
        elif isinstance(ev, Failed):
            self._failed = ev.message
        else:
            return
        self.mark_dirty()

    def clear(self) -> None:
        self._started: SpecStarted | None = None
        self._prefill: SpecPrefilled | None = None
        self._steps: list[SpecStep] = []
        self._drafted = np.zeros(0, np.int64)
        self._accepted = np.zeros(0, np.int64)
        self._baseline: SpecBaseline | None = None
        self._finished: SpecFinished | None = None
        self._failed = ""
        super().clear()

    # ---- what is shown -----------------------------------------------------------------------------------------
    def acceptance_by_position(self) -> np.ndarray:
        """(k,) accepted / drafted so far at each draft position (NaN where nothing was drafted)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._accepted / np.where(self._drafted, self._drafted, np.nan)

    def summary_html(self) -> str:
        if self._failed:
            return f"<span style='color:{ERROR_COLOR}'>{html.escape(self._failed)}</span>"
        cancelled = self.outcome == "cancelled"
        if self._started is None:
            if self._sweep_started is not None:
                return ("cancelled · " if cancelled else "") + self._sweep_html()
            if cancelled:
                return "Cancelled before the first pass." + self.memory_html()
            return "Run speculative decoding to see each pass's guesses and the speedup." + self.memory_html()
        st, steps = self._started, self._steps
        gained = sum(e.tokens_gained for e in steps)
        drafted = int(self._drafted.sum())
        parts = [f"k = {st.k} · {html.escape(st.source_label)} · {'greedy' if st.greedy else 'sampling'}"]
        if steps:
            parts.append(f"<b>{gained / len(steps):.2f}</b> tokens per full pass over {len(steps)} passes · "
                         f"acceptance <b>{100 * self._accepted.sum() / max(drafted, 1):.0f}%</b>")
        fin = self._finished
        if fin is not None and fin.baseline_tokens_per_s > 0:
            parts.append(f"speculative <b>{fin.tokens_per_s:.1f}</b> tok/s, plain {fin.baseline_tokens_per_s:.1f} "
                         f"tok/s: <b>{fin.speedup:.2f}×</b>")
            if fin.matches_baseline is not None:
                parts.append(self.differs_html(fin))
        elif fin is not None:
            parts.append(f"speculative {fin.tokens_per_s:.1f} tok/s (no plain run to compare)")
        elif steps:
            parts.append("cancelled" if cancelled else "running…")
        elif cancelled:
            parts.append("cancelled before the first pass")
        if self._sweep:
            parts.append(self._sweep_html())
        return "<br>".join(parts)

    def memory_of(self) -> LabMemory | None:
        """What a run adds: one sequence of the prompt + new tokens, on its own cache (the weights are shared)."""
        info, cfg, tok = self.bridge.info, self.bridge.cfg, self.bridge.tokenizer
        if info is None or cfg is None or tok is None:
            return None
        n_prompt = len(tok.encode(self.prompt_edit.toPlainText()).ids)
        positions = min(cfg.context_length, n_prompt + self.tokens_spin.value())
        return lab_memory(info, cfg, self.bridge.runtime or "torch", 1, positions)

    def memory_html(self) -> str:
        mem = self.memory_of()
        return "" if mem is None else f"<br><span style='color:{MUTED}'>{html.escape(mem.line())}</span>"

    @staticmethod
    def differs_html(fin: SpecFinished | SweepPoint) -> str:
        """Whether greedy speculative output is plain greedy decoding's, and where and why not, in one sentence."""
        if fin.matches_baseline:
            return "the same tokens as plain greedy decoding"
        d = fin.differs
        if d is None:
            return f"<span style='color:{ERROR_COLOR}'>not the same tokens as plain greedy decoding</span>"
        # a near-tie is rounding, not a fault: said plainly; a wide margin is a fault: said in red
        colour = MUTED if d.near_tie else ERROR_COLOR
        return f"<span style='color:{colour}'>{html.escape('Plain greedy decoding ' + d.sentence())}</span>"

    def _sweep_html(self) -> str:
        if not self._sweep:
            return f"sweep over k: measuring plain decoding… ({html.escape(self._sweep_started.source_label)})"
        best = max(self._sweep, key=lambda p: p.speedup)
        text = (f"sweep: best k = {best.k}, <b>{best.speedup:.2f}×</b> ({best.tokens_per_pass:.2f} tokens per pass, "
                f"{best.tokens_per_s:.1f} against {best.baseline_tokens_per_s:.1f} tok/s)")
        odd = next((p for p in self._sweep if p.matches_baseline is False), None)
        return text + (f"<br>k = {odd.k}: {self.differs_html(odd)}" if odd is not None else "")

    def strip_html(self) -> str:
        rows = []
        for e in self._steps[-STRIP_PASSES:]:
            cells = [f"<span style='color:{MUTED}'>{e.step:4d}</span>&nbsp;"]
            for i, piece in enumerate(e.drafted_pieces):
                text = html.escape(visible_whitespace(piece))
                if i < e.n_accepted:
                    cells.append(f"<span style='background:{OK_COLOR};color:{BACKGROUND}'>{text}</span>")
                elif i == e.n_accepted:
                    cells.append(f"<span style='background:{ERROR_COLOR};color:{BACKGROUND}'><s>{text}</s></span>")
                else:  # never judged: the pass stopped at the first rejection
                    cells.append(f"<span style='color:{MUTED}'><s>{text}</s></span>")
            own = html.escape(visible_whitespace(e.piece))
            cells.append(f"&nbsp;<span style='color:{DECODE_COLOR}'>+{own}</span>")
            rows.append(" ".join(cells))
        return f"<div style='font-family:monospace;color:{FOREGROUND}'>{'<br>'.join(rows)}</div>"

    def draw(self) -> None:
        self.summary.setText(self.summary_html())
        self.strip.setHtml(self.strip_html())
        self.strip.verticalScrollBar().setValue(self.strip.verticalScrollBar().maximum())
        steps = self._steps
        x = np.array([e.step for e in steps], dtype=float)
        kept = np.array([e.tokens_gained - 1 for e in steps], dtype=float)  # a pass cut at end-of-text keeps fewer
        self.accepted_bars.setOpts(x=x, height=kept, width=0.8)
        self.own_bars.setOpts(x=x, y0=kept, height=np.ones_like(kept), width=0.8)
        k = self._started.k if self._started is not None else 4
        pi = self.pass_plot.getPlotItem()
        if steps:
            self.pass_note.setVisible(False)
            pi.getViewBox().setRange(xRange=(0.4, max(x) + 0.6), yRange=(0, k + 1.2), padding=0)
        else:
            show_empty(pi, self.pass_note, "One bar per full pass: accepted guesses\nplus the model's own token",
                       (0.4, 16.6), (0, k + 1.2))
        rate = self.acceptance_by_position()
        pos = np.arange(1, len(rate) + 1, dtype=float)
        self.position_bars.setOpts(x=pos, height=np.nan_to_num(rate), width=0.7)
        pi = self.position_plot.getPlotItem()
        if self._drafted.sum():
            self.position_note.setVisible(False)
            pi.getViewBox().setRange(xRange=(0.4, len(rate) + 0.6), yRange=(0, 1.05), padding=0)
        else:
            show_empty(pi, self.position_note, "How often the guess at each\nposition is accepted",
                       (0.4, k + 0.6), (0, 1.05))
        ks = np.array([p.k for p in self._sweep], dtype=float)
        speedup = np.array([p.speedup for p in self._sweep], dtype=float)
        self.sweep_curve.setData(ks, speedup)
        pi = self.sweep_plot.getPlotItem()
        if self._sweep:
            self.sweep_note.setVisible(False)
            pi.getViewBox().setRange(xRange=(0.5, max(ks.max(), 8) + 0.5),
                                     yRange=(0, max(1.2, speedup.max() * 1.1)), padding=0)
        else:
            show_empty(pi, self.sweep_note, "Sweep k = 1…8: measured speedup\nagainst plain decoding", (0.5, 8.5),
                       (0, 2))

    def pass_bars(self) -> tuple[np.ndarray, np.ndarray]:
        """(passes, tokens gained) as drawn: accepted guesses plus the model's own token."""
        o = self.own_bars.opts
        return np.asarray(o["x"], dtype=float), np.asarray(o["y0"], dtype=float) + np.asarray(o["height"], float)


PANEL = SpeculativePanel
