"""Before a lab runs, it says what it will hold in memory on the loaded model's runtime (weights + the KV cache of
its sequences), and a batch whose cache would not fit in the memory available now is refused before it starts, in
one line, with nothing sent to the engine. The llama.cpp figure is held to llama.cpp's own: the KV size its context
logs when a runtime of that many sequences is made."""

from __future__ import annotations

import ctypes

import pytest

from app.panels import batching
from engine.costs import formulas as costs
from engine.costs.memory import size
from engine.protocol import Loaded

PROMPT, NEW = 32, 16


def panel_on(qtbot, bridge, info, tokenizer, cfg, runtime: str, memory: int):
    bridge.replay(Loaded(info, tokenizer, cfg, runtime=runtime))
    panel = batching.PANEL(bridge)
    panel.memory_available = lambda: memory
    qtbot.addWidget(panel)
    panel.show()
    sent = []
    bridge.run_batch_bench = lambda *a: sent.append(a)  # what would go to the engine
    return panel, sent


def test_the_batching_lab_says_its_memory_and_refuses_a_batch_that_does_not_fit(qtbot, bridge, tiny_lm):
    cfg = tiny_lm.cfg
    per_position = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # float32 keys and values, by hand
    kv32 = 32 * (PROMPT + NEW) * per_position
    panel, sent = panel_on(qtbot, bridge, tiny_lm.info, tiny_lm.tokenizer, cfg, "torch", memory=1 << 34)
    panel.prompt_spin.setValue(PROMPT)
    panel.new_spin.setValue(NEW)
    text = panel.memory_note.text()
    assert panel.memory_of(32, PROMPT, NEW).kv_bytes == kv32
    assert f"weights {size(tiny_lm.info.weight_bytes)}" in text and "32 × 48 positions" in text
    assert f"{per_position:,.0f} B in float32" in text and f"KV cache {size(kv32)}" in text
    panel.run((1, 32), PROMPT, NEW)
    assert len(sent) == 1  # 16 GiB: it fits
    panel.running = False

    panel.memory_available = lambda: int(1.5 * kv32)  # half of it is less than batch 32's cache, more than 1's
    panel.run((1, 32), PROMPT, NEW)
    assert len(sent) == 1 and not panel.running  # refused before it starts
    panel.flush()
    line = panel.summary.text()
    assert line.startswith("failed: batch 32 would not fit") and "\n" not in line
    panel.run((1,), PROMPT, NEW)
    assert len(sent) == 2


@pytest.mark.slow
def test_on_llama_cpp_the_figure_is_llama_cpps_own(qtbot, bridge, tiny_dir):
    from engine.runtime.llamacpp import LlamaCppRuntime
    from tests.app.test_llamacpp_panel_figures import llama_cpp_kv, load_logging

    s, _ = load_logging(tiny_dir.gguf, 256)
    try:
        panel, _sent = panel_on(qtbot, bridge, s.info, s.tokenizer, s.cfg, "llama.cpp", memory=1 << 34)
        mem = panel.memory_of(4, PROMPT, NEW)
        L, lines = s.llama, []
        keep = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
            lambda level, text, data: lines.append(text.decode(errors="replace")))
        L.llama_log_set(keep, None)
        try:
            rt = LlamaCppRuntime(s, 4, PROMPT + NEW)
        finally:
            L.llama_log_set(L._lab_log, None)
        rt.close()
        size, cells, _ = llama_cpp_kv(lines)
        assert mem.cells == 4 * cells == 4 * 256  # a stream of 256 cells per sequence (the log counts one stream)
        assert mem.kv_bytes == pytest.approx(size, abs=0.005 * 2**20)
        assert mem.kv_bytes_per_position == costs.kv_bytes_per_token(s.cfg, "float16")
        assert mem.weights_bytes == s.file_bytes
    finally:
        s.close()


def test_the_scheduling_lab_says_its_pools_and_refuses_what_does_not_fit(qtbot, bridge, tiny_lm):
    from app.panels import scheduling

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg, runtime="torch"))
    panel = scheduling.PANEL(bridge)
    panel.memory_available = lambda: 1 << 34
    qtbot.addWidget(panel)
    panel.show()
    sent = []
    panel.sig_run_requested.connect(sent.append)
    cfg, mcfg = panel.config(), tiny_lm.cfg
    page = cfg.page_size
    n_seq = len(cfg.policies()) * cfg.max_batch  # a page pool per policy, each of max_batch requests
    cells = n_seq * -(-cfg.longest() // page) * page
    kv = cells * 2 * mcfg.n_layers * mcfg.n_kv_heads * mcfg.head_dim * 4  # float32, by hand
    panel.flush()
    assert panel.memory_of(cfg).kv_bytes == kv
    assert f"KV cache {size(kv)}" in panel.memory_note.text()
    assert f"{n_seq} × {cfg.longest():,} positions" in panel.memory_note.text()
    panel.memory_available = lambda: int(1.5 * kv)
    panel.run()
    assert not sent and not panel.running and panel.status.startswith(f"failed: {n_seq} sequences would not fit")


def test_the_speculative_lab_says_its_cache_before_a_run(qtbot, bridge, tiny_lm):
    from app.panels import speculative

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg, runtime="torch"))
    panel = speculative.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.show()
    panel.prompt_edit.setPlainText("the cat sat on the mat")
    panel.tokens_spin.setValue(20)
    panel.flush()
    cfg = tiny_lm.cfg
    positions = len(tiny_lm.tokenizer.encode("the cat sat on the mat").ids) + 20
    kv = positions * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    assert panel.memory_of().kv_bytes == kv
    assert f"KV cache {size(kv)} (1 × {positions} positions" in panel.summary.text()
