"""File → Open model from list…: the models on this machine (engine.formats.discover), what each is, whether it fits.

The list comes from file headers only (no torch, nothing dequantized). Opening a model that would not fit in memory at
the window's dtype is refused with the numbers, or loaded in bfloat16 when that fits and the user agrees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from PySide6 import QtCore, QtWidgets

from app.guard import guarded
from engine.costs.memory import file_memory
from engine.formats.discover import ModelEntry, discover, memory_available
from engine.model.kernel_cache import DEFAULT_MODE, KERNEL_MODES

COLUMNS = ("Name", "Source", "Architecture", "Parameters", "File", "Tensor types", "Fits at {dtype}",
           "Memory on its runtime")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Decision:
    """What opening an entry at a dtype leads to: "load" (at `dtype`), "ask" (bfloat16 would fit) or "refuse"."""

    action: str
    dtype: str
    message: str = ""


def decide(entry: ModelEntry, dtype: str, memory: int) -> Decision:
    """Load, offer bfloat16, or refuse with the numbers (weights at the running dtype against free memory)."""
    run = "float32" if dtype == "auto" else dtype
    need = entry.weight_bytes.get(run)
    if entry.error:
        return Decision("refuse", run, f"{entry.name} cannot be read: {entry.error}")
    if need is None or memory <= 0 or need <= memory:
        return Decision("load", dtype)
    half = entry.weight_bytes.get("bfloat16")
    if entry.runtime == "llama.cpp":  # the file as it is, whatever the dtype: no smaller choice to offer
        return Decision("refuse", run, f"{entry.name} does not fit: on llama.cpp it needs {_gib(need)} (the file "
                                       f"plus its KV cache); {_gib(memory)} of memory is available.")
    numbers = f"its weights need {_gib(need)} at {run}; {_gib(memory)} of memory is available"
    if run != "bfloat16" and half is not None and half <= memory:
        return Decision("ask", "bfloat16", f"{entry.name} does not fit: {numbers}. Load it in bfloat16 "
                                           f"({_gib(half)}) instead?")
    return Decision("refuse", run, f"{entry.name} does not fit: {numbers}.")


# the kernel modes as the picker offers them (KERNEL_MODES says what each does: the item's tooltip)
KERNEL_CHOICES = {"exact": "exact: the file's weights, dequantized", "file": "file: its quantized blocks as they are",
                  "fast": "fast: also int8 requantizations"}


class ModelPicker(QtWidgets.QDialog):
    """A table of the models found; `chosen` is (path, dtype) after accept(), and kernels() the kernel mode picked
    (the torch runtime's; llama.cpp runs a file's blocks as they are whatever it is)."""

    def __init__(self, parent: QtWidgets.QWidget | None = None, dtype: str = "float32",
                 find: Callable[[], list[ModelEntry]] | None = None, memory: int | None = None,
                 kernels: str = DEFAULT_MODE) -> None:
        super().__init__(parent)
        self.setWindowTitle("Open model")
        self.resize(980, 420)
        self.dtype = dtype
        self.memory = memory_available() if memory is None else memory
        QtWidgets.QApplication.setOverrideCursor(QtCore.Qt.CursorShape.WaitCursor)
        try:
            self.entries = (find or discover)()
        finally:
            QtWidgets.QApplication.restoreOverrideCursor()
        self.chosen: tuple[str, str] | None = None

        run = "float32" if dtype == "auto" else dtype
        self.table = QtWidgets.QTableWidget(len(self.entries), len(COLUMNS))
        self.table.setHorizontalHeaderLabels([c.format(dtype=run) for c in COLUMNS])
        self.table.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QtWidgets.QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        for row, e in enumerate(self.entries):
            fits = e.fits.get(run)
            values = [
                e.name, e.source, e.architecture or ("unreadable" if e.error else "?"),
                f"{e.n_params / 1e6:,.0f}M" if e.n_params else "?", f"{e.file_bytes / 2**20:,.0f} MiB",
                ", ".join(f"{k}×{v}" for k, v in sorted(e.quant_types.items())) or "-",
                "?" if fits is None else "yes" if fits else f"no ({_gib(e.weight_bytes[run])})",
                "?" if e.error or run not in e.weight_bytes else
                file_memory(e.path, e.runtime, e.weight_bytes[run], run),
            ]
            for col, value in enumerate(values):
                item = QtWidgets.QTableWidgetItem(value)
                item.setToolTip(e.error or e.path)
                self.table.setItem(row, col, item)
        self.table.resizeColumnsToContents()
        self.table.doubleClicked.connect(self._open)

        self.note = QtWidgets.QLabel(
            f"{len(self.entries)} models found (the default, Gemma 3 270M, recent files, the Hugging Face cache, "
            f"LM Studio and Ollama); {_gib(self.memory)} of memory available now.")
        self.note.setWordWrap(True)
        self.kernels_combo = QtWidgets.QComboBox()
        for mode, label in KERNEL_CHOICES.items():
            self.kernels_combo.addItem(label, mode)
            self.kernels_combo.setItemData(self.kernels_combo.count() - 1, KERNEL_MODES[mode],
                                           QtCore.Qt.ItemDataRole.ToolTipRole)
        self.kernels_combo.setCurrentIndex(max(0, self.kernels_combo.findData(kernels)))
        self.kernels_combo.setToolTip("How the torch runtime computes the model's decode products; remembered, "
                                      "as Engine → Decode kernel mode")
        buttons = QtWidgets.QDialogButtonBox(
            QtWidgets.QDialogButtonBox.StandardButton.Open | QtWidgets.QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self._open)
        buttons.rejected.connect(self.reject)
        bottom = QtWidgets.QHBoxLayout()
        bottom.addWidget(QtWidgets.QLabel("Kernels:"))
        bottom.addWidget(self.kernels_combo)
        bottom.addStretch(1)
        bottom.addWidget(buttons)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addWidget(self.note)
        layout.addWidget(self.table, 1)
        layout.addLayout(bottom)
        if self.entries:
            self.table.selectRow(0)

    def kernels(self) -> str:
        """The kernel mode chosen for the model to open (engine.model.kernel_cache.KERNEL_MODES)."""
        return str(self.kernels_combo.currentData())

    @guarded
    def _open(self, *_args) -> None:
        row = self.table.currentRow()
        if not 0 <= row < len(self.entries):
            return
        entry = self.entries[row]
        d = decide(entry, self.dtype, self.memory)
        if d.action == "refuse":
            QtWidgets.QMessageBox.warning(self, "Cannot open this model", d.message)
            return
        if d.action == "ask":
            answer = QtWidgets.QMessageBox.question(self, "Not enough memory", d.message)
            if answer != QtWidgets.QMessageBox.StandardButton.Yes:
                return
        self.chosen = (entry.path, d.dtype)
        self.accept()
