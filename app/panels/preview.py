"""Next-token preview: while the user types, the model's top candidates for the token after the prompt.

Requests are debounced (150 ms after the last keystroke) and the bridge drops queued requests that a newer one
supersedes; a result older than the last request sent is ignored. The engine keeps the KV cache of the previous
preview, so appending text only prefills the new tokens: the panel says how many were reused.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from app import theme
from app.bridge import PreviewResult
from app.panels.base import Bars, Panel

DEBOUNCE_MS = 150
TOP = 10
LABEL_CHARS = 16
INSIDE_FROM = 0.6  # bars longer than this carry their label inside


def short_piece(piece: str, limit: int = LABEL_CHARS) -> str:
    s = theme.visible_whitespace(piece)
    return s if len(s) <= limit else s[: limit - 1] + "…"


class PreviewPanel(Panel):
    title = "Next-token preview"
    object_name = "dock_preview"
    shortcut = "Alt+2"
    subscriptions = {
        "sig_preview": "_on_preview",
        "sig_model_loaded": "_request_on_load",
        "sig_state": "_on_state",
        "sig_params": "_on_params",
    }
    help_text = (
        "While you type, the model reads the prompt and shows the tokens it finds most likely to come next. Grey "
        "bars are the raw softmax probabilities; blue bars are the probabilities after the current sampling "
        "settings (temperature, top-k, top-p), i.e. what Generate would draw from. Each preview reuses the keys "
        "and values of the unchanged start of the prompt from the KV cache and runs only the new tokens through "
        "the model: 'reused N of M' is prefix caching at work. Edit the start of the prompt and the reuse drops."
    )

    def __init__(self, bridge, parent=None) -> None:
        super().__init__(bridge, parent)
        self._text = ""
        self._chat = False
        self._last_id = 0  # id of the last request sent; older results are stale
        self._waiting_for_idle = False
        self.result: PreviewResult | None = None

        self.info = QtWidgets.QLabel("Waiting for the model…")
        self.info.setWordWrap(True)
        self.info.setTextFormat(QtCore.Qt.TextFormat.RichText)
        # the lines a result's text takes in a narrow dock, from the start: a label that grows when the first result
        # arrives makes the whole window lay itself out and repaint every plot at once
        self.info.setMinimumHeight(3 * self.info.fontMetrics().lineSpacing() + 2)
        self.plot = pg.PlotWidget()
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.hideButtons()
        vb = self.plot.getViewBox()
        vb.invertY(True)
        self.plot.setXRange(0, 1.02, padding=0)
        self.plot.setYRange(-0.6, TOP - 0.4, padding=0)
        self.plot.getAxis("bottom").setLabel("probability")
        self.plot.showGrid(x=True, y=False, alpha=0.2)
        left = self.plot.getAxis("left")
        left.setWidth(118)
        left.setStyle(tickLength=0)
        ys = np.arange(TOP, dtype=float)
        self.bars_raw = Bars(x0=np.zeros(TOP), y=ys, height=0.8, width=np.zeros(TOP),
                                        brush=theme.qcolor(theme.MUTED, 90), pen=pg.mkPen(None))
        self.bars = Bars(x0=np.zeros(TOP), y=ys, height=0.5, width=np.zeros(TOP),
                                    brush=theme.ACCENT, pen=pg.mkPen(None))
        self.plot.addItem(self.bars_raw)
        self.plot.addItem(self.bars)
        self.labels = []
        for i in range(TOP):
            t = pg.TextItem("", color=theme.FOREGROUND, anchor=(0, 0.5))
            t.setPos(0, i)
            self.plot.addItem(t)
            self.labels.append(t)

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addWidget(self.info)
        layout.addWidget(self.plot, 1)

        self.debounce = QtCore.QTimer(self)
        self.debounce.setSingleShot(True)
        self.debounce.setInterval(DEBOUNCE_MS)
        self.debounce.timeout.connect(self.request_now)

    # ---- inputs ----
    def _on_params(self, _params: object) -> None:
        self.debounce.start()  # the preview's funnel follows the sampling settings

    def _request_on_load(self, _info: object) -> None:
        self.request_now()

    @QtCore.Slot(str)
    def set_text(self, text: str) -> None:
        if text != self._text:
            self._text = text
            self.debounce.start()

    @QtCore.Slot(bool)
    def set_chat(self, chat: bool) -> None:
        if bool(chat) != self._chat:
            self._chat = bool(chat)
            self.debounce.start()

    def request_now(self) -> None:
        """Ask the engine for the next-token candidates of the current text (skipped while generating)."""
        self.debounce.stop()
        if self.bridge.tokenizer is None:
            return
        if not self._text:
            self.result = None
            self.mark_dirty()
            return
        if self.bridge.state != "idle":  # the engine defers previews while the cache belongs to a generation
            self._waiting_for_idle = True
            return
        self._waiting_for_idle = False
        self._last_id = self.bridge.preview(self._text, self._chat, TOP)

    @QtCore.Slot(str)
    def _on_state(self, state: str) -> None:
        if state == "idle" and self._waiting_for_idle:
            self.request_now()

    @QtCore.Slot(object)
    def _on_preview(self, result: PreviewResult) -> None:
        if result.request_id < self._last_id:
            return
        self.result = result
        self.mark_dirty()

    def clear(self) -> None:
        self.result = None
        super().clear()

    # ---- paint ----
    def draw(self) -> None:
        r = self.result
        if r is None:
            self.bars.setOpts(width=np.zeros(TOP))
            self.bars_raw.setOpts(width=np.zeros(TOP))
            for t in self.labels:
                t.setText("")
            self.plot.getAxis("left").setTicks([[]])
            self.info.setText("Type a prompt to see the model's next-token candidates."
                              if self.bridge.tokenizer is not None else "Waiting for the model…")
            return
        f = r.funnel
        n = min(TOP, len(f.ids))
        p_final = np.zeros(TOP)
        p_raw = np.zeros(TOP)
        p_final[:n] = f.p_final[:n]
        p_raw[:n] = f.p_raw[:n]
        self.bars.setOpts(width=p_final)
        self.bars_raw.setOpts(width=p_raw)
        ticks = []
        for i in range(TOP):
            if i < n:
                ticks.append((i, short_piece(f.pieces[i])))
                label = self.labels[i]
                label.setText(f"{100 * p_final[i]:.1f}%  (raw {100 * p_raw[i]:.1f}%)")
                end = max(p_final[i], p_raw[i])
                if end > INSIDE_FROM:  # a long bar: write inside its end, so the label is never cut off
                    label.setAnchor((1, 0.5))
                    label.setColor("#10131a")
                    label.setPos(end - 0.01, i)
                else:
                    label.setAnchor((0, 0.5))
                    label.setColor(theme.FOREGROUND)
                    label.setPos(end + 0.01, i)
            else:
                self.labels[i].setText("")
        self.plot.getAxis("left").setTicks([ticks])
        mode = "chat template" if self._chat else "plain text"
        self.info.setText(
            f"Next token after {r.n_tokens} prompt tokens ({mode}): "
            f"<b>reused {r.n_reused} of {r.n_tokens}</b> prompt tokens from the KV cache, "
            f"computed {r.n_computed} in {1e3 * r.seconds:.1f} ms."
            f"<br><span style='color:{theme.MUTED}'>grey = raw softmax, blue = after the sampling settings "
            f"(keeps {f.kept_final:,} of {f.vocab_size:,} tokens)</span>"
        )


PANEL = PreviewPanel
