"""Attention: who each token reads from, for one layer — one head large, all heads as small multiples.

The prefill captures a (heads, T, T) block of weights, each decode step one new row (heads, 1, S); the panel
assembles them into a growing lower-triangular matrix. Cells the causal mask forbids (a key after its query) hold NaN
and are drawn in the mask colour, not as a zero weight. Only the rows the engine sent are kept: a long prefill sends
its last query rows (the event's rows_skipped), so the panel holds (heads, rows sent, S), never S × S, and says that
the first rows were left out. A layer's matrix is held within MATRIX_BYTES: on a long run its oldest rows go (so a
draw costs the same at step 8,000 as at step 800). In a window only the shown layer is held, and another one is
rebuilt from the window's run store, which keeps its own bounded record of every captured layer (app.run_store; the
status line says which steps it holds); a panel on its own keeps each captured layer.

A decode step whose row is not held (let go to bound memory, or a layer not captured) is recomputed when selected:
while the shown run is the engine's live one, its KV cache still holds every key and value of the run, so the
engine runs that step's token again over them (engine.run.recompute) and the panel draws the row it sends. A run
opened from a session file has no cache behind it: its status line says which steps it holds.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import threading

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.panels.base import Holder, Panel
from app.run_store import Run, store_for
from app.theme import ACCENT, BACKGROUND, DECODE_COLOR, FOREGROUND, placeholder, set_data, show_empty, style_plot
from engine.events import AttentionCaptured, ModelInfo, PromptTokenized, ResidualNorms, TokenSampled
from engine.model.config import ModelConfig
from engine.protocol import HeldAttention, Recomputed

FONT_PT = 9
MASK_COLOR = "#3c3c3c"  # the causal mask: cells a query may not read
GROUP_COLORS = ("#e5c07b", "#61afef", "#c678dd", "#98c379", "#e06c75", "#56b6c2", "#d19a66", "#abb2bf")
CMAP = pg.colormap.get("viridis")
EMPTY_TOKENS = 8  # the heat map's size before anything is captured (at least the prompt's length)
MATRIX_BYTES = 32 << 20  # the shown layer's float32 matrix, capacity included; its oldest rows go past it
STRIDED_BELOW = 24  # fit_to_pixels: key blocks narrower than this go by strided passes, wider ones by a reduction
DOWNSAMPLE_FROM = 2  # cells per screen pixel from which the heat map is reduced before it is drawn
RECOMPUTED_BYTES = 32 << 20  # recomputed rows kept, the oldest let go past it (one row of SmolLM2 at 8,000 keys:
# 0.3 MB)


def _readable(piece: str) -> str:
    text = piece.replace("\n", "↵").replace("\t", "→")
    return text if text.strip() else text.replace(" ", "·")


class Prefaulted:
    """A flat float32 array of `n` NaNs whose pages a background thread writes, so that the GUI thread never faults
    them in: filling a fresh array of the budget's size was the longest stall left in a long run of Gemma 3 with both
    cores busy (BENCHMARKS.md, "The matrix's large arrays written off the GUI thread"). `array` is None until the
    thread is done."""

    def __init__(self, n: int) -> None:
        self._array = np.empty(n, dtype=np.float32)  # large: mapped, its pages not yet faulted in
        self._done = threading.Event()
        threading.Thread(target=self._fault, name="attention-prefault", daemon=True).start()

    def _fault(self) -> None:
        # every bit set is a float32 NaN; ctypes' memset is a foreign call, so the GIL is released while it runs
        ctypes.memset(self._array.ctypes.data, 0xFF, self._array.nbytes)
        self._done.set()

    @property
    def array(self) -> np.ndarray | None:
        return self._array if self._done.is_set() else None

    @property
    def nbytes(self) -> int:
        return int(self._array.nbytes)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the pages are written (tests; the panel never waits)."""
        return self._done.wait(timeout)


class AttentionMatrix:
    """The attention weights of one layer for the rows captured so far: (heads, S − first_row, S), NaN where masked.

    Only the rows the engine sent are stored: a long prefill arrives as its last query rows (`rows_skipped` says how
    many came before), so memory follows what the events carry, never S × S. `first_row` is the first query row
    stored; the rows above it were left out (or computed before the layer was asked for) and are not kept.
    `window` > 0 is a local layer's sliding window W: a query at position q reads keys q − W + 1 … q only, so the
    keys before that are masked too (the band along the diagonal).
    """

    def __init__(self, n_heads: int, window: int = 0, max_bytes: int | None = None) -> None:
        self.n_heads = n_heads
        self.window = window
        self.max_bytes = MATRIX_BYTES if max_bytes is None else max_bytes
        self.size = 0  # S: the keys (and the query rows' end) seen so far
        self.first_row = 0
        self.first_step: int | None = None  # the first step captured (> 0: the layer was asked for mid-run)
        self.rows_skipped = 0  # query rows the engine left out of a long prefill to bound memory
        self.rows_dropped = 0  # query rows this matrix let go to stay within max_bytes
        self._w = np.full((n_heads, 0, 0), np.nan, dtype=np.float32)
        self._spare: np.ndarray | None = None  # the array before the last reshape, reused by the next one (flat)
        self._ahead: Prefaulted | None = None  # an array of the budget's size, written off the GUI thread

    def add(self, ev: AttentionCaptured) -> None:
        h, nq, nk = ev.weights.shape
        if self.first_step is None:
            self.first_step = ev.step
            self.first_row = ev.query_start
        self.rows_skipped += ev.rows_skipped
        if ev.query_start < self.first_row:  # rows above the stored ones (not sent today): keep them too
            self._reshape(ev.query_start, self._w.shape[1] + self.first_row - ev.query_start, self._w.shape[2])
        end = max(self.size, ev.query_start + nq, nk)
        rows_cap, keys_cap = self._w.shape[1], self._w.shape[2]
        if end - self.first_row > rows_cap or end > keys_cap:
            # grow geometrically so each decode step is amortised O(S); keys by 1/4 (S may be thousands) so the
            # array stays within a small factor of what the events carry
            if end - self.first_row > rows_cap:
                rows_cap = max(end - self.first_row, int(rows_cap * 1.5) + 64)
            if end > keys_cap:
                keys_cap = max(end, keys_cap + max(128, keys_cap // 4))
            first = self.first_row
            fit = self.max_bytes // (4 * self.n_heads * keys_cap)  # rows the budget holds at this width
            if rows_cap > fit:
                rows_cap = max(nq, fit)
                if end - first > rows_cap:  # let the oldest rows go: half the room stays free for the next ones
                    first = max(first, ev.query_start + nq - max(nq, rows_cap // 2))
                    self.rows_dropped += first - self.first_row
            if (rows_cap, keys_cap) == self._w.shape[1:] and first > self.first_row:
                self._drop_rows(first)  # at the budget: the same array, its oldest rows let go
            else:
                self._reshape(first, rows_cap, keys_cap)
        r = ev.query_start - self.first_row
        if nq == 1 and nk == ev.query_start + 1 and not self.window:  # a decode row: nothing to mask
            self._w[:, r, :nk] = ev.weights[:, 0]
            self.size = end
            return
        block = np.array(ev.weights, dtype=np.float32)
        q = np.arange(ev.query_start, ev.query_start + nq)[:, None]  # (nq, 1) absolute query positions
        k = np.arange(nk)[None, :]  # (1, nk) key positions
        block[:, k > q] = np.nan  # the causal mask, explicitly
        if self.window:
            block[:, q - k >= self.window] = np.nan  # outside the sliding window
        self._w[:, r : r + nq, :nk] = block
        self.size = end

    def reserve(self, first_row: int, end: int, keys: int) -> None:
        """Make room for query rows first_row … end − 1 over `keys` keys before the first add (a layer rebuilt from
        stored captures) when they fit the byte budget; the adds grow the matrix otherwise."""
        if self.first_step is None and 0 < end - first_row <= self.max_bytes // (4 * self.n_heads * keys):
            self._reshape(first_row, end - first_row, keys)

    def _reshape(self, first_row: int, rows_cap: int, keys_cap: int) -> None:
        """Re-allocate as rows first_row … first_row + rows_cap − 1 by keys_cap keys, keeping the rows held there.

        At the budget every widening of the keys makes a new array of the budget's size. A fresh one's pages are
        faulted in as it is filled, tens of milliseconds of the GUI thread each time (BENCHMARKS.md, "AMD EPYC with
        AVX-512 and avx512_bf16"), several times a long run. So an array of half the budget or more is
        kept when replaced and the next reshape writes into its pages, already faulted in (one spare per matrix). Such
        an array is made with room for the budget (pages never written are never faulted in), so that a shape a few
        rows larger than the spare's still fits it. Once the matrix holds an eighth of the budget, such an array is
        made ahead by a background thread (Prefaulted) while there is no spare, and the reshape that needs it takes
        it when it is ready."""
        shape, n = (self.n_heads, rows_cap, keys_cap), self.n_heads * rows_cap * keys_cap
        nbytes, room = 4 * n, max(n, self.max_bytes // 4)  # room: the elements of an array made for the whole budget
        spare, self._spare = self._spare, None
        ahead = self._ahead.array if self._ahead is not None else None
        if spare is not None and spare.size >= n:
            grown = spare[:n].reshape(shape)
            grown.fill(np.nan)
        elif ahead is not None and ahead.size >= n:
            grown = ahead[:n].reshape(shape)  # NaN already, its pages written by the thread
            self._ahead = None
        elif 2 * nbytes >= self.max_bytes:  # room for any later shape within the budget (pages untouched cost nothing)
            grown = np.empty(room, dtype=np.float32)[:n].reshape(shape)
            grown.fill(np.nan)
        else:
            grown = np.full(shape, np.nan, dtype=np.float32)
        lo = max(self.first_row, first_row)  # the query positions held before and after
        hi = min(self.size, first_row + rows_cap)
        if hi > lo:
            grown[:, lo - first_row : hi - first_row, : self.size] = \
                self._w[:, lo - self.first_row : hi - self.first_row, : self.size]
        base = self._base()
        if 2 * base.nbytes >= self.max_bytes:
            self._spare = base.reshape(-1)
            self._ahead = None  # two arrays of the budget's size now take turns; a third is not needed
        self._w, self.first_row = grown, first_row
        if self._spare is None and self._ahead is None and 8 * nbytes >= self.max_bytes:
            self._ahead = Prefaulted(room)

    def _drop_rows(self, first_row: int) -> None:
        """Let the rows before first_row go in place: the rows kept move up and the freed ones become NaN again.

        At the budget this happens every few dozen tokens of a long run; a new array of the budget's size each time
        (its pages faulted in, filled, copied) held the GUI thread for tens of ms, moving half of it does not."""
        drop, w = first_row - self.first_row, self._w
        keep = max(0, min(self.size - first_row, w.shape[1] - drop))
        for a in range(0, keep, drop):  # blocks of at most `drop` rows: a source never overlaps its destination
            b = min(keep, a + drop)
            w[:, a:b, : self.size] = w[:, a + drop : b + drop, : self.size]
        w[:, keep:, : self.size] = np.nan
        self.first_row = first_row

    def _base(self) -> np.ndarray:
        """The array that owns the matrix's memory (a reshape's view may use only part of it)."""
        return self._w.base if self._w.base is not None else self._w

    @property
    def nbytes(self) -> int:
        """Bytes held, capacity, the spare and the array made ahead included (the array ≤ max_bytes; with the spare or
        the one made ahead, never both, ≤ 2 × max_bytes)."""
        return int(self._base().nbytes + (self._spare.nbytes if self._spare is not None else 0)
                   + (self._ahead.nbytes if self._ahead is not None else 0))

    @property
    def weights(self) -> np.ndarray:
        """(heads, S − first_row, S) view of the filled part: row i is query position first_row + i."""
        return self._w[:, : max(0, self.size - self.first_row), : self.size]


def fit_to_pixels(w: np.ndarray, fy: int, fx: int) -> np.ndarray:
    """(R, S) weights reduced by blocks of fy × fx cells to their largest weight (NaN only where a whole block is
    masked): drawing costs what the screen shows, not the square of the run, and a lone strong weight (a previous-
    token head's diagonal) stays visible instead of being averaged away."""
    if fy <= 1 and fx <= 1:
        return w
    r, s = w.shape
    rows, cols = -(-r // fy) * fy, -(-s // fx) * fx
    if (rows, cols) != (r, s):
        pad = np.full((rows, cols), np.nan, dtype=w.dtype)
        pad[:r, :s] = w
        w = pad
    # the keys: a reduction over a short inner axis (fmax.reduce of fx cells) runs several times slower than fx
    # elementwise passes over strided views (tens of ms for one head of a long run's matrix); a long one is the other
    # way round. Then the rows, elementwise over whole rows.
    if fx < STRIDED_BELOW:
        out = w[:, 0::fx].copy()
        for j in range(1, fx):
            np.fmax(out, w[:, j::fx], out=out)
    else:
        out = np.fmax.reduce(w.reshape(rows, cols // fx, fx), axis=2)
    if fy <= 1:
        return out
    by_cols, out = out, out[0::fy].copy()
    for i in range(1, fy):
        np.fmax(out, by_cols[i::fy], out=out)
    return out


def per_pixel(cells: float, pixels: float) -> int:
    """How many cells of a heat map one pixel shows, as fit_to_pixels' block size (1 below DOWNSAMPLE_FROM)."""
    if pixels < 50:  # not laid out yet (a tab behind another): drawn whole
        return 1
    n = cells / pixels
    return int(n) if n >= DOWNSAMPLE_FROM else 1


class AttentionPanel(Panel):
    title = "Attention"
    object_name = "panel_attention"
    shortcut = "Alt+5"
    subscriptions = {
        "sig_model_loaded": "_on_model_loaded",
        "sig_prompt": "_on_prompt",
        "sig_attention": "_on_attention",
        "sig_held_attention": "_on_held_attention",
        "sig_token": "_on_token",
        "sig_norms": "_on_norms",
        "sig_step_selected": "_on_step_selected",
        "sig_recomputed": "_on_recomputed",
    }
    help_text = (
        "Attention weights of one layer: each row is a query token (the one being computed), each column a key "
        "token it reads from. A row is softmax(q·kᵀ / √d_head) over the keys and sums to 1. The model is causal: "
        "a token may read only itself and earlier tokens, so the cells above the diagonal are masked (dark grey): "
        "they are not zero, they do not exist. The prefill fills the whole prompt block in one pass; each decode "
        "step adds one new row at the bottom. Grouped-query attention (GQA): several query heads may share one "
        "key/value head, which makes the KV cache smaller by that factor. The All heads grid shows one row per KV "
        "group, framed in the group's colour; click a head to show it large. Only the chosen layer is captured "
        "during a generation (capturing costs time), so choose it before you generate. Click a row to select "
        "that step in every panel. The colour scale is √weight by default, so small weights stay visible next to "
        "the large ones on the first token (an 'attention sink'). Residual norms: the length ‖x‖ of the newest "
        "token's hidden state after the embedding and after each layer, i.e. how much each layer adds to the "
        "residual stream."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        hd, h, kv, g = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.group_size
        scale = cfg.softmax_scale
        if math.isclose(scale, hd**-0.5):
            text = (f"{info.name} has {cfg.n_layers} layers and d_head = {hd}, so its scores are divided by "
                    f"√{hd} ≈ {math.sqrt(hd):.4g}. ")
        else:  # the model sets its own scale (Gemma's query_pre_attn_scalar)
            text = (f"{info.name} has {cfg.n_layers} layers and d_head = {hd}; it scales its scores by "
                    f"{scale:.4g} instead of 1/√{hd}. ")
        if g == 1:
            text += f"Each of its {h} query heads has its own key/value head (no GQA)."
        else:
            groups = ", ".join(f"{k * g}–{k * g + g - 1}" for k in range(min(kv, 4)))
            more = ", …" if kv > 4 else ""
            text += (f"It has {h} query heads but only {kv} key/value head{'s' if kv > 1 else ''}: query head h "
                     f"reads KV head h // {g}, so heads {groups}{more} share their keys and values, and the KV "
                     f"cache is {g}× smaller than with {h} KV heads.")
        if cfg.n_local_layers:
            text += (f" {cfg.n_local_layers} of its {cfg.n_layers} layers are local: a query there reads only the "
                     f"last {cfg.sliding_window:,} positions (a sliding window, the band along the diagonal); the "
                     f"other {cfg.n_global_layers} read every earlier position.")
        return text

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.n_heads = 1
        self.group_size = 1
        self.n_layers = 1
        self._matrices: dict[int, AttentionMatrix] = {}  # the shown layer's, when captured
        self._captured: set[int] = set()  # every layer this run captured
        self._pieces: list[str] = []
        self._n_prompt = 0
        self._norms: dict[int, np.ndarray] = {}
        self._selected_step: int | None = None
        # rows recomputed from the engine's KV cache: (step, layer) → the step's AttentionCaptured, or why not
        self._recomputed: dict[tuple[int, int], AttentionCaptured | str] = {}
        self._recomputed_bytes = 0
        self._asked: dict[int, tuple[int, int]] = {}  # request id → (step, last layer): layers 0…last, not answered
        self._grid_key: tuple[int, int] | None = None
        self._font = QtGui.QFont()
        self._font.setPointSize(FONT_PT)
        self._build()
        if bridge.info is not None:
            self._on_model_loaded(bridge.info)

    # ---- widgets -----------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.layer_spin = QtWidgets.QSpinBox(minimum=0, maximum=0)
        self.layer_spin.setToolTip("Layer whose attention is captured and shown (0 = first)")
        self.head_spin = QtWidgets.QSpinBox(minimum=0, maximum=0)
        self.head_spin.setToolTip("Query head shown large")
        self.sqrt_check = QtWidgets.QCheckBox("√ scale")
        self.sqrt_check.setChecked(True)
        self.sqrt_check.setToolTip("Colour by √weight so small weights stay visible")
        self.kv_label = QtWidgets.QLabel("")
        self.kv_label.setWordWrap(True)
        self.kv_label.setMinimumWidth(60)
        self.layer_spin.valueChanged.connect(self._on_layer_changed)
        self.head_spin.valueChanged.connect(self.mark_dirty)
        self.sqrt_check.toggled.connect(self.mark_dirty)
        row = QtWidgets.QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        for w in (QtWidgets.QLabel("layer"), self.layer_spin, QtWidgets.QLabel("head"), self.head_spin,
                  self.sqrt_check):
            row.addWidget(w)
        row.addWidget(self.kv_label, 1)
        self.status = QtWidgets.QLabel("Generate to see attention.")
        self.status.setWordWrap(True)

        # one head, large
        self.heat = pg.PlotWidget(background=BACKGROUND)
        pi = self.heat.getPlotItem()
        style_plot(pi, left=None, bottom=("key (read from) →   rows: query (reading) ↓", None), grid=(False, False))
        vb = pi.getViewBox()
        vb.setBackgroundColor(MASK_COLOR)
        vb.invertY(True)
        vb.setAspectLocked(False)
        for name in ("left", "bottom"):
            pi.getAxis(name).setStyle(tickLength=0)
        pi.getAxis("left").setWidth(QtGui.QFontMetrics(self._font).horizontalAdvance("<|im_start 000") + 8)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setColorMap(CMAP)
        pi.addItem(self.image)
        self._fit_factors = (1, 1)  # the heat map is drawn at the view's resolution (fit_to_pixels): again when a
        vb.sigResized.connect(self._on_view_changed)  # resize changes how many cells share a pixel (a zoom redraws
        # anyway: sigRangeChanged marks the panel dirty below)
        self.colorbar = pg.ColorBarItem(values=(0, 1), colorMap=CMAP, interactive=False, width=12)
        self.colorbar.setImageItem(self.image, insert_in=pi)
        self.colorbar.axis.setStyle(tickFont=self._font)
        self.row_box = pg.QtWidgets.QGraphicsRectItem(0, 0, 0, 0)
        self.row_box.setPen(pg.mkPen(ACCENT, width=2))
        self.row_box.setVisible(False)
        pi.addItem(self.row_box)
        self.heat_note = placeholder(pi)
        # a local layer's window edge: query q reads keys from q − W + 1, so the edge runs from (0, W − 1) down
        self.window_edge = pi.plot([], [], pen=pg.mkPen(ACCENT, width=1.5, style=QtCore.Qt.PenStyle.DashLine))
        self.heat.scene().sigMouseClicked.connect(self._on_heat_clicked)
        vb.sigRangeChanged.connect(lambda *_: self.mark_dirty())

        # every head of the layer, grouped by KV head
        self.grid = pg.GraphicsLayoutWidget()
        self.grid.setBackground(BACKGROUND)
        self.grid_images: list[pg.ImageItem] = []
        self.grid_boxes: list[pg.ViewBox] = []
        self.grid_labels: list[pg.LabelItem] = []
        self.grid.scene().sigMouseClicked.connect(self._on_grid_clicked)

        # residual stream norm per layer
        self.norm_plot = pg.PlotWidget(background=BACKGROUND)
        npi = self.norm_plot.getPlotItem()
        style_plot(npi, left=("‖residual‖", None), bottom=("after layer (0 = embedding)", None))
        self.norm_curve = npi.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=2), symbol="o", symbolSize=5,
                                   symbolBrush=DECODE_COLOR)
        self.norm_note = placeholder(npi)
        self._norm_title = ""

        self.tabs = QtWidgets.QTabWidget()
        self.tabs.addTab(self.heat, "Head")
        self.tabs.addTab(self.grid, "All heads")
        self.tabs.addTab(self.norm_plot, "Residual norms")
        self.tabs.currentChanged.connect(self.mark_dirty)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addLayout(row)
        layout.addWidget(Holder(self.status, wrapped=True))  # new figures at every draw
        layout.addWidget(self.tabs, 1)

    def _build_grid(self) -> None:
        """Small multiples: one row per KV head, its `group_size` query heads side by side."""
        key = (self.n_heads, self.group_size)
        if self._grid_key == key:
            return
        self._grid_key = key
        self.grid.clear()
        self.grid_images, self.grid_boxes, self.grid_labels = [], [], []
        cols = self.group_size if self.group_size > 1 else math.ceil(math.sqrt(self.n_heads))
        if cols > 6:
            cols = math.ceil(math.sqrt(self.n_heads))
        for h in range(self.n_heads):
            kv = h // self.group_size
            colour = GROUP_COLORS[kv % len(GROUP_COLORS)]
            r, c = divmod(h, cols)
            cell = self.grid.addLayout(row=r, col=c)
            cell.setSpacing(0)
            label = cell.addLabel(f"h{h} → kv{kv}", row=0, col=0, color=colour, size=f"{FONT_PT}pt")
            vb = cell.addViewBox(row=1, col=0, lockAspect=False, enableMouse=False, invertY=True)
            vb.setBackgroundColor(MASK_COLOR)
            vb.setBorder(pg.mkPen(colour, width=2))
            img = pg.ImageItem(axisOrder="row-major")
            img.setColorMap(CMAP)
            vb.addItem(img)
            vb.setMenuEnabled(False)
            self.grid_images.append(img)
            self.grid_boxes.append(vb)
            self.grid_labels.append(label)

    # ---- events ------------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        self.n_heads, self.n_layers = info.n_heads, info.n_layers
        self.group_size = max(1, info.n_heads // max(1, info.n_kv_heads))
        self.layer_spin.setMaximum(info.n_layers - 1)
        self.head_spin.setMaximum(info.n_heads - 1)
        self.layer_spin.setValue(info.n_layers - 1)
        self.bridge.capture_attention({self.layer_spin.value()})
        self._build_grid()
        self.clear()

    def _on_layer_changed(self, layer: int) -> None:
        self.bridge.capture_attention({int(layer)})  # a running generation captures it from its next token
        store = store_for(self.bridge)
        if store is not None:  # the store holds the other layers: rebuild this one from what it kept
            self._matrices.clear()
            run = store.shown_run()
            if run is not None and layer in self._captured:
                self._rebuild(run, int(layer))
        self._maybe_recompute()
        self.mark_dirty()
        self._draw_now()

    def _rebuild(self, run: Run, layer: int) -> None:
        """The layer's matrix from the run store's captures of it, newest first and only as far back as the matrix
        holds: the older rows it would let go again at once. A layer switch late in a long run then costs what the
        panel shows, not the run (every held capture added in turn, the matrix growing and dropping rows as it did
        live, held the GUI thread for a large part of a second)."""
        found: list[AttentionCaptured] = []
        room = None  # the first query row the matrix holds at the newest capture's width
        for _step, where in itertools.chain(reversed(run._rest), reversed(run._first)):
            ev = next((e for e in (run.events[i] for i in where)
                       if isinstance(e, AttentionCaptured) and e.layer == layer), None)
            if ev is None:
                continue
            if room is None:
                h, nq, nk = ev.weights.shape
                end, keys = ev.query_start + nq, max(nk, ev.query_start + nq)
                room = end - max(1, MATRIX_BYTES // (4 * h * keys))
            found.append(ev)
            if ev.query_start <= room:
                break
        if not found:
            return
        m = self._matrices[layer] = AttentionMatrix(h, self.sliding_window(layer))
        m.reserve(found[-1].query_start, end, keys)  # one allocation, not one per growth
        for ev in reversed(found):
            self._add(ev)
        if found[-1].query_start > room:  # every held capture of the layer is in
            return
        # the oldest held capture says where the layer's capture began (step 0, or the step it was asked for)
        groups = itertools.chain(run._first, run._rest)
        first = next(e for _step, where in groups for e in (run.events[i] for i in where)
                     if isinstance(e, AttentionCaptured) and e.layer == layer)
        m.first_step = first.step
        m.rows_dropped += m.first_row - first.query_start

    @QtCore.Slot(object)
    def _on_prompt(self, ev: PromptTokenized) -> None:
        self._matrices.clear()
        self._captured.clear()
        self._norms.clear()
        self._pieces = [_readable(p) for p in ev.pieces]
        self._n_prompt = len(ev.pieces)
        self._selected_step = None
        self._recomputed.clear()
        self._recomputed_bytes = 0
        self._asked.clear()
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_attention(self, ev: AttentionCaptured) -> None:
        self._captured.add(ev.layer)
        if ev.layer == self.layer() or store_for(self.bridge) is None:  # the window's store keeps the other layers
            self._add(ev)
            self.mark_dirty()

    @QtCore.Slot(object)
    def _on_held_attention(self, msg: HeldAttention) -> None:
        """Steps of layers not shown when they ran, in step order: the layer turned to (drawn), or the rest of a run
        for the window's store (which keeps them; this panel notes which layers it can rebuild)."""
        alone = store_for(self.bridge) is None
        for ev in msg.events:
            self._captured.add(ev.layer)
            if ev.layer == self.layer() or alone:
                self._add(ev)
                self.mark_dirty()

    def _add(self, ev: AttentionCaptured) -> None:
        h = ev.weights.shape[0]
        if ev.layer not in self._matrices or self._matrices[ev.layer].n_heads != h:
            self._matrices[ev.layer] = AttentionMatrix(h, self.sliding_window(ev.layer))
        if h != self.n_heads or ev.group_size != self.group_size:  # a model the panel was not told about
            self.n_heads, self.group_size = h, max(1, ev.group_size)
            self.head_spin.setMaximum(h - 1)
        self._matrices[ev.layer].add(ev)

    @QtCore.Slot(object)
    def _on_token(self, ev: TokenSampled) -> None:
        # the token produced at `position` becomes the query of the next step's row
        while len(self._pieces) <= ev.position:
            self._pieces.append("")
        self._pieces[ev.position] = _readable(ev.piece)
        self.mark_dirty()

    @QtCore.Slot(object)
    def _on_norms(self, ev: ResidualNorms) -> None:
        self._norms[ev.step] = np.asarray(ev.norms, dtype=float)
        self.mark_dirty()

    @QtCore.Slot(int)
    def _on_step_selected(self, step: int) -> None:
        self._selected_step = step
        self._maybe_recompute()
        self.mark_dirty()
        self._draw_now()

    def _draw_now(self) -> None:
        """Answer a user's choice (a step clicked in any panel, a layer, a recomputed row arriving) with this draw,
        not at the panel's turn among the window's draws: one panel per tick, each held back by its last draw's
        cost, which put the click's answer up to a second later."""
        if self.isVisible():
            self.flush()

    # ---- rows recomputed from the KV cache -----------------------------------------------------------------------
    def _live_run(self):
        """The window's shown run when it is the engine's live one (recorded in this window, not opened from a
        file), else None."""
        store = store_for(self.bridge)
        run = store.shown_run() if store is not None else None
        return run if run is not None and store.recording == run.id else None

    def row_held(self, step: int) -> bool:
        """Whether the shown layer's matrix holds the query rows of `step`."""
        m = self._matrices.get(self.layer())
        r0, r1 = self.rows_of_step(step)
        return m is not None and m.size > 0 and m.first_row <= r0 and r1 <= m.size

    def _pending(self, step: int, layer: int) -> bool:
        """Whether a recompute of this step's row of `layer` was asked for and has not been answered."""
        return (step, layer) in self._asked.values()

    def _maybe_recompute(self) -> None:
        """Ask the engine for the selected decode step's row of the shown layer when the panel does not hold it and
        the run is the engine's live one (the answer comes as sig_recomputed). Only that layer travels: the engine
        keeps every layer its pass ran (engine.run.recompute.Recomputation), so a switch to another one is answered
        from there without running the model again, and the answer to a click stays a fraction of a megabyte."""
        step, layer = self._selected_step, self.layer()
        if step is None or step < 1 or self.row_held(step) or (step, layer) in self._recomputed \
                or self._pending(step, layer) or self.stored_row(step) is not None:
            return
        run = self._live_run()
        started = run.source if run is not None else None  # its RunStarted
        if run is None or step >= run.n_tokens or (started is not None and not started.source.can("attention")):
            return
        self._asked[self.bridge.recompute(step, run.context_ids(step), (layer,))] = (step, layer)

    @QtCore.Slot(object)
    def _on_recomputed(self, msg: Recomputed) -> None:
        where = self._asked.pop(msg.request_id, None)
        if where is None:  # another panel's, or a run that is no longer shown
            return
        step, layer = where
        got = next((e for e in msg.attention if e.layer == layer), None)
        self._keep_recomputed(where, got or msg.error or "the engine sent no weights")
        self.mark_dirty()
        if step == self._selected_step and self.layer() == layer:
            self._draw_now()

    def _keep_recomputed(self, where: tuple[int, int], row: AttentionCaptured | str) -> None:
        """Keep a recomputed row (or why there is none), letting the oldest go past RECOMPUTED_BYTES."""
        old = self._recomputed.pop(where, None)
        if isinstance(old, AttentionCaptured):
            self._recomputed_bytes -= old.weights.nbytes
        self._recomputed[where] = row
        if isinstance(row, AttentionCaptured):
            self._recomputed_bytes += row.weights.nbytes
        while self._recomputed_bytes > RECOMPUTED_BYTES and len(self._recomputed) > 1:
            gone = self._recomputed.pop(next(iter(self._recomputed)))
            if isinstance(gone, AttentionCaptured):
                self._recomputed_bytes -= gone.weights.nbytes

    def recomputed_row(self) -> AttentionCaptured | None:
        """The selected step's row of the shown layer when the matrix does not hold that step: as the run store kept
        it, else as the engine recomputed it."""
        step = self._selected_step
        if step is None or self.row_held(step):
            return None
        ev = self.stored_row(step)
        if ev is None:
            ev = self._recomputed.get((step, self.layer()))
        return ev if isinstance(ev, AttentionCaptured) else None

    def stored_row(self, step: int) -> AttentionCaptured | None:
        """Decode step `step`'s row of the shown layer as the window's run store kept it (the run's first steps
        stay there for its life, and more of its steps than the panel's matrix holds), or None. A run opened from a
        file has no KV cache to recompute from: this is how its kept steps outside the matrix are shown."""
        store = store_for(self.bridge)
        run = store.shown_run() if store is not None else None
        if run is None or step < 1:
            return None
        layer = self.layer()
        for groups in (run._first, run._rest):  # each (step, indices of its captures in run.events), in step order
            i = bisect.bisect_left(groups, step, key=lambda g: g[0])
            if i < len(groups) and groups[i][0] == step:
                return next((e for e in (run.events[j] for j in groups[i][1]) if isinstance(e, AttentionCaptured)
                             and e.layer == layer and e.weights.shape[1] == 1), None)
        return None

    def _recompute_note(self) -> str:
        """What became of the selected step's recompute ("" when none was asked for)."""
        step, layer = self._selected_step, self.layer()
        if step is None or self.row_held(step):
            return ""
        if self._pending(step, layer):
            return f"step {step:,} is not held: recomputing its row from the engine's KV cache…"
        why = self._recomputed.get((step, layer))
        return f"step {step:,} is not held, and cannot be recomputed: {why}" if isinstance(why, str) else ""

    def clear(self) -> None:
        self._matrices.clear()
        self._captured.clear()
        self._norms.clear()
        self._recomputed.clear()
        self._recomputed_bytes = 0
        self._asked.clear()
        self._pieces, self._n_prompt, self._selected_step = [], 0, None
        super().clear()

    # ---- rows ↔ steps ------------------------------------------------------------------------------------------
    def step_of_row(self, row: int) -> int:
        """The step whose forward pass computed query row `row`: the prefill for prompt rows, then one per row."""
        return 0 if row < self._n_prompt else row - self._n_prompt + 1

    def rows_of_step(self, step: int) -> tuple[int, int]:
        return (0, self._n_prompt) if step == 0 else (self._n_prompt + step - 1, self._n_prompt + step)

    def _on_heat_clicked(self, event) -> None:
        m = self.matrix()
        if m is None or event.button() != QtCore.Qt.MouseButton.LeftButton:
            return
        vb = self.heat.getPlotItem().getViewBox()
        if not vb.sceneBoundingRect().contains(event.scenePos()):
            return
        p = vb.mapSceneToView(event.scenePos())
        row = int(math.floor(p.y()))
        if self.first_row() <= row < m.shape[2]:
            self.bridge.select_step(self.step_of_row(row))

    def _on_grid_clicked(self, event) -> None:
        for h, vb in enumerate(self.grid_boxes):
            if vb.sceneBoundingRect().contains(event.scenePos()):
                self.head_spin.setValue(h)
                self.tabs.setCurrentIndex(0)
                return

    def show_head(self, layer: int, head: int) -> None:
        """Show this layer and query head large (captured from the next generation on, when it was not)."""
        self.layer_spin.setValue(int(layer))
        self.head_spin.setValue(int(head))
        self.tabs.setCurrentIndex(0)
        self.mark_dirty()

    # ---- drawing -----------------------------------------------------------------------------------------------
    def layer(self) -> int:
        return int(self.layer_spin.value())

    def sliding_window(self, layer: int) -> int:
        """The sliding window of `layer` in the loaded model (0: a global layer, it reads every earlier key)."""
        cfg = self.bridge.cfg
        if cfg is None or not cfg.sliding_window or not 0 <= layer < len(cfg.layer_types):
            return 0
        return cfg.sliding_window if cfg.is_local(layer) else 0

    def head(self) -> int:
        return int(self.head_spin.value())

    def matrix(self) -> np.ndarray | None:
        """(heads, S − first_row, S) of the chosen layer, NaN where masked, or None if that layer was not captured.

        Row i is query position first_row() + i (0 unless the first rows were left out or not captured)."""
        m = self._matrices.get(self.layer())
        return None if m is None or m.size == 0 else m.weights

    def first_row(self) -> int:
        """The query position of the chosen layer's first stored row."""
        m = self._matrices.get(self.layer())
        return 0 if m is None else m.first_row

    def _factors(self) -> tuple[int, int]:
        """(rows, keys) of the matrix that share one pixel of the heat map as it is sized and zoomed now."""
        vb = self.heat.getPlotItem().getViewBox()
        (x0, x1), (y0, y1) = vb.viewRange()
        return per_pixel(y1 - y0, vb.height()), per_pixel(x1 - x0, vb.width())

    def _on_view_changed(self, *_args) -> None:
        if self._factors() != self._fit_factors:
            self.mark_dirty()

    def _fit(self, w: np.ndarray) -> np.ndarray:
        """The matrix reduced to the heat map's pixels (whole while fewer than DOWNSAMPLE_FROM cells share one)."""
        self._fit_factors = self._factors()
        return fit_to_pixels(w, *self._fit_factors)

    def _display(self, w: np.ndarray) -> np.ndarray:
        return np.sqrt(np.clip(w, 0.0, None)) if self.sqrt_check.isChecked() else w

    def draw(self) -> None:
        head = self.head()
        kv = head // self.group_size
        colour = GROUP_COLORS[kv % len(GROUP_COLORS)]
        w = self.sliding_window(self.layer())
        self.kv_label.setText(
            f"<span style='color:{colour}'>head {head} → KV head {kv}</span> "
            f"({self.n_heads} q heads, {max(1, self.n_heads // self.group_size)} KV heads"
            + (f"; local, window {w:,})" if w else ")"))
        unit = "√weight" if self.sqrt_check.isChecked() else "weight"
        if self.colorbar.axis.labelText != unit:  # setLabel redraws the axis whether or not the text changed
            self.colorbar.axis.setLabel(unit)
        m = self.matrix()
        store = store_for(self.bridge)
        run = store.shown_run() if store is not None else None
        kept = run.attention_note() if run is not None else ""
        recomputed = self.recomputed_row()
        pending = self._recompute_note()
        if recomputed is not None:
            self._draw_recomputed(recomputed, kept, stored=recomputed is self.stored_row(recomputed.step))
        elif m is None:
            captured = sorted(self._captured)
            src = self.bridge.run_source
            self.status.setText(
                f"This run came from a server ({src.name}): a server gives no attention weights or residual norms "
                "(File → Disconnect to see them on the local model)." if src is not None and not src.can("attention")
                and not captured else
                "Generate to see attention." if not captured else
                f"Layer {self.layer()} is captured from the next token on (captured so far: "
                f"{', '.join(map(str, captured))})." if self.bridge.state != "idle" else
                f"Layer {self.layer()} was not captured in this run (captured: {', '.join(map(str, captured))}); "
                "generate again to capture it." if self.layer() not in captured else
                f"Layer {self.layer()}'s weights of this run are no longer held "
                f"({kept or 'the panel holds the layer shown, the window keeps the others'})."
                + (f" ⚠ {pending}." if pending else ""))
            self.image.clear()
            for img in self.grid_images:
                img.clear()
            self.row_box.setVisible(False)
            set_data(self.window_edge, [], [])
            self._draw_empty_heat()
        else:
            if self.heat_note.isVisible():  # the first weights: leave the empty view's fixed range
                self.heat_note.setVisible(False)
                self.heat.getPlotItem().getViewBox().enableAutoRange()
            s = m.shape[2]
            am = self._matrices[self.layer()]
            r0 = am.first_row
            notes = []
            if am.first_step:
                notes.append(f"captured from step {am.first_step} on (asked for during the run): the rows before "
                             f"query {r0:,} are not shown")
            if am.rows_skipped:
                notes.append(f"the prefill's first {am.rows_skipped:,} query rows were left out to bound the "
                             f"capture's memory; rows {r0:,}–{s - 1:,} are shown")
            if am.rows_dropped:
                notes.append(f"the newest {s - r0:,} query rows are shown (rows {r0:,}–{s - 1:,}): the panel holds "
                             f"at most {MATRIX_BYTES >> 20} MiB of one layer")
            if kept:
                notes.append(kept)
            if pending:
                notes.append(pending)
            w = am.window
            mask = ("Dark grey = causal mask." if not w else
                    f"Local layer: each query reads only the last {w:,} positions (sliding window); dark grey = "
                    "causal mask and, left of the dashed edge, the keys outside the window.")
            self.status.setText(
                f"Layer {self.layer()}: {s - r0:,} × {s:,} (query × key) — prompt {self._n_prompt:,} tokens at once "
                f"(prefill), "
                f"then one row per decode step. {mask}" + "".join(f" ⚠ {n}." for n in notes))
            top = max(r0, w - 1)  # the edge x = y − W + 1, drawn over the stored rows only
            if w and s > top + 1:
                set_data(self.window_edge, [float(top - w + 1), float(s - w + 1)], [float(top), float(s)])
            else:
                set_data(self.window_edge, [], [])
            self.image.setImage(self._display(self._fit(m[head])), levels=(0.0, 1.0), autoLevels=False)
            self.image.setRect(QtCore.QRectF(0, r0, s, s - r0))
            if self.tabs.currentIndex() == 1 or not self.grid_images:
                self._build_grid()
                for h, img in enumerate(self.grid_images):
                    if h < m.shape[0]:
                        vb = self.grid_boxes[h]
                        fy, fx = (per_pixel(m.shape[1], vb.height()), per_pixel(s, vb.width()))
                        img.setImage(self._display(fit_to_pixels(m[h], fy, fx)), levels=(0.0, 1.0), autoLevels=False)
                        img.setRect(QtCore.QRectF(0, r0, s, s - r0))
                        self.grid_boxes[h].setRange(xRange=(0, s), yRange=(r0, s), padding=0)
            self._draw_labels(s, r0)
            self._draw_selection(s, r0)
        if self.tabs.currentWidget() is self.norm_plot or not self._norms:  # a tab not shown draws when turned to
            self._draw_norms()

    def _draw_recomputed(self, ev: AttentionCaptured, kept: str, stored: bool = False) -> None:
        """The selected step's one row, recomputed from the KV cache (or as the run store kept it): (heads, 1, keys)
        at query position p."""
        p, n_keys = ev.query_start, ev.weights.shape[2]
        s = p + 1
        row = np.full((ev.weights.shape[0], 1, s), np.nan, dtype=np.float32)
        row[:, :, s - n_keys:] = ev.weights  # a local layer sends its window's keys, the last ones
        self.heat_note.setVisible(False)
        self.heat.getPlotItem().getViewBox().enableAutoRange()  # onto the one row, wherever the view was
        head = min(self.head(), row.shape[0] - 1)
        self.image.setImage(self._display(row[head]), levels=(0.0, 1.0), autoLevels=False)
        self.image.setRect(QtCore.QRectF(0, p, s, 1))
        self._build_grid()
        for h, img in enumerate(self.grid_images):
            if h < row.shape[0]:
                img.setImage(self._display(row[h]), levels=(0.0, 1.0), autoLevels=False)
                img.setRect(QtCore.QRectF(0, p, s, 1))
                self.grid_boxes[h].setRange(xRange=(0, s), yRange=(p, s), padding=0)
        set_data(self.window_edge, [], [])
        w = self.sliding_window(ev.layer)
        self.status.setText(
            f"Layer {ev.layer}, step {ev.step:,}: query position {p:,} reading {n_keys:,} keys"
            + (f" (local layer: the last {w:,} positions)" if w else "")
            + (" — as captured in the run, which keeps this step; the heat map holds the newest rows only"
               if stored else " — recomputed from the KV cache: the run's capture of this step is not held")
            + (f" ({kept})" if kept else "") + ". Select a held step to see the matrix again.")
        self._draw_labels(s, p)
        self._draw_selection(s, p)

    def _draw_labels(self, s: int, first_row: int = 0) -> None:
        pi = self.heat.getPlotItem()
        vb = pi.getViewBox()
        (x0, x1), (y0, y1) = vb.viewRange()
        width_px, height_px = max(1.0, vb.width()), max(1.0, vb.height())
        fm = QtGui.QFontMetrics(self._font)
        for axis, lo, hi, px, room in (("bottom", x0, x1, width_px, fm.horizontalAdvance("wwwww")),
                                       ("left", y0, y1, height_px, fm.height() + 2)):
            start = 0 if axis == "bottom" else first_row  # rows above first_row are not stored
            visible = max(1.0, min(hi, s) - max(lo, start))
            per_label = px / visible  # pixels per token
            stride = max(1, math.ceil(room / max(per_label, 1e-6)))
            first = max(start, int(lo))
            ticks = [(i + 0.5, self._label(i, axis == "bottom")) for i in range(first - first % stride,
                                                                                 min(s, int(hi) + 1), stride)]
            pi.getAxis(axis).setTicks([ticks, []])

    def _label(self, i: int, short: bool) -> str:
        text = self._pieces[i] if i < len(self._pieces) else ""
        return text[:6] if short else f"{text[:10]} {i}"

    def _draw_selection(self, s: int, first_row: int = 0) -> None:
        if self._selected_step is None:
            self.row_box.setVisible(False)
            return
        r0, r1 = self.rows_of_step(self._selected_step)
        r0, r1 = max(r0, first_row), min(r1, s)
        self.row_box.setRect(QtCore.QRectF(0, r0, s, max(0, r1 - r0)))
        self.row_box.setVisible(r1 > r0)

    def _draw_empty_heat(self) -> None:
        """No weights yet: the prompt's tokens (if any) on both axes, and what will appear."""
        pi = self.heat.getPlotItem()
        s = len(self._pieces)
        if s:
            self._draw_labels(s)
        else:
            for name in ("left", "bottom"):
                pi.getAxis(name).setTicks([[]])
        n = float(max(s, EMPTY_TOKENS))
        text = (f"Generate: layer {self.layer()}'s attention weights appear here,\n"
                "one row per query token, one column per key token" if not self._matrices else
                self.status.text().split(";")[0])
        show_empty(pi, self.heat_note, text, (0.0, n), (0.0, n))

    def _draw_norms(self) -> None:
        npi = self.norm_plot.getPlotItem()
        if not self._norms:
            set_data(self.norm_curve, [], [])
            npi.setTitle("")
            self._norm_title = ""
            npi.getAxis("left").setTicks([[]])
            show_empty(npi, self.norm_note, f"Generate: the newest token's ‖x‖ after the embedding\n"
                       f"and after each of the {self.n_layers} layers", (-0.5, self.n_layers + 0.5), (0.0, 1.0))
            return
        self.norm_note.setVisible(False)
        npi.getAxis("left").setTicks(None)
        npi.getViewBox().enableAutoRange()
        step = self._selected_step if self._selected_step in self._norms else max(self._norms)
        norms = self._norms[step]
        set_data(self.norm_curve, np.arange(len(norms)), norms)
        title = f"step {step}: newest token's hidden-state norm"
        if title != self._norm_title:  # a new title lays the plot out again
            self._norm_title = title
            npi.setTitle(title, size=f"{FONT_PT}pt", color=FOREGROUND)


PANEL = AttentionPanel
