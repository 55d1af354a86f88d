"""A text view that draws token boundaries over its text: the prompt editor, the chat view and the output use it.

Tokens are given as character spans of the Python string. They do not always tile the text: several tokens can
share one character (byte-level BPE splits an emoji or a rare character into byte tokens), a byte the vocabulary
cannot encode belongs to no token, and a BOS token covers nothing. So the view never treats a span as a token:
`segments()` cuts the text into sorted, non-overlapping segments, each naming the tokens that cover it (token
indices) and the bytes that no token stands for. Qt's document positions count UTF-16 code units, so the
segments are converted once (they differ only after a character outside the Basic Multilingual Plane, e.g. an
emoji). A QSyntaxHighlighter paints each segment's background block by block; hovering shows a tooltip for the
tokens under the mouse and clicking reports the first of them.
"""

from __future__ import annotations

import bisect

# The codecs utf16_len and utf16_positions use, imported with the app: imported at the first token's draw instead, the
# read of the codec's file stalled the GUI once behind a model load's reads (BENCHMARKS.md, "The matrix's large arrays
# written off the GUI thread").
import encodings.utf_16_le  # noqa: F401
import encodings.utf_32_le  # noqa: F401
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from app import theme
from app.guard import guarded


def utf16_positions(text: str) -> np.ndarray | None:
    """Map Python string index → Qt document position (len(text) + 1 entries), or None when they are equal."""
    if text.isascii() or max(text) <= "\uffff":
        return None
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(1 + (cps > 0xFFFF).astype(np.int64))])


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


@dataclass(frozen=True)
class Segments:
    """Sorted, non-overlapping document spans [starts[i], ends[i]) of a text, with what each one holds.

    tokens[i]: indices of the tokens covering segment i (empty when only lost bytes are there);
    lost[i]: (byte offset, byte value) of the bytes in segment i that no token stands for.
    """

    starts: list[int]
    ends: list[int]
    tokens: list[tuple[int, ...]]
    lost: list[tuple[tuple[int, int], ...]]

    def __len__(self) -> int:
        return len(self.starts)


def segments(text: str, offsets: Sequence[Sequence[int]] | np.ndarray,
             unrepresentable: Sequence[tuple[int, int]] = ()) -> Segments:
    """Cut `text` into the segments its tokens (character spans `offsets`) and lost bytes define."""
    n_chars = len(text)
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    c0, c1 = offs[:, 0], offs[:, 1]
    valid = np.flatnonzero((c0 >= 0) & (c1 > c0) & (c1 <= n_chars))  # zero-width tokens (BOS) cover nothing
    lost_at: dict[int, list[tuple[int, int]]] = {}
    if len(unrepresentable):
        char_ends = np.cumsum([len(ch.encode("utf-8", "surrogatepass")) for ch in text], dtype=np.int64)
        for b, v in unrepresentable:
            c = int(np.searchsorted(char_ends, b, side="right"))
            if c < n_chars:
                lost_at.setdefault(c, []).append((int(b), int(v)))
    vs, ve = c0[valid], c1[valid]
    if not lost_at and (len(valid) < 2 or bool(np.all(vs[1:] >= ve[:-1]))):
        # The common case: tokens in order, one per span.
        starts, ends = vs.tolist(), ve.tolist()
        tokens: list[tuple[int, ...]] = [(int(k),) for k in valid]
        lost: list[tuple[tuple[int, int], ...]] = [()] * len(tokens)
    else:
        bounds = sorted({*vs.tolist(), *ve.tolist(), *lost_at, *(c + 1 for c in lost_at)})
        index = {b: i for i, b in enumerate(bounds)}
        cover: list[list[int]] = [[] for _ in range(max(0, len(bounds) - 1))]
        for k, a, b in zip(valid.tolist(), vs.tolist(), ve.tolist(), strict=True):
            for i in range(index[a], index[b]):
                cover[i].append(k)
        starts, ends, tokens, lost = [], [], [], []
        for i, ks in enumerate(cover):
            here = tuple(lost_at.get(bounds[i], ())) if bounds[i + 1] == bounds[i] + 1 else ()
            if not ks and not here:
                continue
            t = tuple(ks)
            if tokens and not here and not lost[-1] and tokens[-1] == t and ends[-1] == bounds[i]:
                ends[-1] = bounds[i + 1]  # one token split only by the cut points of others' lost bytes
                continue
            starts.append(bounds[i])
            ends.append(bounds[i + 1])
            tokens.append(t)
            lost.append(here)
    pos = utf16_positions(text)
    if pos is not None and starts:
        starts, ends = pos[np.asarray(starts)].tolist(), pos[np.asarray(ends)].tolist()
    return Segments(starts, ends, tokens, lost)


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
    """Paints segments [start, end) (document positions, sorted, non-overlapping) with one of a list of formats,
    and remembers which tokens and lost bytes each segment holds."""

    def __init__(self, document: QtGui.QTextDocument) -> None:
        super().__init__(document)
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.kinds: list[int] = []
        self.tokens: list[tuple[int, ...]] = []
        self.lost: list[tuple[tuple[int, int], ...]] = []
        self.formats: list[QtGui.QTextCharFormat] = []

    def set_segments(self, seg: Segments, kinds: Sequence[int], rehighlight: bool = True) -> None:
        if len(kinds) != len(seg):
            raise ValueError(f"{len(kinds)} format kinds for {len(seg)} segments")
        _check_sorted(seg.starts, seg.ends, 0)
        self.starts, self.ends, self.kinds = list(seg.starts), list(seg.ends), list(kinds)
        self.tokens, self.lost = list(seg.tokens), list(seg.lost)
        if rehighlight:
            self.rehighlight()

    def clear_segments(self, rehighlight: bool = True) -> None:
        self.set_segments(Segments([], [], [], []), [], rehighlight)

    def append_segments(self, seg: Segments, kinds: Sequence[int]) -> None:
        """Add segments at the end; the blocks they touch are painted when their text is inserted."""
        if len(kinds) != len(seg):
            raise ValueError(f"{len(kinds)} format kinds for {len(seg)} segments")
        _check_sorted(seg.starts, seg.ends, self.ends[-1] if self.ends else 0)
        self.starts.extend(seg.starts)
        self.ends.extend(seg.ends)
        self.kinds.extend(kinds)
        self.tokens.extend(seg.tokens)
        self.lost.extend(seg.lost)

    painted: int | None = None  # paint only the first this many segments (None: all)

    @guarded
    def highlightBlock(self, text: str) -> None:  # noqa: N802 — Qt's name
        n = len(self.starts) if self.painted is None else min(self.painted, len(self.starts))
        if not n:
            return
        block = self.currentBlock()
        b0 = block.position()
        b1 = b0 + block.length()
        i = bisect.bisect_right(self.ends, b0, 0, n)
        j = bisect.bisect_left(self.starts, b1, 0, n)
        starts, ends, kinds, formats = self.starts, self.ends, self.kinds, self.formats
        for k in range(i, j):
            s = max(starts[k], b0)
            e = min(ends[k], b1)
            if e > s:
                self.setFormat(s - b0, e - s, formats[kinds[k]])


def _check_sorted(starts: Sequence[int], ends: Sequence[int], after: int) -> None:
    """The highlighter's bisections need sorted, non-overlapping segments: refuse anything else loudly."""
    prev = after
    for s, e in zip(starts, ends, strict=True):
        if s < prev or e < s:
            raise ValueError(f"segment [{s}, {e}) overlaps or precedes the one ending at {prev}")
        prev = e


class TokenTextEdit(QtWidgets.QPlainTextEdit):
    """A QPlainTextEdit with token segments: backgrounds, a tooltip per segment and a click signal."""

    sig_token_clicked = QtCore.Signal(int)
    """The user clicked a token: its index (the first token of the segment clicked)."""

    def __init__(self, parent: QtWidgets.QWidget | None = None, read_only: bool = False) -> None:
        super().__init__(parent)
        self.setReadOnly(read_only)
        self.setLineWrapMode(QtWidgets.QPlainTextEdit.LineWrapMode.WidgetWidth)
        font = QtGui.QFontDatabase.systemFont(QtGui.QFontDatabase.SystemFont.FixedFont)
        font.setPointSizeF(max(font.pointSizeF(), 10.0))
        self.setFont(font)
        self.highlighter = TokenHighlighter(self.document())
        # (token indices, lost bytes) of the segment under the mouse → tooltip text
        self.tooltip_for: Callable[[tuple[int, ...], tuple[tuple[int, int], ...]], str] | None = None
        self.viewport().setMouseTracking(True)
        self.viewport().installEventFilter(self)
        self._press_pos: QtCore.QPoint | None = None

    def set_formats(self, formats: list[QtGui.QTextCharFormat]) -> None:
        self.highlighter.formats = formats

    def cluster_at(self, pos: QtCore.QPoint) -> tuple[int, int] | None:
        """Document span [start, end) of the character under a viewport point, or None (a margin, past a line's end).

        A "character" here is what the user can point at: a grapheme cluster (an emoji ZWJ sequence, a letter with
        its combining marks). cursorForPosition gives the nearest gap between clusters; the cluster is the one on
        either side of it whose extent holds the point (in right-to-left text the extent runs leftwards).
        """
        cursor = QtGui.QTextCursor(self.document())
        gap = self.cursorForPosition(pos).position()  # may fall inside a cluster (an emoji ZWJ sequence)
        nxt, prev = QtGui.QTextCursor.MoveOperation.NextCharacter, QtGui.QTextCursor.MoveOperation.PreviousCharacter
        spans = []
        for first, second in ((nxt, prev), (prev, nxt)):  # the cluster right of the gap, then the one left of it
            cursor.setPosition(gap)
            if cursor.movePosition(first):
                a = cursor.position()
                cursor.movePosition(second)
                spans.append((min(a, cursor.position()), max(a, cursor.position())))
        x = pos.x()
        for start, end in spans:
            cursor.setPosition(start)
            a = self.cursorRect(cursor)
            cursor.setPosition(end)
            b = self.cursorRect(cursor)
            if a.top() == b.top() and min(a.left(), b.left()) <= x < max(a.left(), b.left()):
                return start, end
        return None

    def segments_at(self, pos: QtCore.QPoint) -> range:
        """Indices of the segments under a viewport point (empty over a margin or a gap between tokens)."""
        h = self.highlighter
        span = self.cluster_at(pos) if h.starts else None
        if span is None:
            return range(0)
        return range(bisect.bisect_right(h.ends, span[0]), bisect.bisect_left(h.starts, span[1]))

    def tokens_at(self, pos: QtCore.QPoint) -> tuple[int, ...]:
        """Indices of the tokens under a viewport point (several when they share a character; none over a gap)."""
        return self._under(pos)[0]

    def _under(self, pos: QtCore.QPoint) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        h = self.highlighter
        tokens: dict[int, None] = {}
        lost: list[tuple[int, int]] = []
        for k in self.segments_at(pos):
            if h.ends[k] > h.starts[k]:
                tokens.update(dict.fromkeys(h.tokens[k]))
                lost.extend(h.lost[k])
        return tuple(tokens), tuple(lost)

    def tooltip_at(self, pos: QtCore.QPoint) -> str:
        """What hovering this viewport point shows ("" for nothing)."""
        tokens, lost = self._under(pos)
        if self.tooltip_for is None or not (tokens or lost):
            return ""
        return self.tooltip_for(tokens, lost)

    @guarded(default=False)
    def eventFilter(self, obj: QtCore.QObject, event: QtCore.QEvent) -> bool:  # noqa: N802 — Qt's name
        if obj is self.viewport():
            et = event.type()
            if et == QtCore.QEvent.Type.ToolTip and self.tooltip_for is not None:
                tip = self.tooltip_at(event.pos())
                if not tip:
                    QtWidgets.QToolTip.hideText()
                else:
                    QtWidgets.QToolTip.showText(event.globalPos(), tip, self.viewport())
                return True
            if et == QtCore.QEvent.Type.MouseButtonPress:
                self._press_pos = event.position().toPoint()
            elif et == QtCore.QEvent.Type.MouseButtonRelease and self._press_pos is not None:
                pos = event.position().toPoint()
                if (pos - self._press_pos).manhattanLength() < 4 and not self.textCursor().hasSelection():
                    tokens = self.tokens_at(pos)
                    if tokens:
                        self.sig_token_clicked.emit(tokens[0])
                self._press_pos = None
        return super().eventFilter(obj, event)


def token_formats() -> list[QtGui.QTextCharFormat]:
    """Formats for the prompt views: the alternating colours, then special tokens (index len(TOKEN_COLORS))."""
    fmts = [char_format(c, theme.FOREGROUND) for c in theme.TOKEN_COLORS]
    fmts.append(char_format(theme.qcolor(theme.SPECIAL_TOKEN_COLOR).darker(160), "#f2dcff", bold=True))
    return fmts


SPECIAL_KIND = len(theme.TOKEN_COLORS)
