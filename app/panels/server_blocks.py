"""Server KV blocks: a vLLM's own prefix cache, block by block, from its KV-cache events (engine.remote.kvevents).

One cell per cached block, in chain order (each block after the one its prefix continues), coloured by how many
cached sequences run through it: one (blue), or two and more — a prefix they share (amber, brighter the more share
it). Beside it, /metrics' KV-cache usage at the same scrape. The snapshots arrive through sig_serve_blocks and are
only stored here, then drawn on the tick.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtWidgets

from app import theme
from app.bridge import Bridge
from app.panels.base import Panel

COLUMNS = 64  # cells per row of the grid
SINGLE = (79, 176, 224)  # theme.DECODE_COLOR: a block one sequence holds
SHARED = (224, 160, 64)  # theme.PREFILL_COLOR: a prefix several sequences share
EMPTY = (40, 42, 50)
EMPTY_GAP = (30, 31, 36)  # the background between cells


def cell_colors(sharers: np.ndarray, columns: int = COLUMNS) -> np.ndarray:
    """The grid as an RGB image (rows, columns, 3): one cell per block, row-major, empty cells dark."""
    n = len(sharers)
    rows = max(1, math.ceil(n / columns))
    img = np.empty((rows * columns, 3), dtype=np.ubyte)
    img[:] = EMPTY
    if n:
        s = np.asarray(sharers)
        shared = s >= 2
        img[:n][~shared] = SINGLE
        # brighter the more sequences share the prefix (2 → the base colour, 8 and more → near white)
        x = np.clip((s[shared] - 2) / 6.0, 0, 1)[:, None]
        img[:n][shared] = (np.array(SHARED) * (1 - x) + 240 * x).astype(np.ubyte)
    return img.reshape(rows, columns, 3)


def columns_for(n: int) -> int:
    """Cells per row: a few blocks in a short row, many in rows of COLUMNS."""
    return min(COLUMNS, max(8, 1 << math.ceil(math.log2(max(1.0, math.sqrt(2 * n))))))


def upsample(grid: np.ndarray, cell: int = 6) -> np.ndarray:
    """Each cell as `cell` × `cell` pixels with a one-pixel gap of the background after it."""
    img = np.repeat(np.repeat(grid, cell, axis=0), cell, axis=1)
    img[cell - 1::cell, :, :] = EMPTY_GAP
    img[:, cell - 1::cell, :] = EMPTY_GAP
    return img


class ServerBlocksPanel(Panel):
    title = "Server KV blocks"
    object_name = "panel_server_blocks"
    shortcut = "Ctrl+Alt+9"
    subscriptions = {"sig_serve_blocks": "_on_blocks"}
    help_text = (
        "A vLLM's own prefix cache, from the KV-cache events it publishes (start it with --kv-events-config, "
        "endpoint tcp://127.0.0.1:PORT, and tick 'KV events' in the Load lab). vLLM keeps the KV of each full "
        "block of a prompt (and of what it generated) after the request ends, keyed by a hash of all the tokens up "
        "to it, so a later prompt with the same beginning skips their prefill. Each cell is one such block, in "
        "chain order; blue: one sequence runs through it, amber: a prefix two or more share. Counted: blocks "
        "stored and evicted since the subscriber started. /metrics' KV usage counts the blocks running requests "
        "hold (full or not); the cache also keeps blocks no request holds until their memory is needed, so the two "
        "differ, most of all between runs."
    )

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.snapshot = None  # engine.remote.kvevents.BlockSnapshot
        self.grid = cell_colors(np.zeros(0, dtype=np.int32), 8)
        self.kv_usage: float | None = None
        self.status = "Tick 'KV events' in the Load lab and run it against a vLLM that publishes them."
        self.status_label = QtWidgets.QLabel()
        self.status_label.setWordWrap(True)
        self.view = pg.GraphicsLayoutWidget()
        self.view.setBackground(theme.BACKGROUND)
        self.plot = self.view.addPlot()
        self.plot.hideAxis("bottom")
        self.plot.hideAxis("left")
        self.plot.invertY(True)
        self.plot.setAspectLocked(True)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        lay = QtWidgets.QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.status_label)
        lay.addWidget(self.view, 1)
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_blocks(self, notice) -> None:
        self.snapshot, self.kv_usage = notice.blocks, notice.kv_usage
        self.mark_dirty()

    def summary(self) -> str:
        s = self.snapshot
        if s is None:
            return self.status
        shared = int(np.count_nonzero(np.asarray(s.sharers) >= 2))
        usage = "" if self.kv_usage is None else f"; /metrics KV usage {100 * self.kv_usage:.1f}%"
        size = f" of {s.block_size} tokens" if s.block_size else ""
        shown = "" if len(s.sharers) >= s.n_blocks else f" (the newest {len(s.sharers)} drawn)"
        trouble = f" ⚠ {'; '.join(s.problems[:2])}" if s.problems else ""
        return (f"{s.n_blocks} blocks{size} cached{shown}, {shared} of them a prefix two or more sequences share; "
                f"stored {s.stored}, evicted {s.removed}{', cleared ×' + str(s.cleared) if s.cleared else ''}"
                f"{usage}.{trouble}")

    def draw(self) -> None:
        self.status_label.setText(self.summary())
        sharers = np.zeros(0, dtype=np.int32) if self.snapshot is None else np.asarray(self.snapshot.sharers)
        self.grid = cell_colors(sharers, columns_for(len(sharers)))  # one pixel per block (the tests read it)
        self.image.setImage(upsample(self.grid), autoLevels=False, levels=(0, 255))
        self.plot.getViewBox().autoRange(padding=0.02)

    def clear(self) -> None:
        """A new generation does not clear the server's blocks."""
        self.mark_dirty()


PANEL = ServerBlocksPanel
