"""The dark theme and the colours every panel shares.

Colours are "#rrggbb" strings: QColor, pyqtgraph's mkBrush/mkPen and style sheets all accept them.
Prefill is amber and decode is blue everywhere (timeline bars, roofline points, KV cache steps, token chips), so
one glance tells which phase a thing belongs to.
"""

from __future__ import annotations

from PySide6 import QtGui, QtWidgets

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

# Backgrounds for alternating tokens under light text: distinct hues, similar (dark) lightness, so boundaries
# show without any token looking more important than its neighbours.
TOKEN_COLORS = ["#2d4f73", "#5d3d63", "#2f5d4c", "#6a4e2a", "#45507f", "#66383f"]


def token_color(index: int) -> str:
    """Background colour of the token at `index` in an alternating run."""
    return TOKEN_COLORS[index % len(TOKEN_COLORS)]


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
               grid: tuple[bool, bool] = (True, True)) -> None:
    """The common look of a panel's pyqtgraph PlotItem: no menu or buttons, themed ticks and axis labels.

    `left` / `bottom` are (label, units or None). An axis without units gets no automatic SI prefix: a count
    or a ratio is never shown as "(x0.001)".
    """
    font = QtGui.QFont()
    font.setPointSize(PLOT_FONT_PT)
    pi.setMenuEnabled(False)
    pi.hideButtons()
    pi.showGrid(x=grid[0], y=grid[1], alpha=0.2)
    style = {"font-size": f"{PLOT_FONT_PT}pt", "color": FOREGROUND}
    for name, label in (("left", left), ("bottom", bottom)):
        axis = pi.getAxis(name)
        axis.setStyle(tickFont=font)
        axis.setTextPen(FOREGROUND)
        if label is not None:
            pi.setLabel(name, label[0], units=label[1], **style)
        if label is None or label[1] is None:
            axis.enableAutoSIPrefix(False)


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
    return item


def show_empty(pi, note, text: str, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
    """An empty plot shows its real axes over `x_range` × `y_range` and `text` in the middle."""
    pi.getViewBox().setRange(xRange=x_range, yRange=y_range, padding=0)
    note.setText(text)
    note.setPos((x_range[0] + x_range[1]) / 2, (y_range[0] + y_range[1]) / 2)
    note.setVisible(True)
