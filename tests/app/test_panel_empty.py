"""Before the first generation a plot shows its real axes and says what will appear, not pyqtgraph's defaults
(−400…400 with a "(x0.001)" scale and negative megabytes).

The tiny test model is loaded into a bare bridge (2 layers, 2 KV heads of width 16, float32, context 256);
expected ranges are worked out by hand from that config.
"""

from __future__ import annotations

import importlib

import pytest

from app.theme import COUNT_STEPS, stepped_bound
from engine.events import KVCacheGrew, TokenSampled
from engine.protocol import Loaded
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session


@pytest.fixture(scope="module")
def tiny_run(tiny_lm):
    cap = Capture.everything(tiny_lm.cfg.n_layers, funnel_top=20)
    return list(Session(tiny_lm).generate("the cat sat", SamplingParams(temperature=0.9, seed=3), max_new_tokens=4,
                                          capture=cap, ignore_eos=True))


@pytest.fixture
def loaded(bridge, tiny_lm):
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    return bridge


def make(qtbot, name, bridge):
    panel = importlib.import_module(f"app.panels.{name}").PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(500, 350)
    panel.show()
    panel.flush()
    return panel


def no_scale_nonsense(pi) -> None:
    for name in ("left", "bottom"):
        assert "(x" not in pi.getAxis(name).labelString(), (name, pi.getAxis(name).labelString())


def test_kv_cache_empty_axes_span_the_models_context(qtbot, loaded, tiny_run):
    panel = make(qtbot, "kv_cache", loaded)
    pi = panel.plot.getPlotItem()
    (x0, x1), (y0, y1) = pi.getViewBox().viewRange()
    # 2 (K, V) · 2 layers · 2 KV heads · 16 · 4 bytes = 512 bytes a token; 256 tokens → 131,072 bytes.
    assert (x0, x1) == pytest.approx((0, 256))
    assert (y0, y1) == pytest.approx((0, 131_072))
    assert "(kB)" in pi.getAxis("left").labelString()
    no_scale_nonsense(pi)
    assert panel.empty_note.isVisible() and "Generate" in panel.empty_note.textItem.toPlainText()
    assert "512 B per token" in panel.empty_note.textItem.toPlainText()

    for ev in tiny_run:
        loaded.replay(ev)
    panel.flush()
    qtbot.wait(50)  # pyqtgraph fits an auto range before the next paint
    assert not panel.empty_note.isVisible()
    last = [e for e in tiny_run if isinstance(e, KVCacheGrew)][-1]
    (x0, x1), (y0, y1) = pi.getViewBox().viewRange()
    assert x0 <= last.n_tokens <= x1 and x1 < 256 / 2  # the view follows the data again
    assert y0 <= last.bytes_used <= y1


def test_kv_cache_before_any_model(qtbot, bridge):
    panel = make(qtbot, "kv_cache", bridge)
    pi = panel.plot.getPlotItem()
    (x0, _x1), (y0, _y1) = pi.getViewBox().viewRange()
    assert x0 >= 0 and y0 >= 0
    no_scale_nonsense(pi)
    assert "Load a model" in panel.empty_note.textItem.toPlainText()


def test_timeline_empty_axes_in_milliseconds(qtbot, loaded, tiny_run):
    panel = make(qtbot, "timeline", loaded)
    pi = panel.plot.getPlotItem()
    (x0, x1), (y0, y1) = pi.getViewBox().viewRange()
    assert -1 < x0 < 0 < 8 < x1 and y0 == 0 and y1 > 0
    assert "(ms)" in pi.getAxis("left").labelString()
    no_scale_nonsense(pi)
    assert panel.empty_note.isVisible() and "TTFT" in panel.empty_note.textItem.toPlainText()
    for ev in tiny_run:
        loaded.replay(ev)
    panel.flush()
    assert not panel.empty_note.isVisible()
    n_steps = len([e for e in tiny_run if isinstance(e, TokenSampled)])
    # the last bar fits, and the axis ends at the next nice bound above it (it grows in steps, not at every draw)
    assert pi.getViewBox().viewRange()[0][1] == stepped_bound(n_steps - 1 + 0.6, None, headroom=1.0, steps=COUNT_STEPS)


def test_sampling_empty_axes_are_probabilities(qtbot, loaded, tiny_run):
    panel = make(qtbot, "sampling", loaded)
    pi = panel.plot.getPlotItem()
    (x0, x1), (y0, y1) = pi.getViewBox().viewRange()
    assert (x0, x1) == pytest.approx((0, 1))
    assert y0 < 0 and panel.n_show - 1 < y1 < panel.n_show  # rows 0…n_show − 1, one per candidate shown
    no_scale_nonsense(pi)
    assert not panel.sampled_marker.isVisible() and not any(b.isVisible() for b in panel.bars)
    assert panel.empty_note.isVisible() and "candidates" in panel.empty_note.textItem.toPlainText()
    for ev in tiny_run:
        loaded.replay(ev)
    panel.flush()
    assert not panel.empty_note.isVisible() and panel.sampled_marker.isVisible()


def test_attention_empty_axes_and_notes(qtbot, loaded, tiny_run):
    panel = make(qtbot, "attention", loaded)
    heat = panel.heat.getPlotItem()
    (x0, x1), (y0, y1) = heat.getViewBox().viewRange()
    assert x0 == 0 and y0 == 0 and x1 > 0 and y1 > 0
    no_scale_nonsense(heat)
    assert panel.heat_note.isVisible()
    assert f"layer {panel.layer()}" in panel.heat_note.textItem.toPlainText()
    norms = panel.norm_plot.getPlotItem()
    (n0, n1), _ = norms.getViewBox().viewRange()
    assert n0 < 0 and n1 > 2  # after the embedding (0) and after each of the 2 layers
    assert "2 layers" in panel.norm_note.textItem.toPlainText()
    no_scale_nonsense(norms)

    prompt = tiny_run[1]  # after RunStarted
    loaded.replay(prompt)  # the prompt alone: its tokens label the empty axes
    panel.flush()
    (x0, x1), _ = heat.getViewBox().viewRange()
    assert x1 >= len(prompt.ids)
    assert len(heat.getAxis("bottom")._tickLevels[0]) > 0

    for ev in tiny_run[1:]:
        loaded.replay(ev)
    panel.flush()
    assert not panel.heat_note.isVisible()
    panel.tabs.setCurrentWidget(panel.norm_plot)  # the norms' tab draws when it is turned to
    panel.flush()
    assert not panel.norm_note.isVisible()


def test_batching_empty_axes(qtbot, loaded):
    panel = make(qtbot, "batching", loaded)
    tl, sp = panel.tl_plot.getPlotItem(), panel.speed_plot.getPlotItem()
    (x0, x1), (y0, y1) = tl.getViewBox().viewRange()
    assert x0 == 0 and y0 == 0 and x1 > 0 and y1 > 0  # ms and tokens/s start at zero
    (bx0, bx1), _ = sp.getViewBox().viewRange()  # log10 of the batch sizes offered, 1…32
    assert bx0 < 0 < 1.5 < bx1 < 1.7
    assert [t for _, t in sp.getAxis("bottom")._tickLevels[0]] == ["1", "2", "4", "8", "16", "32"]
    for pi in (tl, sp, panel.roof_plot.getPlotItem()):
        no_scale_nonsense(pi)
    assert panel.tl_note.isVisible() and panel.speed_note.isVisible()
