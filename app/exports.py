"""Exports: any panel as PNG or SVG, and the run's data (timeline, funnels, attention, KV growth) as CSV or JSON.

The data come from the shown run of the window's run store (app.run_store), so an opened session exports the same
files as the live run it was saved from. Everything a user picks a path for says so when it cannot be written.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from engine.events import AttentionCaptured, KVCacheGrew, TokenSampled

PANEL_EXTS = (".png", ".svg")
DATA_EXTS = (".csv", ".json")


# ---- data tables (plain rows of numbers and strings) ------------------------------------------------------------
def timeline_rows(events: Sequence) -> list[dict]:
    """One row per step: phase, seconds, the token, FLOPs and bytes of the step."""
    return [{"step": e.step, "phase": e.phase, "position": e.position, "seconds": e.seconds,
             "token_id": e.token_id, "token": e.piece, "flops": e.cost.flops, "bytes": e.cost.bytes,
             "forced": e.forced}
            for e in events if isinstance(e, TokenSampled)]


def funnel_rows(events: Sequence) -> list[dict]:
    """One row per candidate of every step's funnel: its probability after each stage."""
    rows = []
    for e in events:
        if not isinstance(e, TokenSampled) or e.funnel is None:
            continue
        f = e.funnel
        for i in range(len(f.ids)):
            rows.append({"step": e.step, "token_id": int(f.ids[i]), "token": f.pieces[i],
                         "sampled": int(f.ids[i]) == e.token_id, "logit": float(f.logits[i]),
                         "p_raw": float(f.p_raw[i]), "p_temperature": float(f.p_temperature[i]),
                         "p_top_k": float(f.p_top_k[i]), "p_top_p": float(f.p_top_p[i]),
                         "p_final": float(f.p_final[i])})
    return rows


def kv_rows(events: Sequence) -> list[dict]:
    return [{"step": e.step, "tokens": e.n_tokens, "bytes_used": e.bytes_used, "bytes_allocated": e.bytes_allocated}
            for e in events if isinstance(e, KVCacheGrew)]


ATTENTION_COLUMNS = ("step", "head", "query", "key", "weight")


def write_attention(path: str | os.PathLike[str], events: Sequence, layer: int) -> None:
    """Every captured weight of one layer (step, head, query position, key position, weight) as CSV or JSON (a
    list of objects), one event at a time: a long run holds millions of weights, and a row object for each would
    need gigabytes, so each event's weights become one array of rows, formatted by numpy and written before the
    next."""
    p = Path(path)
    ext = p.suffix.lower()
    if ext not in DATA_EXTS:
        raise ValueError(f"{p.name}: unknown file type {ext or '(none)'!r}; use .csv or .json")
    if ext == ".json":
        row = "{" + ", ".join(f'"{c}": %d' for c in ATTENTION_COLUMNS[:-1]) + ', "weight": %.9g}'
    else:
        row = "%d,%d,%d,%d,%.9g"
    try:
        with open(p, "w", encoding="utf-8", newline="") as fh:
            fh.write("[" if ext == ".json" else ",".join(ATTENTION_COLUMNS) + "\r\n")
            first = True
            for e in events:
                if not isinstance(e, AttentionCaptured) or e.layer != layer:
                    continue
                w = np.asarray(e.weights, dtype=np.float64)  # (H, rows, S)
                h, q, k = np.nonzero(w > 0)
                if not h.size:
                    continue
                table = np.column_stack([np.full(h.size, e.step), h, e.query_start + q, k, w[h, q, k]])
                buf = io.StringIO()
                np.savetxt(buf, table, fmt=row, delimiter="", newline="," if ext == ".json" else "\r\n")
                text = buf.getvalue()
                if ext == ".json":  # savetxt ends every row with the separator: between events, one comma
                    text = ("" if first else ",") + text[:-1]
                fh.write(text)
                first = False
            if ext == ".json":
                fh.write("]")
    except OSError as e:
        raise OSError(f"cannot write {p}: {e.strerror or e}") from None


def write_rows(path: str | os.PathLike[str], rows: list[dict]) -> None:
    """CSV (header from the first row) or JSON (a list of objects) by extension; OSError names the path."""
    p = Path(path)
    ext = p.suffix.lower()
    if ext not in DATA_EXTS:
        raise ValueError(f"{p.name}: unknown file type {ext or '(none)'!r}; use .csv or .json")
    try:
        if ext == ".json":
            p.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
        else:
            with open(p, "w", newline="", encoding="utf-8") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["empty"])
                w.writeheader()
                w.writerows(rows)
    except OSError as e:
        raise OSError(f"cannot write {p}: {e.strerror or e}") from None


# ---- panels as pictures -----------------------------------------------------------------------------------------
def export_panel(panel: QtWidgets.QWidget, path: str | os.PathLike[str]) -> None:
    """The panel as it is on screen: PNG (pixels) or SVG (vector drawing of the widget) by extension."""
    p = Path(path)
    ext = p.suffix.lower()
    if ext not in PANEL_EXTS:
        raise ValueError(f"{p.name}: unknown file type {ext or '(none)'!r}; use .png or .svg")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise OSError(f"cannot write {p}: the folder {folder} does not exist or is not writable")
    if ext == ".png":
        if not panel.grab().save(str(p), "PNG"):
            raise OSError(f"cannot write {p}")
        return
    from PySide6 import QtSvg

    gen = QtSvg.QSvgGenerator()
    gen.setFileName(str(p))
    gen.setSize(panel.size())
    gen.setViewBox(QtCore.QRect(QtCore.QPoint(0, 0), panel.size()))
    gen.setTitle(getattr(panel, "title", "panel"))
    painter = QtGui.QPainter()
    if not painter.begin(gen):
        raise OSError(f"cannot write {p}")
    try:
        panel.render(painter, QtCore.QPoint(0, 0))
    finally:
        painter.end()


# ---- the window's side ------------------------------------------------------------------------------------------
DATA_KINDS = {"timeline": "Timeline", "funnels": "Sampling funnels", "attention": "Attention (shown layer)",
              "kv": "KV cache growth", "why": "Why (shown experiment)"}


def data_rows(window, kind: str) -> list[dict]:
    """The rows of a data export (every kind but attention, which write_attention streams)."""
    events = window.run_store.events()
    if kind == "timeline":
        return timeline_rows(events)
    if kind == "funnels":
        return funnel_rows(events)
    if kind == "kv":
        return kv_rows(events)
    if kind == "why":
        why = window.panels.get("why")
        return why.export_rows() if why is not None else []
    raise ValueError(f"unknown data kind {kind!r}")


def export_data_to(window, kind: str, path: str) -> bool:
    try:
        if kind == "attention":
            att = window.panels.get("attention")
            layer = att.layer_spin.value() if att is not None and hasattr(att, "layer_spin") else 0
            write_attention(path, window.run_store.events(), layer)
        else:
            write_rows(path, data_rows(window, kind))
    except (OSError, ValueError) as e:
        window.show_error(str(e), title="Export failed", box=window.interactive)
        return False
    window.set_message(f"{DATA_KINDS[kind]} saved to {path}")
    return True


def export_panel_to(window, name: str, path: str) -> bool:
    try:
        export_panel(window.panels[name], path)
    except (OSError, ValueError) as e:
        window.show_error(str(e), title="Export failed", box=window.interactive)
        return False
    window.set_message(f"{window.panels[name].title} saved to {path}")
    return True


def install(window) -> None:
    """View → Export panel ▸ (each panel), File → Export data ▸ (timeline, funnels, attention, KV), and a
    right-click menu on every panel with the same two exports."""
    panel_menu = window.view_menu.addMenu("Export &panel")
    for name, panel in window.panels.items():
        panel_menu.addAction(f"{panel.title}…", lambda n=name: _panel_dialog(window, n))
        panel.setContextMenuPolicy(QtCore.Qt.ContextMenuPolicy.CustomContextMenu)
        panel.customContextMenuRequested.connect(lambda pos, n=name: _context_menu(window, n, pos))
    data_menu = QtWidgets.QMenu("Export &data", window)
    for kind, label in DATA_KINDS.items():
        data_menu.addAction(f"{label}…", lambda k=kind: _data_dialog(window, k))
    anchor = next((a for a in reversed(window.file_menu.actions()) if a.isSeparator()), None)
    window.file_menu.insertMenu(anchor, data_menu) if anchor is not None else window.file_menu.addMenu(data_menu)
    window.export_panel_menu, window.export_data_menu = panel_menu, data_menu


def _context_menu(window, name: str, pos: QtCore.QPoint) -> None:
    panel = window.panels[name]
    menu = QtWidgets.QMenu(panel)
    menu.addAction(f"Export {panel.title} as PNG or SVG…", lambda: _panel_dialog(window, name))
    menu.addMenu(window.export_data_menu)
    menu.popup(panel.mapToGlobal(pos))
    window._export_context_menu = menu


def _panel_dialog(window, name: str) -> None:
    path, _ = QtWidgets.QFileDialog.getSaveFileName(
        window, f"Export {window.panels[name].title}", str(Path.home() / f"{name}.png"),
        "PNG image (*.png);;SVG drawing (*.svg)")
    if path:
        export_panel_to(window, name, path)


def _data_dialog(window, kind: str) -> None:
    path, _ = QtWidgets.QFileDialog.getSaveFileName(
        window, f"Export {DATA_KINDS[kind]}", str(Path.home() / f"{kind}.csv"), "CSV (*.csv);;JSON (*.json)")
    if path:
        export_data_to(window, kind, path)
