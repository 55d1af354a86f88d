"""A step of the live run whose attention and lens the app let go (or never captured) is recomputed by the real engine
process from its KV cache when selected, and drawn by the Attention and Logit lens panels; the weights are held to
the independent float64 reference (tests/tiny_model.py). A run opened from a session has no cache: its note stays."""

from __future__ import annotations

import numpy as np

from app import run_store
from tests.app.conftest import wait_loaded
from tests.tiny_model import reference_logits


def generate(qtbot, w, text: str, max_new: int):
    """A run of `text` once its next-token preview has come (a preview deferred until after the run would take the
    KV cache over: engine.run.session's prefix caching keeps the prompt's positions only)."""
    prompt, gen = w.panels["prompt"], w.panels["generation"]
    prompt.set_chat(False)
    prompt.set_text(text)
    with qtbot.waitSignal(w.bridge.sig_preview, timeout=30_000):
        w.panels["preview"].request_now()
    gen.set_max_new_tokens(max_new)
    gen.ignore_eos = True
    with qtbot.waitSignal(w.bridge.sig_finished, timeout=60_000) as blocker:
        assert gen.generate() is not False
    qtbot.waitUntil(lambda: gen._state == "idle", timeout=30_000)
    w.tick_panels(flush=True)
    return blocker.args[0]


def test_a_dropped_step_of_the_live_run_is_recomputed_and_drawn(qtbot, make_window, tiny_dir, monkeypatch):
    from app.panels import attention

    monkeypatch.setattr(run_store, "ATTENTION_BYTES", 64 << 10)  # small budgets, so a short run drops steps
    monkeypatch.setattr(attention, "MATRIX_BYTES", 32 << 10)
    w = make_window()
    wait_loaded(qtbot, w)
    att, lens = w.panels["attention"], w.panels["lens"]
    fin = generate(qtbot, w, "hello world, this is a test", 90)
    store = run_store.store_for(w.bridge)
    run = store.shown_run()
    assert run.dropped is not None
    step = (run.dropped[0] + run.dropped[1]) // 2
    assert not att.row_held(step) and step not in lens.lens  # neither panel holds it (the lens was never captured)
    w.bridge.select_step(step)
    w.tick_panels(flush=True)
    assert "recomputing" in att.status.text() and "recomputing" in lens.header.text()
    qtbot.waitUntil(lambda: att.recomputed_row() is not None and step in lens.recomputed, timeout=30_000)
    w.tick_panels(flush=True)

    ids = [int(i) for i in fin.prompt_ids] + [int(i) for i in fin.ids]
    ref: dict = {}
    logits = reference_logits(tiny_dir.hf_weights, ids[:-1], attention=ref)
    p = len(fin.prompt_ids) + step - 1  # the step's query position
    ev = att.recomputed_row()
    assert (ev.step, ev.layer, ev.query_start, ev.weights.shape[2]) == (step, att.layer(), p, p + 1)
    np.testing.assert_allclose(ev.weights[:, 0], ref[att.layer()][:, p, :p + 1].numpy(), atol=2e-5, rtol=0)
    drawn = np.sqrt(np.clip(ev.weights[att.head(), 0], 0, None))  # the panel's √ scale
    np.testing.assert_allclose(att.image.image, drawn[None, :], rtol=1e-6)
    assert "recomputed from the KV cache" in att.status.text()
    got = lens.recomputed[step]
    assert got.position == p and got.token_id == ids[p + 1]
    assert got.ids[-1, 0] == int(logits[p].argmax())  # the model's output row: its most probable next token
    assert "recomputed from the KV cache" in lens.header.text()

    # a switch to a layer below: the engine kept every layer its pass ran, so it answers without running the model
    assert att.layer() == 1
    answers = []
    w.bridge.sig_recomputed.connect(answers.append)
    att.layer_spin.setValue(0)
    qtbot.waitUntil(lambda: att.recomputed_row() is not None, timeout=30_000)
    assert [(m.reused, [e.layer for e in m.attention]) for m in answers] == [(True, [0])]
    np.testing.assert_allclose(att.recomputed_row().weights[:, 0], ref[0][:, p, :p + 1].numpy(), atol=2e-5)
    w.tick_panels(flush=True)
    assert "recomputed from the KV cache" in att.status.text()

    # a preview of another text takes the cache over: the next step asked for is refused in one sentence
    with qtbot.waitSignal(w.bridge.sig_preview, timeout=30_000):
        w.bridge.preview("something else entirely", False)
    w.bridge.select_step(step + 1)
    qtbot.waitUntil(lambda: not att._asked and not lens._asked, timeout=30_000)  # both panels asked; both answered
    w.tick_panels(flush=True)
    assert att.recomputed_row() is None
    assert "cannot be recomputed: the engine's KV cache no longer holds this run" in att.status.text()
    assert "KV cache no longer holds this run" in lens.header.text()  # (rich text: its apostrophe is escaped)

    # the same run opened from a session: no engine cache behind it, nothing is asked, the note stays
    store.load(store.records())
    again = store.shown_run()
    assert store.recording is None and again.dropped == run.dropped
    att._recomputed.clear()
    lens.recomputed.clear()
    w.bridge.select_step(step - 1)
    w.tick_panels(flush=True)
    assert not att._asked and not lens._asked
    assert att.recomputed_row() is None and again.attention_note() in att.status.text()
