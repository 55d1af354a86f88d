"""A text view that draws token boundaries over its text: the prompt editor, the chat view and the output use it.

Tokens are given as character spans of the Python string; Qt's document positions count UTF-16 code units, so
the spans are converted once (they differ only after a character outside the Basic Multilingual Plane, e.g. an
emoji). A QSyntaxHighlighter paints each token's background block by block; hovering shows a tooltip with the
token's details and clicking reports the token's index.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from app import theme


def utf16_positions(text: str) -> np.ndarray | None:
    """Map Python string index → Qt document position (len(text) + 1 entries), or None when they are equal."""
    if text.isascii() or max(text) <= "\uffff":
        return None
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(1 + (cps > 0xFFFF).astype(np.int64))])


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def char_format(background: QtGui.QColor | str | None, foreground: str | None = None,
                underline: QtGui.QColor | None = None, bold: bool = False) -> QtGui.QTextCharFormat:
    f = QtGui.QTextCharFormat()
    if background is not None:
        f.setBackground(QtGui.QColor(background))
    if foreground is not None:
        f.setForeground(QtGui.QColor(foreground))
    if underline is not None:
        f.setUnderlineStyle(QtGui.QTextCharFormat.UnderlineStyle.WaveUnderline)
        f.setUnderlineColor(underline)
    if bold:
        f.setFontWeight(QtGui.QFont.Weight.Bold)
    return f


class TokenHighlighter(QtGui.QSyntaxHighlighter):
    """Paints spans [start, end) (document positions, sorted, non-overlapping) with one of a list of formats."""

    def __init__(self, document: QtGui.QTextDocument) -> None:
        super().__init__(document)
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.kinds: list[int] = []
        self.formats: list[QtGui.QTextCharFormat] = []

    def set_spans(self, starts: Sequence[int], ends: Sequence[int], kinds: Sequence[int], rehighlight=True) -> None:
        self.starts, self.ends, self.kinds = list(starts), list(ends), list(kinds)
        if rehighlight:
            self.rehighlight()

    def append_spans(self, starts: Sequence[int], ends: Sequence[int], kinds: Sequence[int]) -> None:
        """Add spans at the end; the blocks they touch are painted when their text is inserted."""
        self.starts.extend(starts)
        self.ends.extend(ends)
        self.kinds.extend(kinds)

    def highlightBlock(self, text: str) -> None:  # noqa: N802 — Qt's name
        if not self.starts:
            return
        block = self.currentBlock()
        b0 = block.position()
        b1 = b0 + block.length()
        i = bisect.bisect_right(self.ends, b0)
        j = bisect.bisect_left(self.starts, b1)
        starts, ends, kinds, formats = self.starts, self.ends, self.kinds, self.formats
        for k in range(i, j):
            s = max(starts[k], b0)
            e = min(ends[k], b1)
            if e > s:
                self.setFormat(s - b0, e - s, formats[kinds[k]])


class TokenTextEdit(QtWidgets.QPlainTextEdit):
    """A QPlainTextEdit with token spans: backgrounds, a tooltip per token and a click signal."""

    sig_token_clicked = QtCore.Signal(int)
    """The user clicked the token with this index."""

    def __init__(self, parent: QtWidgets.QWidget | None = None, read_only: bool = False) -> None:
        super().__init__(parent)
        self.setReadOnly(read_only)
        self.setLineWrapMode(QtWidgets.QPlainTextEdit.LineWrapMode.WidgetWidth)
        font = QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont)
        font.setPointSizeF(max(font.pointSizeF(), 10.0))
        self.setFont(font)
        self.highlighter = TokenHighlighter(self.document())
        self.tooltip_for: Callable[[int], str] | None = None  # token index → tooltip text
        self.viewport().setMouseTracking(True)
        self.viewport().installEventFilter(self)
        self._press_pos: QtCore.QPoint | None = None

    def set_formats(self, formats: list[QtGui.QTextCharFormat]) -> None:
        self.highlighter.formats = formats

    def token_at(self, pos: QtCore.QPoint) -> int | None:
        """Index of the token under a viewport point, or None."""
        h = self.highlighter
        if not h.starts:
            return None
        cursor = self.cursorForPosition(pos)
        # cursorForPosition gives the nearest gap between characters; take the character right of it unless the
        # point lies in the right half of the character to the left.
        p = cursor.position()
        rect = self.cursorRect(cursor)
        if pos.x() < rect.left() and p > 0:
            p -= 1
        k = bisect.bisect_right(h.starts, p) - 1
        while k >= 0 and h.ends[k] <= h.starts[k]:  # skip zero-width tokens (BOS, half of a character)
            k -= 1
        if k < 0 or not (h.starts[k] <= p < h.ends[k]):
            return None
        return k

    def eventFilter(self, obj: QtCore.QObject, event: QtCore.QEvent) -> bool:  # noqa: N802 — Qt's name
        if obj is self.viewport():
            et = event.type()
            if et == QtCore.QEvent.Type.ToolTip and self.tooltip_for is not None:
                k = self.token_at(event.pos())
                if k is None:
                    QtWidgets.QToolTip.hideText()
                else:
                    QtWidgets.QToolTip.showText(event.globalPos(), self.tooltip_for(k), self.viewport())
                return True
            if et == QtCore.QEvent.Type.MouseButtonPress:
                self._press_pos = event.position().toPoint()
            elif et == QtCore.QEvent.Type.MouseButtonRelease and self._press_pos is not None:
                pos = event.position().toPoint()
                if (pos - self._press_pos).manhattanLength() < 4 and not self.textCursor().hasSelection():
                    k = self.token_at(pos)
                    if k is not None:
                        self.sig_token_clicked.emit(k)
                self._press_pos = None
        return super().eventFilter(obj, event)


def token_formats() -> list[QtGui.QTextCharFormat]:
    """Formats for the prompt views: the alternating colours, then special tokens (index len(TOKEN_COLORS))."""
    fmts = [char_format(c, theme.FOREGROUND) for c in theme.TOKEN_COLORS]
    fmts.append(char_format(theme.qcolor(theme.SPECIAL_TOKEN_COLOR).darker(160), "#f2dcff", bold=True))
    return fmts


SPECIAL_KIND = len(theme.TOKEN_COLORS)
