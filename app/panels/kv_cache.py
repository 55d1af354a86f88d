"""KV cache: bytes held against tokens, live, with the per-token formula spelled out in the loaded model's numbers
and a table of how batch size, dtype and GQA would change it. Every number comes from engine.costs.formulas.

The curves grow as the events arrive (the points are appended to arrays; the allocated staircase gains a step only
when the allocation changes), so a draw late in a long run costs what it did early on.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app import units
from app.bridge import Bridge
from app.panels.base import Holder, Panel, reserve_lines
from app.theme import (
    ACCENT,
    BACKGROUND,
    COUNT_STEPS,
    DECODE_COLOR,
    FOREGROUND,
    PREFILL_COLOR,
    placeholder,
    set_data,
    set_number_cell,
    set_title,
    show_empty,
    stepped_bound,
    style_plot,
)
from engine.costs import formulas as costs
from engine.events import KVCacheGrew, ModelInfo, PromptTokenized
from engine.model.config import ModelConfig

FONT_PT = 9
ALLOC_COLOR = "#9a9a9a"
KEY_HTML = (f"<span style='color:{ALLOC_COLOR}'><b>- - -</b></span> allocated &nbsp; "
            f"<span style='color:{PREFILL_COLOR}'><b>—</b></span> prefill (one jump) &nbsp; "
            f"<span style='color:{DECODE_COLOR}'><b>-•-</b></span> decode")
TABLE_DTYPES = ("fp32", "fp16", "int8")
TABLE_BATCHES = (1, 8, 32)
EMPTY_TOKENS = (0.0, 1024.0)  # the axes before any model is loaded
EMPTY_BYTES = 1e6
MARKED_STEPS = 128


def fmt_bytes(n: float) -> str:
    return units.fmt_bytes(n, digits=2)


class KVCachePanel(Panel):
    title = "KV cache"
    object_name = "panel_kv_cache"
    shortcut = "Alt+6"
    subscriptions = {
        "sig_model_loaded": "_on_model_loaded",
        "sig_prompt": "_on_prompt",
        "sig_kv": "_on_kv",
        "sig_server_metrics": "_on_server_metrics", "sig_serve_metrics": "_on_server_metrics",
    }
    help_text = (
        "The KV cache keeps the key and value vectors of every token already processed, so each new token needs "
        "one forward pass over itself instead of re-running the whole sequence. It grows by the same amount with "
        "every token: bytes per token = 2 · layers · KV heads · head dim · bytes per value (the 2 is one key plus "
        "one value). The plot shows the bytes in use against the tokens held: the prefill writes the whole "
        "prompt in one jump, then each decode step adds one token. The dashed line is what the engine has "
        "allocated (it reserves room in blocks of positions). The table scales the formula: × batch (each "
        "sequence keeps its own cache), × bytes per value (fp32 4, fp16 2, int8 1), and × the GQA group size "
        "without grouped-query attention, where each query head would need its own keys and values."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        dtype = costs.kv_cache_dtype(info)
        per_token = costs.kv_bytes_per_token(cfg, dtype)
        full = sum(costs.kv_bytes(cfg, dtype, cfg.context_length))
        weights = info.weight_bytes  # what the runtime holds: the file's bytes on llama.cpp, n_params × dtype on torch
        held = f"in {dtype}" if dtype == info.dtype else f"with a {dtype} KV cache ({info.file_type} weights)"
        text = (f"For {info.name} {held}: 2 · {cfg.n_layers} · {cfg.n_kv_heads} · {cfg.head_dim} · "
                f"{costs.bytes_per_value(dtype):g} = {per_token:,.0f} bytes ({fmt_bytes(per_token)}) per token, so "
                f"its full {cfg.context_length:,}-token context holds {fmt_bytes(full)} per sequence, "
                f"{full / weights:.0%} of the {fmt_bytes(weights)} its weights take.")
        if cfg.n_local_layers:
            g, loc = costs.kv_bytes(cfg, dtype, cfg.context_length)
            text += (f" Only its {cfg.n_global_layers} global layers grow with the context ({fmt_bytes(g)} at full "
                     f"context); its {cfg.n_local_layers} local layers keep the last {cfg.sliding_window:,} positions "
                     f"(a sliding window), so they stop at {fmt_bytes(loc)}.")
        if cfg.group_size > 1:
            text += (f" Without GQA each of its {cfg.n_heads} query heads would keep its own keys and values: "
                     f"{cfg.group_size}× as many bytes.")
        return text

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self._reset()
        self._stepped = False  # the plot's bounds follow a run in steps (stepped_bound), not the empty plot's
        self._font = QtGui.QFont()
        self._font.setPointSize(FONT_PT)
        self._build()
        self.server_metrics = None  # the latest engine.remote.metrics.ServerMetrics of a remote generation
        self.mark_dirty()

    def _build(self) -> None:
        self.formula = QtWidgets.QLabel("Load a model to see its KV cache formula.")
        self.formula.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.formula.setWordWrap(True)
        self.formula.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        reserve_lines(self.formula, 4)  # the formula, the local layers (Gemma 3), the bytes now, a server's figures
        self.plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.plot.getPlotItem()
        style_plot(pi, left=("KV cache", "B"), bottom=("tokens in the cache", None))
        # the curves are keyed in the plot's title (KEY_HTML): a legend inside the plot sat on the curves' newest
        # end, top right, where the cache has just grown to, and on the label of its size
        self.alloc_curve = pi.plot([], [], pen=pg.mkPen(ALLOC_COLOR, width=1.5, style=QtCore.Qt.PenStyle.DashLine))
        self.prefill_curve = pi.plot([], [], pen=pg.mkPen(PREFILL_COLOR, width=2))
        self.used_curve = pi.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=2), symbol="o", symbolSize=4,
                                  symbolBrush=DECODE_COLOR, symbolPen=None)
        self.prefill_point = pi.plot([], [], pen=None, symbol="o", symbolSize=9, symbolBrush=PREFILL_COLOR,
                                     symbolPen=None)
        self.total_text = pg.TextItem("", color="#e0e0e0", anchor=(1, 1))
        self.total_text.setFont(self._font)
        pi.addItem(self.total_text, ignoreBounds=True)  # a label: the range fits the data only
        self.empty_note = placeholder(pi)

        self.table = QtWidgets.QTableWidget(len(TABLE_DTYPES) * len(TABLE_BATCHES), 4)
        self.table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setDefaultSectionSize(20)
        self.table.horizontalHeader().setSectionResizeMode(QtWidgets.QHeaderView.ResizeMode.Stretch)
        self.table_note = QtWidgets.QLabel("")
        self.table_note.setWordWrap(True)
        table_page = QtWidgets.QWidget()
        tl = QtWidgets.QVBoxLayout(table_page)
        tl.setContentsMargins(0, 0, 0, 0)
        tl.addWidget(self.table_note)
        tl.addWidget(self.table, 1)

        self.tabs = QtWidgets.QTabWidget()
        self.tabs.addTab(self.plot, "Growth")
        self.tabs.addTab(table_page, "How it scales")
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addWidget(Holder(self.formula, wrapped=True))  # new figures at every draw
        layout.addWidget(self.tabs, 1)

    # ---- events ------------------------------------------------------------------------------------------------
    @QtCore.Slot(object)
    def _on_model_loaded(self, _info: ModelInfo) -> None:
        self.clear()

    @QtCore.Slot(object)
    def _on_prompt(self, _ev: PromptTokenized) -> None:
        self.clear()

    @QtCore.Slot(object)
    def _on_server_metrics(self, item) -> None:
        self.server_metrics = item.metrics  # a generation's scrape or a load run's
        self.mark_dirty()

    def server_text(self) -> str:
        """The server's own KV figures (vLLM /metrics), or what it cannot say."""
        src, server = self.bridge.run_source, self.bridge.run_server
        if src is None or not src.measured_by_server:
            return ""
        m = self.server_metrics if server is not None else None
        kind = server.kind if server is not None else src.name
        if m is None or m.kv_usage is None:
            return f"<br><i>{kind} reports no KV-cache figures; the curve shows nothing from a server</i>"
        hit = "" if m.prefix_hit_rate is None else f" · prefix-cache hits {m.prefix_hit_rate:.0%}"
        return (f"<br>server ({kind}, /metrics): KV cache <b>{m.kv_usage:.1%}</b> used · "
                f"{m.running or 0:.0f} running · {m.waiting or 0:.0f} waiting{hit}")

    @QtCore.Slot(object)
    def _on_kv(self, ev: KVCacheGrew) -> None:
        self._events.append(ev)
        if ev.step == 0:  # the prefill: the used curve starts at its end
            self._prefill, self._n = ev, 0
        else:
            if self._n == len(self._used):
                self._used = np.resize(self._used, (2 * self._n + 64, 2))
            self._used[self._n] = ev.n_tokens, ev.bytes_used
            self._n += 1
        if not self._ax:
            first = ev
            self._ax = [first.n_tokens - (first.n_tokens if first.step == 0 else 1)]
            self._ay = [first.bytes_allocated]
        elif ev.bytes_allocated != self._ay[-1]:
            self._ax += [ev.n_tokens, ev.n_tokens]
            self._ay += [self._ay[-1], ev.bytes_allocated]
        self.mark_dirty()

    def clear(self) -> None:
        self._reset()
        super().clear()

    def _reset(self) -> None:
        self._events: list[KVCacheGrew] = []
        self._prefill: KVCacheGrew | None = None  # the newest prefill's event
        self._used, self._n = np.zeros((0, 2)), 0  # (tokens, bytes used) of the decode steps after it
        self._ax: list[float] = []  # the allocated staircase, without its last point
        self._ay: list[float] = []

    # ---- numbers (all from engine.costs.formulas) --------------------------------------------------------------------
    def kv_dtype(self) -> str:
        """The dtype the loaded model's cache holds (not always its weights': llama.cpp keeps float16)."""
        info = self.bridge.info
        return costs.kv_cache_dtype(info) if info is not None else "float32"

    def per_token(self) -> float | None:
        cfg = self.bridge.cfg
        return None if cfg is None else costs.kv_bytes_per_token(cfg, self.kv_dtype())

    def last_point(self) -> tuple[float, float] | None:
        x, y = self.used_curve.getData()
        if x is None or len(x) == 0:
            x, y = self.prefill_curve.getData()
        if x is None or len(x) == 0:
            return None
        return float(x[-1]), float(y[-1])

    # ---- drawing -----------------------------------------------------------------------------------------------
    def draw(self) -> None:
        cfg = self.bridge.cfg
        if cfg is None:
            self._draw_curves()
            return
        dtype = self.kv_dtype()
        per_token = costs.kv_bytes_per_token(cfg, dtype)
        bpv = costs.bytes_per_value(dtype)
        n = self._events[-1].n_tokens if self._events else 0
        used = self._events[-1].bytes_used if self._events else 0
        alloc = self._events[-1].bytes_allocated if self._events else 0
        text = (f"per token = 2 (K, V) · {cfg.n_layers} layers · {cfg.n_kv_heads} KV heads · {cfg.head_dim} head "
                f"dim · {bpv:g} B ({dtype}) = <b>{per_token:,.0f} bytes</b> ({fmt_bytes(per_token)})<br>")
        llama = self.bridge.runtime == "llama.cpp"  # swa_full: its local layers keep every position
        # engine.runtime.torch: a generation's local layers keep every position when that fits its budget
        full_local = llama or bool(self._events) and self._events[-1].local_slots > 2 * cfg.sliding_window
        if cfg.n_local_layers and full_local:
            why = ("llama.cpp keeps every position in them too (a full-size cache, so a cached prefix can be cut "
                   "anywhere)" if llama else "this run's cache keeps every position in them too (it is short enough "
                   "for the engine's budget, so any step of it can be recomputed for any layer)")
            text += (f"its {cfg.n_local_layers} local layers attend to the last {cfg.sliding_window:,} positions "
                     f"only, but {why}<br>now: {n:,} tokens × {per_token:,.0f} B = ")
        elif cfg.n_local_layers:
            g, loc = costs.kv_bytes(cfg, dtype, max(1, n))
            w = cfg.sliding_window
            text += (f"of which {cfg.n_global_layers} global layers keep every token and {cfg.n_local_layers} local "
                     f"layers only the last {w:,} (sliding window): now {fmt_bytes(g)} global + {fmt_bytes(loc)} "
                     f"local by the formula<br>now: {n:,} tokens → ")
        else:
            text += f"now: {n:,} tokens × {per_token:,.0f} B = "
        beyond = ""
        if cfg.n_local_layers and not full_local and used > sum(costs.kv_bytes(cfg, dtype, max(1, n))):
            # engine.model.kv_cache: a local layer keeps up to twice its window (so prefix caching can step back), and
            # drops the older half only when it runs out of slots
            beyond = (f" (more than the formula: a local layer keeps up to 2 × {cfg.sliding_window:,} positions "
                      "before dropping the oldest, so a re-run can reuse them)")
        self.formula.setText(
            text + f"<b style='color:{ACCENT}'>{fmt_bytes(used)}</b> in use"
            + (f", {fmt_bytes(alloc)} allocated" if alloc else "") + beyond
            + self.server_text()
        )
        self._draw_curves()
        self._draw_table(cfg, n)

    def _draw_curves(self) -> None:
        evs = self._events
        pi = self.plot.getPlotItem()
        if not evs:
            for c in (self.alloc_curve, self.prefill_curve, self.prefill_point, self.used_curve):
                set_data(c, [], [])
            self.total_text.setText("")
            self._draw_empty(pi)
            return
        self.empty_note.setVisible(False)
        set_title(pi, KEY_HTML, self.plot.width(), size=f"{FONT_PT}pt", color=FOREGROUND)
        first = evs[0]
        start = first.n_tokens - (first.n_tokens if first.step == 0 else 1)
        start_bytes = 0 if first.step == 0 else first.bytes_used - (first.bytes_used / max(1, first.n_tokens))
        p = self._prefill
        if p is not None:
            set_data(self.prefill_curve, [start, p.n_tokens], [start_bytes, p.bytes_used])
            set_data(self.prefill_point, [p.n_tokens], [p.bytes_used])
        else:
            set_data(self.prefill_curve, [], [])
            set_data(self.prefill_point, [], [])
        used = self._used[: self._n]
        if p is not None and self._n:
            used = np.concatenate([[(p.n_tokens, p.bytes_used)], used])
        # a marker per decode step while they can be told apart; past that, the line alone (a marker each is a
        # paint each, and a long run's draw would cost more with every token)
        symbol = "o" if self._n <= MARKED_STEPS else None
        if self.used_curve.opts["symbol"] != symbol:
            self.used_curve.setSymbol(symbol)
        set_data(self.used_curve, used[:, 0] if self._n else [], used[:, 1] if self._n else [])
        # allocated: a staircase (it only grows in blocks)
        set_data(self.alloc_curve, self._ax + [evs[-1].n_tokens], self._ay + [evs[-1].bytes_allocated])
        last = evs[-1]
        self.total_text.setText(f"{last.n_tokens} tokens: {fmt_bytes(last.bytes_used)}")
        self.total_text.setPos(last.n_tokens, last.bytes_used)
        # the tokens' axis grows in steps, not at every token; the bytes' axis fits what is allocated, which grows
        # in blocks
        vb = pi.getViewBox()
        x1 = stepped_bound(last.n_tokens, vb.viewRange()[0][1] if self._stepped else None, headroom=1.0,
                           steps=COUNT_STEPS)
        self._stepped = True
        y1 = max(last.bytes_allocated, last.bytes_used) * 1.02
        vb.setRange(xRange=(start - 0.02 * (x1 - start), x1), yRange=(start_bytes - 0.02 * (y1 - start_bytes), y1),
                    padding=0)

    def _draw_empty(self, pi: pg.PlotItem) -> None:
        """Before the first generation: the axes of the model's whole context, and what will appear."""
        set_title(pi, None, self.plot.width())
        self._stepped = False
        cfg = self.bridge.cfg
        if cfg is None:
            show_empty(pi, self.empty_note, "Load a model to see its KV cache grow", EMPTY_TOKENS,
                       (0.0, EMPTY_BYTES))
            return
        per_token, full = self.per_token(), cfg.context_length
        at_full = sum(costs.kv_bytes(cfg, self.kv_dtype(), full))
        show_empty(pi, self.empty_note,
                   f"Generate: the bytes in the cache\nappear here, token by token\n"
                   f"({fmt_bytes(per_token)} per token,\n{fmt_bytes(at_full)} at the full "
                   f"{full:,}-token context)", (0.0, float(full)), (0.0, at_full))

    def _draw_table(self, cfg, n_now: int) -> None:
        full = cfg.context_length
        no_gqa = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
        now = max(1, n_now)
        self.table.setHorizontalHeaderLabels(
            ["per token", f"now\n({now:,} tokens)", f"full context\n({full:,})",
             f"full, no GQA\n({cfg.n_heads} KV heads)"])
        labels = []
        r = 0
        for dtype in TABLE_DTYPES:
            for batch in TABLE_BATCHES:
                labels.append(f"{dtype} · batch {batch}")
                per = costs.kv_bytes_per_token(cfg, dtype, batch)
                cells = (per, sum(costs.kv_bytes(cfg, dtype, now, batch)), sum(costs.kv_bytes(cfg, dtype, full, batch)),
                         sum(costs.kv_bytes(no_gqa, dtype, full, batch)))
                for c, value in enumerate(cells):
                    set_number_cell(self.table, r, c, fmt_bytes(value))
                r += 1
        self.table.setVerticalHeaderLabels(labels)
        ratio = cfg.n_heads / cfg.n_kv_heads
        self.table_note.setText(
            f"Each sequence in a batch keeps its own cache; halving the bytes per value halves it. Grouped-query "
            f"attention shares {cfg.n_kv_heads} KV heads among {cfg.n_heads} query heads: without it the cache "
            f"would be {ratio:g}× larger.")


PANEL = KVCachePanel
