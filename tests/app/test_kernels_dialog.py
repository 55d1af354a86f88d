"""Engine → Decode kernels…: the dialog shows what the engine measured on this CPU, read from its cache file."""

from __future__ import annotations

import time

import pytest

from engine.model import kernel_cache
from engine.model.kernel_cache import Entry, Machine


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path))
    return tmp_path / kernel_cache.CACHE_FILE


def _entry(cpu: str, cores: int, shape=(960, 576), seconds=None, weights=kernel_cache.FLOAT) -> Entry:
    return Entry(Machine(cpu, cores, "2.13.0+cpu", "AVX2"), "float32", 2, shape,
                 seconds or {"linear": 80e-6, "split": 40e-6, "onednn": 60e-6}, 30, 5, time.time(), weights)


def test_the_dialog_lists_this_cpus_shapes_with_every_candidate(qtbot, cache):
    from app.kernels_dialog import KernelsDialog

    cpu, cores = kernel_cache.this_cpu()
    kernel_cache.write([_entry(cpu, cores), _entry(cpu, cores, (49152, 576), {"linear": 3e-3, "split": 4e-3}),
                        _entry("Some Other CPU", cores, (64, 64))], cache)
    dlg = KernelsDialog()
    qtbot.addWidget(dlg)
    t = dlg.table
    header = [t.horizontalHeaderItem(j).text() for j in range(t.columnCount())]
    cells = [[t.item(i, j).text() for j in range(t.columnCount())] for i in range(t.rowCount())]
    assert t.rowCount() == 2  # the other CPU's measurement is not this machine's
    assert header[:6] == ["dtype", "threads", "weight (out × in)", "weights", "count", "chosen"]
    first = dict(zip(header, cells[0], strict=True))  # the larger weight first
    assert first["weight (out × in)"] == "49,152 × 576" and first["chosen"] == "linear"
    assert first["onednn"] == "—"  # not measured for that shape
    second = dict(zip(header, cells[1], strict=True))
    assert second["chosen"] == "split" and second["linear"] == "80 µs (2.00×)" and second["split"] == "40 µs (1.00×)"


def test_a_shape_measured_with_q4_blocks_is_its_own_row(qtbot, cache):
    from app.kernels_dialog import KernelsDialog

    cpu, cores = kernel_cache.this_cpu()
    q4 = {"linear": 80e-6, "split": 70e-6, "int4": 50e-6, "int8": 60e-6}
    q4_file = {"linear": 80e-6, "split": 70e-6, "int4": 55e-6}  # file mode: the file's own int4 blocks, no int8
    kernel_cache.write([_entry(cpu, cores), _entry(cpu, cores, seconds=q4, weights=kernel_cache.Q4),
                        _entry(cpu, cores, seconds=q4_file, weights=kernel_cache.Q4_FILE)], cache)
    dlg = KernelsDialog()
    qtbot.addWidget(dlg)
    t = dlg.table
    header = [t.horizontalHeaderItem(j).text() for j in range(t.columnCount())]
    rows = [dict(zip(header, [t.item(i, j).text() for j in range(t.columnCount())], strict=True))
            for i in range(t.rowCount())]
    by_weights = {r["weights"]: r for r in rows}  # the same shape three times, told apart by kernel mode
    fast, file = "float + int4 and int8 forms (fast mode)", "float + the file's int4 blocks (file mode)"
    assert by_weights.keys() == {"float", fast, file}
    assert by_weights[fast]["chosen"] == "int4" and by_weights["float"]["int4"] == "—"
    assert by_weights[file]["int4"] == "55 µs (1.00×)" and by_weights[file]["int8"] == "—"


def test_the_attention_table_lists_each_measured_key_count_with_every_way(qtbot, cache):
    from app.kernels_dialog import KernelsDialog

    cpu, cores = kernel_cache.this_cpu()
    m = Machine(cpu, cores, "2.13.0+cpu", "AVX512")
    entries = [kernel_cache.AttentionEntry(m, "bfloat16", 1, (3, 3, 64), keys, seconds, 5, time.time())
               for keys, seconds in ((8192, {"upcast": 5e-3, "blocked": 3e-3, "sdpa": 2e-3}),
                                     (512, {"upcast": 2e-4, "blocked": 6e-4, "sdpa": 1e-4}))]
    kernel_cache.write(entries, kind=kernel_cache.AttentionEntry)
    dlg = KernelsDialog()
    qtbot.addWidget(dlg)
    t = dlg.attention
    header = [t.horizontalHeaderItem(j).text() for j in range(t.columnCount())]
    rows = [dict(zip(header, [t.item(i, j).text() for j in range(t.columnCount())], strict=True))
            for i in range(t.rowCount())]
    assert [r["keys"] for r in rows] == ["512", "8,192"]
    assert [(r["fastest"], r["with weights shown"]) for r in rows] == [("sdpa", "upcast"), ("sdpa", "blocked")]
    assert rows[1]["upcast"] == "5,000 µs (2.50×)" and rows[1]["heads (KV × G × size)"] == "3 × 3 × 64"


def test_with_nothing_measured_it_says_so(qtbot, cache):
    from app.kernels_dialog import KernelsDialog

    cache.write_text("{ damaged")
    dlg = KernelsDialog()
    qtbot.addWidget(dlg)
    assert dlg.table.rowCount() == 0 and dlg.attention.rowCount() == 0


def test_the_engine_menu_opens_it(make_window, monkeypatch):
    from app import kernels_dialog

    opened = []
    monkeypatch.setattr(kernels_dialog.KernelsDialog, "exec", lambda self: opened.append(self.windowTitle()))
    w = make_window()
    action = next(a for a in w.engine_menu.actions() if a.text() == "Decode &kernels…")
    action.trigger()
    assert opened == ["Decode kernels"]
