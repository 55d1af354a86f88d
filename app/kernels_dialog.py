"""Engine → Decode kernels…: which kernel the engine measured fastest for each weight shape on this machine, with
every candidate's time, and which way a decode query's attention runs at each context length (read-only).

The engine process measures at a model's first load and keeps the result in the cache (engine.model.kernels,
engine.model.kernel_cache); this dialog only reads that file, so it opens without torch and without a model.
"""

from __future__ import annotations

from PySide6 import QtCore, QtWidgets

from engine.model import kernel_cache, threads

SHOWN_CHAINS = 4  # the newest chain timings shown (one per model and dtype loaded on this machine)

FIXED = ("dtype", "threads", "weight (out × in)", "weights", "count", "chosen")
# a measured group's weights: float only, or with a GGUF's quantized forms of one kernel mode (KERNEL_MODES): the
# int4 and int8 candidates timed too (fast), or the file's own int4 blocks only (file)
WEIGHTS = {kernel_cache.FLOAT: "float", kernel_cache.Q4: "float + int4 and int8 forms (fast mode)",
           kernel_cache.Q4_FILE: "float + the file's int4 blocks (file mode)"}


def table_rows(entries: list[kernel_cache.Entry]) -> tuple[list[str], list[list[str]]]:
    """The table's header and cells: one row per measured shape, each candidate's µs and ratio to the fastest."""
    rows = kernel_cache.rows(entries)
    names = [n for n in kernel_cache.NAMES if any(n in r["seconds"] for r in rows)]
    header = [*FIXED, *names, "torch", "measured"]
    cells = []
    for r in rows:
        times = [f"{r['seconds'][n] * 1e6:,.0f} µs ({r['vs_fastest'][n]:.2f}×)" if n in r["seconds"] else "—"
                 for n in names]
        cells.append([r["dtype"], str(r["threads"]), f"{r['shape'][0]:,} × {r['shape'][1]:,}",
                      WEIGHTS.get(r.get("weights", kernel_cache.FLOAT), str(r.get("weights"))), str(r["count"]),
                      r["choice"], *times, f"{r['torch']} ({r['capability']})", r["measured"]])
    return header, cells


ATTENTION_FIXED = ("dtype", "threads", "heads (KV × G × size)", "keys", "fastest", "with weights shown")


def attention_table_rows(entries: list[kernel_cache.AttentionEntry]) -> tuple[list[str], list[list[str]]]:
    """The attention table's header and cells: one row per measured key count, each way's µs per layer and ratio to
    the fastest; "with weights shown": the way a layer runs while a panel captures it."""
    rows = kernel_cache.attention_rows(entries)
    names = [n for n in kernel_cache.ATTENTION_DESCRIPTIONS if any(n in r["seconds"] for r in rows)]
    cells = [[r["dtype"], str(r["threads"]), " × ".join(map(str, r["heads"])), f"{r['keys']:,}", r["fastest"],
              r["fastest_with_weights"],
              *(f"{r['seconds'][n] * 1e6:,.0f} µs ({r['vs_fastest'][n]:.2f}×)" if n in r["seconds"] else "—"
                for n in names), r["measured"]] for r in rows]
    return [*ATTENTION_FIXED, *names, "measured"], cells


def _table(parent: QtWidgets.QWidget, header: list[str], cells: list[list[str]], bold: int) -> QtWidgets.QTableWidget:
    table = QtWidgets.QTableWidget(len(cells), len(header), parent)
    table.setHorizontalHeaderLabels(header)
    table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
    table.verticalHeader().hide()
    for i, row in enumerate(cells):
        for j, text in enumerate(row):
            item = QtWidgets.QTableWidgetItem(text)
            if j == bold:
                font = item.font()
                font.setBold(True)
                item.setFont(font)
            table.setItem(i, j, item)
    table.resizeColumnsToContents()
    return table


def thread_lines(records: list[threads.ChainTiming], cpu: str, cores: int) -> list[str]:
    """The newest chain timings measured on this CPU: each thread count's time for a decode step's products with
    that count's chosen kernels, and the most threads `--threads auto` uses by it."""
    mine = [t for t in records if t.cpu == cpu and t.cores == cores]
    return [t.summary() for t in sorted(mine, key=lambda t: -t.measured_at)[:SHOWN_CHAINS]]


class KernelsDialog(QtWidgets.QDialog):
    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Decode kernels")
        self.resize(980, 640)
        cpu, cores = kernel_cache.this_cpu()
        header, cells = table_rows(kernel_cache.entries_for_this_cpu())
        intro = QtWidgets.QLabel(
            f"Each decode product (one row times a weight) runs the kernel measured fastest for its shape, dtype and "
            f"thread count on this machine ({cpu}, {cores} cores), timed once when a model is first loaded, with the "
            f"model's own weights streamed from memory. Times: median µs for one product, and ÷ the fastest (over 2 ×: "
            f"its first round only, not measured further). A model loaded in the file or fast kernel mode (Engine → "
            f"Decode kernel mode) has its quantized weights' shapes measured again with those forms among the "
            f"candidates: their own rows.")
        intro.setWordWrap(True)
        self.table = _table(self, header, cells, FIXED.index("chosen"))
        a_header, a_cells = attention_table_rows(kernel_cache.entries_for_this_cpu(kind=kernel_cache.AttentionEntry))
        attention = QtWidgets.QLabel(
            "A decode query's attention over the KV cache, timed the same way at each key count (µs per layer); a "
            "step runs the fastest way measured at the nearest count. A layer a panel shows runs the fastest way that "
            "forms the weights. " + "; ".join(f"{n}: {d}" for n, d in kernel_cache.ATTENTION_DESCRIPTIONS.items()))
        attention.setWordWrap(True)
        self.attention = _table(self, a_header, a_cells, ATTENTION_FIXED.index("fastest"))
        forced = QtCore.QProcessEnvironment.systemEnvironment().value(kernel_cache.KERNEL_ENV, "")
        note = QtWidgets.QLabel(
            ("Nothing measured on this machine yet: load a model first." if not cells else "")
            + (f" {kernel_cache.KERNEL_ENV}={forced}: every decode product is forced through it." if forced else "")
            + f" Measure again on a quiet machine with: python -m engine kernels --remeasure "
              f"(cache: {kernel_cache.cache_path()})")
        lines = thread_lines(list(threads.read_chains().values()), cpu, cores)
        self.chains = QtWidgets.QLabel("\n".join(["Threads, newest first:", *lines]) if lines else "")
        self.chains.setWordWrap(True)
        self.chains.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        note.setWordWrap(True)
        note.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        buttons = QtWidgets.QDialogButtonBox(QtWidgets.QDialogButtonBox.StandardButton.Close, parent=self)
        buttons.rejected.connect(self.reject)
        layout = QtWidgets.QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addWidget(self.table, 1)
        layout.addWidget(attention)
        layout.addWidget(self.attention, 1)
        layout.addWidget(self.chains)
        layout.addWidget(note)
        layout.addWidget(buttons)
