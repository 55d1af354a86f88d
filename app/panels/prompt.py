"""Prompt: the text being typed, with the model's token boundaries drawn over it live.

Tokenizing runs in the GUI thread on every edit: the tokenizer is Rust BPE plus a few numpy sums, and the
highlighter repaints only colours, so even a long prompt re-tokenizes and re-paints within a frame (`python -m
benchmarks bench` times the encode of a ~2,000-token text: "tokenizer" in benchmarks/results.json).
Connected to a server with a tokenize endpoint, the boundaries are the server's own: asked for in the engine process
(engine.server's Tokenize, answered by the server backend's tokenize, engine.remote.served; never on the GUI thread)
SERVER_DEBOUNCE_MS after the last edit, and labelled as the server's; a server without one falls back to the local
tokenizer and says so in one line.
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


def as_tokenization(ev) -> Tokenization:
    """A server's PromptTokenized as the Tokenization the highlighter draws (a server reports no skipped bytes)."""
    return Tokenization(text=ev.text, ids=[int(i) for i in ev.ids], pieces=list(ev.pieces),
                        offsets=[tuple(o) for o in ev.offsets], byte_offsets=[tuple(o) for o in ev.byte_offsets],
                        special=[bool(s) for s in ev.special], unrepresentable=[])


class PromptPanel(Panel):
    title = "Prompt"
    object_name = "dock_prompt"
    shortcut = "Alt+1"
    subscriptions = {
        "sig_model_loaded": "_on_model_loaded",
        "sig_server_connected": "_on_server_connected",
        "sig_server_disconnected": "_on_server_disconnected",
        "sig_server_tokens": "_on_server_tokens",
    }
    SERVER_DEBOUNCE_MS = 250
    help_text = (
        "Type a prompt. The coloured boxes over the text are the model's tokens: the units it actually reads. "
        "Hover a token for its id, its text piece (· is a space, ↵ a newline), and the bytes and characters it "
        "covers. The counters show how many tokens the text costs; English prose averages roughly 0.75 words per "
        "token, code and other languages usually fewer. 'Chat template' shows the prompt as the model receives it "
        "in chat mode: wrapped in the template's role markers, which are special tokens (purple). Connected to a "
        "server, the boundaries come from the server's own tokenizer (vLLM /tokenize, llama.cpp /tokenize), asked "
        "a moment after you stop typing; a server without a tokenize endpoint shows the local model's instead and "
        "says so."
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
        self._server_request = 0  # the id of the newest server tokenization asked for (0: none pending)
        self._server_timer = QtCore.QTimer(self)
        self._server_timer.setSingleShot(True)
        self._server_timer.setInterval(self.SERVER_DEBOUNCE_MS)
        self._server_timer.timeout.connect(self._ask_server)

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
        self.source_label = QtWidgets.QLabel("")
        self.source_label.setWordWrap(True)
        self.source_label.setStyleSheet(f"color: {theme.MUTED};")
        self.source_label.hide()
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
        layout.addWidget(self.source_label)
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

    @QtCore.Slot(object)
    def _on_server_connected(self, _info) -> None:
        self.retokenize()

    @QtCore.Slot()
    def _on_server_disconnected(self) -> None:
        self._server_request = 0
        self._server_timer.stop()
        self.retokenize()  # the local tokenizer's boundaries again

    def _server(self):
        """The connected server's ServerInfo, or None while generating locally."""
        return self.bridge.server

    @QtCore.Slot()
    def _ask_server(self) -> None:
        if self._server() is not None:
            self._server_request = self.bridge.server_tokenize(self._text, self.chat())

    @QtCore.Slot(object)
    def _on_server_tokens(self, answer) -> None:
        request_id, text, tok, error = answer.request_id, answer.text, answer.prompt, answer.error
        chat_tok, chat_error = answer.chat_prompt, answer.chat_error
        server = self._server()
        if request_id != self._server_request or text != self._text or server is None:
            return  # superseded by a newer edit (its answer is on the way)
        self._server_request = 0
        if tok is None:
            self._local_tokenize(f"The server could not tokenize ({error}): the boundaries shown are the local "
                                 "model's tokenizer, which may not be the server's.")
            return
        self.tok = as_tokenization(tok)
        self.warning.hide()
        self.editor.highlighter.set_segments(*prompt_segments(self.tok))
        self._set_source(f"Token boundaries from the server's own tokenizer ({server.kind} {server.tokenize}, "
                         f"{server.model}).")
        if self.chat():
            if chat_tok is not None:
                self._show_chat(as_tokenization(chat_tok))
            else:
                self.chat_tok = None
                self.chat_view.highlighter.clear_segments(rehighlight=False)
                self.chat_view.setPlainText(f"(the server's chat tokenization is not available: {chat_error})")
        self._update_counters()

    def _set_source(self, line: str) -> None:
        self.source_label.setText(line)
        self.source_label.setVisible(bool(line))

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
        """Tokenize the text (and its chat-wrapped form when shown) and repaint the boundaries now; connected to a
        server with a tokenize endpoint, ask it instead (debounced, answered through sig_server_tokens)."""
        server = self._server()
        if server is not None and server.tokenize:
            self.tok = self.chat_tok = None
            self.editor.highlighter.clear_segments()  # the old boundaries do not fit the new text
            self._server_request = -1  # pending: the timer sends it
            self._server_timer.start()
            self._update_counters()
            return
        self._local_tokenize("" if server is None else
                             f"This {server.kind} server has no tokenize endpoint: the boundaries shown are the "
                             "local model's tokenizer, which may not be the server's.")

    def _local_tokenize(self, note: str = "") -> None:
        self._set_source(note)
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
        self._show_chat(tokenizer.encode(wrapped))

    def _show_chat(self, chat_tok: Tokenization) -> None:
        self.chat_tok = chat_tok
        wrapped = chat_tok.text
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
        if self.tok is None and self._server_request:
            parts.append("tokens: asking the server…")
        elif self.tok is None:
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
