"""The prompt, preview and generation panels on the tiny random model (and the real tokenizer where it matters)."""

from __future__ import annotations

import pytest
from PySide6 import QtCore

from app import theme
from app.panels.prompt import PromptPanel, token_tooltip
from app.token_view import SPECIAL_KIND
from tests.app.conftest import wait_loaded


def finish_generation(qtbot, w, start, timeout=30_000):
    """Run `start()` and wait for the bridge's sig_finished (GUI thread), then let every panel draw."""
    with qtbot.waitSignal(w.bridge.sig_finished, timeout=timeout) as blocker:
        assert start() is not False
    # The panel turns idle on the engine's state message, which may arrive after sig_finished: a test that starts
    # the next generation at once would otherwise be refused as busy (seen on a loaded machine).
    qtbot.waitUntil(lambda: w.panels["generation"]._state == "idle", timeout=timeout)
    w.tick_panels(flush=True)
    return blocker.args[0]


def block_backgrounds(edit) -> list[tuple[int, int, str]]:
    """(start, length, background) of the highlighter's format ranges in the first block."""
    layout = edit.document().firstBlock().layout()
    return [(r.start, r.length, r.format.background().color().name()) for r in layout.formats()]


# ---- prompt ----------------------------------------------------------------------------------------------------
def test_typing_updates_boundaries_and_counters(qtbot, window):
    prompt = window.panels["prompt"]
    prompt.set_text("")
    qtbot.keyClicks(prompt.editor, "Hello world, hello tokens")
    text = "Hello world, hello tokens"
    assert prompt.text() == text
    expected = window.bridge.tokenizer.encode(text)
    assert prompt.tok.ids == expected.ids
    assert f"{len(expected.ids)} tokens" in prompt.counters.text()
    assert f"{len(text)} characters" in prompt.counters.text()
    assert "4 words" in prompt.counters.text()
    # One coloured range per token, placed on the token's character span, neighbours in different colours.
    ranges = block_backgrounds(prompt.editor)
    assert [(s, n) for s, n, _ in ranges] == [(a, b - a) for a, b in expected.offsets if b > a]
    colours = [c for _, _, c in ranges]
    assert all(a != b for a, b in zip(colours, colours[1:], strict=False))
    assert set(colours) <= {theme.qcolor(c).name() for c in theme.TOKEN_COLORS}

    # Another keystroke re-tokenizes at once.
    qtbot.keyClicks(prompt.editor, "!")
    assert prompt.tok.ids == window.bridge.tokenizer.encode(text + "!").ids


def test_text_changed_signal_feeds_preview_and_generation(qtbot, window):
    prompt = window.panels["prompt"]
    with qtbot.waitSignal(prompt.sig_text_changed) as blocker:
        prompt.set_text("abc def")
    assert blocker.args == ["abc def"]
    assert window.panels["generation"].text() == "abc def"
    assert window.panels["preview"]._text == "abc def"


def test_tooltip_makes_whitespace_visible(window):
    prompt = window.panels["prompt"]
    prompt.set_text("a b\n\tc")
    tip = "\n".join(token_tooltip(prompt.tok, k) for k in range(len(prompt.tok.ids)))
    assert "·" in tip and "↵" in tip and "→" in tip
    assert "bytes 0–" in tip and "chars 0–" in tip and f"id {prompt.tok.ids[0]}" in tip


def test_hover_finds_the_token_under_the_mouse(qtbot, window):
    prompt = window.panels["prompt"]
    prompt.set_text("Hello world")
    editor = prompt.editor
    cursor = editor.textCursor()
    cursor.setPosition(len("Hello wo"))
    rect = editor.cursorRect(cursor)
    ks = editor.tokens_at(QtCore.QPoint(rect.center().x() + 2, rect.center().y()))
    assert len(ks) == 1
    a, b = prompt.tok.offsets[ks[0]]
    assert a <= len("Hello wo") < b


def test_chat_toggle_shows_special_tokens(qtbot, window):
    prompt, gen = window.panels["prompt"], window.panels["generation"]
    prompt.set_chat(False)
    prompt.set_text("Hi there")
    assert not prompt.chat_pane.isVisibleTo(prompt)
    prompt.set_chat(True)
    assert prompt.chat_pane.isVisibleTo(prompt)
    tok = window.bridge.tokenizer
    wrapped = tok.chat_prompt("Hi there")
    assert prompt.chat_view.toPlainText() == wrapped
    assert prompt.chat_tok.ids == tok.encode(wrapped).ids
    assert sum(prompt.chat_tok.special) >= 2
    assert SPECIAL_KIND in prompt.chat_view.highlighter.kinds
    assert "with the chat template" in prompt.counters.text()
    assert gen.chat()  # the toggle is shared with the generation panel
    gen.set_chat(False)
    assert not prompt.chat()


@pytest.mark.slow
def test_real_tokenizer_counts_and_chat_template(qtbot, bridge, real_tokenizer):
    panel = PromptPanel(bridge)
    qtbot.addWidget(panel)
    bridge.tokenizer = real_tokenizer
    text = "Explain what a KV cache is in two sentences.\nThen stop."
    panel.set_text(text)
    assert panel.tok.ids == real_tokenizer.encode(text).ids
    assert f"{len(real_tokenizer.encode(text).ids)} tokens" in panel.counters.text()
    panel.set_chat(True)
    assert "<|im_start|>" in panel.chat_view.toPlainText()
    specials = [p for p, s in zip(panel.chat_tok.pieces, panel.chat_tok.special, strict=True) if s]
    assert "<|im_start|>" in specials and "<|im_end|>" in specials
    # Characters outside the Basic Multilingual Plane take two document positions: spans must still line up.
    panel.set_chat(False)
    panel.set_text("🙂 ok")
    ranges = block_backgrounds(panel.editor)
    assert ranges[-1][0] + ranges[-1][1] == len("🙂 ok".encode("utf-16-le")) // 2


def test_prompt_panel_without_model_counts_characters(qtbot, bridge):
    panel = PromptPanel(bridge)
    qtbot.addWidget(panel)
    panel.set_text("two words")
    assert "9 characters" in panel.counters.text()
    assert "waiting for the model" in panel.counters.text()
    assert panel.tok is None


# ---- preview ---------------------------------------------------------------------------------------------------
def test_preview_shows_candidates_and_prefix_reuse(qtbot, window):
    preview = window.panels["preview"]
    prompt = window.panels["prompt"]
    prompt.set_chat(False)
    prompt.set_text("the cat sat on the")
    # a preview asked for earlier (the restored prompt) may still arrive first: wait for this text's
    qtbot.waitUntil(lambda: preview.result is not None and preview.result.text == "the cat sat on the",
                    timeout=10_000)
    window.tick_panels(flush=True)
    first = preview.result
    assert first is not None and first.text == "the cat sat on the"
    assert first.n_computed + first.n_reused == first.n_tokens
    assert len(preview.bars.opts["width"]) == 10 and preview.bars.opts["width"].sum() > 0
    assert "reused" in preview.info.text()
    prompt.set_text("the cat sat on the mat and")
    qtbot.waitUntil(lambda: preview.result.text == "the cat sat on the mat and", timeout=10_000)
    window.tick_panels(flush=True)
    second = preview.result
    assert second.text == "the cat sat on the mat and"
    assert second.n_reused > 0  # the unchanged prefix came from the KV cache
    assert f"reused {second.n_reused} of {second.n_tokens}" in preview.info.text()


def test_preview_ignores_stale_results(qtbot, window):
    from dataclasses import replace

    preview = window.panels["preview"]
    window.panels["prompt"].set_text("the cat")
    qtbot.waitUntil(lambda: preview.result is not None and preview.result.text == "the cat", timeout=10_000)
    real = preview.result
    preview._last_id = real.request_id + 10
    current = replace(real, request_id=preview._last_id, text="new")
    preview._on_preview(current)
    assert preview.result is current
    preview._on_preview(replace(real, request_id=preview._last_id - 1, text="old"))  # answers an older request
    assert preview.result is current


# ---- generation ------------------------------------------------------------------------------------------------
def setup_generation(window, text="hello world, this is a test", max_new=12, chat=False):
    prompt, gen = window.panels["prompt"], window.panels["generation"]
    prompt.set_chat(chat)
    prompt.set_text(text)
    gen.set_max_new_tokens(max_new)
    gen.ignore_eos = True
    return gen


def test_generate_yields_tokens_and_lights_up_prefill(qtbot, window):
    gen = setup_generation(window, max_new=10)
    assert gen.generate_btn.isEnabled() and not gen.stop_btn.isEnabled()
    fin = finish_generation(qtbot, window, gen.generate)
    assert fin.reason == "length" and len(fin.ids) == 10
    assert [t.step for t in gen.tokens] == list(range(10))
    assert [t.token_id for t in gen.tokens] == fin.ids.tolist()
    out = gen.output.toPlainText()
    assert out.startswith("hello world, this is a test")
    shown = "".join(t.shown for t in gen.tokens)
    # the text view keeps lines as paragraphs: a sampled \r (or U+2028/U+2029) reads back as \n
    assert out.endswith(shown.translate({ord("\r"): "\n", 0x2028: "\n", 0x2029: "\n"}))
    # Prompt tokens are painted in the prefill colours, generated ones after them.
    hl = gen.output.highlighter
    n_prompt = len(gen.prompt.ids)
    assert len(hl.starts) == n_prompt + 10
    assert set(hl.kinds[:n_prompt]) <= {1, 2, 5}  # PREFILL_A, PREFILL_B, SPECIAL
    assert hl.kinds[n_prompt] == 6  # the token the prefill produced
    assert set(hl.kinds[n_prompt + 1:]) <= {3, 4, 5}  # decode shades
    assert "prefill:" in gen.prefill_label.text() and "one forward pass" in gen.prefill_label.text()
    assert "10 tokens generated" in gen.status.text() and "TPOT" in gen.status.text()
    qtbot.waitUntil(lambda: gen.generate_btn.isEnabled(), timeout=5_000)
    assert not {"prompt", "preview", "generation"} & set(window.draw_errors)


def test_generate_request_uses_bridge_params_and_capture(qtbot, window):
    from app.panels.generation import ALL_LAYERS_BELOW, EVERY_LAYER_POSITIONS
    from engine.run.sampling import SamplingParams

    n_layers = window.bridge.info.n_layers
    window.bridge.set_params(SamplingParams(temperature=0.0))
    gen = setup_generation(window, max_new=3)
    finish_generation(qtbot, window, gen.generate)
    req = gen.last_request
    assert req.params.temperature == 0.0 and req.max_new_tokens == 3 and not req.chat
    assert req.capture.funnel_top == 20 and req.capture.logits and req.capture.residual_norms
    # A short prompt: every layer while the run is short, then the layer the attention panel shows.
    assert req.capture.at(0, n_layers).attention_layers == frozenset(range(n_layers))
    assert req.capture.at(EVERY_LAYER_POSITIONS - 1, n_layers).attention_layers == frozenset(range(n_layers))
    assert req.capture.at(EVERY_LAYER_POSITIONS, n_layers).attention_layers == frozenset({n_layers - 1})
    # A long prompt: only the layer the attention panel shows (the last one after loading).
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=5_000)
    setup_generation(window, text="the cat " * ALL_LAYERS_BELOW, max_new=2)
    finish_generation(qtbot, window, gen.generate)
    assert gen.last_request.capture.attention_layers == frozenset({n_layers - 1})
    window.panels["attention"].layer_spin.setValue(0)
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=5_000)
    finish_generation(qtbot, window, gen.generate)
    assert gen.last_request.capture.attention_layers == frozenset({0})


def test_changing_the_attention_layer_mid_generation_captures_it_from_the_next_token(qtbot, window):
    from app.panels.generation import ALL_LAYERS_BELOW

    attention = window.panels["attention"]
    gen = setup_generation(window, text="the cat " * ALL_LAYERS_BELOW, max_new=4)
    attention.layer_spin.setValue(1)
    with qtbot.waitSignal(window.bridge.sig_token, timeout=20_000):
        gen.step()  # prefill, then pause
    qtbot.waitUntil(lambda: gen.state == "paused", timeout=5_000)
    assert gen.last_request.capture.attention_layers == frozenset({1})
    attention.layer_spin.setValue(0)
    window.tick_panels(flush=True)
    assert "captured from the next token on" in attention.status.text()
    with qtbot.waitSignal(window.bridge.sig_token, timeout=10_000):
        gen.step()
    window.tick_panels(flush=True)
    m = attention._matrices[0]
    assert m.first_step == 1
    assert attention.matrix() is not None and "captured from step 1 on" in attention.status.text()
    finish_generation(qtbot, window, gen.stop)


def test_pause_step_resume(qtbot, window):
    gen = setup_generation(window, max_new=6)
    bridge = window.bridge
    with qtbot.waitSignals([bridge.sig_token, bridge.sig_state], timeout=10_000):
        gen.step()  # idle: prefill, then pause
    qtbot.waitUntil(lambda: gen.state == "paused", timeout=5_000)
    assert len(gen.tokens) == 1 and gen.tokens[0].step == 0
    assert gen.pause_btn.text() == "Resume" and gen.step_btn.isEnabled()

    with qtbot.waitSignal(bridge.sig_token, timeout=10_000) as blocker:
        gen.step()
    assert blocker.args[0].step == 1
    # no further token while paused: the engine answers a pause (it is paused already) between two tokens only, so
    # any token it made after step 1 would arrive before this answer (the bridge relays events in order)
    with qtbot.waitSignal(bridge.sig_state, timeout=10_000, check_params_cb=lambda state: state == "paused"):
        bridge.pause()
    assert len(gen.tokens) == 2 and gen.state == "paused"

    fin = finish_generation(qtbot, window, gen.toggle_pause)  # Resume
    assert fin.reason == "length" and len(gen.tokens) == 6
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=5_000)
    assert gen.generate_btn.isEnabled() and not gen.pause_btn.isEnabled()


def test_stop_ends_early(qtbot, window):
    gen = setup_generation(window, max_new=50)
    with qtbot.waitSignal(window.bridge.sig_token, timeout=10_000):
        gen.step()
    qtbot.waitUntil(lambda: gen.state == "paused", timeout=5_000)
    fin = finish_generation(qtbot, window, gen.stop)
    assert fin.reason == "stopped" and len(fin.ids) < 50
    qtbot.waitUntil(lambda: gen.state == "idle", timeout=5_000)
    window.tick_panels(flush=True)
    assert "finished (stopped)" in gen.status.text()


def test_shortcuts_drive_generation(qtbot, window):
    gen = setup_generation(window, max_new=4)
    window.activateWindow()
    with qtbot.waitSignal(window.bridge.sig_finished, timeout=10_000):
        qtbot.keyClick(gen.output, QtCore.Qt.Key.Key_Return, QtCore.Qt.KeyboardModifier.ControlModifier)
    assert len(gen.tokens) == 4


def test_clicking_a_token_selects_its_step(qtbot, window):
    gen = setup_generation(window, text="abc", max_new=5)
    finish_generation(qtbot, window, gen.generate)
    n_prompt = len(gen.prompt.ids)  # token indices of the output view: the prompt first, then the generated
    with qtbot.waitSignal(window.bridge.sig_step_selected) as blocker:
        gen._on_token_clicked(n_prompt + 3)
    assert blocker.args == [3]
    window.tick_panels(flush=True)
    assert len(gen.output.extraSelections()) == 1
    with qtbot.waitSignal(window.bridge.sig_step_selected) as blocker:
        gen._on_token_clicked(0)
    assert blocker.args == [0]


def test_empty_prompt_is_refused_with_a_message(qtbot, window):
    gen = setup_generation(window, text="   ")
    assert gen.generate() is False
    assert "prompt" in gen.status.text().lower()
    assert gen.state == "idle"


def test_closing_mid_generation_stops_the_worker(qtbot, make_window):
    w = make_window()
    wait_loaded(qtbot, w)
    gen = setup_generation(w, max_new=200)
    with qtbot.waitSignal(w.bridge.sig_token, timeout=10_000):
        assert gen.generate()
    w.close()  # while tokens are still coming
    assert not w.bridge.worker_thread.isRunning()


def test_closing_while_paused_stops_the_worker(qtbot, make_window):
    w = make_window()
    wait_loaded(qtbot, w)
    gen = setup_generation(w, max_new=50)
    with qtbot.waitSignal(w.bridge.sig_token, timeout=10_000):
        gen.step()
    qtbot.waitUntil(lambda: gen.state == "paused", timeout=5_000)
    w.close()
    assert not w.bridge.worker_thread.isRunning()
