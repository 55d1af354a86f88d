"""The contract every panel follows: receive fast, paint on a tick.

A panel names the bridge signals it listens to in one table, `subscriptions` ({"sig_token": "_on_token", …}),
which the base class connects; those slots only store the latest data and call `mark_dirty()`.
One app-wide timer calls `tick()` on every panel about 30 times a second; `tick()` calls `draw()` only when
something changed and the panel is on screen: a dock tabbed behind another, closed or minimized does no work, and
draws its latest data when it is shown again. Plot items are created once in `__init__`; `draw()` only updates them
(setData / setImage).

Help texts: the class's `help_text` explains the panel in general terms; `model_help()` adds sentences in the
loaded model's own numbers (from its config and engine.costs.formulas), so a panel never speaks of a model that is not
loaded. The instance's `help_text` is the two together, refreshed on every model load.
"""

from __future__ import annotations

import time
from typing import ClassVar

import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.guard import guarded
from engine.events import ModelInfo
from engine.model.config import ModelConfig

MAX_DRAW_INTERVAL_S = 1.0  # however costly its drawing, a panel with new data redraws at least once a second


class Panel(QtWidgets.QWidget):
    title: ClassVar[str] = "Panel"
    object_name: ClassVar[str] = "panel"  # the QDockWidget's objectName: stable, so saveState/restoreState work
    help_text: ClassVar[str] = ""  # shown by the dock's help button and the Help menu, in our own words
    # (an instance's help_text adds model_help() once a model is loaded)
    shortcut: ClassVar[str] = ""  # e.g. "Alt+3": show and focus this panel
    # A plot repaint costs milliseconds of GUI thread (axes, text) and the GUI shares the cores with the engine:
    # repainting every panel at the timer's rate slows the engine's decode. Plots redraw at most this often.
    max_fps: ClassVar[float] = 8.0
    # …and each panel's drawing (its draw() and its share of the window's paint that follows, measured every time)
    # may take at most this fraction of one core: a panel that costs 13 ms a frame redraws about 3 times a second, a
    # 2-ms one 8 times.
    # The measurement is wall time, so on a loaded machine (a paint that waits for a core) panels slow down too.
    # What the GUI then takes of a core: BENCHMARKS.md, "The window's paint charged to the panels that drew".
    paint_budget: ClassVar[float] = 0.02
    subscriptions: ClassVar[dict[str, str]] = {}  # bridge signal → this panel's slot (method name)

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        # Opaque: a repaint of the panel's widgets starts at the panel. Transparent, it started at the dock, whose
        # title and buttons Fusion draws again each time (their icons loaded from file on every paint).
        self.setAutoFillBackground(True)
        self.bridge = bridge
        self._dirty = False
        self._next_draw = 0.0  # monotonic time before which tick() does not draw again
        self._drawn_at, self._draw_cost = 0.0, 0.0  # the last draw: when, and what draw() took
        self.paint_due = False  # drawn since the window's last paint (its paint is charged to this panel)
        self._views: list[pg.GraphicsView] | None = None  # the panel's plots, found at its first draw
        self.draw_count = 0  # how many times draw() ran (the GUI benchmark reads it)
        bridge.sig_model_loaded.connect(self._refresh_help)
        for signal, slot in self.subscriptions.items():
            getattr(bridge, signal).connect(getattr(self, slot))
        if bridge.info is not None and bridge.cfg is not None:
            self._refresh_help(bridge.info)

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        """Sentences of the help text in the loaded model's numbers ("" when the panel has none)."""
        return ""

    def _refresh_help(self, info: ModelInfo) -> None:
        cfg = self.bridge.cfg
        general = type(self).help_text
        extra = self.model_help(cfg, info) if cfg is not None and info is not None else ""
        self.help_text = f"{general} {extra}" if extra else general
        self.setWhatsThis(self.help_text)
        dock = panel_dock(self)
        if dock is not None:
            dock.setWhatsThis(self.help_text)

    def mark_dirty(self) -> None:
        self._dirty = True

    @property
    def dirty(self) -> bool:
        """New data not drawn yet."""
        return self._dirty

    def draw_soon(self) -> None:
        """Let the next tick draw, whatever the rate limit (a run's end: its last state is drawn now, not up to a
        second later, when the autosave's encoding would take turns with the draw for the GIL)."""
        self._next_draw = 0.0

    def on_screen(self) -> bool:
        """Some of the panel is drawn in the window: shown, not in a dock tabbed behind another (a tabbed-away dock
        stays visible to Qt, covered by the one in front) or closed, and not in a minimized window."""
        return self.isVisible() and not self.visibleRegion().isEmpty() and not self.window().isMinimized()

    @QtCore.Slot(bool)
    def came_into_view(self, visible: bool = True) -> None:
        """Brought on screen (its tab chosen, its dock reopened: the dock's visibilityChanged): what arrived while it
        was hidden is drawn in the event loop's next turn, whatever the rate limit, so it never shows stale data."""
        if visible and self._dirty:
            QtCore.QTimer.singleShot(0, self, self.flush)

    @guarded
    def showEvent(self, event: QtGui.QShowEvent) -> None:  # noqa: N802 — Qt's name
        super().showEvent(event)
        self.came_into_view()

    def _draw(self) -> None:
        now = time.monotonic()
        self._dirty = False
        self.draw()
        self.settle_plots()
        # Qt paints what the draw changed in the window's next paint, which the window times and charges back
        # (charge_paint). A repaint() here painted the panel's controls, which a draw seldom changes, and never its
        # plots: a QGraphicsView's viewport is left out of a parent's repaint, and one repainted at once was painted
        # again as pyqtgraph's deferred updates arrived (BENCHMARKS.md, "The window's paint charged to the panels that
        # drew").
        self._drawn_at, self._draw_cost = now, time.monotonic() - now
        self._next_draw = now + self._interval(self._draw_cost)
        self.draw_count += 1
        self.paint_due = True

    def _interval(self, cost: float) -> float:
        return max(1.0 / self.max_fps, min(cost / self.paint_budget, MAX_DRAW_INTERVAL_S))

    def charge_paint(self, seconds: float) -> None:
        """The window's paint after this panel's draw took `seconds` (its share of it): the next draw waits as for a
        draw that cost that much more."""
        self.paint_due = False
        self._next_draw = max(self._next_draw, self._drawn_at + self._interval(self._draw_cost + seconds))

    def settle_plots(self) -> None:
        """Let each plot fit its auto-range to the new data now. pyqtgraph does it when the plot is about to paint,
        and the change of range makes it paint a second time: settled here, each draw costs one paint."""
        if self._views is None:
            self._views = [v for v in self.findChildren(QtWidgets.QGraphicsView) if isinstance(v, pg.GraphicsView)]
        for view in self._views:
            if view.isVisible():
                view.scene().prepareForPaint()

    def flush(self) -> None:
        """Draw now if anything changed, whatever the rate limit and whether it is on screen (screenshots, exports,
        tests)."""
        if self._dirty:
            self._next_draw = 0.0
            self._draw()

    def tick(self) -> None:
        """The shared timer's turn: draw if there is new data, the panel is on screen and its interval passed."""
        if not self._dirty or time.monotonic() < self._next_draw:
            return  # stays dirty: a later tick draws the latest data
        if not self.on_screen():
            return  # stays dirty: it draws when it comes into view
        self._draw()

    def draw(self) -> None:
        """Update the plot items from the stored data. Called on the GUI timer, only when dirty."""

    def clear(self) -> None:
        """Forget the data of the previous generation."""
        self.mark_dirty()


class Holder(QtWidgets.QWidget):
    """One widget, filling this one, held without a layout, so that a change inside it stops here unless it changes
    what it asks of the layout around it (`_asked`).

    Every setText on a label makes Qt lay out the label's panel again, and everything in it, whether or not the label
    now asks for other room; a layout-less parent is only told (LayoutRequest), and passes it on when what the widget
    asks did change (BENCHMARKS.md, "What the GUI thread pays for a redraw")."""

    def __init__(self, held: QtWidgets.QWidget, wrapped: bool = False) -> None:
        """`wrapped`: the widget is text that wraps at the width it is given (a word-wrapped label): its preferred
        width is not asked of the layout (it follows the text), its height at its width is (when it has one)."""
        super().__init__()
        self.held = held
        self._wrapped = wrapped
        held.setParent(self)
        self._asks = self._asked()
        self._follow()

    def _asked(self) -> tuple[tuple, tuple]:
        """What the widget asks of the layout around it: (what does not depend on its size: its least and largest
        sizes and its policy; what does: its preferred size where it is beyond the room it has (a label's preferred
        width follows its text, and within the room it has a layout would do nothing new) and a wrapped text's height
        at its width)."""
        h, hint = self.held, self.held.sizeHint()
        hfw = h.heightForWidth(self.width()) if self.hasHeightForWidth() else -1
        beyond = (hint.width() if hint.width() > self.width() and not self._wrapped else 0,
                  hint.height() if hint.height() > self.height() and hfw < 0 else 0)  # else its height is hfw's
        return (h.minimumSizeHint(), h.minimumSize(), h.maximumSize(), h.sizePolicy()), (beyond, hfw)

    def _pass_on(self) -> None:
        self._follow()
        self.updateGeometry()

    def _follow(self) -> None:
        """Take on the widget's size policy and largest size (its hints and least size are read through)."""
        policy = self.held.sizePolicy()
        policy.setHeightForWidth(self.hasHeightForWidth())
        self.setSizePolicy(policy)
        self.setMaximumSize(self.held.maximumSize())

    @guarded(default=QtCore.QSize())
    def sizeHint(self) -> QtCore.QSize:  # noqa: N802 — Qt's name
        return self.held.sizeHint()

    @guarded(default=QtCore.QSize())
    def minimumSizeHint(self) -> QtCore.QSize:  # noqa: N802 — Qt's name
        return self.held.minimumSizeHint().expandedTo(self.held.minimumSize())

    @guarded(default=False)
    def hasHeightForWidth(self) -> bool:  # noqa: N802 — Qt's name
        return self._wrapped and self.held.hasHeightForWidth()

    @guarded(default=-1)
    def heightForWidth(self, width: int) -> int:  # noqa: N802 — Qt's name
        return self.held.heightForWidth(width) if self.hasHeightForWidth() else -1

    @guarded(default=False)
    def event(self, event: QtCore.QEvent) -> bool:
        if event.type() == QtCore.QEvent.Type.LayoutRequest:
            asks, old = self._asked(), self._asks
            self._asks = asks
            if asks != old:
                self._pass_on()
            return True
        return super().event(event)

    @guarded
    def resizeEvent(self, event: QtGui.QResizeEvent) -> None:  # noqa: N802 — Qt's name
        self.held.setGeometry(self.rect())
        # what depends on the size changes with it; a change of the rest that has not reached the layout yet (its
        # LayoutRequest still on its way) is passed on here
        asks, old = self._asked(), self._asks
        self._asks = asks
        if asks[0] != old[0]:
            self._pass_on()


class PanelFrame(Holder):
    """What a dock holds: one panel (a Holder), so that a label's new text in a live panel lays out that panel, not
    its dock and the whole main window with every dock (QLayout::activate ends in updateGeometry, whatever
    changed)."""

    @property
    def panel(self) -> Panel:
        return self.held


class Bars(pg.BarGraphItem):
    """pyqtgraph's bar item, keeping its bounding rectangle until its bars or its view's transform change.

    BarGraphItem computes the rectangle from the device transform (a pixel's size, for the pen) at every call, and Qt
    asks each item for it several times a paint (BENCHMARKS.md, "Where a panel's redraw goes")."""

    _rect: QtCore.QRectF | None = None

    def setOpts(self, **opts) -> None:
        self._rect = None
        super().setOpts(**opts)

    def viewTransformChanged(self) -> None:
        self._rect = None
        super().viewTransformChanged()

    @guarded(default=QtCore.QRectF())
    def boundingRect(self) -> QtCore.QRectF:  # noqa: N802 — Qt's name
        if self._rect is None:
            self._rect = super().boundingRect()
        return QtCore.QRectF(self._rect)


def panel_dock(widget: QtWidgets.QWidget) -> QtWidgets.QDockWidget | None:
    """The dock a panel sits in (through its PanelFrame), or None."""
    while widget is not None and not isinstance(widget, QtWidgets.QDockWidget):
        widget = widget.parentWidget()
    return widget


def reserve_lines(label: QtWidgets.QLabel, lines: int) -> None:
    """Give a word-wrapped label room for `lines` lines from the start, whatever its text. A wrapped label asks for
    its height at the width it is given (height for width), so new text that wraps once more made its dock taller
    in the middle of a run, and the whole window was laid out and repainted again."""
    policy = label.sizePolicy()
    policy.setHeightForWidth(False)
    label.setSizePolicy(policy)
    label.setMinimumHeight(lines * label.fontMetrics().lineSpacing() + 2)
    label.setAlignment(QtCore.Qt.AlignmentFlag.AlignLeft | QtCore.Qt.AlignmentFlag.AlignTop)


def spin_box(lo: float, hi: float, value: float, tip: str, decimals: int = 0) -> QtWidgets.QAbstractSpinBox:
    """A labs' knob: an integer spin box, or a decimal one with `decimals` places."""
    s = QtWidgets.QDoubleSpinBox() if decimals else QtWidgets.QSpinBox()
    if decimals:
        s.setDecimals(decimals)
    s.setRange(lo, hi)
    s.setValue(value)
    s.setToolTip(tip)
    return s
