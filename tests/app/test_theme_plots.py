"""The shared plot helpers in app.theme: log ticks, the roof curve, the common axis style."""

from __future__ import annotations

import math

import pyqtgraph as pg
import pytest

from app import theme


def test_log_ticks_narrow_medium_wide():
    assert [t for _, t in theme.log_ticks(0.0, math.log10(4))] == ["1", "1.5", "2", "3", "4"]
    assert [t for _, t in theme.log_ticks(0.0, 2.0)] == ["1", "2", "5", "10", "20", "50", "100"]
    wide = theme.log_ticks(9.0, 13.0)
    assert [t for _, t in wide] == ["1G", "10G", "100G", "1T", "10T"]
    assert [p for p, _ in wide] == [9.0, 10.0, 11.0, 12.0, 13.0]
    sparse = theme.log_ticks(-2.0, 15.0, most=9)  # 18 decades: every other one
    assert [p for p, _ in sparse] == [float(k) for k in range(-2, 15, 2)]
    assert theme.log_ticks(0.0, 3.0, sep=" ", decades_beyond=0.0) == [(0.0, "1"), (1.0, "10"), (2.0, "100"),
                                                                       (3.0, "1 k")]


def test_roof_points_are_the_two_roofs():
    peak, bw = 100e12, 2e12  # ridge at 50 FLOP/byte
    xs, ys = theme.roof_points(0.1, 1000.0, peak, bw)
    assert list(xs) == [0.1, 50.0, 1000.0]
    assert list(ys) == pytest.approx([0.1 * 2e12, 100e12, 100e12])
    xs, ys = theme.roof_points(0.1, 10.0, peak, bw)  # all left of the ridge: the memory roof alone
    assert list(xs) == [0.1, 10.0] and list(ys) == pytest.approx([2e11, 2e13])


def test_style_plot(qtbot):
    w = pg.PlotWidget()
    qtbot.addWidget(w)
    pi = w.getPlotItem()
    theme.style_plot(pi, left=("time", "s"), bottom=("step", None), right=("tokens/s", None), log=(True, False),
                     mouse=False, colors={"right": theme.SYSTEM_COLOR})
    assert pi.getAxis("right").isVisible() and pi.ctrl.logXCheck.isChecked() and not pi.ctrl.logYCheck.isChecked()
    assert not pi.getViewBox().state["mouseEnabled"][0]
    assert pi.getAxis("left").autoSIPrefix and not pi.getAxis("bottom").autoSIPrefix
    assert not pi.getAxis("right").autoSIPrefix
    assert theme.SYSTEM_COLOR in pi.getAxis("right").labelStyle["color"]
