"""A change inside a panel stays inside it (app.panels.base.PanelFrame, Holder): a live label's new text lays out
nothing unless it needs other room, and never the dock and the whole window; a panel that comes to need more room
still gets it."""

from __future__ import annotations

from PySide6 import QtCore, QtWidgets

from app.panels.base import PanelFrame


class LayoutRequests(QtCore.QObject):
    """Counts the LayoutRequest events each watched widget receives."""

    def __init__(self, *widgets: QtWidgets.QWidget) -> None:
        super().__init__()
        self.counts = {w: 0 for w in widgets}
        for w in widgets:
            w.installEventFilter(self)

    def eventFilter(self, obj, event):  # noqa: N802 — Qt's name
        if event.type() == QtCore.QEvent.Type.LayoutRequest and obj in self.counts:
            self.counts[obj] += 1
        return False


def test_a_label_set_while_generating_lays_out_its_panel_not_the_window(qtbot, window):
    panel = window.panels["generation"]
    dock = window.docks["generation"]
    assert isinstance(dock.widget(), PanelFrame) and dock.widget().panel is panel
    qtbot.wait(50)
    panel.status.setText("<b>decoding</b> · 0 tokens generated · TPOT 30.0 ms")  # the run's first figures
    qtbot.wait(50)
    seen = LayoutRequests(window, dock, panel)
    for i in range(20):  # what each draw of a run does: one line of figures, changing
        panel.status.setText(f"<b>decoding</b> · {i} tokens generated · TPOT {30 + i / 10:.1f} ms")
        QtWidgets.QApplication.processEvents()
    # the label sits in a Holder: new figures on as many lines leave even its panel's layout alone
    assert seen.counts[panel] == 0 and seen.counts[dock] == 0 and seen.counts[window] == 0
    lines = panel.status.height()
    panel.status.setText("<b>decoding</b> · " + " · ".join(["a long line of figures"] * 40))  # many more lines
    qtbot.waitUntil(lambda: panel.status.height() > lines, timeout=5_000)  # it asks for more height, and gets it
    assert seen.counts[panel] >= 1  # the panel was laid out again to give it


def test_a_panel_that_needs_more_room_gets_it(qtbot, window):
    panel = window.panels["generation"]
    dock = window.docks["generation"]
    qtbot.wait(50)
    seen = LayoutRequests(dock)
    needed = panel.height() + 200
    panel.status.setMinimumHeight(needed)  # more than the panel has: the dock must hear of it
    qtbot.waitUntil(lambda: seen.counts[dock] > 0, timeout=5_000)
    assert dock.widget().minimumSizeHint().height() >= needed
    qtbot.waitUntil(lambda: panel.height() >= needed, timeout=5_000)
