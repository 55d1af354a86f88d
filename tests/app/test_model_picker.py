"""File → Open model from list…: the table of discovered models and the fits-in-memory decision."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6 import QtWidgets

from app.model_picker import ModelPicker, decide
from engine.formats.discover import ModelEntry, read_model_facts

GIB = 2**30


def _entry(name: str, n_params: int, error: str | None = None) -> ModelEntry:
    e = ModelEntry(name=name, path=f"/models/{name}.gguf", source="lmstudio", format="gguf", file_bytes=n_params,
                   architecture="llama", n_params=n_params, quant_types={"Q4_K": 3}, error=error)
    e.weight_bytes = {"float32": 4 * n_params, "bfloat16": 2 * n_params, "float16": 2 * n_params}
    e.fits = {dtype: need <= GIB for dtype, need in e.weight_bytes.items()}  # as discover() would with 1 GiB free
    return e


def test_decide_loads_offers_bfloat16_or_refuses_with_numbers() -> None:
    small, mid, huge = _entry("small", GIB // 8), _entry("mid", GIB // 2), _entry("huge", 4 * GIB)
    assert decide(small, "float32", GIB).action == "load"
    d = decide(mid, "float32", GIB)  # 2 GiB at float32, 1 GiB in bfloat16
    assert d.action == "ask" and d.dtype == "bfloat16"
    assert "2.00 GiB at float32" in d.message and "(1.00 GiB)" in d.message
    d = decide(huge, "float32", GIB)
    assert d.action == "refuse" and "16.00 GiB at float32" in d.message and "1.00 GiB of memory" in d.message
    assert decide(mid, "bfloat16", GIB).action == "load"
    assert decide(_entry("bad", 1, error="ValueError: cut short"), "float32", GIB).action == "refuse"
    big = _entry("8b", 7 * GIB)  # a GGUF that auto runs on llama.cpp: the file plus its KV cache, at any dtype
    big.runtime, big.weight_bytes = "llama.cpp", dict.fromkeys(big.weight_bytes, 5 * GIB)
    d = decide(big, "float32", 4 * GIB)
    assert d.action == "refuse" and "on llama.cpp it needs 5.00 GiB" in d.message and "bfloat16" not in d.message
    assert decide(big, "float32", 6 * GIB).action == "load"


def test_picker_lists_and_opens(qtbot, tiny_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    real = read_model_facts(tiny_dir.gguf, "tiny", "recent", memory=GIB)
    entries = [real, _entry("mid", GIB // 2)]
    picker = ModelPicker(dtype="float32", find=lambda: entries, memory=GIB)
    qtbot.addWidget(picker)
    assert picker.table.rowCount() == 2
    assert picker.table.item(0, 0).text() == "tiny" and picker.table.item(0, 2).text() == "llama"
    assert picker.table.item(0, 6).text() == "yes" and picker.table.item(1, 6).text().startswith("no (2.00 GiB")
    picker.table.selectRow(0)
    picker._open()
    assert picker.chosen == (str(Path(tiny_dir.gguf)), "float32")

    picker = ModelPicker(dtype="float32", find=lambda: entries, memory=GIB)
    qtbot.addWidget(picker)
    monkeypatch.setattr(QtWidgets.QMessageBox, "question",
                        staticmethod(lambda *a, **k: QtWidgets.QMessageBox.StandardButton.Yes))
    picker.table.selectRow(1)
    picker._open()
    assert picker.chosen == ("/models/mid.gguf", "bfloat16")


def test_picker_says_weights_and_kv_cache_for_each_runtime(qtbot, tiny_dir) -> None:
    from engine.costs.memory import size
    from tests.tiny_model import CFG

    head_dim = CFG["d_model"] // CFG["n_heads"]
    per_value = 2 * CFG["n_layers"] * CFG["n_kv_heads"] * head_dim  # keys and values of one position, all layers
    context = min(CFG["context_length"], 4096)
    torch_entry = read_model_facts(tiny_dir.gguf, "tiny", "recent", memory=GIB)
    lcpp = read_model_facts(tiny_dir.gguf, "tiny-on-llama.cpp", "recent", memory=GIB)
    lcpp.runtime = "llama.cpp"  # as auto would send a large file: the file plus its float16 cache
    kv = per_value * 2 * context
    lcpp.weight_bytes = {"float32": lcpp.file_bytes + kv}
    picker = ModelPicker(dtype="float32", find=lambda: [torch_entry, lcpp], memory=GIB)
    qtbot.addWidget(picker)
    col = picker.table.columnCount() - 1
    torch_text, lcpp_text = picker.table.item(0, col).text(), picker.table.item(1, col).text()
    assert torch_text == (f"torch: weights {size(torch_entry.weight_bytes['float32'])} at float32 + KV cache "
                          f"{size(per_value * 4)} a position ({size(per_value * 4 * context)} at {context:,})")
    assert lcpp_text == (f"llama.cpp: file {size(lcpp.file_bytes)} + KV cache {size(kv)} (float16, {context:,} "
                         f"positions) = {size(lcpp.file_bytes + kv)}")
