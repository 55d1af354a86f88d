"""Prompt: the text being typed, with the model's token boundaries drawn over it live.

Tokenizing runs in the GUI thread on every edit: the tokenizer is Rust BPE plus a few numpy sums, and the
highlighter repaints only colours, so a 2,000-token prompt re-tokenizes and re-paints within one frame.
"""

from __future__ import annotations

import time

from PySide6 import QtCore, QtWidgets

from app import theme
from app.chat_toggle import fit_chat_box
from app.panels.base import Panel
from app.token_view import SPECIAL_KIND, Segments, TokenTextEdit, char_format, segments, token_formats
from engine.tokenizer import Tokenization

UNREPRESENTABLE_KIND = SPECIAL_KIND + 1


def token_tooltip(tok: Tokenization, k: int) -> str:
    """What hovering one prompt token shows: index, id, piece (whitespace visible), byte span and char span."""
    b0, b1 = tok.byte_offsets[k]
    c0, c1 = tok.offsets[k]
    kind = " · special" if tok.special[k] else ""
    return (
        f"token {k} of {len(tok.ids)} · id {tok.ids[k]}{kind}\n"
        f"piece  {theme.visible_whitespace(tok.pieces[k])}\n"
        f"bytes {b0}–{b1} ({b1 - b0} B) · chars {c0}–{c1}"
    )


def segment_tooltip(tok: Tokenization, tokens: tuple[int, ...], lost: tuple[tuple[int, int], ...]) -> str:
    """What hovering a segment of the prompt shows: its token, every token sharing its character, and the bytes
    no token stands for."""
    parts = []
    if len(tokens) > 1:
        parts.append(f"this character is split across {len(tokens)} tokens:")
    parts.extend(token_tooltip(tok, k) for k in tokens)
    for b, v in lost:
        parts.append(f"byte 0x{v:02X} at byte {b}: no token of this vocabulary stands for it; the model never "
                     "sees it")
    return "\n\n".join(parts) if len(tokens) > 1 else "\n".join(parts)


def prompt_segments(tok: Tokenization) -> tuple[Segments, list[int]]:
    """The segments of a tokenization and their format kinds: alternating colours, special tokens apart, and
    segments holding a byte no token stands for marked on their own."""
    seg = segments(tok.text, tok.offsets, tok.unrepresentable)
    n = len(theme.TOKEN_COLORS)
    kinds = [UNREPRESENTABLE_KIND if lost or not ks else (SPECIAL_KIND if tok.special[ks[-1]] else ks[-1] % n)
             for ks, lost in zip(seg.tokens, seg.lost, strict=True)]
    return seg, kinds


class PromptPanel(Panel):
    title = "Prompt"
    object_name = "dock_prompt"
    subscriptions = {
        "sig_model_loaded": "_on_model_loaded",
    }
    help_text = (
        "Type a prompt. The coloured boxes over the text are the model's tokens: the units it actually reads. "
        "Hover a token for its id, its text piece (· is a space, ↵ a newline), and the bytes and characters it "
        "covers. The counters show how many tokens the text costs; English prose averages roughly 0.75 words per "
        "token, code and other languages usually fewer. 'Chat template' shows the prompt as the model receives it "
        "in chat mode: wrapped in the template's role markers, which are special tokens (purple)."
    )

    sig_text_changed = QtCore.Signal(str)
    """The prompt text changed (every edit)."""
    sig_chat_changed = QtCore.Signal(bool)
    """The chat-template toggle changed."""

    def __init__(self, bridge, parent=None) -> None:
        super().__init__(bridge, parent)
        self.tok: Tokenization | None = None
        self.chat_tok: Tokenization | None = None
        self.last_tokenize_ms = 0.0  # time of the last re-tokenize + re-highlight, for the curious
        self._text = ""

        self.editor = TokenTextEdit(self)
        self.editor.setPlaceholderText("Type a prompt…")
        self.editor.tooltip_for = lambda ks, lost: segment_tooltip(self.tok, ks, lost) if self.tok else ""
        self.chat_view = TokenTextEdit(self, read_only=True)
        self.chat_view.tooltip_for = lambda ks, lost: (segment_tooltip(self.chat_tok, ks, lost) if self.chat_tok
                                                         else "")
        self.chat_view.setToolTip("")
        formats = token_formats()
        formats.append(char_format(theme.qcolor(theme.ERROR_COLOR).darker(250), theme.FOREGROUND,
                                   underline=theme.qcolor(theme.ERROR_COLOR)))
        self.editor.set_formats(formats)
        self.chat_view.set_formats(formats)

        self.chat_box = QtWidgets.QCheckBox("Chat template")
        self.chat_box.setToolTip("Show (and generate from) the prompt wrapped in the model's chat template")
        self.counters = QtWidgets.QLabel("")
        self.counters.setWordWrap(True)
        self.counters.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        self.warning = QtWidgets.QLabel("")
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet(f"color: {theme.ERROR_COLOR};")
        self.warning.hide()
        self.chat_label = QtWidgets.QLabel("As the model sees it (chat template, special tokens in purple):")
        self.chat_label.setStyleSheet(f"color: {theme.MUTED};")

        chat_pane = QtWidgets.QWidget()
        cl = QtWidgets.QVBoxLayout(chat_pane)
        cl.setContentsMargins(0, 0, 0, 0)
        cl.setSpacing(2)
        cl.addWidget(self.chat_label)
        cl.addWidget(self.chat_view)
        self.chat_pane = chat_pane
        self.splitter = QtWidgets.QSplitter(QtCore.Qt.Orientation.Vertical)
        self.splitter.addWidget(self.editor)
        self.splitter.addWidget(chat_pane)
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setStretchFactor(0, 2)
        self.splitter.setStretchFactor(1, 3)  # the wrapped prompt is the longer text
        chat_pane.hide()

        top = QtWidgets.QHBoxLayout()
        top.addWidget(self.counters, 1)
        top.addWidget(self.chat_box)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addLayout(top)
        layout.addWidget(self.warning)
        layout.addWidget(self.splitter, 1)

        self.editor.textChanged.connect(self._on_text_changed)
        self.chat_box.toggled.connect(self._on_chat_toggled)
        self._update_counters()

    # ---- public ----
    def text(self) -> str:
        return self.editor.toPlainText()

    def set_text(self, text: str) -> None:
        self.editor.setPlainText(text)

    def chat(self) -> bool:
        return self.chat_box.isChecked()

    def set_chat(self, chat: bool) -> None:
        self.chat_box.setChecked(bool(chat) and self.chat_box.isEnabled())  # disabled: the model cannot chat

    # ---- slots ----
    @QtCore.Slot(object)
    def _on_model_loaded(self, _info) -> None:
        fit_chat_box(self.chat_box, self.bridge.tokenizer)  # a base model without a template cannot chat
        self._text = self.text()
        self.retokenize()

    @QtCore.Slot()
    def _on_text_changed(self) -> None:
        text = self.text()
        if text == self._text:  # a format-only change (the highlighter) or no change at all
            return
        self._text = text
        self.retokenize()
        self.sig_text_changed.emit(text)

    @QtCore.Slot(bool)
    def _on_chat_toggled(self, chat: bool) -> None:
        self.chat_pane.setVisible(chat)
        self.retokenize()
        self.sig_chat_changed.emit(chat)

    # ---- work ----
    def retokenize(self) -> None:
        """Tokenize the text (and its chat-wrapped form when shown) and repaint the boundaries now."""
        t0 = time.perf_counter()
        tokenizer = self.bridge.tokenizer
        text = self._text
        if tokenizer is None:
            self.tok = self.chat_tok = None
        else:
            try:
                self.tok = tokenizer.encode(text)
            except ValueError as e:  # a lone surrogate pasted in
                self.tok = None
                self.editor.highlighter.clear_segments()
                self._show_warning(str(e))
            else:
                self.editor.highlighter.set_segments(*prompt_segments(self.tok))
                self._warn_unrepresentable(self.tok)
            if self.chat() and self.tok is not None:
                self._retokenize_chat(tokenizer, text)
        self.last_tokenize_ms = (time.perf_counter() - t0) * 1e3
        self._update_counters()

    def _retokenize_chat(self, tokenizer, text: str) -> None:
        try:
            wrapped = tokenizer.chat_prompt(text)
        except ValueError as e:
            self.chat_tok = None
            self.chat_view.highlighter.clear_segments(rehighlight=False)
            self.chat_view.setPlainText(f"(the chat template failed: {e})")
            return
        self.chat_tok = tokenizer.encode(wrapped)
        bar = self.chat_view.verticalScrollBar()
        scroll = bar.value()
        self.chat_view.highlighter.set_segments(*prompt_segments(self.chat_tok), rehighlight=False)
        if self.chat_view.toPlainText() != wrapped:
            self.chat_view.setPlainText(wrapped)  # highlights as it lays the text out
            bar.setValue(min(scroll, bar.maximum()))
        else:
            self.chat_view.highlighter.rehighlight()

    def _warn_unrepresentable(self, tok: Tokenization) -> None:
        if not tok.unrepresentable:
            self.warning.hide()
            return
        shown = ", ".join(f"0x{v:02X} at byte {b}" for b, v in tok.unrepresentable[:4])
        more = f" and {len(tok.unrepresentable) - 4} more" if len(tok.unrepresentable) > 4 else ""
        self._show_warning(
            f"⚠ {len(tok.unrepresentable)} byte(s) cannot be encoded by this vocabulary, so the model never sees "
            f"them (underlined in red): {shown}{more}"
        )

    def _show_warning(self, message: str) -> None:
        self.warning.setText(message)
        self.warning.show()

    def _update_counters(self) -> None:
        text = self._text
        n_chars, n_words = len(text), len(text.split())
        parts = [f"{n_chars:,} characters", f"{n_words:,} words"]
        if self.tok is None:
            parts.append("tokens: waiting for the model" if self.bridge.tokenizer is None else "tokens: –")
        else:
            n_tok = len(self.tok.ids)
            parts.append(f"<b>{n_tok:,} tokens</b>")
            if n_tok and n_words:
                parts.append(f"{n_words / n_tok:.2f} words/token ({n_tok / n_words:.2f} tokens/word)")
            if self.chat() and self.chat_tok is not None:
                n_special = int(sum(self.chat_tok.special))
                parts.append(f"{len(self.chat_tok.ids):,} with the chat template ({n_special} special)")
        self.counters.setText(" · ".join(parts))

    def draw(self) -> None:
        """Nothing to paint on the tick: typing repaints at once."""


PANEL = PromptPanel
