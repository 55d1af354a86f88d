"""The capacity estimator and the batching lab panels.

Capacity: pure arithmetic from engine.costs.estimate, checked against the seed's worked example (Llama-2-70B, fp16,
H100 SXM: about 138 GB of weights, a TPOT floor of about 41 ms). Batching: a real batched-decode measurement on
the tiny random model through a real Bridge (engine process), waited for on the bridge's GUI-thread signals.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from app.panels import batching, capacity
from engine.costs import formulas as costs
from engine.costs.catalog import Hardware
from engine.labs.batching import BatchRow
from engine.protocol import Loaded, ThisMachine

PANEL_SIZE = (700, 450)


def number(text: str) -> float:
    """The first number in a label, e.g. '138.0 GB  (fp16)' -> 138.0, '2,171 tok/s' -> 2171."""
    m = re.search(r"[-+]?\d[\d,]*(?:\.\d+)?", text)
    assert m, f"no number in {text!r}"
    return float(m.group().replace(",", ""))


def show(qtbot, panel):
    qtbot.addWidget(panel)
    panel.resize(*PANEL_SIZE)
    panel.show()
    panel.flush()
    return panel


def test_panel_contract():
    for cls in (capacity.PANEL, batching.PANEL):
        assert cls.title and cls.help_text and cls.shortcut and cls.object_name.startswith("panel_")
        assert "<b>" not in cls.help_text
    assert capacity.PANEL.object_name != batching.PANEL.object_name


# ---- capacity ----------------------------------------------------------------------------------------------------
@pytest.fixture
def cap(qtbot, bridge):
    return show(qtbot, capacity.PANEL(bridge))


def test_seed_example_numbers_in_widgets(qtbot, cap):
    cap.select(model="llama-3-8b", hardware="l4", dtype="int8", context=1024, batch=4)
    cap.flush()
    assert number(cap.values["weights"].text()) < 100
    qtbot.mouseClick(cap.seed_button, capacity.QtCore.Qt.MouseButton.LeftButton)
    cap.flush()
    assert cap.model_combo.currentData() == "llama-2-70b" and cap.hw_combo.currentData() == "h100-sxm"
    assert cap.dtype() == "fp16" and cap.context_spin.value() == 4096 and cap.batch_spin.value() == 1
    weights = cap.values["weights"].text()
    assert "GB" in weights and 138 <= number(weights) <= 140
    tpot = cap.values["tpot_floor"].text()
    assert "ms" in tpot and 41 <= number(tpot) <= 43
    assert 23 <= number(cap.values["per_stream"].text()) <= 25
    assert "memory-bound" in cap.values["intensity"].text()
    assert 0.9 <= number(cap.values["intensity"].text()) <= 1.2  # about 1 FLOP/byte, as the seed says
    assert "Does not fit" in cap.fits_label.text()  # 139 GB on one 80 GB H100
    assert cap.values["ttft"].text().endswith("compute-bound)")


def test_batch_changes_system_tokens(cap):
    cap.select(model="llama-3-8b", batch=1)
    cap.flush()
    one = number(cap.values["system"].text())
    cap.batch_spin.setValue(16)
    cap.flush()
    sixteen = number(cap.values["system"].text())
    assert sixteen > 8 * one  # memory-bound: 16 streams share each weight read
    r = cap.result
    assert r["batch"] == 16 and r["tokens_per_s_system"] == pytest.approx(16 * r["tokens_per_s_per_stream"])
    # xData/yData: the values as given (getData() returns them log10-transformed on log axes)
    x, y = cap.current_system.xData, cap.current_system.yData
    assert list(x) == [16] and y[0] == pytest.approx(r["tokens_per_s_system"])
    bx = cap.system_curve.xData
    assert bx[0] == 1 and bx[-1] == capacity.SWEEP_MAX_BATCH


def test_prompt_is_clamped_to_context(cap):
    cap.select(prompt=2000, context=512)
    assert cap.prompt_spin.value() == 512 and cap.result is not None and cap.result["prompt_tokens"] == 512


def test_loaded_model_entry(cap, bridge, tiny_lm):
    assert cap.model_combo.findData(capacity.LOADED) < 0
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))  # emits sig_model_loaded
    i = cap.model_combo.findData(capacity.LOADED)
    assert i >= 0 and tiny_lm.cfg.name in cap.model_combo.itemText(i)
    cap.select(model=capacity.LOADED, dtype="fp32", context=128, batch=2)
    cap.flush()
    assert cap.result["n_params"] == costs.n_params(tiny_lm.cfg)
    assert cap.result["kv_bytes_per_token"] == costs.kv_bytes_per_token(tiny_lm.cfg, "fp32")


def test_this_machine_only_when_cached(qtbot, bridge):
    panel = show(qtbot, capacity.PANEL(bridge))
    with qtbot.waitSignal(bridge.sig_this_machine, timeout=30_000):  # the engine's answer (private cache: none)
        pass
    assert panel.hw_combo.findData(capacity.THIS_MACHINE) < 0
    hw = Hardware("this-machine", "This machine (test)", {"fp32": 1e11}, 2e10, 8e9, "test", measured=True)
    bridge.replay(ThisMachine("cpu", panel.dtype(), hw))  # as the engine answers once measured
    panel.select(hardware=capacity.THIS_MACHINE, model="smollm2-135m", dtype="fp32", context=1024)
    r = panel.result
    assert r["hardware_measured"] and r["ridge_point"] == pytest.approx(5.0)


# ---- batching ----------------------------------------------------------------------------------------------------
def row(b: int, tpot_s: float) -> BatchRow:
    return BatchRow(b, 40, tpot_s, 1 / tpot_s, b / tpot_s, 2e8 * b, 4e8, 0.5 * b, 2e8 * b / tpot_s, 4e8 / tpot_s, 1e6)


def test_summary_sentence():
    text = batching.summarize([row(16, 0.0128), row(1, 0.010)])
    assert "×12.5 from B=1 to B=16" in text and "per-stream speed fell by 22%" in text
    assert "peaks" not in text
    text = batching.summarize([row(1, 0.01), row(2, 0.012), row(4, 0.05)], roofs=(1e11, 2e10))
    assert "peaks at B=2" in text and "of the roof" in text
    assert batching.summarize([]) == ""


@pytest.fixture
def loaded_bridge(qtbot, bridge, tiny_dir):
    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=30_000):
        bridge.load_model(str(tiny_dir.gguf), "cpu", "float32")
    return bridge


def test_buttons_wait_for_the_model(qtbot, bridge, tiny_dir):
    panel = show(qtbot, batching.PANEL(bridge))
    assert not panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()
    panel.run()  # ignored without a model
    assert not panel.running
    with qtbot.waitSignal(bridge.sig_model_loaded, timeout=30_000):
        bridge.load_model(str(tiny_dir.gguf), "cpu", "float32")
    assert panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()


def test_batching_run_on_tiny_model(qtbot, loaded_bridge, tmp_path):
    bridge = loaded_bridge
    panel = show(qtbot, batching.PANEL(bridge))
    with qtbot.waitSignal(bridge.sig_batch_done, timeout=60_000) as done:
        panel.run((1, 2, 4), prompt_tokens=8, new_tokens=5)
        assert panel.running and not panel.run_button.isEnabled() and panel.cancel_button.isEnabled()
    assert done.args[0].outcome == "done" and panel.outcome == "done"
    panel.flush()
    assert not panel.running and panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()
    assert [r.batch for r in panel.rows] == [1, 2, 4]
    for r in panel.rows:
        assert r.tokens_per_s_system == pytest.approx(r.batch * r.tokens_per_s_per_stream)
    x, y = panel.tl_curve.getData()
    assert len(x) == 3
    np.testing.assert_allclose(x, [r.tpot_s * 1e3 for r in panel.rows])
    np.testing.assert_allclose(y, [r.tokens_per_s_system for r in panel.rows])
    bx, stream = panel.stream_curve.xData, panel.stream_curve.yData
    system = panel.system_curve.yData
    np.testing.assert_allclose(system, np.asarray(bx) * np.asarray(stream))
    assert [label.toPlainText() for label in panel._labels["tl"]] == ["B=1", "B=2", "B=4"]
    assert panel.table.rowCount() == 3 and panel.table.item(2, 0).text() == "4"
    assert "from B=1 to B=4" in panel.summary.text()
    assert panel.progress.value() == 1000

    # Measured points always; analytic ones (on the roof, same intensity) only with roofs chosen.
    mx = panel.measured_points.xData
    assert len(mx) == 3
    panel.select_roofs("h100-sxm")
    panel.flush()
    ax, ay = panel.analytic_points.xData, panel.analytic_points.yData
    np.testing.assert_allclose(ax, mx)
    hw = panel.presets["h100-sxm"]
    want = [costs.attainable_flops(i, hw.peak_for("fp32"), hw.bandwidth_bytes_per_s) for i in mx]
    np.testing.assert_allclose(ay, want)
    assert all("%" in label.toPlainText() for label in panel._labels["roof"][:3])
    assert "of the roof" in panel.summary.text()
    path = tmp_path / "batching.png"
    assert panel.grab().save(str(path))


def test_cancel_before_the_run_starts(qtbot, loaded_bridge):
    """A cancel sent before the engine picks the run up still stops it."""
    bridge = loaded_bridge
    panel = show(qtbot, batching.PANEL(bridge))
    batches = (4,) * 40
    with qtbot.waitSignal(bridge.sig_batch_done, timeout=60_000) as done:
        panel.run(batches, prompt_tokens=8, new_tokens=200)
        panel.cancel()
    assert done.args[0].outcome == "cancelled" and panel.outcome == "cancelled"
    panel.flush()
    assert panel.status.startswith("cancelled") and len(panel.rows) < len(batches)
    assert panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()


def test_cancel_mid_run(qtbot, loaded_bridge):
    bridge = loaded_bridge
    panel = show(qtbot, batching.PANEL(bridge))
    batches = (4,) * 40
    with qtbot.waitSignal(bridge.sig_batch_row, timeout=60_000):
        panel.run(batches, prompt_tokens=8, new_tokens=200)
    with qtbot.waitSignal(bridge.sig_batch_done, timeout=60_000) as done:
        qtbot.mouseClick(panel.cancel_button, batching.QtCore.Qt.MouseButton.LeftButton)
    assert done.args[0].outcome == "cancelled"
    assert 1 <= len(panel.rows) < len(batches)


def test_capacity_renders(qtbot, cap, tmp_path):
    from PySide6 import QtGui

    cap.flush()
    path = tmp_path / "capacity.png"
    assert cap.grab().save(str(path))
    img = QtGui.QImage(str(path))
    colours = {img.pixel(x, y) for x in range(0, img.width(), 7) for y in range(0, img.height(), 7)}
    assert len(colours) > 20
