"""A narrow roofline keeps a readable x axis: label room may widen it by at most MAX_WIDEN decades a side (a
260-pixel-wide dock once showed 1e-35 … 1e14 FLOP/byte)."""

from __future__ import annotations

import math

from engine.protocol import Loaded


def test_narrow_roofline_axis_stays_readable(qtbot, bridge, tiny_lm):
    from app.panels import roofline

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    panel = roofline.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(260, 330)
    panel.show()
    panel.select_hardware("h100-sxm")
    panel.dtype_combo.setCurrentText("bf16")
    qtbot.wait(20)
    panel.flush()
    (x0, x1), _ = panel.plot.getPlotItem().getViewBox().viewRange()  # log10 of FLOP/byte
    # before widening the range is [min(0.1, points/3), max(ridge·20, 100, points·5)] out to whole quarter decades:
    # at most 1.5 decades more
    ridge = panel.roofs()[2]
    points = [c.intensity for c in panel.analytic_costs().values()]
    lo = math.floor(4 * math.log10(min([0.1] + [p / 3 for p in points]))) / 4
    hi = math.ceil(4 * math.log10(max([ridge * 20, 100.0] + [p * 5 for p in points]))) / 4
    assert lo - 1.5 - 1e-9 <= x0 and x1 <= hi + 1.5 + 1e-9
