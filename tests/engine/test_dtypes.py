"""One dtype table (engine.model.dtypes) for bytes, names, peaks and timing; checked against torch's element sizes and
the gguf package's block sizes, and for agreement between every module that reads it."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.costs import formulas as costs
from engine.costs.catalog import Hardware, canonical_dtype
from engine.costs.estimate import DTYPE_CHOICES
from engine.model import dtypes


@pytest.mark.parametrize("name, torch_dtype", [("fp32", torch.float32), ("fp16", torch.float16),
                                               ("bf16", torch.bfloat16), ("int8", torch.int8),
                                               ("fp8", torch.float8_e4m3fn), ("tf32", torch.float32)])
def test_bytes_match_torch(name, torch_dtype):
    assert costs.bytes_per_value(name) == torch.empty(0, dtype=torch_dtype).element_size()


@pytest.mark.parametrize("name, qtype", [("q8_0", gguf.GGMLQuantizationType.Q8_0),
                                         ("q4_1", gguf.GGMLQuantizationType.Q4_1)])
def test_block_formats_match_gguf(name, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert costs.bytes_per_value(name) == size / block


def test_every_spelling_is_known_everywhere():
    hw = Hardware("x", "x", {"fp32": 1e12, "fp16": 2e12, "int8": 4e12}, 1e11, 1e10, "test")
    for spelling in dtypes.ACCEPTED:
        name = canonical_dtype(spelling)
        assert costs.bytes_per_value(spelling) == costs.bytes_per_value(name) > 0
        assert hw.peak_for(spelling) > 0
        assert spelling in DTYPE_CHOICES
    # spellings the catalogue accepted and the cost model refused before the table was one
    for spelling in ("half", "tf32", "float8", "torch.bfloat16", " FP16 "):
        assert costs.bytes_per_value(spelling) == costs.bytes_per_value(canonical_dtype(spelling))


def test_peak_fallbacks_and_measurable():
    hw = Hardware("x", "x", {"fp32": 1e12, "fp16": 2e12, "int8": 4e12}, 1e11, 1e10, "test")
    assert hw.peak_for("bf16") == 2e12  # bf16 → fp16
    assert hw.peak_for("int4") == 4e12  # int4 → int8
    assert hw.peak_for("tf32") == 1e12  # tf32 → fp32
    assert set(dtypes.MEASURABLE) == {"fp32", "tf32", "fp16", "bf16"}


def test_unknown_dtype_has_one_clear_message():
    with pytest.raises(ValueError, match="unknown dtype 'fp5'; valid: float32, fp32"):
        costs.bytes_per_value("fp5")
    with pytest.raises(ValueError, match="unknown dtype"):
        canonical_dtype("fp5")
