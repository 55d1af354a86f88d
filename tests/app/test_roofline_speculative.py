"""The Roofline draws a speculative run's verify passes where they belong: one pass over k + 1 positions reads the
weights once, so it sits right of a plain decode step at the same position (issue 19)."""

from __future__ import annotations

import numpy as np

from engine.labs import speculative as sp
from engine.protocol import Loaded
from engine.run.sampling import SamplingParams
from engine.run.session import Session
from tests.engine.test_speculative import REPEATS


def test_verify_passes_are_drawn_right_of_decode(qtbot, bridge, tiny_lm):
    from app.panels import roofline

    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    panel = roofline.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(700, 450)
    panel.show()
    panel.select_hardware("h100-sxm")
    k = 4
    run = list(sp.speculate(Session(tiny_lm), REPEATS,
                            sp.SpecConfig(k=k, source="early-exit", exit_layer=1, ignore_eos=True),
                            SamplingParams.greedy_params(), 24))
    for ev in run:
        bridge.sig_spec.emit(ev)  # as the bridge routes them
    panel.flush()
    steps = [e for e in run if isinstance(e, sp.SpecStep)]
    xs, ys = panel.verify_points.getData()
    assert len(xs) == len(steps) > 0
    # (the plot is on log axes: pyqtgraph hands back log10 of the data)
    np.testing.assert_allclose(xs, np.log10([e.verify_cost.intensity for e in steps]))
    np.testing.assert_allclose(ys, np.log10([e.verify_cost.flops / e.verify_s for e in steps]))
    # n + 1 positions per weight read: right of one decode step at the same position, by about n + 1 (a little
    # less: the cache grows by n + 1 rows, not one); a pass with no guess is a decode step
    for e in steps:
        positions = len(e.drafted) + 1
        ratio = e.verify_cost.intensity / e.decode_cost.intensity
        assert 0.8 * positions <= ratio <= positions + 1e-9, (positions, ratio)
    assert max(len(e.drafted) for e in steps) == k
    assert f"verify k+1={k + 1}" in panel.verify_text.toPlainText()
    assert f"k + 1 = {k + 1} positions, {len(steps)} passes" in panel.takeaway.text()

    bridge.sig_spec.emit(run[0])  # the next run starts from nothing
    panel.clear()
    panel.flush()
    assert len(panel.verify_points.getData()[0] or []) == 0 and "verify" not in panel.takeaway.text().lower()
