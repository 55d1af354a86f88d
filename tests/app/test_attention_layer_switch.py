"""A layer switch late in a long run (issue 26): the Attention panel rebuilds the new layer from the run store's
captures, newest first and only as far back as its matrix holds, so the work does not grow with the run; what it
shows is what it would have shown had that layer been on screen from the start."""

from __future__ import annotations

import numpy as np
import pytest

from app.run_store import RunStore
from engine.events import AttentionCaptured, PromptTokenized, RunSource, RunStarted
from engine.protocol import Loaded

N_PROMPT = 8


class CountingList(list):
    """A run's event list that counts the events read from it, by index or by walking it."""

    read = 0

    def __getitem__(self, i):
        item = super().__getitem__(i)
        self.read += len(item) if isinstance(i, slice) else 1
        return item

    def __iter__(self):
        for item in super().__iter__():
            self.read += 1
            yield item


def random_run(n_steps: int, layers: int, heads: int, from_step: dict[int, int] | None = None, seed: int = 0):
    """A run's events as the engine sends them, every layer captured (or layer l from step from_step[l] on): the
    prefill's causal block, then one row per layer and decode step; each row a random distribution over its keys."""
    rng = np.random.default_rng(seed)
    from_step = from_step or {}
    yield RunStarted(source=RunSource(kind="local", name="synthetic"))
    yield PromptTokenized(text="p" * N_PROMPT, ids=np.arange(N_PROMPT), pieces=("p",) * N_PROMPT,
                          offsets=np.zeros((N_PROMPT, 2), np.int64), byte_offsets=np.zeros((N_PROMPT, 2), np.int64),
                          special=np.zeros(N_PROMPT, bool))
    for step in range(n_steps):
        for layer in range(layers):
            if step < from_step.get(layer, 0):
                continue
            if step == 0:
                w = np.tril(rng.random((heads, N_PROMPT, N_PROMPT), dtype=np.float32))
                yield AttentionCaptured(step=0, phase="prefill", layer=layer, query_start=0,
                                        weights=w / w.sum(-1, keepdims=True), group_size=2)
            else:
                pos = N_PROMPT + step - 1
                w = rng.random((heads, 1, pos + 1), dtype=np.float32)
                yield AttentionCaptured(step=step, phase="decode", layer=layer, query_start=pos,
                                        weights=w / w.sum(-1, keepdims=True), group_size=2)


def panel_on(bridge, layer: int, qtbot):
    from app.panels import attention

    panel = attention.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(700, 450)
    panel.show()
    panel.layer_spin.setValue(layer)
    return panel


@pytest.mark.parametrize("n_steps", [300, 900])
def test_a_layer_switch_reads_what_the_matrix_holds_not_the_run(qtbot, bridge, tiny_lm, monkeypatch, n_steps):
    from app.panels import attention

    rows_held = 48
    s_end = N_PROMPT + n_steps - 1
    heads, layers = tiny_lm.cfg.n_heads, tiny_lm.cfg.n_layers
    monkeypatch.setattr(attention, "MATRIX_BYTES", rows_held * 4 * heads * s_end)
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    store = RunStore(bridge)
    shown = panel_on(bridge, layers - 1, qtbot)
    witness = attention.PANEL(bridge)  # a bare panel keeps every layer it is sent: layer 0 as it came, live
    qtbot.addWidget(witness)
    witness.layer_spin.setValue(0)
    for ev in random_run(n_steps, layers, heads):
        bridge.replay(ev)
    run = store.runs[0]
    assert run.dropped is None  # the store holds the whole run: the switch could read all of it
    run.events = CountingList(run.events)
    adds = []
    original = attention.AttentionMatrix.add
    monkeypatch.setattr(attention.AttentionMatrix, "add", lambda m, ev: (adds.append(ev.step), original(m, ev)))

    bridge.select_step(n_steps - 10)
    shown.layer_spin.setValue(0)
    shown.flush()

    # the work: the captures the matrix holds (its budget's rows), whatever the run's length
    assert len(adds) <= rows_held + 1 and adds == sorted(adds) and adds[-1] == n_steps - 1
    assert run.events.read <= (rows_held + 2) * layers
    # what is shown: the newest rows, each as sent, at its query position, and at least what the live panel kept
    m, r0 = shown.matrix(), shown.first_row()
    live, live_r0 = witness.matrix(), witness.first_row()
    assert m.shape[2] == live.shape[2] == s_end
    assert r0 <= live_r0 and m.shape[1] == s_end - r0 >= rows_held - 1
    np.testing.assert_array_equal(m[:, live_r0 - r0:], live)
    sent = {ev.query_start: ev.weights[:, 0] for ev in random_run(n_steps, layers, heads)
            if isinstance(ev, AttentionCaptured) and ev.layer == 0 and ev.step > 0}
    for q in (r0, s_end - 1):
        np.testing.assert_array_equal(m[:, q - r0, : q + 1], sent[q])
    text = shown.status.text()
    assert f"the newest {s_end - r0:,} query rows are shown (rows {r0:,}–{s_end - 1:,})" in text
    assert "captured from step" not in text  # layer 0 was captured from the prefill on
    assert shown.row_held(n_steps - 10)


def test_a_layer_asked_for_mid_run_still_says_so_after_a_switch(qtbot, bridge, tiny_lm, monkeypatch):
    from app.panels import attention

    n_steps, rows_held, since = 400, 32, 150
    heads, layers = tiny_lm.cfg.n_heads, tiny_lm.cfg.n_layers
    s_end = N_PROMPT + n_steps - 1
    monkeypatch.setattr(attention, "MATRIX_BYTES", rows_held * 4 * heads * s_end)
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    RunStore(bridge)
    shown = panel_on(bridge, layers - 1, qtbot)
    for ev in random_run(n_steps, layers, heads, from_step={0: since}):
        bridge.replay(ev)
    shown.layer_spin.setValue(0)
    shown.flush()
    text = shown.status.text()
    assert f"captured from step {since} on" in text
    assert f"the newest {s_end - shown.first_row():,} query rows are shown" in text

    # a layer whose every held capture fits is rebuilt whole: from its first captured row
    monkeypatch.setattr(attention, "MATRIX_BYTES", 64 << 20)
    shown.layer_spin.setValue(layers - 1)
    shown.layer_spin.setValue(0)
    shown.flush()
    assert shown.first_row() == N_PROMPT + since - 1
    assert "query rows are shown" not in shown.status.text()


@pytest.mark.parametrize("live", [True, False])
def test_a_step_the_store_kept_but_the_matrix_let_go_is_drawn_as_captured(qtbot, bridge, tiny_lm, monkeypatch, live):
    """An early step of a long run (the store keeps a run's first steps for its life) outside the panel's matrix: drawn
    from the store's capture at once, with nothing asked of the engine; in a run opened from a file (no KV cache
    behind it) this is the only way to see it."""
    from app.panels import attention

    n_steps, rows_held = 300, 32
    heads, layers = tiny_lm.cfg.n_heads, tiny_lm.cfg.n_layers
    s_end = N_PROMPT + n_steps - 1
    monkeypatch.setattr(attention, "MATRIX_BYTES", rows_held * 4 * heads * s_end)
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    store = RunStore(bridge)
    shown = panel_on(bridge, layers - 1, qtbot)
    for ev in random_run(n_steps, layers, heads):
        bridge.replay(ev)
    if not live:  # as a session file opens: the same runs, no engine run behind them
        store.load(store.records())
        assert store.recording is None
    asked = []
    monkeypatch.setattr(bridge, "recompute", lambda *a, **k: asked.append(a) or 0)
    step = 5
    assert not shown.row_held(step)
    bridge.select_step(step)
    shown.flush()
    ev = shown.recomputed_row()
    assert ev is not None and (ev.step, ev.layer, ev.query_start) == (step, layers - 1, N_PROMPT + step - 1)
    sent = next(e for e in random_run(n_steps, layers, heads)
                if isinstance(e, AttentionCaptured) and e.step == step and e.layer == layers - 1)
    np.testing.assert_array_equal(ev.weights, sent.weights)
    drawn = np.sqrt(np.clip(sent.weights[shown.head(), 0], 0, None))  # the panel's √ scale
    np.testing.assert_allclose(shown.image.image, drawn[None, :], rtol=1e-6)
    assert not asked and "as captured in the run" in shown.status.text()
