"""Generation: run the model on the prompt and watch the two phases of inference.

Prefill is one step: the whole prompt goes through the model in a single forward pass, so the whole prompt lights
up at once (amber). Decode then produces one token per forward pass, and each appears on its own (blue).
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6 import QtCore, QtGui, QtWidgets

from app import theme
from app.bridge import GenerateRequest
from app.chat_toggle import fit_chat_box
from app.panels.base import Holder, Panel
from app.settings import DEFAULT_MAX_NEW_TOKENS
from app.token_view import Segments, TokenHighlighter, TokenTextEdit, char_format, segments, utf16_len
from engine.events import Finished, PrefillDone, PromptTokenized, TokenSampled
from engine.protocol import FUNNEL_TOP, Capture

# Format kinds of the output view.
PENDING, PREFILL_A, PREFILL_B, DECODE_A, DECODE_B, SPECIAL, FIRST = range(7)
ALL_LAYERS_BELOW = 64  # capture attention of every layer for prompts shorter than this, else only the last layer
EVERY_LAYER_POSITIONS = 512  # …and only while the context is shorter than this: past it, the layers a panel shows


@dataclass(frozen=True)
class OutToken:
    """What the output view keeps of a sampled token (not its logits: those stay with the sampling panel)."""

    step: int
    phase: str
    position: int
    token_id: int
    piece: str
    shown: str  # the text drawn for it
    seconds: float


def _formats() -> list[QtGui.QTextCharFormat]:
    pa, pb = theme.phase_shades(theme.PREFILL_COLOR)
    da, db = theme.phase_shades(theme.DECODE_COLOR)
    return [
        char_format(None, theme.MUTED),
        char_format(pa, theme.FOREGROUND), char_format(pb, theme.FOREGROUND),
        char_format(da, "#ffffff"), char_format(db, "#ffffff"),
        char_format(theme.qcolor(theme.SPECIAL_TOKEN_COLOR).darker(160), "#f2dcff", bold=True),
        char_format(theme.PREFILL_COLOR, "#1a1a1a", bold=True),
    ]


class OutputHighlighter(TokenHighlighter):
    """Paints the prompt's segments only (the first `painted`). A generated token is inserted with its format in
    the document itself, so a new token never makes the highlighter repaint every token of the paragraph it ends
    (a long run written as one paragraph cost a Python call per token of it, per draw)."""

    painted = 0


class GenerationPanel(Panel):
    title = "Generation"
    object_name = "dock_generation"
    shortcut = "Alt+3"
    subscriptions = {
        "sig_model_loaded": "_on_model_loaded",
        "sig_load_progress": "_on_loading",
        "sig_state": "_on_state",
        "sig_failed": "_on_failed",
        "sig_prompt": "_on_prompt",
        "sig_prefill": "_on_prefill",
        "sig_token": "_on_token",
        "sig_finished": "_on_finished",
        "sig_step_selected": "_on_step_selected",
        "sig_engine_lost": "_on_engine_lost",
        "sig_engine_restarted": "_on_engine_restarted",
    }
    help_text = (
        "Generate runs the model on the prompt (Ctrl+Enter). First comes the prefill: every prompt token goes "
        "through the model in one forward pass, which fills the KV cache and yields the first new token; the time "
        "it takes is the time to first token (TTFT). Then decode: one forward pass per new token, each reading the "
        "whole KV cache; the time per step is the time per output token (TPOT). Pause stops between two tokens, "
        "Step (F10) runs exactly one more decode step, Stop (Esc) ends the generation. Click a token to show that "
        "step in the other panels; hover it for its id, piece and time."
    )

    sig_chat_changed = QtCore.Signal(bool)
    """The chat toggle changed."""

    def __init__(self, bridge, parent=None) -> None:
        super().__init__(bridge, parent)
        self._text = ""
        self._state = "idle"  # "idle", "starting" (sent, not yet acknowledged), "generating", "paused"
        self._loaded = False
        self.ignore_eos = False  # tests set this for deterministic lengths
        self.prompt: PromptTokenized | None = None
        self.prefill: PrefillDone | None = None
        self.tokens: list[OutToken] = []
        self.finished: Finished | None = None
        self.selected_step: int | None = None
        self.last_request: GenerateRequest | None = None
        self._reset_view = True
        self._lit = False
        self._rendered = 0
        self._doc_len = 0
        self._decode_s = 0.0  # the decode steps' seconds so far, and how many: the status line without a walk
        self._decode_n = 0

        self.generate_btn = QtWidgets.QPushButton("Generate")
        self.generate_btn.setToolTip("Prefill the prompt and decode until the end (Ctrl+Enter)")
        self.pause_btn = QtWidgets.QPushButton("Pause")
        self.pause_btn.setToolTip("Pause between two tokens / resume")
        self.step_btn = QtWidgets.QPushButton("Step")
        self.step_btn.setToolTip("Run exactly one more token, then pause (F10 or Ctrl+Right). "
                                 "When idle: prefill, then pause")
        self.stop_btn = QtWidgets.QPushButton("Stop")
        self.stop_btn.setToolTip("End the generation after the current token (Esc)")
        self.max_tokens = QtWidgets.QSpinBox()
        self.max_tokens.setRange(1, 8192)
        self.max_tokens.setValue(DEFAULT_MAX_NEW_TOKENS)
        self.max_tokens.setToolTip("Max new tokens")
        self.max_tokens.setPrefix("max ")
        self.max_tokens.setSuffix(" tokens")
        self.chat_box = QtWidgets.QCheckBox("Chat")
        self.chat_box.setToolTip("Wrap the prompt in the model's chat template")

        self.prefill_label = QtWidgets.QLabel("")
        self.prefill_label.setWordWrap(True)
        self.prefill_label.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.status = QtWidgets.QLabel("")
        self.status.setWordWrap(True)  # a long run summary wraps instead of widening the window
        self.status.setTextFormat(QtCore.Qt.TextFormat.RichText)
        # Why the engine died and what the app did; stays until the next generation starts (draw() leaves it alone).
        self.notice = QtWidgets.QLabel("")
        self.notice.setWordWrap(True)
        self.notice.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.notice.linkActivated.connect(self._on_notice_link)
        self.notice.hide()
        self.lost = None  # the bridge's EngineLost shown in the notice
        self.output = TokenTextEdit(self, read_only=True)
        self.output.highlighter.setDocument(None)
        self.output.highlighter = OutputHighlighter(self.output.document())
        self.output.setPlaceholderText("Generated tokens appear here, one by one.")
        self.output.set_formats(_formats())
        self.output.tooltip_for = self._tooltip
        self.output.sig_token_clicked.connect(self._on_token_clicked)

        buttons = QtWidgets.QHBoxLayout()
        for w in (self.generate_btn, self.pause_btn, self.step_btn, self.stop_btn):
            buttons.addWidget(w)
        buttons.addStretch(1)
        buttons.addWidget(self.chat_box)
        buttons.addWidget(self.max_tokens)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addLayout(buttons)
        layout.addWidget(Holder(self.status, wrapped=True))  # its figures change at every draw
        layout.addWidget(self.notice)
        layout.addWidget(Holder(self.prefill_label, wrapped=True))
        layout.addWidget(self.output, 1)

        self.generate_btn.clicked.connect(lambda: self.generate())
        self.pause_btn.clicked.connect(self.toggle_pause)
        self.step_btn.clicked.connect(self.step)
        self.stop_btn.clicked.connect(self.stop)
        self.chat_box.toggled.connect(self.sig_chat_changed)
        win = QtCore.Qt.ShortcutContext.WindowShortcut
        for keys, slot in (("Ctrl+Return", self.generate), ("Ctrl+Enter", self.generate), ("Esc", self.stop),
                           ("F10", self.step), ("Ctrl+Right", self.step)):
            sc = QtGui.QShortcut(QtGui.QKeySequence(keys), self, context=win)
            sc.activated.connect(lambda s=slot: s())

        self._update_buttons()
        self._update_status()

    # ---- inputs from other panels and settings ----
    @QtCore.Slot(str)
    def set_text(self, text: str) -> None:
        self._text = text

    def text(self) -> str:
        return self._text

    @QtCore.Slot(bool)
    def set_chat(self, chat: bool) -> None:
        self.chat_box.setChecked(bool(chat) and self.chat_box.isEnabled())  # disabled: the model cannot chat

    def chat(self) -> bool:
        return self.chat_box.isChecked()

    def set_max_new_tokens(self, n: int) -> None:
        self.max_tokens.setValue(int(n))

    @property
    def state(self) -> str:
        return self._state

    # ---- commands ----
    def capture_for(self, text: str, chat: bool) -> Capture:
        """What to record: the attention layers a panel asked for, and every layer while a short prompt's run is
        short (so switching layers afterwards shows the whole run; a long run's other layers are recomputed when
        asked for, since capturing L layers × the context every token would grow with the run). The engine bounds
        each layer's capture of a long prefill to its last query rows (Capture.attention_max_bytes); the attention
        panel says when rows were left out."""
        layers = set(self.bridge.options.attention_layers)
        cfg = self.bridge.cfg
        every_below = 0
        if cfg is not None:
            try:
                n_prompt = len(self.bridge.tokenizer.encode(
                    self.bridge.tokenizer.chat_prompt(text) if chat else text).ids)
            except ValueError:
                n_prompt = ALL_LAYERS_BELOW
            if n_prompt < ALL_LAYERS_BELOW:
                every_below = EVERY_LAYER_POSITIONS
            if not layers:
                layers = {cfg.n_layers - 1}
        return Capture(attention_layers=frozenset(layers), residual_norms=True, funnel_top=FUNNEL_TOP, logits=True,
                       lens_top=self.bridge.options.lens_top, prompt_scores=self.bridge.options.score_prompt,
                       every_layer_below=every_below)

    def generate(self, start_paused: bool = False) -> bool:
        """Start a generation of the current prompt; returns False when one cannot start now."""
        if not self._loaded or self._state != "idle":
            return False
        text = self._text
        if not text.strip():
            self.status.setText(f"<span style='color:{theme.WARNING_COLOR}'>Type a prompt first.</span>")
            return False
        chat = self.chat()
        req = GenerateRequest(
            text=text, chat=chat, max_new_tokens=self.max_tokens.value(), params=self.bridge.params,
            capture=self.capture_for(text, chat), ignore_eos=self.ignore_eos, start_paused=start_paused,
            **self.bridge.options.grammar,  # regex= / json_schema= from the Constrain panel
        )
        self.last_request = req
        self._state = "starting"
        self._update_buttons()
        self.bridge.generate(req)
        return True

    def toggle_pause(self) -> None:
        if self._state == "generating":
            self.bridge.pause()
        elif self._state == "paused":
            self.bridge.resume()

    def step(self) -> None:
        if self._state == "idle":
            self.generate(start_paused=True)
        elif self._state in ("generating", "paused"):
            self.bridge.step()

    def stop(self) -> None:
        if self._state in ("generating", "paused", "starting"):
            self.bridge.stop()

    # ---- bridge slots: store, mark dirty ----
    @QtCore.Slot(object)
    def _on_model_loaded(self, info) -> None:
        self._loaded = True
        fit_chat_box(self.chat_box, self.bridge.tokenizer)  # a base model without a template cannot chat
        self.max_tokens.setMaximum(max(1, int(info.context_length) - 1))
        self._update_buttons()
        self._update_status()

    @QtCore.Slot(float, str)
    def _on_loading(self, _fraction: float, _message: str) -> None:
        if self._loaded:  # another model is on its way in
            self._loaded = False
            self._update_buttons()

    @QtCore.Slot(str)
    def _on_state(self, state: str) -> None:
        if state != "idle":  # a new generation: the last engine death no longer describes the app
            self.notice.hide()
        self._state = state
        self._update_buttons()
        self.mark_dirty()

    @QtCore.Slot(str)
    def _on_failed(self, message: str) -> None:
        if self._state == "starting":  # the engine refused the request (no state change follows)
            self._state = "idle"
            self._update_buttons()
        self.status.setText(f"<span style='color:{theme.ERROR_COLOR}'>{_escape(message)}</span>")

    @QtCore.Slot(object)
    def _on_engine_lost(self, lost) -> None:
        self.lost = lost
        self._show_notice(lost.outcome, offer=bool(lost.torch_offer))

    @QtCore.Slot(object)
    def _on_engine_restarted(self, info) -> None:
        if self.lost is not None and self.notice.isVisible():
            self._show_notice(f"A new engine has {info.name} loaded again; Generate runs as before.",
                              offer=bool(self.lost.torch_offer))

    def _show_notice(self, outcome: str, offer: bool) -> None:
        link = (f" {_escape(self.lost.torch_offer)} <a href='torch'>Load it on the torch runtime</a>" if offer
                else "")
        self.notice.setText(f"<span style='color:{theme.ERROR_COLOR}'>{_escape(self.lost.cause)}</span> "
                            f"{_escape(outcome)}{link}")
        self.notice.show()

    def _on_notice_link(self, _href: str) -> None:
        self.bridge.load_on_torch()
        self._show_notice("Loading it on the torch runtime…", offer=False)

    @QtCore.Slot(object)
    def _on_prompt(self, ev: PromptTokenized) -> None:
        self.prompt, self.prefill, self.finished = ev, None, None
        self.tokens = []
        self._decode_s, self._decode_n = 0.0, 0
        self.selected_step = None
        self._reset_view = True
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_prefill(self, ev: PrefillDone) -> None:
        self.prefill = ev
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_token(self, ev: TokenSampled) -> None:
        special = self._is_special(ev.token_id)
        shown = ev.text or (ev.piece if special else "")
        self.tokens.append(OutToken(ev.step, ev.phase, ev.position, ev.token_id, ev.piece, shown, ev.seconds))
        if ev.step > 0:
            self._decode_s += ev.seconds
            self._decode_n += 1
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_finished(self, ev: Finished) -> None:
        self.finished = ev
        self.mark_dirty()

    @QtCore.Slot(int)
    def _on_step_selected(self, step: int) -> None:
        self.selected_step = step
        self.mark_dirty()

    def _n_prompt_tokens(self) -> int:
        return len(self.prompt.ids) if self.prompt is not None else 0

    def _on_token_clicked(self, k: int) -> None:
        """Token indices of the output view: the prompt's tokens first, then the generated ones."""
        n = self._n_prompt_tokens()
        if k < n:
            self.bridge.select_step(0)
        elif k - n < len(self.tokens):
            self.bridge.select_step(self.tokens[k - n].step)

    def clear(self) -> None:
        self.prompt = self.prefill = self.finished = None
        self.tokens = []
        self._decode_s, self._decode_n = 0.0, 0
        self.selected_step = None
        self._reset_view = True
        super().clear()

    # ---- view ----
    def _update_buttons(self) -> None:
        s, ok = self._state, self._loaded
        self.generate_btn.setEnabled(ok and s == "idle")
        self.pause_btn.setEnabled(ok and s in ("generating", "paused"))
        self.pause_btn.setText("Resume" if s == "paused" else "Pause")
        self.step_btn.setEnabled(ok and s in ("idle", "generating", "paused"))
        self.stop_btn.setEnabled(ok and s in ("generating", "paused", "starting"))

    def _tooltip(self, tokens: tuple[int, ...], lost: tuple[tuple[int, int], ...]) -> str:
        parts = [self._token_tooltip(k) for k in tokens]
        parts += [f"byte 0x{v:02X} at byte {b}: no token stands for it; the model never saw it" for b, v in lost]
        return "\n\n".join(p for p in parts if p)

    def _token_tooltip(self, k: int) -> str:
        n = self._n_prompt_tokens()
        if k < n:
            p = self.prompt
            when = (f"computed in the prefill: {len(p.ids)} tokens in one forward pass"
                    if self.prefill is not None else "waiting for the prefill")
            return (f"prompt token {k} · id {int(p.ids[k])}{' · special' if p.special[k] else ''}\n"
                    f"piece  {theme.visible_whitespace(p.pieces[k])}\n{when}")
        i = k - n
        if not 0 <= i < len(self.tokens):
            return ""
        t = self.tokens[i]
        what = "from the prefill's forward pass (TTFT)" if t.step == 0 else "one decode forward pass"
        return (f"step {t.step} ({t.phase}) · position {t.position} · id {t.token_id}\n"
                f"piece  {theme.visible_whitespace(t.piece)}\n"
                f"{1e3 * t.seconds:.1f} ms — {what}")

    def _prompt_segments(self, lit: bool) -> tuple[Segments, list[int]]:
        p = self.prompt
        seg = segments(p.text, p.offsets, p.unrepresentable)
        if lit:
            kinds = [PENDING if not ks else SPECIAL if p.special[ks[-1]] else (PREFILL_A, PREFILL_B)[ks[-1] % 2]
                     for ks in seg.tokens]
        else:
            kinds = [PENDING] * len(seg)
        return seg, kinds

    def _is_special(self, token_id: int) -> bool:
        """Per the local tokenizer; a server's ids (-1 when it names none) belong to its vocabulary, not ours."""
        tok = self.bridge.tokenizer
        source = self.bridge.run_source
        if tok is None or (source is not None and not source.token_ids_are_local) or not 0 <= token_id < tok.vocab_size:
            return False
        return tok.is_special(token_id)

    def _token_kind(self, t: OutToken, index: int) -> int:
        if t.step == 0:
            return FIRST
        if self._is_special(t.token_id):
            return SPECIAL
        return DECODE_A if index % 2 else DECODE_B

    def draw(self) -> None:
        out = self.output
        hl = out.highlighter
        if self._reset_view:
            self._reset_view = False
            self._lit, self._rendered, self._doc_len = False, 0, 0
            hl.clear_segments(rehighlight=False)
            out.setExtraSelections([])
            hl.painted = 0
            if self.prompt is None:
                out.clear()
            else:
                self._lit = self.prefill is not None
                hl.set_segments(*self._prompt_segments(self._lit), rehighlight=False)
                hl.painted = len(hl.starts)
                out.setPlainText(self.prompt.text)  # highlights as it lays out
                self._doc_len = utf16_len(self.prompt.text)
        if self.prompt is not None and self.prefill is not None and not self._lit:
            self._lit = True  # the prefill finished: the whole prompt lights up in one go
            _seg, kinds = self._prompt_segments(True)
            hl.kinds[: len(kinds)] = kinds
            hl.rehighlight()
        if self._rendered < len(self.tokens):
            new = self.tokens[self._rendered:]
            starts, ends, kinds = [], [], []
            pos = self._doc_len
            first = self._n_prompt_tokens() + self._rendered
            for i, t in enumerate(new, start=self._rendered):
                n = utf16_len(t.shown)
                starts.append(pos)
                ends.append(pos + n)
                kinds.append(self._token_kind(t, i))
                pos += n
            hl.append_segments(Segments(starts, ends, [(first + j,) for j in range(len(new))], [()] * len(new)),
                               kinds)
            # each token's text goes in with its format (one insertion per run of tokens of one kind): the
            # highlighter leaves generated text alone, so this costs the new tokens only
            cursor = QtGui.QTextCursor(out.document())
            cursor.movePosition(QtGui.QTextCursor.MoveOperation.End)
            cursor.beginEditBlock()
            j = 0
            while j < len(new):
                k = j + 1
                while k < len(new) and kinds[k] == kinds[j]:
                    k += 1
                cursor.insertText("".join(t.shown for t in new[j:k]), hl.formats[kinds[j]])
                j = k
            cursor.endEditBlock()
            self._doc_len = pos
            self._rendered = len(self.tokens)
            bar = out.verticalScrollBar()
            bar.setValue(bar.maximum())
        self._draw_selection()
        self._update_status()

    def _draw_selection(self) -> None:
        out, step = self.output, self.selected_step
        span = None
        if step is not None:
            # steps arrive in order (step i is token i) and each drawn token is one segment after the prompt's: look
            # there first, so a selection late in a long run costs no walk through it
            i = step if 0 <= step < len(self.tokens) and self.tokens[step].step == step else next(
                (i for i, t in enumerate(self.tokens) if t.step == step), None)
            if i is not None:
                k, hl = self._n_prompt_tokens() + i, out.highlighter
                j = len(hl.tokens) - self._rendered + i
                span = j if 0 <= j < len(hl.tokens) and k in hl.tokens[j] else next(
                    (j for j in range(len(hl.tokens) - 1, -1, -1) if k in hl.tokens[j]), None)
        if span is None:
            out.setExtraSelections([])
            return
        sel = QtWidgets.QTextEdit.ExtraSelection()
        c = QtGui.QTextCursor(out.document())
        c.setPosition(out.highlighter.starts[span])
        c.setPosition(out.highlighter.ends[span], QtGui.QTextCursor.MoveMode.KeepAnchor)
        sel.cursor = c
        sel.format = char_format(theme.ACCENT, "#10131a", bold=True)
        out.setExtraSelections([sel])

    def _update_status(self) -> None:
        if not self._loaded:
            self.status.setText("Waiting for the model…")
            self.prefill_label.setText("")
            return
        n = len(self.tokens)
        state = {"starting": "starting…"}.get(self._state, self._state)
        if self.finished is not None and self._state == "idle":
            state = f"finished ({self.finished.reason})"
        parts = [f"<b>{state}</b>", f"{n} token{'s' if n != 1 else ''} generated"]
        if self.prefill is not None:
            parts.append(f"TTFT {1e3 * self.prefill.seconds:.1f} ms")
        if self._decode_n:
            last = next(t.seconds for t in reversed(self.tokens) if t.step > 0)
            parts.append(f"TPOT {1e3 * last:.1f} ms (mean {1e3 * self._decode_s / self._decode_n:.1f} ms, "
                         f"{self._decode_n / self._decode_s:.1f} tok/s)")
        self.status.setText(" · ".join(parts))
        if self.prompt is None:
            self.prefill_label.setText("")
        elif self.prefill is None:
            self.prefill_label.setText(
                f"<span style='color:{theme.MUTED}'>prefill: running {len(self.prompt.ids)} prompt tokens…</span>")
        else:
            pf = self.prefill
            n_prompt = len(self.prompt.ids)
            reused = f" ({pf.n_reused} reused from the KV cache, {pf.n_tokens} computed)" if pf.n_reused else ""
            self.prefill_label.setText(
                f"<span style='color:{theme.PREFILL_COLOR}'>■ prefill: {n_prompt} tokens{reused} in "
                f"{1e3 * pf.seconds:.1f} ms, one forward pass</span>"
                f"&nbsp;&nbsp;<span style='color:{theme.DECODE_COLOR}'>■ decode: one forward pass per token</span>")


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


PANEL = GenerationPanel
