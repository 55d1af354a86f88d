"""The contract every panel follows: receive fast, paint on a tick.

A panel's slots (connected to the bridge's `sig_…` signals) only store the latest data and call `mark_dirty()`.
One app-wide timer calls `tick()` on every panel about 30 times a second; `tick()` calls `draw()` only when
something changed. Plot items are created once in `__init__`; `draw()` only updates them (setData / setImage).
"""

from __future__ import annotations

from typing import ClassVar

from PySide6 import QtWidgets

from app.bridge import Bridge


class Panel(QtWidgets.QWidget):
    title: ClassVar[str] = "Panel"
    object_name: ClassVar[str] = "panel"  # the QDockWidget's objectName: stable, so saveState/restoreState work
    help_text: ClassVar[str] = ""  # shown by the dock's help button and the Help menu, in our own words
    shortcut: ClassVar[str] = ""  # e.g. "Alt+3": show and focus this panel

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self._dirty = False
        self.draw_count = 0  # how many times draw() ran (the GUI benchmark reads it)

    def mark_dirty(self) -> None:
        self._dirty = True

    def tick(self) -> None:
        if self._dirty:
            self._dirty = False
            self.draw()
            self.draw_count += 1

    def draw(self) -> None:
        """Update the plot items from the stored data. Called on the GUI timer, only when dirty."""

    def clear(self) -> None:
        """Forget the data of the previous generation."""
        self.mark_dirty()
