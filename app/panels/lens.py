"""Logit lens: the next-token guess the model would make if it stopped after each layer, for the selected step.

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
from app.panels.base import Panel
from app.run_store import store_for
from app.theme import ACCENT, BACKGROUND, MUTED, WARNING_COLOR, style_plot
from engine.events import LensCaptured, ModelInfo, PromptTokenized, TokenSampled
from engine.model.config import ModelConfig
from engine.protocol import Recomputed

LENS_TOP = 5  # top tokens per layer the generation captures while this panel exists
LENS_STEPS = 1024  # steps whose lens the panel holds: the first LENS_FIRST and the newest
LENS_FIRST = 64
RECOMPUTED_STEPS = 64  # steps whose recomputed lens the panel keeps
FONT_PT = 9
AXIS_WIDTH = 48
ENTROPY_COLOR = WARNING_COLOR


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
    }
    help_text = (
        "The logit lens reads the residual stream of the newest token after the embedding and after every layer "
        "and sends it through the model's own final norm and LM head, as if the model stopped there: "
        "p_ℓ = softmax(head(norm(x_ℓ))). Each table row shows that layer's most probable next tokens; the "
        "plot shows, per layer, the probability of the token the step finally chose and the entropy of the "
        "layer's whole distribution in bits (log₂ of the number of equally likely tokens it amounts to). The "
        "last row, 'output', is the model's real distribution before any sampling setting. Click a token in the "
        "Generation panel to see its step. Capturing the lens costs one LM head per layer per step; the step "
        "times shown elsewhere do not include it."
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
        pi.getAxis("right").setLabel("entropy", units="bits", **{"color": ENTROPY_COLOR, "font-size": f"{FONT_PT}pt"})
        dash = QtCore.Qt.PenStyle.DashLine
        self.h_curve = pg.PlotDataItem([], [], pen=pg.mkPen(ENTROPY_COLOR, width=1.5, style=dash))
        self.entropy_view.addItem(self.h_curve)
        legend.addItem(self.h_curve, "entropy (bits)")
        pi.vb.sigResized.connect(lambda: self.entropy_view.setGeometry(pi.vb.sceneBoundingRect()))

        self.table = QtWidgets.QTableWidget(0, 2 + LENS_TOP)
        self.table.setHorizontalHeaderLabels(["layer", "H bits"] + [f"#{i + 1}" for i in range(LENS_TOP)])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
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
        layout.addWidget(self.header)
        layout.addWidget(split, 1)

    @QtCore.Slot(bool)
    def set_capture(self, on: bool) -> None:
        """Capture the lens (LENS_TOP tokens a layer) in the next generations, or stop capturing it."""
        if self.capture_box.isChecked() != bool(on):
            self.capture_box.setChecked(bool(on))  # comes back here through toggled
            return
        self.bridge.options.set_lens(LENS_TOP if on else 0)

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
        if ev.token_probs is not None:
            self.p_curve.setData(x, ev.token_probs)
        self.h_curve.setData(x, ev.entropy_bits)
        self.entropy_view.setYRange(0, max(1.0, float(np.max(ev.entropy_bits)) * 1.05), padding=0)
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
        n, k = ev.ids.shape
        self.table.setColumnCount(2 + k)
        self.table.setHorizontalHeaderLabels(["layer", "H bits"] + [f"#{i + 1}" for i in range(k)])
        self.table.setRowCount(n)
        accent = QtGui.QColor(ACCENT)
        for r in range(n):
            self.table.setItem(r, 0, QtWidgets.QTableWidgetItem(row_name(r, n)))
            h = QtWidgets.QTableWidgetItem(f"{ev.entropy_bits[r]:.2f}")
            h.setTextAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
            self.table.setItem(r, 1, h)
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
                self.table.setItem(r, 2 + j, item)


PANEL = LensPanel
