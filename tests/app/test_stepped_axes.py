"""Axes that follow growing data move in steps, so a draw between two steps re-lays no axis out (issue 50)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
import pytest

from app.theme import COUNT_STEPS, set_data, set_ticks, set_title, stepped_bound

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


def test_a_bound_holds_while_the_data_fits_and_fills_half_of_it():
    assert stepped_bound(7.0, None) == 8.0  # 7 × 1.1 = 7.7: the next of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 × 10^k
    assert stepped_bound(128.0, None, headroom=1.0) == 150.0
    assert stepped_bound(149.0, 150.0) == 150.0  # still fits: unchanged
    assert stepped_bound(151.0, 150.0) == 200.0  # outgrown: the next step
    assert stepped_bound(60.0, 150.0) == 80.0  # under half of it (a new, smaller run): fitted again
    bounds = set()
    b = None
    for n in range(1, 257):  # a 256-token run's x axis
        b = stepped_bound(float(n), b)
        assert n <= b <= 1.25 * n * 1.1  # the data always fits, and never in much less than the plot
        bounds.add(b)
    assert len(bounds) < 30  # not one per token


def test_a_count_axis_steps_in_one_two_five():
    """Steps and tokens grow at every token while a panel draws a few times a second: their axes step in 1-2-5, so
    a 256-token run's axis changes a handful of times, not at nearly every draw."""
    bounds = []
    b = None
    for n in range(1, 257):
        b = stepped_bound(float(n), b, headroom=1.0, steps=COUNT_STEPS)
        assert n <= b < 2.5 * n + 1e-9  # the data fits, and fills at least 40 % of the axis
        if not bounds or bounds[-1] != b:
            bounds.append(b)
    assert bounds == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]


def test_set_data_leaves_an_item_alone_when_its_values_are_the_same(qtbot):
    """pyqtgraph rebuilds an item's points at every setData: the same values again must not reach it."""
    w = pg.PlotWidget()
    qtbot.addWidget(w)
    item = w.getPlotItem().plot([], [], pen=None, symbol="o")
    calls = []
    item.sigPlotChanged.connect(lambda *_: calls.append(1))
    set_data(item, [], [])
    assert calls == []  # empty and empty again
    set_data(item, [1, 2], [3.0, 4.0])
    assert len(calls) == 1
    set_data(item, np.array([1.0, 2.0]), [3, 4])  # the same values, another type
    assert len(calls) == 1
    set_data(item, [1, 2], [3.0, 5.0])  # one value changed
    set_data(item, [1, 2, 3], [3.0, 5.0, 6.0])  # one more point
    set_data(item, [], [])  # cleared
    assert len(calls) == 4
    x, _y = item.getOriginalDataset()
    assert x is None or len(x) == 0


def test_same_ticks_or_title_again_leave_the_axis_picture_alone(qtbot):
    w = pg.PlotWidget()
    qtbot.addWidget(w)
    pi = w.getPlotItem()
    axis = pi.getAxis("left")
    set_ticks(axis, [[(0.0, "a"), (1.0, "b")]])
    axis.picture = "kept"  # stands for a generated picture: a setTicks clears it
    set_ticks(axis, [[(0.0, "a"), (1.0, "b")]])
    assert axis.picture == "kept"
    set_ticks(axis, [[(0.0, "a"), (1.0, "c")]])
    assert axis.picture is None
    set_title(pi, "one", 300.0)
    label = pi.titleLabel.text
    pi.titleLabel.text = "untouched"
    set_title(pi, "one", 300.0)
    assert pi.titleLabel.text == "untouched"
    set_title(pi, "two", 300.0)
    assert pi.titleLabel.text != "untouched" and label
    set_title(pi, None, 300.0)
    assert not pi.titleLabel.isVisible()


def test_bars_keep_pyqtgraphs_bounding_rect_through_changes(qtbot):
    """Bars caches BarGraphItem's bounding rectangle: after new bars, a new view range and a resize it is still what
    pyqtgraph's own item computes for the same bars."""
    from app.panels.base import Bars

    w = pg.PlotWidget()
    qtbot.addWidget(w)
    w.resize(300, 200)
    w.show()
    pi = w.getPlotItem()
    ours = Bars(x=[0, 1, 2], height=[1.0, 2.0, 3.0], width=0.8, pen=pg.mkPen("w", width=3))
    ref = pg.BarGraphItem(x=[0, 1, 2], height=[1.0, 2.0, 3.0], width=0.8, pen=pg.mkPen("w", width=3))
    for item in (ours, ref):
        pi.addItem(item)

    def same() -> None:
        qtbot.wait(5)
        assert ours.boundingRect() == ref.boundingRect()

    same()
    for item in (ours, ref):
        item.setOpts(x=[0, 1, 2, 3], height=[1.0, 2.0, 3.0, 9.0])
    same()
    pi.getViewBox().setRange(xRange=(0, 40), yRange=(0, 100), padding=0)  # a pixel is larger in data units
    same()
    w.resize(600, 500)
    same()
