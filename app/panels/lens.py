"""Logit lens: the next-token guess the model would make if it stopped after each layer, for the selected step.

Beside the logit lens, the tuned lens (engine.why.tuned_lens: one affine map per layer, fitted on this machine to the
model's own output): Fit fits and saves one for the loaded model file (on Python's help text, or the text file
Corpus… names) with progress and Cancel; the switch reads each step through either lens, and the plot draws both
lenses' KL to the output per layer wherever the step carries them.

A long run holds the lens of its first LENS_FIRST steps and its newest ones, LENS_STEPS in all: the run store
(app.run_store) bounds what it keeps the same way, and the header says when a selected step's lens is gone. While
the shown run is the engine's live one, a selected step whose lens is not held (let go, or never captured) is
recomputed from the engine's KV cache (engine.run.recompute) and drawn when it arrives.
"""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.guard import guarded
from app.panels.base import Panel
from app.run_store import store_for
from app.theme import ACCENT, BACKGROUND, ERROR_COLOR, MUTED, OK_COLOR, WARNING_COLOR, filling, style_plot
from engine.events import LensCaptured, ModelInfo, PromptTokenized, TokenSampled
from engine.model.config import ModelConfig
from engine.protocol import LensTuned, Recomputed

LENS_TOP = 5  # top tokens per layer the generation captures while this panel exists
LENS_STEPS = 1024  # steps whose lens the panel holds: the first LENS_FIRST and the newest
LENS_FIRST = 64
FIXED_COLUMNS = 3  # layer, entropy, KL; then the top tokens
RECOMPUTED_STEPS = 64  # steps whose recomputed lens the panel keeps
FONT_PT = 9
AXIS_WIDTH = 48
ENTROPY_COLOR = WARNING_COLOR
KL_LOGIT_COLOR = ERROR_COLOR
KL_TUNED_COLOR = OK_COLOR
KINDS = ("logit", "tuned")


def row_name(row: int, n_rows: int) -> str:
    return "embedding" if row == 0 else ("output" if row == n_rows - 1 else f"layer {row}")


EMPTY = "Tick 'Capture the lens' and generate to see each layer's guess for the next token."


class LensPanel(Panel):
    title = "Logit lens"
    object_name = "panel_lens"
    shortcut = "Alt+9"
    subscriptions = {
        "sig_prompt": "_on_prompt",
        "sig_lens": "_on_lens",
        "sig_token": "_on_token",
        "sig_step_selected": "_on_step_selected",
        "sig_recomputed": "_on_recomputed",
        "sig_lens_tuned": "_on_lens_tuned",
        "sig_tune_progress": "_on_tune_progress",
        "sig_model_loaded": "_on_model_loaded",
    }
    help_text = (
        "The logit lens reads the residual stream of the newest token after the embedding and after every layer "
        "and sends it through the model's own final norm and LM head, as if the model stopped there: "
        "p_ℓ = softmax(head(norm(x_ℓ))). Each table row shows that layer's most probable next tokens; the "
        "plot shows, per layer, the probability of the token the step finally chose and the entropy of the "
        "layer's whole distribution in bits (log₂ of the number of equally likely tokens it amounts to). The "
        "last row, 'output', is the model's real distribution before any sampling setting. Click a token in the "
        "Generation panel to see its step. Capturing the lens costs one LM head per layer per step; the step "
        "times shown elsewhere do not include it. "
        "The logit lens reads the middle layers poorly: their residual is not yet in the basis the head reads. The "
        "tuned lens (Belrose et al. 2023) first moves row ℓ by an affine map fitted for it, x + A_ℓ x + b_ℓ, so that "
        "its distribution matches the output; 'Fit tuned lens' fits the maps on this machine for the loaded model "
        "file (a least-squares start, then steps that lower the KL; a few minutes on two cores) on Python's own "
        "help text, or on a text file you choose, and saves them; 'tuned' reads every later step through them, on "
        "either runtime. The plot's solid lines are each lens's KL(output ‖ layer) in bits: how many extra bits per "
        "token the layer's guess costs when the model's own output is the truth; 0 at the output."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        return (f"For {info.name}: {cfg.n_layers + 2} rows (the embedding, {cfg.n_layers} layers, the output), "
                f"each a {cfg.d_model} → {cfg.vocab_size:,} projection, "
                f"{2 * cfg.d_model * cfg.vocab_size * (cfg.n_layers + 1) / 1e9:.2f} GFLOP per step for the lens.")

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.lens: dict[int, LensCaptured] = {}
        self.pieces: dict[int, str] = {}  # step → the chosen token's piece
        self.selected: int | None = None  # None: follow the newest step
        self.dropped: tuple[int, int] | None = None  # (first, last) step whose lens this panel let go
        self.recomputed: dict[int, LensCaptured | str] = {}  # step → its lens from the KV cache, or why not
        self._asked: dict[int, int] = {}  # request id → step, not yet answered
        self.kind = "logit"  # which lens the table reads each step through (KINDS)
        self.corpus = ""  # the text file a fit reads ("": Python's help text)
        self.fitting = False
        self.tuned_summary: dict | None = None  # the tuned lens in use: engine.why.tuned_lens.summary
        self._build()
        self.mark_dirty()

    def _build(self) -> None:
        self.header = QtWidgets.QLabel(EMPTY)
        # Off by default: the lens costs L + 1 LM-head products per step, more than the step itself on a small
        # model. The step times the panels show never include it.
        self.capture_box = QtWidgets.QCheckBox("Capture the lens while generating")
        self.capture_box.setToolTip("Each step then also projects every layer's residual through the LM head "
                                    "(about one extra decode step of time per token here)")
        self.capture_box.toggled.connect(self.set_capture)
        self.kind_buttons = {k: QtWidgets.QRadioButton(k) for k in KINDS}
        self.kind_buttons["logit"].setChecked(True)
        self.kind_buttons["tuned"].setToolTip("Read each step through the tuned lens saved for this model file")
        group = QtWidgets.QButtonGroup(self)
        for k, b in self.kind_buttons.items():
            group.addButton(b)
            b.toggled.connect(lambda on, k=k: on and self.set_kind(k))
        self.fit_button = QtWidgets.QPushButton("Fit tuned lens")
        self.fit_button.setToolTip("Fit one affine map per layer to the model's own output on the corpus, save it for "
                                   "this model file and use it (after any generation)")
        self.fit_button.clicked.connect(self.fit)
        self.corpus_button = QtWidgets.QPushButton("Corpus…")
        self.corpus_button.setToolTip("A UTF-8 text file to fit on (default: Python's help text)")
        self.corpus_button.clicked.connect(self._choose_corpus)
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.bridge.cancel_tune_lens)
        self.tune_status = QtWidgets.QLabel("")
        self.tune_status.setWordWrap(True)
        self.tune_status.setTextFormat(QtCore.Qt.TextFormat.RichText)
        # Two short rows, each no wider than the capture box above them: the panel's minimum width (and so the
        # window's, in a full layout) stays what it was.
        kinds = QtWidgets.QHBoxLayout()
        kinds.addWidget(QtWidgets.QLabel("lens:"))
        for b in self.kind_buttons.values():
            kinds.addWidget(b)
        kinds.addStretch(1)
        fits = QtWidgets.QHBoxLayout()
        fits.setSpacing(4)
        for w in (self.fit_button, self.corpus_button, self.cancel_button):
            w.setMinimumWidth(w.fontMetrics().horizontalAdvance(w.text()) + 12)  # not the style's wider minimum
            fits.addWidget(w)
        fits.addStretch(1)
        self.header.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.header.setWordWrap(True)
        self.plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.plot.getPlotItem()
        style_plot(pi, left=("p(chosen token)", None), bottom=("layer", None))
        pi.setYRange(0, 1, padding=0.02)
        pi.getAxis("left").setWidth(AXIS_WIDTH)  # fixed: an axis that sized itself to earlier data never shrinks
        pi.getAxis("bottom").setTickSpacing(levels=[(5, 0), (1, 0)])  # layers are whole numbers
        legend = pi.addLegend(offset=(8, 8), labelTextSize=f"{FONT_PT}pt", brush=pg.mkBrush(20, 20, 20, 200))
        self.p_curve = pi.plot([], [], pen=pg.mkPen(ACCENT, width=2), symbol="o", symbolSize=5,
                               symbolBrush=ACCENT, name="p(chosen token)")
        # entropy on its own axis at the right
        self.entropy_view = pg.ViewBox()
        pi.showAxis("right")
        pi.scene().addItem(self.entropy_view)
        pi.getAxis("right").linkToView(self.entropy_view)
        pi.getAxis("right").setWidth(AXIS_WIDTH)
        self.entropy_view.setXLink(pi)
        pi.getAxis("right").setLabel("entropy · KL", units="bits",
                                     **{"color": ENTROPY_COLOR, "font-size": f"{FONT_PT}pt"})
        dash = QtCore.Qt.PenStyle.DashLine
        self.h_curve = pg.PlotDataItem([], [], pen=pg.mkPen(ENTROPY_COLOR, width=1.5, style=dash))
        self.entropy_view.addItem(self.h_curve)
        legend.addItem(self.h_curve, "entropy (bits)")
        self.kl_curves = {k: pg.PlotDataItem([], [], pen=pg.mkPen(c, width=1.5), symbol="t", symbolSize=4,
                                             symbolBrush=c, symbolPen=None)
                          for k, c in (("logit", KL_LOGIT_COLOR), ("tuned", KL_TUNED_COLOR))}
        for k, curve in self.kl_curves.items():
            self.entropy_view.addItem(curve)
            legend.addItem(curve, f"KL {k} lens → output (bits)")
        pi.vb.sigResized.connect(lambda: self.entropy_view.setGeometry(pi.vb.sceneBoundingRect()))

        self.table = QtWidgets.QTableWidget(0, FIXED_COLUMNS + LENS_TOP)
        self.table.setHorizontalHeaderLabels(["layer", "H bits", "KL bits"] + [f"#{i + 1}" for i in range(LENS_TOP)])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setDefaultSectionSize(18)
        font = QtGui.QFont()
        font.setPointSize(FONT_PT)
        self.table.setFont(font)

        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical)
        split.addWidget(self.plot)
        split.addWidget(self.table)
        split.setSizes([150, 300])
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.capture_box)
        layout.addLayout(kinds)
        layout.addLayout(fits)
        layout.addWidget(self.tune_status)
        layout.addWidget(self.header)
        layout.addWidget(split, 1)

    @QtCore.Slot(bool)
    def set_capture(self, on: bool) -> None:
        """Capture the lens (LENS_TOP tokens a layer) while this panel is on screen, from the next token on, or stop
        capturing it."""
        if self.capture_box.isChecked() != bool(on):
            self.capture_box.setChecked(bool(on))  # comes back here through toggled
            return
        self._subscribe()

    def _subscribe(self) -> None:
        # The lens costs L + 1 LM-head products a step: the engine computes it only while someone can see it (a step
        # it skipped is recomputed from the live run's KV cache when selected).
        self.bridge.options.set_lens(LENS_TOP if self.capture_box.isChecked() and self.on_screen() else 0)

    @QtCore.Slot(bool)
    def came_into_view(self, visible: bool = True) -> None:
        super().came_into_view(visible)
        QtCore.QTimer.singleShot(0, self, self._subscribe)  # once Qt has laid out what is in front

    @guarded
    def hideEvent(self, event: QtGui.QHideEvent) -> None:  # noqa: N802 — Qt's name
        super().hideEvent(event)
        QtCore.QTimer.singleShot(0, self, self._subscribe)

    def set_kind(self, kind: str) -> None:
        """Read the steps through the logit or the tuned lens; "tuned" asks the engine to use the lens saved for this
        model file (sig_lens_tuned answers), "logit" to stop computing it."""
        if kind not in KINDS:
            raise ValueError(f"not a lens: {kind!r} (choose {', '.join(KINDS)})")
        if not self.kind_buttons[kind].isChecked():
            self.kind_buttons[kind].setChecked(True)  # comes back here through toggled
            return
        if kind == self.kind:
            return
        self.kind = kind
        if self.bridge.info is not None:
            self.bridge.tune_lens("use" if kind == "tuned" else "off")
            if kind == "tuned" and self.tuned_summary is None:
                self.tune_status.setText("Looking for a tuned lens saved for this model file…")
        self.mark_dirty()

    def set_corpus(self, path: str) -> None:
        """Fit later tuned lenses on this UTF-8 text file ("": Python's help text)."""
        self.corpus = path
        name = path.replace("\\", "/").rsplit("/", 1)[-1] if path else "Python's help text"
        self.corpus_button.setToolTip(f"A UTF-8 text file to fit on; now: {path or name}")
        if not self.fitting:
            self.tune_status.setText(f"The next fit reads {html.escape(name)}.")

    def _choose_corpus(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self, "Text to fit the tuned lens on", "",
                                                        "Text (*.txt *.md *.rst);;All files (*)")
        if path:
            self.set_corpus(path)

    def fit(self, tokens: int = 0, steps: int = -1) -> int | None:
        """Fit the tuned lens of the loaded model on the corpus (0 / -1: the fit's own defaults); None while one is
        fitting or no model is loaded."""
        if self.fitting or self.bridge.info is None:
            return None
        self.fitting = True
        self.fit_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.tune_status.setText("Fitting the tuned lens (after any generation)…")
        return self.bridge.tune_lens("fit", corpus=self.corpus, tokens=tokens, steps=steps)

    @QtCore.Slot(float, str)
    def _on_tune_progress(self, fraction: float, message: str) -> None:
        self.tune_status.setText(f"Fitting the tuned lens: {fraction:.0%} · {html.escape(message)}")

    @QtCore.Slot(object)
    def _on_lens_tuned(self, m: LensTuned) -> None:
        if m.action == "fit":
            self.fitting = False
            self.fit_button.setEnabled(True)
            self.cancel_button.setEnabled(False)
        if m.in_use:
            self.tuned_summary = m.summary
            self.tune_status.setText(tuned_summary_text(m.summary or {}, m.action == "fit"))
            if self.kind != "tuned":
                self.kind = "tuned"
                self.kind_buttons["tuned"].setChecked(True)
        elif m.cancelled:
            self.tune_status.setText("The fit was cancelled; nothing was saved.")
        elif m.error:
            self.tune_status.setText(f"<span style='color:{ERROR_COLOR}'>Tuned lens: {html.escape(m.error)}</span>")
            if m.action == "use" and self.kind == "tuned":
                self.kind = "logit"
                self.kind_buttons["logit"].setChecked(True)
        elif m.action == "off":
            self.tuned_summary = None
            self.tune_status.setText("")
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_model_loaded(self, _info: ModelInfo) -> None:
        """Another model (or the same again): the tuned lens in use was the old head's; ask for this file's."""
        self.tuned_summary = None
        self.tune_status.setText("")
        if self.kind == "tuned":
            self.bridge.tune_lens("use")

    # ---- slots: store, mark dirty ----
    @QtCore.Slot(object)
    def _on_prompt(self, _ev: PromptTokenized) -> None:
        self.clear()

    @QtCore.Slot(object)
    def _on_lens(self, ev: LensCaptured) -> None:
        self.lens[ev.step] = ev
        if len(self.lens) > LENS_STEPS:  # the oldest step after the first ones goes
            first = next(k for i, k in enumerate(self.lens) if i == LENS_FIRST)
            del self.lens[first]
            lo, hi = self.dropped or (first, first)
            self.dropped = (min(lo, first), max(hi, first))
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_token(self, ev: TokenSampled) -> None:
        self.pieces[ev.step] = ev.piece
        if ev.step == self.shown_step():
            self.mark_dirty()

    @QtCore.Slot(int)
    def _on_step_selected(self, step: int) -> None:
        self.selected = step if step >= 0 else None
        self._maybe_recompute()
        self.mark_dirty()

    def _maybe_recompute(self) -> None:
        """Ask the engine for the selected step's lens when the panel does not hold it and the shown run is the
        engine's live one (recorded in this window, not opened from a file); sig_recomputed answers."""
        step = self.selected
        if step is None or step in self.lens or step in self.recomputed or step in self._asked.values():
            return
        store = store_for(self.bridge)
        run = store.shown_run() if store is not None else None
        if run is None or store.recording != run.id or step >= run.n_tokens:
            return
        chosen = int(run.context_ids(step + 1)[-1])  # the token the step chose: its probability in every row
        self._asked[self.bridge.recompute(step, run.context_ids(step), (), LENS_TOP, chosen)] = step

    @QtCore.Slot(object)
    def _on_recomputed(self, msg: Recomputed) -> None:
        step = self._asked.pop(msg.request_id, None)
        if step is None:  # another panel's, or a run no longer shown
            return
        self.recomputed[step] = msg.lens if msg.lens is not None else (msg.error or "the engine sent no lens")
        while len(self.recomputed) > RECOMPUTED_STEPS:
            del self.recomputed[next(iter(self.recomputed))]
        self.mark_dirty()

    def clear(self) -> None:
        self.lens.clear()
        self.pieces.clear()
        self.selected = None
        self.dropped = None
        self.recomputed.clear()
        self._asked.clear()
        super().clear()

    def shown_step(self) -> int | None:
        if self.selected is not None and self.selected in self.lens:
            return self.selected
        return max(self.lens) if self.lens else None

    # ---- drawing ----
    def draw(self) -> None:
        again = self.recomputed.get(self.selected) if self.selected not in self.lens else None
        if isinstance(again, LensCaptured):
            self._draw_lens(again, " · <b>recomputed from the KV cache</b> (the panel holds no lens of this step)")
            return
        if self.selected is not None and self.selected in self._asked.values():
            self.header.setText(f"Step {self.selected:,}'s lens is not held: recomputing it from the engine's KV "
                                "cache…")
            return
        why = f" It cannot be recomputed: {html.escape(again)}." if isinstance(again, str) else ""
        step = self.shown_step()
        if step is None:
            self.p_curve.setData([], [])
            self.h_curve.setData([], [])
            self.table.setRowCount(0)
            self.header.setText(EMPTY if self.selected is None
                                else f"No lens was captured for step {self.selected}.{why}")
            return
        gone = self._gone_note(self.selected) if self.selected is not None and self.selected != step else ""
        if gone:  # the selected step's lens was let go
            self.header.setText(gone + why)
            return
        self._draw_lens(self.lens[step])

    def _draw_lens(self, ev: LensCaptured, note: str = "") -> None:
        step = ev.step
        n = ev.ids.shape[0]
        x = np.arange(n)
        tuned = ev.tuned if _same_rows(ev.tuned, ev) else None
        kl = {"logit": _row_values(ev.kl_bits, n), "tuned": _row_values(tuned.kl_bits, n) if tuned else None}
        if self.kind == "tuned" and tuned is not None:
            ev, note = ev.tuned, note + " · <b>tuned lens</b>"
        elif self.kind == "tuned":
            note += " · <b>logit lens</b> (this step was captured without a tuned lens in use)"
        if ev.token_probs is not None:
            self.p_curve.setData(x, ev.token_probs)
        self.h_curve.setData(x, ev.entropy_bits)
        top, above = float(np.max(ev.entropy_bits)), []
        for k, curve in self.kl_curves.items():
            values = kl[k]
            # an infinite KL (the row rules out a token the output gives) is left out of the line: a gap
            shown = None if values is None else np.where(np.isfinite(values), values, np.nan)
            if shown is None:
                curve.setData([], [])
                continue
            curve.setData(x, shown)
            # The axis follows the layers, not the embedding row: the logit lens reads the embeddings far from the
            # output (well over every layer's KL), and scaling to it would flatten every other point.
            rest = shown[1:]
            if np.isfinite(rest).any():
                top = max(top, float(np.nanmax(rest)))
            if np.isfinite(shown[0]) and shown[0] > max(1.0, top) * 1.05:
                above.append(f"{k} {shown[0]:.1f}")
        self.entropy_view.setYRange(0, max(1.0, top * 1.05), padding=0)
        if above:
            note += f" · the embedding row's KL ({', '.join(above)} bits) is above the plot"
        chosen = self.pieces.get(step, "")
        first = ""
        if ev.token_probs is not None and ev.token_id >= 0:
            top1 = np.flatnonzero(ev.ids[:, 0] == ev.token_id)
            if top1.size:
                first = f" · first on top at <b>{row_name(int(top1[0]), n)}</b>"
        phase = "prefill" if step == 0 else f"decode step {step}"
        self.header.setText(
            f"<b>{phase}</b> · position {ev.position} · chose <b>{html.escape(repr(chosen))}</b>{first}{note}"
            f" <span style='color:{MUTED}'>(click a token in Generation to pick a step)</span>")
        self._fill_table(ev)

    def _gone_note(self, step: int) -> str:
        """Why step `step` has no lens when it was let go to bound memory, else ""."""
        store = store_for(self.bridge)
        run = store.shown_run() if store is not None else None
        if run is not None and run.dropped and run.dropped[0] <= step <= run.dropped[1]:
            note = run.attention_note()
        elif self.dropped and self.dropped[0] <= step <= self.dropped[1]:
            note = (f"this panel holds the lens of the first {LENS_FIRST} and the newest steps; steps "
                    f"{self.dropped[0]:,}–{self.dropped[1]:,} were let go to bound memory")
        else:
            return ""
        return f"No lens is held for step {step}: {html.escape(note)}."

    def _fill_table(self, ev: LensCaptured) -> None:
        with filling(self.table):
            self._fill_items(ev)

    def _fill_items(self, ev: LensCaptured) -> None:
        n, k = ev.ids.shape
        self.table.setColumnCount(FIXED_COLUMNS + k)
        self.table.setHorizontalHeaderLabels(["layer", "H bits", "KL bits"] + [f"#{i + 1}" for i in range(k)])
        self.table.setRowCount(n)
        accent = QtGui.QColor(ACCENT)
        kl = _row_values(ev.kl_bits, n)
        right = QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter
        for r in range(n):
            self.table.setItem(r, 0, QtWidgets.QTableWidgetItem(row_name(r, n)))
            h = QtWidgets.QTableWidgetItem(f"{ev.entropy_bits[r]:.2f}")
            h.setTextAlignment(right)
            self.table.setItem(r, 1, h)
            d = QtWidgets.QTableWidgetItem("" if kl is None else f"{kl[r]:.2f}")
            d.setTextAlignment(right)
            d.setToolTip("KL(output ‖ this row) in bits: what this row's guess costs per token against the output")
            self.table.setItem(r, 2, d)
            for j in range(k):
                piece = ev.pieces[r][j] if ev.pieces else str(ev.ids[r, j])
                p = float(ev.probs[r, j])
                item = QtWidgets.QTableWidgetItem(f"{piece!r} {p:.2f}")
                item.setToolTip(f"id {int(ev.ids[r, j])} · {piece!r} · p = {p:.4f}")
                bg = QtGui.QColor(accent)
                bg.setAlphaF(min(1.0, 0.08 + 0.75 * p))
                item.setBackground(bg)
                if int(ev.ids[r, j]) == ev.token_id:
                    f = item.font()
                    f.setBold(True)
                    item.setFont(f)
                self.table.setItem(r, FIXED_COLUMNS + j, item)


def _same_rows(tuned: object, ev: LensCaptured) -> bool:
    """Whether `tuned` is a tuned lens's record of ev's step with arrays a table can read row for row (a session
    file's record may not be)."""
    if not isinstance(tuned, LensCaptured):
        return False
    n, k = ev.ids.shape
    arrays = (tuned.ids, tuned.probs, tuned.entropy_bits, tuned.token_probs)
    if not all(a is None or isinstance(a, np.ndarray) for a in arrays) or tuned.ids is None or tuned.probs is None:
        return False
    return (tuned.ids.shape == tuned.probs.shape == (n, k) and getattr(tuned.entropy_bits, "shape", None) == (n,)
            and (tuned.token_probs is None or tuned.token_probs.shape == (n,))
            and (not tuned.pieces or (len(tuned.pieces) == n and all(len(r) == k for r in tuned.pieces))))


def _row_values(values: np.ndarray | None, n: int) -> np.ndarray | None:
    """A per-row array of n float values, or None (absent, or the wrong shape: a damaged session file)."""
    if not isinstance(values, np.ndarray) or values.shape != (n,) or values.dtype.kind not in "fiu":
        return None
    return values.astype(np.float64)


def tuned_summary_text(summary: dict, fitted_now: bool) -> str:
    """One line on the tuned lens in use: what it was fitted on and its held-out KL against the logit lens's."""
    logit, tuned = summary.get("held_out_logit_kl_bits") or [], summary.get("held_out_tuned_kl_bits") or []
    judged = ""
    if len(logit) == len(tuned) and len(logit) > 1:  # the mean over layers 0…L − 1 (row L is the output's own)
        a, b = float(np.mean(logit[:-1])), float(np.mean(tuned[:-1]))
        judged = (f"; held-out mean KL to the output over the layers: logit {a:.2f} bits → "
                  f"<b>tuned {b:.2f} bits</b> ({summary.get('held_out_tokens', '?')} positions)")
    how = "fitted and saved" if fitted_now else "loaded"
    return (f"Tuned lens {how}: {html.escape(str(summary.get('corpus', '?')))}, "
            f"{summary.get('train_tokens', '?')} tokens, {summary.get('kl_steps', '?')} KL steps, "
            f"{summary.get('seconds', '?')} s{judged}")


PANEL = LensPanel
