"""Logits and sampling: the funnel from raw logits to the sampled token, for one step, with the knobs that shape it.

Each candidate (the top tokens by raw logit) gets one row of four bars: its probability as plain softmax of the raw
logits, after temperature (and repetition penalty), after top-k and after top-p and min-p — the distribution the
token was actually drawn from. A bar a stage removed is drawn grey at the height it had before that stage.
Changing a knob re-runs the funnel of the shown step from its captured logits (engine.run.refunnel, numpy, no model run)
and, debounced, sends the settings to the engine for the next token.
"""

from __future__ import annotations

import dataclasses
import html
import math

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.panels.base import Bars, Holder, Panel, reserve_lines
from app.run_store import logits_steps, store_for
from app.theme import (
    ACCENT,
    BACKGROUND,
    DECODE_COLOR,
    ERROR_COLOR,
    PREFILL_COLOR,
    placeholder,
    set_ticks,
    show_empty,
    stepped_bound,
    style_plot,
)
from engine.events import Funnel, ModelInfo, PromptTokenized, TokenSampled
from engine.model.config import ModelConfig
from engine.protocol import FUNNEL_TOP, SamplingParams
from engine.run.refunnel import refunnel

FONT_PT = 9
REMOVED_COLOR = "#9a9a9a"  # drawn hatched
STAGES = (  # (label, Funnel attribute, colour)
    ("raw softmax", "p_raw", "#98c379"),
    ("temperature", "p_temperature", DECODE_COLOR),
    ("top-k", "p_top_k", "#b48ead"),
    ("top-p · min-p", "p_final", PREFILL_COLOR),
)


def _readable(piece: str) -> str:
    return repr(piece)


def entropy_bits(logits: np.ndarray) -> float:
    """Shannon entropy of softmax(logits), in bits: H = −Σ p·log2 p."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    logp = z - np.log(np.exp(z).sum())
    p = np.exp(logp)
    return float(-(p * logp).sum() / np.log(2.0))


class SamplingPanel(Panel):
    title = "Logits and sampling"
    object_name = "panel_sampling"
    shortcut = "Alt+4"
    subscriptions = {
        "sig_prompt": "_on_prompt",
        "sig_token": "_on_token",
        "sig_step_selected": "_on_step_selected",
        "sig_params": "_on_bridge_params",
    }
    help_text = (
        "From logits to one token. The model's last layer gives one raw score (logit) per vocabulary entry. "
        "Sampling turns them into one choice in stages, each over the whole "
        "vocabulary. (1) Repetition penalty: tokens already in the context get their logit divided by the penalty "
        "(multiplied when negative); 1 = off. (2) Temperature: p = softmax(logits / T); T < 1 sharpens, T > 1 "
        "flattens, T = 0 is greedy (always the top token). (3) Top-k: keep the k most probable tokens; 0 = off. "
        "(4) Top-p (nucleus): keep the smallest set of most probable tokens whose probabilities add up to at "
        "least p; 1 = off. (5) Min-p: keep the tokens with p ≥ min_p · p_max; 0 = off. After each cut the "
        "survivors are renormalised to sum to 1, and the token is drawn from the last distribution with a seeded "
        "random generator. Each row is one candidate with four bars: plain softmax of the raw logits, after "
        "temperature, after top-k, after top-p and min-p; a hatched bar was removed by that stage. The counts say "
        "how many of all the vocabulary's tokens survive each stage. The entropy of the raw distribution, "
        "H = −Σ p·log2(p) in bits, says how unsure the model is: 0 bits = certain, log2(vocabulary size) bits = "
        "uniform. Moving a knob while paused re-runs the funnel of the shown step from its saved logits, without "
        "a forward pass; the next token uses the new settings."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        v = cfg.vocab_size
        return (f"{info.name} scores {v:,} tokens at every step, so a uniform distribution over its vocabulary "
                f"has log2({v:,}) ≈ {math.log2(v):.1f} bits.")

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self._tokens: dict[int, TokenSampled] = {}
        self._latest: int | None = None
        self._selected: int | None = None  # None: follow the latest step
        self._params = bridge.params
        self._updating = False
        self._shown_funnel: Funnel | None = None
        self._shown_step: int | None = None
        self._entropy_cache: dict[int, float] = {}
        self.n_show = 12
        self._build_controls()
        self._build_plot()
        self._debounce = QtCore.QTimer(self, singleShot=True, interval=50)
        self._debounce.timeout.connect(self._send_params)
        self._show_params(self._params)
        self.mark_dirty()

    # ---- widgets -----------------------------------------------------------------------------------------------
    def _build_controls(self) -> None:
        def spin(lo: float, hi: float, step: float, decimals: int, tip: str) -> QtWidgets.QDoubleSpinBox:
            s = QtWidgets.QDoubleSpinBox(minimum=lo, maximum=hi, singleStep=step, decimals=decimals)
            s.setToolTip(tip)
            s.setKeyboardTracking(False)
            s.valueChanged.connect(self._on_control)
            return s

        self.temperature_slider = QtWidgets.QSlider(QtCore.Qt.Orientation.Horizontal, minimum=0, maximum=200)
        self.temperature_slider.setToolTip("Temperature × 100 (0 = greedy)")
        self.temperature = spin(0.0, 10.0, 0.05, 2, "Temperature: softmax(logits / T); 0 = greedy (argmax)")
        self.top_k = QtWidgets.QSpinBox(minimum=0, maximum=1_000_000, singleStep=1)
        self.top_k.setSpecialValueText("off")
        self.top_k.setToolTip("Top-k: keep the k most probable tokens; 0 = off")
        self.top_k.setKeyboardTracking(False)
        self.top_k.valueChanged.connect(self._on_control)
        self.top_p_slider = QtWidgets.QSlider(QtCore.Qt.Orientation.Horizontal, minimum=1, maximum=100)
        self.top_p_slider.setToolTip("Top-p × 100 (100 = off)")
        self.top_p = spin(0.0, 1.0, 0.01, 2, "Top-p (nucleus): smallest set with cumulative probability ≥ p; 1 = off")
        self.min_p = spin(0.0, 0.99, 0.01, 2, "Min-p: keep tokens with p ≥ min_p · max p; 0 = off")
        self.repetition_penalty = spin(0.0, 5.0, 0.05, 2, "Repetition penalty on tokens already seen; 1 = off")
        self.seed = QtWidgets.QSpinBox(minimum=0, maximum=2**31 - 1)
        self.seed.setToolTip("Seed of the random generator: the same seed repeats the same draws")
        self.seed.setKeyboardTracking(False)
        self.seed.valueChanged.connect(self._on_control)
        self.random_seed = QtWidgets.QCheckBox("random")
        self.random_seed.setToolTip("Draw a fresh seed for each generation")
        self.random_seed.toggled.connect(self._on_control)
        self.temperature_slider.valueChanged.connect(lambda v: self._slider_to_spin(self.temperature, v / 100))
        self.top_p_slider.valueChanged.connect(lambda v: self._slider_to_spin(self.top_p, v / 100))

        def label(text: str) -> QtWidgets.QLabel:
            return QtWidgets.QLabel(text)

        for w in (self.temperature, self.top_p, self.min_p, self.repetition_penalty, self.top_k):
            w.setMaximumWidth(80)
        self.seed.setMaximumWidth(110)
        row0 = QtWidgets.QHBoxLayout()
        for w, stretch in ((label("temp"), 0), (self.temperature_slider, 1), (self.temperature, 0),
                           (label("top-p"), 0), (self.top_p_slider, 1), (self.top_p, 0)):
            row0.addWidget(w, stretch)
        row1 = QtWidgets.QHBoxLayout()
        for w in (label("top-k"), self.top_k, label("min-p"), self.min_p, label("rep. penalty"),
                  self.repetition_penalty):
            row1.addWidget(w)
        row1.addStretch(1)
        row2 = QtWidgets.QHBoxLayout()
        for w in (label("seed"), self.seed, self.random_seed):
            row2.addWidget(w)
        self.error_label = QtWidgets.QLabel("")
        self.error_label.setStyleSheet(f"color: {ERROR_COLOR};")
        self.error_label.setWordWrap(True)
        row2.addWidget(self.error_label, 1)

        self.summary = QtWidgets.QLabel("Generate to see the sampling funnel of each step.")
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(QtCore.Qt.TextFormat.RichText)
        # the lines a step's summary takes, from the start and never more: a label that grows at the first token (or
        # wraps once more at a later one, as a narrow dock's did every few tokens) lays the panel out again and
        # repaints its plot
        reserve_lines(self.summary, 3)

        self.legend = QtWidgets.QLabel(" ".join(
            f"<span style='color:{c}'>■</span> {n}" for n, _a, c in STAGES
        ) + f" <span style='color:{REMOVED_COLOR}'>■</span> removed <span style='color:{ACCENT}'>□</span> sampled")
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        for r in (row0, row1, row2):
            r.setSpacing(4)
            layout.addLayout(r)
        layout.addWidget(Holder(self.summary, wrapped=True))  # new figures at every draw
        layout.addWidget(self.legend)

    def _build_plot(self) -> None:
        self.plot = pg.PlotWidget(background=BACKGROUND)
        self.plot.setMinimumHeight(140)
        pi = self.plot.getPlotItem()
        style_plot(pi, bottom=("probability", None), grid=(True, False))
        vb = pi.getViewBox()
        vb.setMouseEnabled(x=False, y=False)
        vb.invertY(True)
        self._removed_brush = QtGui.QBrush(QtGui.QColor(REMOVED_COLOR), QtCore.Qt.BrushStyle.Dense5Pattern)
        self.bars: list[pg.BarGraphItem] = []
        h = 0.8 / len(STAGES)
        for name, _attr, colour in STAGES:
            bar = Bars(x0=[0], y=[0], height=h, width=[0], brush=colour, pen=None, name=name)
            self.bars.append(bar)
            pi.addItem(bar)
        self.sampled_marker = Bars(x0=[0], y=[0], height=0.95, width=[0], brush=None,
                                              pen=pg.mkPen(ACCENT, width=2))
        pi.addItem(self.sampled_marker)
        self.cut_lines = {}
        for key, colour in (("top-k", "#b48ead"), ("top-p", PREFILL_COLOR), ("min-p", "#e06c75")):
            line = pg.InfiniteLine(angle=0, pen=pg.mkPen(colour, width=1.5, style=QtCore.Qt.PenStyle.DashLine),
                                   label=key, labelOpts={"position": 0.98, "color": colour, "anchors": [(1, 1), (1, 1)],
                                              "fill": pg.mkBrush(27, 27, 27, 200)})
            line.setVisible(False)
            pi.addItem(line)
            self.cut_lines[key] = line
        self.empty_note = placeholder(pi)
        self.layout().addWidget(self.plot, 1)

    def _slider_to_spin(self, spin: QtWidgets.QDoubleSpinBox, value: float) -> None:
        if not self._updating:
            spin.setValue(value)

    # ---- params ------------------------------------------------------------------------------------------------
    def params(self) -> SamplingParams:
        """The settings the panel shows (the last valid ones if the controls are invalid)."""
        return self._params

    def set_params(self, p: SamplingParams) -> None:
        """Show these settings and send them to the engine at once (used to restore saved settings)."""
        self._show_params(p)
        self._params = p
        self.error_label.setText("")
        self.mark_dirty()
        self._debounce.stop()
        if p != self.bridge.params:
            self.bridge.set_params(p)

    def _show_params(self, p: SamplingParams) -> None:
        self._updating = True
        try:
            self.temperature.setValue(p.temperature)
            self.temperature_slider.setValue(round(min(p.temperature, 2.0) * 100))
            self.top_k.setValue(p.top_k)
            self.top_p.setValue(p.top_p)
            self.top_p_slider.setValue(max(1, round(p.top_p * 100)))
            self.min_p.setValue(p.min_p)
            self.repetition_penalty.setValue(p.repetition_penalty)
            self.random_seed.setChecked(p.seed is None)
            if p.seed is not None:
                self.seed.setValue(p.seed)
            self.seed.setEnabled(p.seed is not None)
        finally:
            self._updating = False

    def _params_from_controls(self) -> SamplingParams:
        return SamplingParams(
            temperature=round(self.temperature.value(), 4), top_k=int(self.top_k.value()),
            top_p=round(self.top_p.value(), 4), min_p=round(self.min_p.value(), 4),
            repetition_penalty=round(self.repetition_penalty.value(), 4),
            logit_bias=self._params.logit_bias,
            seed=None if self.random_seed.isChecked() else int(self.seed.value()),
        )

    def _on_control(self, *_args) -> None:
        if self._updating:
            return
        self._updating = True
        try:  # keep the sliders in step with their spin boxes
            self.temperature_slider.setValue(round(min(self.temperature.value(), 2.0) * 100))
            self.top_p_slider.setValue(max(1, round(self.top_p.value() * 100)))
            self.seed.setEnabled(not self.random_seed.isChecked())
        finally:
            self._updating = False
        try:
            p = self._params_from_controls()
        except ValueError as e:
            self.error_label.setText(f"Not applied: {e}")
            self._debounce.stop()
            return
        self.error_label.setText("")
        if p != self._params:
            self._params = p
            self.mark_dirty()  # the funnel of the shown step is re-run at the next tick
            self._debounce.start()

    def _send_params(self) -> None:
        if self._params != self.bridge.params:
            self.bridge.set_params(self._params)

    @QtCore.Slot(object)
    def _on_bridge_params(self, p: SamplingParams) -> None:
        if p != self._params:
            self._params = p
            self._show_params(p)
            self.error_label.setText("")
            self.mark_dirty()

    # ---- events ------------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_prompt(self, _ev: PromptTokenized) -> None:
        self.clear()

    @QtCore.Slot(object)
    def _on_token(self, ev: TokenSampled) -> None:
        self._tokens[ev.step] = ev
        self._latest = ev.step
        if ev.logits is not None:  # full logits for as many recent steps as the run store keeps (app.run_store)
            old = ev.step - logits_steps(ev.logits.shape[-1])
            if old in self._tokens and self._tokens[old].logits is not None:
                self._tokens[old] = dataclasses.replace(self._tokens[old], logits=None)
        if self._selected is None:
            self.mark_dirty()

    @QtCore.Slot(int)
    def _on_step_selected(self, step: int) -> None:
        self._selected = None if step == self._latest or step < 0 else step
        self.mark_dirty()

    def clear(self) -> None:
        self._tokens.clear()
        self._entropy_cache.clear()
        self._latest = self._selected = None
        super().clear()

    # ---- drawing -----------------------------------------------------------------------------------------------
    def shown_step(self) -> int | None:
        step = self._selected if self._selected is not None else self._latest
        return step if step in self._tokens else self._latest

    def current_funnel(self) -> Funnel | None:
        """The funnel of the shown step under the panel's current settings (re-run from the logits if saved)."""
        step = self.shown_step()
        if step is None:
            return None
        ev = self._tokens[step]
        if ev.logits is None or self.bridge.tokenizer is None:
            return ev.funnel
        if ev.funnel is not None and ev.params == self._params and len(ev.funnel.ids) >= FUNNEL_TOP:
            return ev.funnel  # as sampled: no need to re-run (and no torch work on the GUI thread)
        if ev.funnel is not None and getattr(ev.funnel, "kept_grammar", -1) >= 0:
            return ev.funnel  # a grammar shaped this step: re-running the knobs without it would mislead
        store = store_for(self.bridge)  # the repetition penalty needs the ids before this step: the run store's
        context = store.context_ids(step) if store is not None and self._params.repetition_penalty != 1.0 else None
        return refunnel(ev, self._params, self.bridge.tokenizer, top=FUNNEL_TOP, context_ids=context)

    def kept_counts(self) -> tuple[int, int, int] | None:
        f = self._shown_funnel
        return None if f is None else (f.kept_top_k, f.kept_top_p, f.kept_final)

    def draw(self) -> None:
        step = self.shown_step()
        f = self.current_funnel()
        self._shown_funnel, self._shown_step = f, step
        n = 0 if f is None else min(self.n_show, len(f.ids))
        for item in (*self.bars, self.sampled_marker):
            item.setVisible(f is not None)
        if f is None:
            for bar in self.bars:
                bar.setOpts(x0=[0], y=[0], width=[0])
            self.sampled_marker.setOpts(x0=[0], y=[0], width=[0])
            for line in self.cut_lines.values():
                line.setVisible(False)
            self.summary.setText("Generate to see the sampling funnel of each step." if step is None else
                                 f"Step {step}: no funnel was captured for this step.")
            pi = self.plot.getPlotItem()
            pi.getAxis("left").setTicks([[]])
            show_empty(pi, self.empty_note,
                       "Generate: the top candidates of a step appear here, one row each,\n"
                       "with their probability after every stage of the funnel" if step is None else
                       f"step {step}: no funnel captured", (0.0, 1.0), (-0.6, self.n_show - 0.4))
            return
        self.empty_note.setVisible(False)
        ev = self._tokens[step]
        order = list(range(n))
        if ev.token_id in f.ids.tolist() and f.ids.tolist().index(ev.token_id) >= n:
            order[-1] = f.ids.tolist().index(ev.token_id)  # keep the sampled token in view
        idx = np.asarray(order)
        rows = np.arange(n, dtype=float)
        h = 0.8 / len(STAGES)
        prev = f.p_raw[idx]
        for i, (bar, (_name, attr, colour)) in enumerate(zip(self.bars, STAGES, strict=True)):
            p = getattr(f, attr)[idx]
            removed = (p <= 0) & (prev > 0)
            widths = np.where(removed, prev, p)
            brushes = [self._removed_brush if r else pg.mkBrush(colour) for r in removed]
            bar.setOpts(x0=np.zeros(n), y=rows - 0.4 + h * (i + 0.5), height=h, width=widths, brushes=brushes)
            if attr != "p_raw":
                prev = np.where(removed, 0.0, p)
        # the sampled token's row is framed
        ids = f.ids[idx].tolist()
        if ev.token_id in ids:
            r = ids.index(ev.token_id)
            top = float(max(f.p_raw[idx][r], f.p_temperature[idx][r], f.p_final[idx][r], f.p_top_k[idx][r]))
            self.sampled_marker.setOpts(x0=[0], y=[r], width=[top * 1.02 + 1e-3], height=0.95)
        else:
            self.sampled_marker.setOpts(x0=[0], y=[0], width=[0])
        cuts = [("top-k", f.p_top_k[idx] > 0, self._params.top_k > 0),
                ("top-p", f.p_top_p[idx] > 0, self._params.top_p < 1.0),
                ("min-p", f.p_final[idx] > 0, self._params.min_p > 0)]
        placed: dict[float, QtWidgets.QGraphicsItem] = {}
        for key, kept, active in cuts:
            pos = self._cut_position(kept, active and not f.greedy)
            line = self.cut_lines[key]
            line.setVisible(pos is not None and pos not in placed)
            if pos is None:
                continue
            if pos in placed:  # two cuts at the same place: one line, one label naming both
                placed[pos].label.setFormat(placed[pos].label.format + " = " + key)
                continue
            line.setPos(pos)
            line.label.setFormat(key)
            placed[pos] = line
        ax = self.plot.getPlotItem().getAxis("left")
        set_ticks(ax, [[(float(r), _readable(f.pieces[j])[:14]) for r, j in zip(rows, idx, strict=True)]])
        xmax = float(max(1e-3, max(getattr(f, a)[idx].max() for _n, a, _c in STAGES)))
        vb = self.plot.getPlotItem().getViewBox()
        # a probability axis: in steps as the top candidate's probability moves, and never past 1.05
        x1 = min(stepped_bound(xmax * 1.05, vb.viewRange()[0][1], headroom=1.0), 1.05)
        vb.setRange(xRange=(0, x1), yRange=(-0.6, max(n, 1) - 0.4), padding=0)
        self._set_summary(ev, f, step)

    @staticmethod
    def _cut_position(kept: np.ndarray, active: bool) -> float | None:
        """Between the last kept candidate row and the next one, or None when the cut is off or out of view."""
        if not active or not kept.any() or kept.all():
            return None
        return float(np.nonzero(kept)[0].max()) + 0.5

    def _entropy(self, ev: TokenSampled, f: Funnel) -> tuple[float, bool]:
        if ev.logits is not None:
            if ev.step not in self._entropy_cache:
                self._entropy_cache[ev.step] = entropy_bits(ev.logits)
            return self._entropy_cache[ev.step], True
        p = f.p_raw[f.p_raw > 0].astype(np.float64)  # only the candidates: a lower bound on the true entropy
        return float(-(p * np.log2(p)).sum()), False

    def _set_summary(self, ev: TokenSampled, f: Funnel, step: int) -> None:
        v = f.vocab_size
        phase = "prefill" if ev.phase == "prefill" else "decode"
        ids = f.ids.tolist()
        j = ids.index(ev.token_id) if ev.token_id in ids else None
        p_tok = f" (p = {f.p_final[j]:.3f} now)" if j is not None else ""
        h, full = self._entropy(ev, f)
        ent = f"entropy of raw p: <b>{h:.2f} bits</b>" + ("" if full else " (top candidates only)")
        mode = "greedy (T = 0): argmax" if f.greedy else (
            f"kept: top-k <b>{f.kept_top_k:,}</b>/{v:,} · top-p <b>{f.kept_top_p:,}</b>/{v:,} · "
            f"min-p <b>{f.kept_final:,}</b>/{v:,}")
        kept_grammar = getattr(f, "kept_grammar", -1)
        if kept_grammar >= 0:  # the grammar is the first stage: what it removed is hatched from temperature on
            mode = f"grammar kept <b>{kept_grammar:,}</b>/{v:,} (the rest removed by the grammar) · " + mode
        live = "" if ev.logits is not None else " · <i>no logits saved: knobs cannot re-run this step</i>"
        if getattr(f, "source", None):  # engine.remote.backend.TopNFunnel: kept counts are among these N only
            live = f" · <i>re-drawn from the {f.top_n} {f.source}</i>"
        piece = f.pieces[j] if j is not None else ev.piece  # special tokens have no text piece of their own
        self.summary.setText(
            f"Step {step} ({phase}): sampled <span style='color:{ACCENT}'><b>{html.escape(_readable(piece))}</b></span>"
            f"{p_tok} · {ent}<br>{mode}{live}"
        )


PANEL = SamplingPanel
