"""One policy for "this machine" (engine.costs.hardware.this_machine), which the roofline, capacity and batching panels
all follow: the dtype's own measurement when it can be timed, else the float32 one, else nothing; never measures."""

from __future__ import annotations

import pytest

from engine.costs import hardware
from engine.costs.catalog import Hardware


def hw(name: str, peak: float) -> Hardware:
    return Hardware(name, name, {"fp32": peak}, 1e10, 8e9, "test", measured=True)


@pytest.fixture
def no_measuring(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("measured")

    monkeypatch.setattr(hardware, "measure_this_machine", fail)


def test_policy(tmp_path, no_measuring):
    assert hardware.this_machine("cpu", "fp16", tmp_path) is None  # nothing cached: None, not a measurement
    fp32, bf16 = hw("fp32-run", 1e11), hw("bf16-run", 3e11)
    hardware.store_cached(fp32, "cpu", "float32", tmp_path)
    hardware.store_cached(bf16, "cpu", "bfloat16", tmp_path)
    assert hardware.this_machine("cpu", "bf16", tmp_path) == bf16  # its own measurement
    assert hardware.this_machine("cpu", "bfloat16", tmp_path) == bf16
    assert hardware.this_machine("cpu", "fp16", tmp_path) == fp32  # timeable but not measured: float32's
    assert hardware.this_machine("cpu", "int8", tmp_path) == fp32  # cannot be timed: float32's
    assert hardware.this_machine("cpu", "fp32", tmp_path) == fp32


def test_only_a_bf16_measurement(tmp_path, no_measuring):
    bf16 = hw("bf16-run", 3e11)
    hardware.store_cached(bf16, "cpu", "bf16", tmp_path)
    assert hardware.this_machine("cpu", "fp32", tmp_path) is None
    assert hardware.this_machine("cpu", "int8", tmp_path) is None
    assert hardware.this_machine("cpu", "bf16", tmp_path) == bf16
