"""The Why panel's gallery page: the canned experiments of engine.why.gallery, one a row, with the chosen one's words
(what it shows, what to look for) beneath. The panel runs the chosen one (GalleryParams) and draws its result in that
experiment's own view; this widget only picks and says. Nothing here imports torch."""

from __future__ import annotations

import html

from PySide6 import QtCore, QtWidgets

from app.theme import MUTED, OK_COLOR
from engine.why.gallery import GALLERY, Entry

KIND_NAMES = {"heads": "head roles", "patch": "patching", "dla": "logit attribution"}


class GalleryPicker(QtWidgets.QWidget):
    """A list of the gallery's experiments and the chosen one's text; sig_chosen(name) when the choice changes,
    sig_run when one is double-clicked (or Enter pressed on it): run it at once."""

    sig_chosen = QtCore.Signal(str)
    sig_run = QtCore.Signal()

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.list = QtWidgets.QListWidget()
        self.list.setToolTip("Pick one, then Run (or double-click it): it is set up for the loaded model and drawn "
                             "in its own view")
        for e in GALLERY:
            item = QtWidgets.QListWidgetItem(e.title)
            item.setData(QtCore.Qt.ItemDataRole.UserRole, e.name)
            self.list.addItem(item)
        self.list.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(QtCore.Qt.TextElideMode.ElideRight)
        rows = len(GALLERY) + 2  # the words beside the list need a few lines more than its four rows
        self.list.setFixedHeight(self.list.sizeHintForRow(0) * rows + 2 * self.list.frameWidth())
        self.list.setFixedWidth(290)
        # the words scroll in a box as tall as the list, so that the result below keeps its room in a small dock
        self.text = QtWidgets.QTextBrowser()
        self.text.setOpenLinks(False)
        self.text.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        self.text.setFixedHeight(self.list.height())
        self._ran: dict[str, str] = {}  # name → a few words on its kept result
        lay = QtWidgets.QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.list)
        lay.addWidget(self.text, 1)
        self.list.currentRowChanged.connect(self._on_row)
        self.list.itemActivated.connect(lambda _item: self.sig_run.emit())
        self.list.setCurrentRow(0)

    def entry(self) -> Entry:
        return GALLERY[max(0, self.list.currentRow())]

    def name(self) -> str:
        return self.entry().name

    def choose(self, name: str) -> None:
        for i, e in enumerate(GALLERY):
            if e.name == name:
                self.list.setCurrentRow(i)
                return
        raise ValueError(f"the gallery has no experiment {name!r}")

    def set_ran(self, ran: dict[str, str]) -> None:
        """Which experiments have a kept result (name → "2.1 s on SmolLM2"): marked in the list and the text."""
        self._ran = dict(ran)
        for i, e in enumerate(GALLERY):
            self.list.item(i).setText(e.title + ("  ✓" if e.name in self._ran else ""))
        self._on_row(self.list.currentRow())

    def words(self) -> str:
        """The chosen experiment's words as shown, in plain text."""
        return self.text.toPlainText()

    def _on_row(self, row: int) -> None:
        e = GALLERY[max(0, row)]
        ran = self._ran.get(e.name)
        kept = (f"<span style='color:{OK_COLOR}'>Result kept ({html.escape(ran)}): shown below; Run runs it "
                "again.</span>" if ran else f"<span style='color:{MUTED}'>Run sets it up for the loaded model and "
                f"shows it below ({KIND_NAMES.get(e.kind, e.kind)}).</span>")
        self.text.setHtml(f"<b>{html.escape(e.title)}</b>. {html.escape(e.shows)}<br><b>What to look for</b>: "
                          f"{html.escape(e.look_for)}<br>{kept}")
        self.sig_chosen.emit(e.name)
