"""Roofline, Capacity and Batching lab find "this machine" by the same policy (engine.costs.hardware.this_machine).

The engine process answers those look-ups (Bridge.this_machine); here the bridge answers at once by running the
policy in this process over a fake cache, as the engine would over the real one.
"""

from __future__ import annotations

import pytest

from engine.costs.catalog import Hardware, canonical_dtype
from engine.protocol import Loaded

FP32 = Hardware("this-machine", "this machine, fp32 run", {"fp32": 1e11}, 2e10, 8e9, "test", measured=True)
BF16 = Hardware("this-machine", "this machine, bf16 run", {"bf16": 3e11}, 2e10, 8e9, "test", measured=True)
# what the policy must answer, worked out by hand: bf16 was measured, fp16 and int8 fall back to the fp32 run
EXPECTED = {"fp32": FP32, "fp16": FP32, "bf16": BF16, "int8": FP32}


def answer_here(monkeypatch, bridge) -> None:
    """The bridge answers look-ups by the engine's policy, synchronously, in this process."""
    import engine.costs.hardware

    monkeypatch.setattr(bridge, "this_machine", lambda device, dtype: engine.costs.hardware.this_machine(device, dtype))


@pytest.fixture
def cache(monkeypatch, bridge):
    import engine.costs.hardware

    stored = {"fp32": FP32, "bf16": BF16}
    asked = []

    def load_cached(device="cpu", dtype="float32", *_a, **_k):
        asked.append((device, canonical_dtype(dtype)))
        return stored.get(canonical_dtype(dtype)) if device == "cpu" else None

    monkeypatch.setattr(engine.costs.hardware, "load_cached", load_cached)
    answer_here(monkeypatch, bridge)
    return asked


@pytest.fixture
def loaded(bridge, tiny_lm):
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    return bridge


def test_three_panels_one_policy(qtbot, cache, loaded):
    from app.panels import batching, capacity, roofline

    roof = roofline.PANEL(loaded)
    cap = capacity.PANEL(loaded)
    lab = batching.PANEL(loaded)
    for p in (roof, cap, lab):
        qtbot.addWidget(p)
    assert roof.hw_combo.currentData() == roofline.THIS_MACHINE  # a cached measurement: it opens on it
    for dtype, expected in EXPECTED.items():
        roof.dtype_combo.setCurrentText(dtype)
        assert roof.hardware() == expected, dtype
        i = cap.dtype_combo.findData(dtype)
        if i >= 0:
            cap.dtype_combo.setCurrentIndex(i)
            cap.select(hardware=capacity.THIS_MACHINE)
            assert cap.chip() == expected, dtype
            assert cap.result["peak_flops"] == expected.peak_for(dtype)
    assert lab.this_machine == EXPECTED["fp32"]  # the loaded model runs in float32
    lab.select_roofs(batching.THIS_MACHINE)
    assert lab.roofs() == (FP32.peak_for("fp32"), FP32.bandwidth_bytes_per_s)
    assert {device for device, _ in cache} == {"cpu"}  # the loaded model's device


def test_roofline_never_borrows_another_dtypes_run(qtbot, monkeypatch, loaded):
    """Only a bf16 run is cached: fp32 roofs must not come from it (they did: "any measurement" was a fallback)."""
    import engine.costs.hardware
    from app.panels import roofline

    monkeypatch.setattr(engine.costs.hardware, "load_cached",
                        lambda device="cpu", dtype="float32", *_a, **_k: BF16 if canonical_dtype(dtype) == "bf16"
                        else None)
    answer_here(monkeypatch, loaded)
    roof = roofline.PANEL(loaded)
    qtbot.addWidget(roof)
    roof.select_hardware(roofline.THIS_MACHINE)
    roof.dtype_combo.setCurrentText("bf16")
    assert roof.hardware() == BF16
    roof.dtype_combo.setCurrentText("fp32")
    assert roof.hardware() is None
