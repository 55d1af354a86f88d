"""Issue 50 in the app: a step's message carries the layer the Attention panel shows; the layers captured for the
record come once (a layer turned to mid-run at once, the rest at the run's end). Through the real engine process,
the panel and the run store end up with what the engine computed (read from the engine directly, not through the
app): the turned-to layer's whole run in the panel, every layer of every step in the store."""

from __future__ import annotations

import numpy as np

from engine.events import AttentionCaptured
from engine.protocol import Capture, SamplingParams
from engine.run.session import Session
from tests.app.test_prompt_generation import finish_generation

PROMPT = "the cat sat on the mat"
N = 6


def test_a_layer_turned_to_mid_run_and_the_record_reach_the_window(qtbot, window, tiny_lm):
    att, gen, store = window.panels["attention"], window.panels["generation"], window.run_store
    last = att.n_layers - 1
    assert att.layer() == last
    window.panels["prompt"].set_text(PROMPT)
    gen.set_chat(False)
    gen.set_max_new_tokens(N)
    gen.ignore_eos = True
    window.bridge.set_params(SamplingParams.greedy_params())
    with qtbot.waitSignal(window.bridge.sig_token, timeout=30_000):
        assert gen.generate(start_paused=True)  # the prefill's token, then paused
    with qtbot.waitSignal(window.bridge.sig_held_attention, timeout=30_000) as held:
        att.layer_spin.setValue(0)  # layer 0 was held for the record: the engine sends its prefill now
    assert {(e.step, e.layer) for e in held.args[0].events} == {(0, 0)}
    finish_generation(qtbot, window, lambda: window.bridge.resume())

    direct = [e for e in Session(tiny_lm).generate(
        PROMPT, SamplingParams.greedy_params(), N, ignore_eos=True,
        capture=Capture(attention_layers=frozenset(range(att.n_layers))))
        if isinstance(e, AttentionCaptured)]
    run = store.shown_run()
    kept = {(e.step, e.layer): e.weights for e in run.events if isinstance(e, AttentionCaptured)}
    assert sorted(kept) == sorted((e.step, e.layer) for e in direct)  # every layer of every step, once
    for e in direct:
        np.testing.assert_array_equal(kept[(e.step, e.layer)], e.weights)
    m = att.matrix()  # layer 0, all of it: the prefill held, then every step live
    rows = {e.query_start: e.weights for e in direct if e.layer == 0}
    assert m.shape[1] == max(rows) + 1  # the prompt's rows and one row per decode step
    np.testing.assert_array_equal(m[:, -1, :], rows[max(rows)][:, 0, :])
