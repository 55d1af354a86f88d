"""Help texts speak of the loaded model, in its own numbers.

The tiny test model (tests/tiny_model.py) is loaded into a bare bridge; every expected figure below is worked out
by hand from its config (2 layers, d_model 64, 4 query heads of width 16, 2 KV heads, FFN 96, vocabulary 300,
context 256, untied embeddings, float32), not by calling engine.costs.formulas or the panels.
"""

from __future__ import annotations

import importlib

import pytest
from PySide6 import QtWidgets

from engine.protocol import Loaded

PANELS = ("sampling", "attention", "kv_cache", "timeline", "roofline", "capacity", "batching")
SMOLLM2_FIGURES = ("SmolLM", "49,152", "46,080", "538 MB", "30 layers", "9 query heads", "d_head = 64")


@pytest.fixture
def loaded(bridge, tiny_lm):
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    return bridge


def make(qtbot, name, bridge):
    panel = importlib.import_module(f"app.panels.{name}").PANEL(bridge)
    qtbot.addWidget(panel)
    return panel


def test_tiny_config_is_what_the_hand_figures_assume(tiny_lm):
    c = tiny_lm.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size,
            c.context_length, c.tied_embeddings, tiny_lm.info.dtype) == (2, 64, 4, 2, 16, 96, 300, 256, False,
                                                                         "float32")


@pytest.mark.parametrize("name", PANELS)
def test_no_help_text_names_another_models_figures(qtbot, loaded, name):
    text = make(qtbot, name, loaded).help_text
    for figure in SMOLLM2_FIGURES:
        assert figure not in text, (name, figure)


def test_help_texts_use_the_loaded_models_numbers(qtbot, loaded):
    name = loaded.info.name
    # KV bytes per token: 2 (K, V) · 2 layers · 2 KV heads · 16 · 4 bytes = 512; the full 256-token context
    # holds 131,072 bytes. Parameters: per layer wq 64·64 + wk, wv 32·64 each + wo 64·64 = 12,288, MLP 3·96·64
    # = 18,432, two norms 128 → 30,848; × 2 layers + embedding 300·64 + final norm 64 + LM head 300·64 = 100,160
    # parameters = 400,640 bytes; 131,072 / 400,640 = 33 %.
    kv = make(qtbot, "kv_cache", loaded).help_text
    assert f"For {name} in float32: 2 · 2 · 2 · 16 · 4 = 512 bytes" in kv
    assert "256-token context holds 131.07 kB" in kv
    assert "33% of the 400.64 kB its weights take" in kv
    assert "4 query heads" in kv and "2× as many bytes" in kv

    # Vocabulary 300: log2(300) = 8.23 bits.
    sampling = make(qtbot, "sampling", loaded).help_text
    assert "scores 300 tokens" in sampling and "log2(300) ≈ 8.2 bits" in sampling

    # d_head 16 → scores divided by √16 = 4; 4 query heads over 2 KV heads: groups of 2.
    attention = make(qtbot, "attention", loaded).help_text
    assert "2 layers and d_head = 16" in attention and "√16 ≈ 4" in attention
    assert "4 query heads but only 2 key/value heads" in attention
    assert "h // 2, so heads 0–1, 2–3 share" in attention and "2× smaller than with 4 KV heads" in attention

    # One decode step reads every matrix once plus one embedding row (the table is untied, so its other rows
    # stay put): 100,160 − 19,200 + 64 = 81,024 parameters = 324,096 bytes ≈ 324.1 kB.
    timeline = make(qtbot, "timeline", loaded).help_text
    assert "streams about 324.1 kB of weights" in timeline and "plus 512 B of KV cache per token" in timeline

    # Decode FLOPs at context 1: 2 · 2 layers · 30,720 matrix weights = 122,880, + the LM head 2 · 300 · 64 =
    # 38,400, + attention 2·2 · 2 layers · 4 heads · 16 · 1 key = 512 → 161,792 FLOP ≈ 162 kFLOP; over about
    # 325 kB that is I ≈ 0.5 FLOP/byte.
    roofline = make(qtbot, "roofline", loaded).help_text
    assert "about 162 kFLOP over 32" in roofline and "I ≈ 0.5 FLOP/byte" in roofline


def test_help_follows_the_model_and_reaches_the_dock(qtbot, bridge, tiny_lm):
    panel = make(qtbot, "kv_cache", bridge)
    dock = QtWidgets.QDockWidget("KV cache")
    qtbot.addWidget(dock)
    dock.setWidget(panel)
    general = type(panel).help_text
    assert panel.help_text == general  # nothing loaded: no model's numbers at all
    assert "512 bytes" not in general
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    assert panel.help_text.startswith(general) and "512 bytes" in panel.help_text
    assert dock.whatsThis() == panel.help_text


def test_attention_help_states_a_models_own_scale(qtbot, bridge, tiny_lm):
    import dataclasses

    cfg = dataclasses.replace(tiny_lm.cfg, attn_scale=0.1)  # as Gemma's query_pre_attn_scalar sets it
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, cfg))
    text = make(qtbot, "attention", bridge).help_text
    assert "scales its scores by 0.1 instead of 1/√16" in text and "divided by √16" not in text
