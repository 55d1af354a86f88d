"""Plot titles and labels: the timeline's text never sits on its bars (with decode steps as tall as their mean, a
label on the TPOT-mean line would cross them, so the line is keyed in the title; checked geometrically, every
visible text item against every bar in scene pixels), and titles fit a narrow dock: wrapped, never clipped."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore

from engine.protocol import Loaded


def test_no_text_inside_the_plot_overlaps_a_bar(qtbot, bridge):
    from app.panels import timeline

    panel = timeline.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(700, 300)
    panel.show()
    rng = np.random.default_rng(0)
    for step, seconds in {0: 0.030, **{k: 0.028 + 0.006 * float(rng.random()) for k in range(1, 30)}}.items():
        panel._on_token(SimpleNamespace(step=step, seconds=seconds))  # what the slot reads of a TokenSampled
    panel.flush()
    qtbot.wait(10)
    panel.flush()
    vb = panel.plot.getPlotItem().getViewBox()
    steps, secs = panel.bar_data()
    assert len(steps) == 30  # every bar drawn: the overlap check below is not vacuous
    bars = [vb.mapViewToScene(QtCore.QRectF(x - 0.4, 0.0, 0.8, h)).boundingRect()
            for x, h in zip(steps, secs, strict=True)]
    texts = [it for it in vb.allChildItems() if isinstance(it, (pg.TextItem, pg.InfLineLabel)) and it.isVisible()]
    for t in texts:
        r = t.sceneBoundingRect()
        assert not any(r.intersects(b) for b in bars), f"{t} overlaps a bar"
    assert panel.tpot_line.isVisible() and "- - -</b></span>&nbsp;mean" in panel.stats_text()  # the line is keyed


def test_the_title_fits_a_narrow_dock(qtbot, bridge):
    """The three title lines fit a 340 px wide panel (the default layout's timeline dock is about 350 px) with long
    figures: a clipped line hid the measured total."""
    from app.panels import timeline
    from engine.events import Finished

    panel = timeline.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(340, 320)
    panel.show()
    steps = np.full(127, 0.1234)
    for step, seconds in {0: 12.345, **{k: 0.1234 for k in range(1, 128)}}.items():
        panel._on_token(SimpleNamespace(step=step, seconds=seconds))
    panel._on_finished(Finished(reason="length", prompt_ids=np.zeros(4054, dtype=np.int64),
                                ids=np.zeros(128, dtype=np.int64), text="", ttft_s=12.345, tpot_s=0.1234,
                                step_seconds=steps, total_s=123.45))
    panel.flush()
    qtbot.wait(10)
    panel.flush()
    pi = panel.plot.getPlotItem()
    assert "measured" in panel.stats_text()
    width = panel.plot.width()  # a title wider than this pushed the plot item past its widget: clipped
    title = pi.titleLabel.item.boundingRect()
    assert title.width() <= width - pi.getAxis("left").width() and pi.width() <= width, panel.stats_text()
    assert pi.layout.rowMinimumHeight(0) >= title.height()  # every (wrapped) line shows


def test_kv_cache_key_fits_a_narrow_dock(qtbot, bridge, tiny_lm):
    from app.panels import kv_cache
    from engine.events import KVCacheGrew

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    panel = kv_cache.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(220, 420)
    panel.show()
    bridge.sig_kv.emit(KVCacheGrew(step=0, n_tokens=7, bytes_used=3584, bytes_allocated=4096))
    panel.flush()
    qtbot.wait(10)
    panel.flush()
    pi = panel.plot.getPlotItem()
    width = panel.plot.width()
    title = pi.titleLabel.item.boundingRect()
    assert "allocated" in pi.titleLabel.text and pi.width() <= width and title.width() <= width
    assert pi.layout.rowMinimumHeight(0) >= title.height()
