"""The dark theme and the colours every panel shares.

Colours are "#rrggbb" strings: QColor, pyqtgraph's mkBrush/mkPen and style sheets all accept them.
Prefill is amber and decode is blue everywhere (timeline bars, roofline points, KV cache steps, token chips), so
one glance tells which phase a thing belongs to.
"""

from __future__ import annotations

import contextlib
import html
import math
from collections.abc import Iterator

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from app.units import si
from engine.costs import formulas as costs

# ---- base palette ----------------------------------------------------------------------------------------------
BACKGROUND = "#1e1f24"  # window and plot background
SURFACE = "#272a31"  # text fields, lists
SURFACE_ALT = "#2e323b"
FOREGROUND = "#d8dae0"  # ordinary text
MUTED = "#8b90a0"  # secondary text, axis labels
GRID = "#3a3f4b"

# ---- meaning -------------------------------------------------------------------------------------------------
ACCENT = "#7aa2f7"  # selection, the sampled token, links
PREFILL_COLOR = "#e0a040"  # the prefill step: the whole prompt in one forward pass
DECODE_COLOR = "#4fb0e0"  # decode steps: one token each
SPECIAL_TOKEN_COLOR = "#b35fd0"  # control tokens such as <|im_start|>
WARNING_COLOR = "#e8b44c"
ERROR_COLOR = "#f7768e"
OK_COLOR = "#9ece6a"
SYSTEM_COLOR = "#bb9af7"  # system tokens/s (all streams together): apart from decode blue (TPOT) and prefill amber
ROOF_COLOR = "#e8e8e8"  # the roofline's roofs
RIDGE_COLOR = "#888888"

# Backgrounds for alternating tokens under light text: distinct hues, similar (dark) lightness, so boundaries
# show without any token looking more important than its neighbours.
TOKEN_COLORS = ["#2d4f73", "#5d3d63", "#2f5d4c", "#6a4e2a", "#45507f", "#66383f"]


def qcolor(name: str, alpha: int | None = None) -> QtGui.QColor:
    c = QtGui.QColor(name)
    if alpha is not None:
        c.setAlpha(alpha)
    return c


def phase_shades(color: str) -> tuple[QtGui.QColor, QtGui.QColor]:
    """Two darkened shades of a phase colour, alternated as token backgrounds under light text."""
    c = QtGui.QColor(color)
    return c.darker(210), c.darker(300)


def visible_whitespace(piece: str) -> str:
    """A token piece with its whitespace made visible: space → ·, newline → ↵, tab → →, carriage return → ␍."""
    return piece.replace(" ", "·").replace("\n", "↵").replace("\t", "→").replace("\r", "␍")


def apply_theme(app: QtWidgets.QApplication) -> None:
    """Dark Fusion palette for the widgets and matching pyqtgraph defaults for the plots."""
    import pyqtgraph as pg

    app.setStyle("Fusion")
    p = QtGui.QPalette()
    role, group = QtGui.QPalette.ColorRole, QtGui.QPalette.ColorGroup
    colours = {
        role.Window: BACKGROUND, role.WindowText: FOREGROUND, role.Base: SURFACE, role.AlternateBase: SURFACE_ALT,
        role.ToolTipBase: "#32363f", role.ToolTipText: FOREGROUND, role.PlaceholderText: MUTED,
        role.Text: FOREGROUND, role.Button: SURFACE_ALT, role.ButtonText: FOREGROUND, role.BrightText: "#ffffff",
        role.Link: ACCENT, role.Highlight: "#3d5a99", role.HighlightedText: "#ffffff",
        role.Light: "#3c404a", role.Midlight: "#33363f", role.Mid: "#2a2d34", role.Dark: "#15161a",
        role.Shadow: "#000000",
    }
    for r, c in colours.items():
        p.setColor(r, QtGui.QColor(c))
    for r in (role.WindowText, role.Text, role.ButtonText):
        p.setColor(group.Disabled, r, QtGui.QColor("#6b7080"))
    app.setPalette(p)
    app.setStyleSheet(
        f"QToolTip {{ color: {FOREGROUND}; background-color: #32363f; border: 1px solid {GRID}; }}"
        f"QDockWidget::title {{ background: {SURFACE_ALT}; padding: 3px 6px; }}"
    )
    pg.setConfigOptions(background=BACKGROUND, foreground=FOREGROUND, antialias=True)


PLOT_FONT_PT = 9  # tick and axis-label size of every plot


def style_plot(pi, left: tuple[str, str | None] | None = None, bottom: tuple[str, str | None] | None = None,
               grid: tuple[bool, bool] = (True, True), *, right: tuple[str, str | None] | None = None,
               log: tuple[bool, bool] = (False, False), mouse: bool = True,
               colors: dict[str, str] | None = None) -> None:
    """The common look of a panel's pyqtgraph PlotItem: no menu or buttons, themed ticks and axis labels.

    `left` / `bottom` / `right` are (label, units or None); `right` also shows the right axis. An axis without
    units gets no automatic SI prefix: a count or a ratio is never shown as "(x0.001)". `log` sets log axes,
    `mouse=False` fixes the view, `colors` gives an axis label its own colour (by axis name).
    """
    font = QtGui.QFont()
    font.setPointSize(PLOT_FONT_PT)
    pi.setMenuEnabled(False)
    pi.hideButtons()
    pi.showGrid(x=grid[0], y=grid[1], alpha=0.2)
    if any(log):
        pi.setLogMode(x=log[0], y=log[1])
    if not mouse:
        pi.setMouseEnabled(False, False)
    if right is not None:
        pi.showAxis("right")
    for name, label in (("left", left), ("bottom", bottom), ("right", right)):
        if name == "right" and label is None:
            continue
        axis = pi.getAxis(name)
        # An axis draws its ticks, labels and the grid lines across the whole plot; pyqtgraph replays them from a
        # QPicture whenever anything in the plot repaints (text replayed as polygons): the largest part of a
        # panel's paint. A pixmap cache makes that a copy until the ticks change.
        axis.setCacheMode(QtWidgets.QGraphicsItem.CacheMode.DeviceCoordinateCache)
        # The room for the tick labels grows to the widest seen and never shrinks back: a plot whose labels change
        # with each step (the sampling panel's tokens) was laid out again, and painted two more times, at each draw.
        axis.setStyle(tickFont=font, autoReduceTextSpace=False)
        axis.setTextPen(FOREGROUND)
        if label is not None:
            colour = (colors or {}).get(name, FOREGROUND)
            pi.setLabel(name, label[0], units=label[1], **{"font-size": f"{PLOT_FONT_PT}pt", "color": colour})
        if label is None or label[1] is None:
            axis.enableAutoSIPrefix(False)


def log_ticks(lo: float, hi: float, most: int = 10, sep: str = "",
              decades_beyond: float = 3.0) -> list[tuple[float, str]]:
    """Ticks of a log10 axis between log10 bounds lo and hi, labelled in SI units (1k, 2M, 10G).

    Every 1…9 × 10^k in a range narrower than a factor of about 6, 1-2-5 × 10^k up to `decades_beyond` decades,
    and whole decades beyond that (every other one, or sparser, when there would be more than `most`).
    """
    if hi - lo > decades_beyond:
        ks = range(math.ceil(lo), math.floor(hi) + 1)
        stride = max(1, math.ceil(len(ks) / most))
        return [(float(k), si(10.0**k, sep)) for k in ks if k % stride == 0]
    steps = (1, 2, 5) if hi - lo > 0.8 else (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)
    ticks = []
    for k in range(math.floor(lo), math.ceil(hi) + 1):
        for m in steps:
            v = m * 10.0**k
            if lo <= math.log10(v) <= hi:
                ticks.append((math.log10(v), si(v, sep)))
    return ticks


def roof_points(lo: float, hi: float, peak: float, bandwidth: float) -> tuple[np.ndarray, np.ndarray]:
    """The roofline min(peak, I · bandwidth) (engine.costs.formulas.attainable_flops) between intensities lo and hi.

    On log-log axes both roofs are straight lines, so the ends and the ridge point draw it exactly.
    """
    ridge = costs.ridge_point(peak, bandwidth)
    xs = np.array([lo, *([ridge] if lo < ridge < hi else []), hi], dtype=float)
    return xs, np.array([costs.attainable_flops(i, peak, bandwidth) for i in xs])


def placeholder(pi) -> object:
    """A muted note centred in an empty plot, saying what will appear there (see `show_empty`)."""
    import pyqtgraph as pg

    font = QtGui.QFont()
    font.setPointSize(PLOT_FONT_PT)
    item = pg.TextItem("", color=MUTED, anchor=(0.5, 0.5))
    item.setFont(font)
    item.setZValue(10)
    item.setVisible(False)
    pi.addItem(item, ignoreBounds=True)
    vb = pi.getViewBox()

    def fit(*_args: object) -> None:  # wrap inside the plot, however narrow the dock
        item.setTextWidth(max(60.0, vb.width() - 16.0))

    vb.sigResized.connect(fit)
    fit()
    return item


def show_empty(pi, note, text: str, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
    """An empty plot shows its real axes over `x_range` × `y_range` and `text` in the middle."""
    pi.getViewBox().setRange(xRange=x_range, yRange=y_range, padding=0)
    note.setHtml(f"<div style='text-align:center'>{html.escape(text).replace(chr(10), '<br>')}</div>")
    note.setPos((x_range[0] + x_range[1]) / 2, (y_range[0] + y_range[1]) / 2)
    note.setVisible(True)


def set_number_cell(table: QtWidgets.QTableWidget, row: int, col: int, text: str) -> None:
    """Write a right-aligned number into a table cell, creating the item on first use."""
    item = table.item(row, col)
    if item is None:
        item = QtWidgets.QTableWidgetItem()
        item.setTextAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
        table.setItem(row, col, item)
    item.setText(text)


def wrap_title(pi, widget_width: float) -> None:
    """Let a plot's title wrap within its widget's width and size its row to the wrapped lines.

    pyqtgraph gives a title the minimum width of its longest line and a row of one line's height: in a narrow dock
    that widens the plot past its widget (clipping the title and the plot) or cuts the lines below the first.
    """
    label = pi.titleLabel
    label.item.setTextWidth(max(80.0, widget_width - pi.getAxis("left").width() - 12))
    label.setMinimumWidth(10)
    label.setPreferredWidth(10)
    height = label.item.boundingRect().height() + 2
    label.setMaximumHeight(height)
    pi.layout.setRowFixedHeight(0, height)


# An axis that follows growing data is re-laid out (its ticks, labels and grid regenerated) whenever its range
# changes: fitted to the data at each draw, that was every draw. It grows instead in steps of these multiples of a
# power of ten, so it stays put for the draws between two steps.
NICE_STEPS = (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
# An axis of a count that grows at every token (steps, tokens in the cache) steps in 1-2-5: a panel draws a few
# times a second, and with the finer steps a run of a few hundred tokens crossed one at nearly every draw.
COUNT_STEPS = (1.0, 2.0, 5.0, 10.0)


def stepped_bound(value: float, bound: float | None, headroom: float = 1.1,
                  steps: tuple[float, ...] = NICE_STEPS) -> float:
    """The upper bound of an axis showing data up to `value` (> 0): the current `bound` while the data fits under
    it and fills more than half of it, else the next of `steps` × a power of ten above value × headroom."""
    if bound is not None and bound * 0.5 < value <= bound:
        return bound
    target = max(value * headroom, 1e-12)
    decade = 10.0 ** math.floor(math.log10(target))
    return next(m * decade for m in steps if m * decade >= target * (1 - 1e-9))


def set_data(item, x, y) -> None:
    """`item.setData(x, y)` (a PlotDataItem) unless it holds these values already: pyqtgraph rebuilds the item's
    points (a scatter's symbols too), bounds and bounding rectangle at every setData, the same data or not, and a
    panel redraws many items of which a step changes few."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    x0, y0 = item.getOriginalDataset()  # (None, None) when it holds nothing
    empty = np.empty(0)
    if np.array_equal(empty if x0 is None else x0, x) and np.array_equal(empty if y0 is None else y0, y):
        return
    item.setData(x, y)


def set_ticks(axis, ticks) -> None:
    """Set an axis's ticks only when they changed: pyqtgraph regenerates the axis picture on every setTicks."""
    if axis._tickLevels != ticks:
        axis.setTicks(ticks)


def set_title(pi, text: str | None, widget_width: float, **style: str) -> None:
    """Set a plot's title (None: none) and wrap it (wrap_title) when its text, style or the widget's width changed:
    setting the same title again relays the whole plot out, and its axes with it."""
    key = (text, widget_width, tuple(sorted(style.items())))
    if getattr(pi, "_title_key", None) == key:
        return
    pi._title_key = key
    pi.setTitle(text, **style)
    if text is not None:
        wrap_title(pi, widget_width)


@contextlib.contextmanager
def filling(table: QtWidgets.QTableWidget) -> Iterator[None]:
    """Fill a table's items in here: a column that fits its contents (ResizeToContents) does so once, at the end. As
    the contents changed it measured all its rows again at every setItem, so a refill cost rows² measures
    (BENCHMARKS.md, "What the engine sends the window, and what the GUI thread pays")."""
    header = table.horizontalHeader()
    modes = [header.sectionResizeMode(c) for c in range(header.count())]
    header.setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.Fixed)
    table.setUpdatesEnabled(False)
    try:
        yield
    finally:
        for c in range(header.count()):  # a column added meanwhile takes the last one's mode
            header.setSectionResizeMode(c, modes[min(c, len(modes) - 1)] if modes else
                                        QtWidgets.QHeaderView.ResizeMode.Interactive)
        table.setUpdatesEnabled(True)
