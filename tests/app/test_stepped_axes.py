"""Axes that follow growing data move in steps, so a draw between two steps re-lays no axis out (issue 50)."""

from __future__ import annotations

import pyqtgraph as pg
import pytest

from app.theme import set_ticks, set_title, stepped_bound

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
