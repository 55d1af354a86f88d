"""The timeline's text never sits on its bars: with decode steps as tall as their mean (a short prompt, where the
prefill takes about one decode step) any label on the TPOT-mean line would cross them; the line is keyed in the
title instead. Checked geometrically: every visible text item in the plot against every bar, in scene pixels."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore


def test_no_text_inside_the_plot_overlaps_a_bar(qtbot, bridge):
    from app.panels import timeline

    panel = timeline.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(700, 300)
    panel.show()
    rng = np.random.default_rng(0)
    panel._seconds = {0: 0.030, **{k: 0.028 + 0.006 * float(rng.random()) for k in range(1, 30)}}
    panel.flush()
    qtbot.wait(10)
    panel.flush()
    vb = panel.plot.getPlotItem().getViewBox()
    steps, secs = panel.bar_data()
    bars = [vb.mapViewToScene(QtCore.QRectF(x - 0.4, 0.0, 0.8, h)).boundingRect()
            for x, h in zip(steps, secs, strict=True)]
    texts = [it for it in vb.allChildItems() if isinstance(it, (pg.TextItem, pg.InfLineLabel)) and it.isVisible()]
    for t in texts:
        r = t.sceneBoundingRect()
        assert not any(r.intersects(b) for b in bars), f"{t} overlaps a bar"
    assert panel.tpot_line.isVisible() and "TPOT mean" in panel.stats_text()  # the dashed line is keyed
