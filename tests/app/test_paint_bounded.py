"""A panel's draw late in a long run costs what it did early on: the attention heat map is reduced to the pixels it
has, the roofline draws a bounded trail of decode steps, and the KV cache's curve drops its per-step markers."""

from __future__ import annotations

import numpy as np
import pytest

from engine.events import KVCacheGrew, TokenSampled
from engine.protocol import Loaded
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


def block_max_reference(w: np.ndarray, fy: int, fx: int) -> np.ndarray:
    """The largest finite weight of each fy × fx block, NaN where the block holds none: one block at a time."""
    r, s = w.shape
    out = np.full((-(-r // fy), -(-s // fx)), np.nan)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            block = w[i * fy:(i + 1) * fy, j * fx:(j + 1) * fx].astype(np.float64)
            finite = block[~np.isnan(block)]
            if finite.size:
                out[i, j] = finite.max()
    return out


@pytest.mark.parametrize(("shape", "fy", "fx"), [((37, 41), 3, 4), ((64, 64), 2, 2), ((10, 300), 1, 7),
                                                        ((45, 700), 5, 30)])
def test_fit_to_pixels_keeps_each_blocks_strongest_weight(shape, fy, fx):
    from app.panels.attention import fit_to_pixels

    rng = np.random.default_rng(0)
    w = rng.random(shape, dtype=np.float32)
    w[np.triu_indices(shape[0], 1, shape[1])] = np.nan  # the causal mask
    got = fit_to_pixels(w, fy, fx)
    np.testing.assert_array_equal(got, block_max_reference(w, fy, fx).astype(np.float32))
    assert fit_to_pixels(w, 1, 1) is w


@pytest.fixture(scope="module")
def long_run(tiny_lm):
    """A real generation on the tiny model long enough to pass the panels' bounds."""
    cap = Capture.everything(tiny_lm.cfg.n_layers, funnel_top=5)
    gen = Session(tiny_lm).generate("the cat", SamplingParams(temperature=0.0), max_new_tokens=40, capture=cap,
                                    ignore_eos=True)
    return list(gen)


def test_long_runs_draw_bounded_markers(qtbot, bridge, tiny_lm, long_run, monkeypatch):
    from app.panels import kv_cache, roofline

    monkeypatch.setattr(roofline, "TRAIL_POINTS", 8)
    monkeypatch.setattr(kv_cache, "MARKED_STEPS", 16)
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    roof, kv = roofline.PANEL(bridge), kv_cache.PANEL(bridge)
    for p in (roof, kv):
        qtbot.addWidget(p)
        p.resize(500, 350)
        p.show()
    steps = [ev for ev in long_run if isinstance(ev, KVCacheGrew) and ev.step > 0]
    assert len(steps) > 16
    for ev in long_run:
        bridge.replay(ev)
        if isinstance(ev, KVCacheGrew) and ev.step == 10:
            kv.flush()
            assert kv.used_curve.opts["symbol"] == "o"  # a short run: a marker per step
    roof.flush()
    kv.flush()
    x = roof.measured_decode.xData  # the data as given (getData() answers in the plot's log scale)
    decode = roof._decode
    assert len(decode) > 8 and len(x) == 8
    assert x[-1] == decode[-1][0] and x[0] == decode[0][0]  # the first and the newest step among them
    assert kv.used_curve.opts["symbol"] is None  # past MARKED_STEPS: the line only, every step still on it
    assert len(kv.used_curve.xData) == len(steps) + 1
    assert sum(isinstance(e, TokenSampled) for e in long_run) == 40
