"""Exports: every panel as PNG and SVG; timeline, funnels, attention and KV growth as CSV and JSON."""

from __future__ import annotations

import csv
import json

import pytest
from PySide6 import QtCore, QtGui, QtWidgets

from app import exports
from engine.events import KVCacheGrew, TokenSampled
from tests.app.test_sessions import generate


def test_every_panel_exports_png_and_svg(qtbot, window, tmp_path):
    generate(qtbot, window, n=4)
    window.tick_panels(flush=True)
    assert len(window.export_panel_menu.actions()) == len(window.panels)
    for name in window.panels:
        png, svg = tmp_path / f"{name}.png", tmp_path / f"{name}.svg"
        assert exports.export_panel_to(window, name, str(png)), window.last_error
        assert exports.export_panel_to(window, name, str(svg)), window.last_error
        image = QtGui.QImage(str(png))
        assert not image.isNull() and image.width() > 10
        text = svg.read_text()
        assert "<svg" in text and "</svg>" in text
    assert not exports.export_panel_to(window, "timeline", str(tmp_path / "no" / "t.png"))
    assert "cannot write" in window.last_error
    assert not exports.export_panel_to(window, "timeline", str(tmp_path / "t.gif"))


def test_data_exports_hold_the_run(qtbot, window, tmp_path):
    generate(qtbot, window, n=5)
    events = window.run_store.events()
    steps = [e for e in events if isinstance(e, TokenSampled)]
    for kind in exports.DATA_KINDS:
        for ext in (".csv", ".json"):
            path = tmp_path / f"{kind}{ext}"
            assert exports.export_data_to(window, kind, str(path)), window.last_error
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert [r["step"] for r in timeline] == [t.step for t in steps]
    assert [r["seconds"] for r in timeline] == [t.seconds for t in steps]
    with open(tmp_path / "kv.csv", newline="") as fh:
        kv = list(csv.DictReader(fh))
    assert [int(r["bytes_used"]) for r in kv] == [e.bytes_used for e in events if isinstance(e, KVCacheGrew)]
    funnels = json.loads((tmp_path / "funnels.json").read_text())
    assert {r["step"] for r in funnels} == {t.step for t in steps}
    assert sum(r["sampled"] for r in funnels) == len(steps)
    attention = json.loads((tmp_path / "attention.json").read_text())
    layer = window.panels["attention"].layer_spin.value()
    assert attention and all(0 <= r["weight"] <= 1 for r in attention)
    # every query row of the shown layer sums to one over its keys
    sums: dict = {}
    for r in attention:
        key = (r["step"], r["head"], r["query"])
        sums[key] = sums.get(key, 0.0) + r["weight"]
    assert all(abs(s - 1) < 1e-4 for s in sums.values()), layer
    assert not exports.export_data_to(window, "kv", str(tmp_path / "kv.txt"))
    assert "unknown file type" in window.last_error


@pytest.mark.qt_log_ignore("This plugin does not support raise", "This plugin does not support grabbing")
def test_right_click_on_a_panel_offers_the_exports(qtbot, window):
    panel = window.panels["timeline"]
    panel.customContextMenuRequested.emit(QtCore.QPoint(5, 5))
    menu = window._export_context_menu
    assert isinstance(menu, QtWidgets.QMenu) and "Export Timeline" in menu.actions()[0].text()
    menu.close()
