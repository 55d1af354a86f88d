"""A panel's plots paint once per draw: pyqtgraph fits an auto-ranged plot to new data when it is about to paint,
and that change of range used to make it paint a second time, doubling what each draw cost the GUI thread during a
run (Panel.settle_plots). Counted, not timed."""

from __future__ import annotations

import pyqtgraph as pg
import pytest
from PySide6 import QtCore, QtWidgets

from engine.events import KVCacheGrew, TokenSampled
from engine.protocol import Loaded
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


class PaintCount(QtCore.QObject):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def eventFilter(self, _obj, event) -> bool:  # noqa: N802 — Qt's name
        if event.type() == QtCore.QEvent.Type.Paint:
            self.n += 1
        return False


@pytest.mark.parametrize("name", ["kv_cache", "timeline", "sampling", "roofline"])
def test_each_draw_paints_each_plot_once(qtbot, bridge, tiny_lm, name):
    import importlib

    module = importlib.import_module(f"app.panels.{name}")
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    events = list(Session(tiny_lm).generate("the cat sat on the mat", SamplingParams(temperature=0.0),
                                            max_new_tokens=24, capture=Capture(), ignore_eos=True))
    panel = module.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(700, 400)
    panel.show()
    qtbot.waitExposed(panel)
    views = [v for v in panel.findChildren(QtWidgets.QGraphicsView) if isinstance(v, pg.GraphicsView)
             and v.isVisible()]
    assert views
    counters = [PaintCount() for _ in views]
    for v, c in zip(views, counters, strict=True):
        v.viewport().installEventFilter(c)
    draws = 0
    for ev in events:
        bridge.replay(ev)
        if isinstance(ev, (TokenSampled, KVCacheGrew)):
            before = panel.draw_count
            panel.flush()
            draws += panel.draw_count - before
            for _ in range(3):  # the paints a draw leads to, however many event-loop turns they take
                QtWidgets.QApplication.processEvents()
                QtCore.QCoreApplication.sendPostedEvents()
    assert draws >= 24
    for c in counters:
        # a draw that changes nothing a plot shows paints nothing there; one that does, once (an axis that widens
        # for a longer tick label may add one now and then)
        assert c.n <= draws * 1.2 + 2, (c.n, draws)
