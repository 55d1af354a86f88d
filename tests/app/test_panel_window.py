"""Sliding-window models (Gemma 3, Mistral): the attention panel masks the keys outside a local layer's window and
draws its edge; the KV cache panel splits global and local layers. The tiny test model is turned into a windowed
one (window 4, layer 0 local, layer 1 global); the expected cells and bytes are worked out by hand."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.events import AttentionCaptured
from engine.protocol import Loaded


@pytest.fixture
def windowed(bridge, tiny_lm):
    cfg = dataclasses.replace(tiny_lm.cfg, sliding_window=4, layer_types=("local", "global"))
    per_layer = tiny_lm.info.kv_bytes_per_token_global // tiny_lm.cfg.n_layers  # the tiny model's layers are global
    info = dataclasses.replace(tiny_lm.info, sliding_window=4, layer_types=("local", "global"),
                               kv_bytes_per_token_global=per_layer, kv_bytes_per_token_local=per_layer)
    bridge.replay(Loaded(info, tiny_lm.tokenizer, cfg))
    return bridge


def prefill(layer: int, t: int = 7) -> AttentionCaptured:
    w = np.tril(np.ones((4, t, t), dtype=np.float32))  # causal rows (not normalised: only the mask matters here)
    return AttentionCaptured(step=0, phase="prefill", layer=layer, query_start=0, weights=w, group_size=2)


def test_attention_masks_outside_the_window(qtbot, windowed):
    from app.panels import attention

    panel = attention.PANEL(windowed)
    qtbot.addWidget(panel)
    assert (panel.sliding_window(0), panel.sliding_window(1)) == (4, 0)
    windowed.sig_attention.emit(prefill(0))
    windowed.sig_attention.emit(prefill(1))
    panel.layer_spin.setValue(0)
    panel.flush()
    m = panel.matrix()[0]
    # query 6 reads keys 3, 4, 5, 6 (6 − 4 + 1 = 3); keys 0…2 are outside the window, 7+ do not exist
    assert np.isnan(m[6, :3]).all() and not np.isnan(m[6, 3:7]).any()
    assert not np.isnan(m[3, :4]).any()  # query 3 still sees every earlier key (3 − 4 + 1 = 0)
    x, y = panel.window_edge.getData()
    assert list(x) == [0.0, 4.0] and list(y) == [3.0, 7.0]  # from (0, W − 1) to (S − W + 1, S)
    assert "sliding window" in panel.status.text() and "window 4" in panel.kv_label.text()

    panel.layer_spin.setValue(1)  # the global layer: only the causal mask
    panel.flush()
    m = panel.matrix()[0]
    assert not np.isnan(m[6, :7]).any()
    assert panel.window_edge.getData()[0] is None or len(panel.window_edge.getData()[0]) == 0
    assert "1 of its 2 layers are local" in panel.help_text


def test_kv_cache_splits_global_and_local(qtbot, windowed):
    from app.panels import kv_cache

    panel = kv_cache.PANEL(windowed)
    qtbot.addWidget(panel)
    panel.flush()
    # one layer's keys and values per position: 2 · 2 KV heads · 16 · 4 bytes = 256 B. At the full 256-token
    # context the global layer holds 256 · 256 = 65,536 B and the local one 4 · 256 = 1,024 B: 66,560 B in all.
    assert "65.54 kB at full context" in panel.help_text and "stop at 1.02 kB" in panel.help_text
    assert "holds 66.56 kB per sequence" in panel.help_text
    header = [panel.table.horizontalHeaderItem(c).text() for c in range(4)]
    full = header.index("full context\n(256)")
    assert panel.table.item(0, full).text() == "66.56 kB"  # fp32, batch 1
    # without GQA: 4 KV heads, twice the bytes
    assert panel.table.item(0, 3).text() == "133.12 kB"
    assert "1 global layers keep every token and 1 local layers only the last 4" in panel.formula.text()
    (_x0, _x1), (y0, y1) = panel.plot.getPlotItem().getViewBox().viewRange()
    assert (y0, y1) == pytest.approx((0, 66_560))


def test_timeline_help_says_what_a_token_adds_past_the_window(qtbot, windowed):
    from app.panels import timeline

    panel = timeline.PANEL(windowed)
    qtbot.addWidget(panel)
    # 2 · 2 KV heads · 16 · 4 bytes = 256 B per layer and position: 512 B for both layers up to the window of 4,
    # then 256 B (the one global layer) per further token
    assert "plus 512 B of KV cache per token of context up to 4 tokens" in panel.help_text
    assert "each further token adds 256 B (its 1 global layer)" in panel.help_text


def test_kv_cache_says_why_in_use_exceeds_the_formula(qtbot, windowed):
    from app.panels import kv_cache
    from engine.events import KVCacheGrew

    panel = kv_cache.PANEL(windowed)
    qtbot.addWidget(panel)
    # 7 tokens, 256 B per layer and position: the formula holds 7 (global) + 4 (local, the window) = 2,816 B; a
    # local layer that has not rolled over yet still holds all 7 (up to 2 × 4 slots): 3,584 B in use
    windowed.sig_kv.emit(KVCacheGrew(step=0, n_tokens=7, bytes_used=3584, bytes_allocated=4096))
    panel.flush()
    text = panel.formula.text()
    assert "1.79 kB global + 1.02 kB local by the formula" in text and "3.58 kB</b> in use" in text
    assert "more than the formula: a local layer keeps up to 2 × 4 positions" in text
    windowed.sig_kv.emit(KVCacheGrew(step=1, n_tokens=7, bytes_used=2816, bytes_allocated=4096))
    panel.flush()
    assert "more than the formula" not in panel.formula.text()


def test_kv_cache_says_when_the_run_keeps_every_position_of_its_local_layers(qtbot, windowed):
    """A generation's local layers keep every position when that fits the engine's budget (engine.runtime.torch);
    the panel then says so instead of explaining the excess by the ring of 2 × window."""
    from app.panels import kv_cache
    from engine.events import KVCacheGrew

    panel = kv_cache.PANEL(windowed)
    qtbot.addWidget(panel)
    # 12 tokens, 256 B per layer and position, both layers holding all 12 of a 256-position cache: 6,144 B in use
    windowed.sig_kv.emit(KVCacheGrew(step=0, n_tokens=12, bytes_used=6144, bytes_allocated=131072, local_slots=256))
    panel.flush()
    text = panel.formula.text()
    assert "this run's cache keeps every position in them too" in text and "6.14 kB</b> in use" in text
    assert "more than the formula" not in text
    windowed.sig_kv.emit(KVCacheGrew(step=1, n_tokens=12, bytes_used=4096, bytes_allocated=67584, local_slots=8))
    panel.flush()  # a ring of 2 × 4 positions that has rolled: 12 global + 4 local positions
    assert "keeps every position" not in panel.formula.text()
