"""A model that cannot chat (no chat template, no ChatML tokens: Gemma 3 270M base) disables both Chat toggles with
the reason as tooltip; a model with a template gets them back as the user left them."""

from __future__ import annotations

from engine.protocol import Loaded
from engine.tokenizer import Tokenizer
from tests.tiny_tokenizer import tiny_vocab


def base_tokenizer() -> Tokenizer:
    tokens, merges, types = tiny_vocab(300)
    keep = [i for i, t in enumerate(tokens) if t not in ("<|im_start|>", "<|im_end|>")]
    return Tokenizer.from_vocab([tokens[i] for i in keep], merges, [types[i] for i in keep])


def test_chat_toggles_follow_the_model(qtbot, bridge, tiny_lm):
    from app.panels import generation, prompt

    panels = [prompt.PANEL(bridge), generation.PANEL(bridge)]
    for p in panels:
        qtbot.addWidget(p)
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    for p in panels:
        p.set_chat(True)
        assert p.chat_box.isEnabled() and p.chat()
    prompt_panel = panels[0]
    prompt_panel.set_text("hello there")
    assert prompt_panel.chat_pane.isVisibleTo(prompt_panel)  # the ChatML-wrapped prompt, shown and counted
    assert "<|im_start|>user\nhello there" in prompt_panel.chat_view.toPlainText()
    assert "with the chat template" in prompt_panel.counters.text()

    base = base_tokenizer()
    assert base.chat_unavailable is not None
    bridge.replay(Loaded(tiny_lm.info, base, tiny_lm.cfg))
    for p in panels:
        assert not p.chat_box.isEnabled() and not p.chat()
        assert "no chat template" in p.chat_box.toolTip()
        p.set_chat(True)  # settings or --chat cannot turn it on
        assert not p.chat()
    # what the user sees of the template now: nothing (the pane is hidden and the counters leave it out)
    assert not prompt_panel.chat_pane.isVisibleTo(prompt_panel)
    counters = prompt_panel.counters.text()
    assert "chat template" not in counters and f"<b>{len(base.encode('hello there').ids)} tokens</b>" in counters

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))  # a model with a template again
    for p in panels:
        assert p.chat_box.isEnabled() and p.chat() and "no chat template" not in p.chat_box.toolTip()
