"""The analysis panels (sampling, attention, KV cache, timeline, roofline) fed with real engine events.

A generation runs headless on the tiny random model (2 layers, 4 query heads, 2 KV heads); its events go through a
real Bridge's routing (`_on_raw`, which re-emits them as the typed sig_… signals) into the panels, exactly as they
arrive from the engine process. The panels are then drawn with tick() and the plot items' data is checked.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from PySide6 import QtCore, QtGui

from engine.costs import formulas as costs
from engine.events import AttentionCaptured, Finished, KVCacheGrew, PrefillDone, PromptTokenized, TokenSampled
from engine.protocol import Loaded
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session

N_NEW = 6
PANEL_SIZE = (500, 350)


@pytest.fixture(scope="module")
def tiny_run(tiny_lm):
    """One real generation on the tiny model with every layer's attention, the funnels and the logits captured."""
    cap = Capture.everything(tiny_lm.cfg.n_layers, funnel_top=20)
    gen = Session(tiny_lm).generate("the cat sat on the mat", SamplingParams(temperature=0.9, seed=3),
                                    max_new_tokens=N_NEW, capture=cap, ignore_eos=True)
    return list(gen)


@pytest.fixture
def loaded(bridge, tiny_lm):
    """The bare bridge, told that the tiny model is loaded (as its worker would)."""
    bridge.replay(Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    return bridge


def make_panel(qtbot, module, bridge):
    panel = module.PANEL(bridge)
    qtbot.addWidget(panel)
    panel.resize(*PANEL_SIZE)
    panel.show()
    return panel


def feed(bridge, events, until=None):
    for ev in events:
        bridge.replay(ev)
        if until is not None and until(ev):
            return


def of(events, cls):
    return [e for e in events if isinstance(e, cls)]


def not_blank(path) -> bool:
    img = QtGui.QImage(str(path))
    assert not img.isNull()
    colours = {img.pixel(x, y) for x in range(0, img.width(), 7) for y in range(0, img.height(), 7)}
    return len(colours) > 20


def test_panel_contract():
    from app.panels import attention, kv_cache, roofline, sampling, timeline

    names = set()
    for m in (sampling, attention, kv_cache, timeline, roofline):
        cls = m.PANEL
        assert cls.title and cls.help_text and cls.shortcut and cls.object_name.startswith("panel_")
        assert "<b>" not in cls.help_text  # the main window shows it as plain text
        names.add(cls.object_name)
    assert len(names) == 5


HELD = {  # what each panel keeps of a generation: nothing before it and after clear(), something after it
    "sampling": lambda p: len(p._tokens),
    "attention": lambda p: len(p._matrices),
    "kv_cache": lambda p: len(p._events),
    "timeline": lambda p: len(p._seconds),
    "roofline": lambda p: (p._prefill is not None) + len(p._decode),
}


@pytest.mark.parametrize("name", sorted(HELD))
def test_panels_draw_empty_and_after_clear(qtbot, loaded, tiny_run, name):
    import importlib

    panel = make_panel(qtbot, importlib.import_module(f"app.panels.{name}"), loaded)
    held = HELD[name]
    panel.draw()  # before any generation
    assert held(panel) == 0
    feed(loaded, tiny_run)
    drawn = panel.draw_count
    panel.flush()
    assert held(panel) > 0 and panel.draw_count == drawn + 1
    panel.clear()
    panel.flush()  # a new generation starts from nothing
    assert held(panel) == 0 and panel.draw_count == drawn + 2
    loaded.replay(tiny_run[1])  # PromptTokenized alone (after RunStarted)
    panel.flush()
    assert held(panel) == 0


# ---- sampling -------------------------------------------------------------------------------------------------
def test_sampling_bars_and_knobs_refunnel_without_the_model(qtbot, loaded, tiny_run, monkeypatch):
    from app.panels import sampling

    panel = make_panel(qtbot, sampling, loaded)
    feed(loaded, tiny_run)
    panel.flush()
    last = of(tiny_run, TokenSampled)[-1]
    assert panel.shown_step() == last.step
    n = min(panel.n_show, len(last.funnel.ids))
    assert len(panel.bars) == 4
    for bar in panel.bars:
        assert len(bar.opts["width"]) == n
    order = list(range(n))  # the top candidates by logit, with the sampled token kept in view in the last row
    rank = last.funnel.ids.tolist().index(last.token_id)
    if rank >= n:
        order[-1] = rank
    assert np.allclose(panel.bars[0].opts["width"], last.funnel.p_raw[order])
    assert panel.kept_counts() == (last.funnel.kept_top_k, last.funnel.kept_top_p, last.funnel.kept_final)
    assert "entropy" in panel.summary.text() and "bits" in panel.summary.text()

    # The model must not run: a knob re-runs the funnel from the step's saved logits.
    def no_model(*_a, **_k):
        raise AssertionError("the model ran")

    monkeypatch.setattr(Session, "_forward", no_model)
    loaded.select_step(1)
    panel.top_k.setValue(3)
    panel.flush()
    assert panel.shown_step() == 1
    k_kept, _, _ = panel.kept_counts()
    assert k_kept == 3
    kept_rows = np.asarray(panel.bars[2].opts["brushes"])
    assert sum(b.style() == QtCore.Qt.BrushStyle.SolidPattern for b in kept_rows) == 3  # the rest are hatched
    assert panel.cut_lines["top-k"].isVisible() and panel.cut_lines["top-k"].value() == pytest.approx(2.5)
    panel.top_p.setValue(0.5)
    panel.flush()
    assert panel.kept_counts()[1] <= 3
    # the engine gets the settings after the debounce
    qtbot.waitUntil(lambda: loaded.params.top_k == 3 and loaded.params.top_p == 0.5, timeout=2000)

    # an invalid combination is refused with the reason, never a crash
    panel.top_p.setValue(0.0)
    panel.flush()
    assert "top_p" in panel.error_label.text()
    assert panel.params().top_p == 0.5

    # greedy
    panel.top_p.setValue(1.0)
    panel.temperature.setValue(0.0)
    panel.flush()
    assert panel.params().greedy and "greedy" in panel.summary.text()


def test_sampling_params_round_trip(qtbot, loaded):
    from app.panels import sampling

    panel = make_panel(qtbot, sampling, loaded)
    p = SamplingParams(temperature=1.3, top_k=40, top_p=0.85, min_p=0.05, repetition_penalty=1.1, seed=7)
    panel.set_params(p)
    assert panel.params() == p and loaded.params == p
    assert panel.temperature_slider.value() == 130 and not panel.random_seed.isChecked()
    panel.set_params(SamplingParams(seed=None))
    assert panel.random_seed.isChecked() and not panel.seed.isEnabled()
    # settings changed elsewhere (e.g. restored by the main window) show up in the controls
    loaded.set_params(SamplingParams(temperature=0.2, top_k=5))
    assert panel.top_k.value() == 5 and panel.temperature.value() == pytest.approx(0.2)


# ---- attention ------------------------------------------------------------------------------------------------
def test_attention_matrix_grows_with_causal_mask(qtbot, loaded, tiny_run, tiny_lm):
    from app.panels import attention

    cfg = tiny_lm.cfg
    panel = make_panel(qtbot, attention, loaded)
    assert loaded.options.attention_layers == {cfg.n_layers - 1}  # the generation panel captures what we show
    n_prompt = len(of(tiny_run, PromptTokenized)[0].ids)
    feed(loaded, tiny_run, until=lambda e: isinstance(e, PrefillDone))
    panel.flush()
    m = panel.matrix()
    assert m.shape == (cfg.n_heads, n_prompt, n_prompt)
    upper = np.triu_indices(n_prompt, 1)
    assert np.isnan(m[:, upper[0], upper[1]]).all()
    assert not np.isnan(m[:, np.tril_indices(n_prompt)[0], np.tril_indices(n_prompt)[1]]).any()
    assert np.allclose(np.nansum(m, axis=-1), 1.0, atol=1e-4)  # each row is a softmax
    assert panel.image.image.shape == (n_prompt, n_prompt)

    rest = tiny_run[tiny_run.index(of(tiny_run, PrefillDone)[0]) + 1:]
    size = n_prompt
    for ev in rest:
        loaded.replay(ev)
        if isinstance(ev, AttentionCaptured) and ev.layer == panel.layer():
            size += 1
            panel.flush()
            assert panel.image.image.shape == (size, size)
            row = panel.matrix()[:, -1]
            assert np.isnan(row[:, size:]).all() and not np.isnan(row[:, :size]).any()
    assert size == n_prompt + N_NEW - 1  # the last token is sampled but never fed back

    # all heads as small multiples, labelled with their KV head (GQA)
    panel.tabs.setCurrentIndex(1)
    panel.flush()
    assert len(panel.grid_images) == cfg.n_heads
    g = cfg.n_heads // cfg.n_kv_heads
    for h, (img, label) in enumerate(zip(panel.grid_images, panel.grid_labels, strict=True)):
        assert img.image.shape == (size, size)
        assert f"h{h} → kv{h // g}" in label.text
    panel.head_spin.setValue(cfg.n_heads - 1)
    panel.flush()
    assert f"KV head {(cfg.n_heads - 1) // g}" in panel.kv_label.text()

    # rows map to steps; the layer choice is what gets captured next time
    assert panel.step_of_row(0) == 0 and panel.step_of_row(n_prompt - 1) == 0
    assert panel.step_of_row(n_prompt) == 1
    with qtbot.waitSignal(loaded.sig_step_selected) as sel:
        vb = panel.heat.getPlotItem().getViewBox()
        panel.tabs.setCurrentIndex(0)
        qtbot.wait(10)
        click(qtbot, panel.heat, vb, QtCore.QPointF(1.5, n_prompt + 1.5))
    assert sel.args == [2]
    panel.layer_spin.setValue(0)
    assert loaded.options.attention_layers == {0}
    assert len(panel.norm_curve.getData()[1] or ()) == 0  # a tab not shown is not drawn…
    panel.tabs.setCurrentWidget(panel.norm_plot)  # …until it is turned to
    panel.flush()
    norms = panel.norm_curve.getData()[1]
    assert len(norms) == cfg.n_layers + 1 and (norms > 0).all()


def click(qtbot, plot_widget, vb, view_point: QtCore.QPointF) -> None:
    scene_pt = vb.mapViewToScene(view_point)
    widget_pt = plot_widget.mapFromScene(scene_pt)
    qtbot.mouseClick(plot_widget.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=widget_pt)


# ---- KV cache -------------------------------------------------------------------------------------------------
def test_kv_cache_plot_and_formula(qtbot, loaded, tiny_run, tiny_lm):
    from app.panels import kv_cache

    panel = make_panel(qtbot, kv_cache, loaded)
    feed(loaded, tiny_run)
    panel.flush()
    last = of(tiny_run, KVCacheGrew)[-1]
    assert panel.last_point() == (last.n_tokens, last.bytes_used)
    per_token = costs.kv_bytes_per_token(tiny_lm.cfg, tiny_lm.info.dtype)
    assert last.bytes_used == per_token * last.n_tokens
    text = panel.formula.text()
    assert f"{per_token:,.0f} bytes" in text
    cfg = tiny_lm.cfg
    assert f"{cfg.n_layers} layers · {cfg.n_kv_heads} KV heads · {cfg.head_dim} head dim" in text
    x, y = panel.alloc_curve.getData()
    assert y[-1] == last.bytes_allocated
    # the "how it scales" table: fp16 · batch 8 at full context, all through engine.costs.formulas
    row = list(kv_cache.TABLE_DTYPES).index("fp16") * len(kv_cache.TABLE_BATCHES) + 1
    expected = costs.kv_bytes_per_token(cfg, "fp16", 8) * cfg.context_length
    assert panel.table.item(row, 2).text() == kv_cache.fmt_bytes(expected)


# ---- timeline -------------------------------------------------------------------------------------------------
def test_timeline_bars_stats_and_click(qtbot, loaded, tiny_run):
    from app.panels import timeline

    panel = make_panel(qtbot, timeline, loaded)
    feed(loaded, tiny_run)
    panel.flush()
    fin = of(tiny_run, Finished)[0]
    steps, secs = panel.bar_data()
    n_decode = len(of(tiny_run, TokenSampled)) - 1
    assert len(steps) == 1 + n_decode == len(fin.ids)
    assert secs[0] == pytest.approx(fin.ttft_s) and np.allclose(secs[1:], fin.step_seconds)
    s = panel.stats()
    assert s["ttft_s"] == pytest.approx(fin.ttft_s) and s["tpot_s"] == pytest.approx(fin.tpot_s)
    assert s["tokens_per_s"] == pytest.approx(fin.tokens_per_s)
    assert s["tpot_p50_s"] == pytest.approx(np.median(fin.step_seconds))
    assert s["latency_formula_s"] == pytest.approx(fin.ttft_s + (len(fin.ids) - 1) * fin.tpot_s)
    assert s["measured_total_s"] == pytest.approx(fin.total_s)
    assert "TTFT" in panel.stats_text() and "measured" in panel.stats_text()

    vb = panel.plot.getPlotItem().getViewBox()
    qtbot.wait(10)
    with qtbot.waitSignal(loaded.sig_step_selected) as sel:
        click(qtbot, panel.plot, vb, QtCore.QPointF(3, float(secs[3]) / 2))
    assert sel.args == [3]
    panel.flush()
    assert list(panel.selected_bar.getData()[0]) == [3] and panel.selected_bar.opts["pen"].widthF() > 1


def test_timeline_export_png_svg_and_bad_paths(qtbot, loaded, tiny_run, tmp_path):
    from app.panels import timeline

    panel = make_panel(qtbot, timeline, loaded)
    feed(loaded, tiny_run)
    panel.flush()
    png = tmp_path / "t.png"
    panel.export(str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = QtGui.QImage(str(png))
    assert img.width() >= 1200 and not_blank(png)

    svg = tmp_path / "t.svg"
    panel.export(str(svg))
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = svg.read_text()
    assert "<path" in text and "TTFT" in text  # the statistics travel with the plot

    with pytest.raises(ValueError, match="png or .svg"):
        panel.export(str(tmp_path / "t.jpg"))
    with pytest.raises(OSError, match="does not exist"):
        panel.export(str(tmp_path / "missing" / "t.png"))
    (tmp_path / "adir.png").mkdir()
    with pytest.raises(OSError):
        panel.export(str(tmp_path / "adir.png"))


def test_timeline_exports_when_never_shown(qtbot, loaded, tiny_run, tmp_path):
    from app.panels import timeline

    panel = timeline.PANEL(loaded)
    qtbot.addWidget(panel)
    feed(loaded, tiny_run)
    out = tmp_path / "hidden.png"
    panel.export(str(out))
    assert QtGui.QImage(str(out)).width() >= 1200 and not_blank(out)


# ---- roofline -------------------------------------------------------------------------------------------------
def test_roofline_points_and_ridge(qtbot, loaded, tiny_run):
    from app.panels import roofline
    from engine.costs.catalog import hardware_presets

    panel = make_panel(qtbot, roofline, loaded)
    panel.select_hardware("h100-sxm")
    panel.dtype_combo.setCurrentText("fp16")
    feed(loaded, tiny_run)
    panel.flush()
    hw = hardware_presets()["h100-sxm"]
    peak, bw, ridge = panel.roofs()
    assert peak == hw.peak_for("fp16") and bw == hw.bandwidth_bytes_per_s
    assert ridge == pytest.approx(costs.ridge_point(peak, bw))
    assert panel.ridge_line.value() == pytest.approx(math.log10(ridge))  # log-log axes
    assert f"{ridge:.3g}" in panel.ridge_text.textItem.toPlainText()

    pts = panel.measured_points()
    pre = of(tiny_run, PrefillDone)[0]
    assert pts["prefill"] == pytest.approx((pre.cost.intensity, pre.cost.flops / pre.seconds))
    last = of(tiny_run, TokenSampled)[-1]
    assert pts["decode"] == pytest.approx((last.cost.intensity, last.cost.flops / last.seconds))
    for x, y in pts.values():
        assert x > 0 and y > 0
    xs, ys = panel.measured_decode.xData, panel.measured_decode.yData  # getData() gives log10 on log axes
    assert len(xs) == len(of(tiny_run, TokenSampled)) - 1 and (ys > 0).all()
    for key, text in (("prefill", panel.prefill_text), ("decode", panel.decode_text)):
        assert "% of roof" in text.textItem.toPlainText()
        # written as the analytic labels write intensities (was '2.4e+02' beside '≈ 244')
        assert text.textItem.toPlainText().startswith(f"{key} {roofline.fmt_intensity(pts[key][0])} FLOP/B")
        assert "e+" not in text.textItem.toPlainText()
    # analytic (hollow) points sit on the roof
    ax, ay = panel.analytic_decode.xData, panel.analytic_decode.yData
    assert ay[0] == pytest.approx(costs.attainable_flops(ax[0], peak, bw))
    assert "memory-bound" in panel.takeaway.text()


def n_points(item) -> int:
    return 0 if item.xData is None else len(item.xData)


def test_roofline_batch_and_catalogue_model_move_the_analytic_points(qtbot, loaded, tiny_run):
    from app.panels import roofline
    from engine.costs.catalog import model_presets

    panel = make_panel(qtbot, roofline, loaded)
    panel.resize(650, 330)
    assert panel.model_key() == roofline.LOADED and panel.batch() == 1
    panel.select_hardware("h100-sxm")
    panel.dtype_combo.setCurrentText("fp16")
    feed(loaded, tiny_run)
    n_prompt = len(of(tiny_run, PromptTokenized)[0].ids)
    assert panel.prompt_length() == n_prompt  # follows the last prompt
    panel.flush()
    assert n_points(panel.measured_decode) > 0 and n_points(panel.measured_prefill) == 1
    # the latest decode step attended exactly the positions the KV cache held after it (the engine's own count)
    assert panel.decode_context() == of(tiny_run, KVCacheGrew)[-1].n_tokens
    last = [e for e in of(tiny_run, TokenSampled) if e.phase == "decode"][-1]
    assert costs.decode_cost(loaded.cfg, panel.decode_context()) == last.cost
    generated = of(tiny_run, TokenSampled)[-1].position + 1 - n_prompt

    cfg = model_presets()["llama-2-70b"]
    panel.select_model("llama-2-70b")
    panel.prompt_spin.setValue(512)
    ctx = 512 + generated - 1  # the newest token is sampled, not yet in the cache
    intensity = {}
    for batch in (1, 256):
        panel.batch_spin.setValue(batch)
        panel.flush()
        want = costs.decode_cost(cfg, ctx, batch=batch, weight_dtype="fp16").intensity
        assert panel.analytic_costs()["decode"].intensity == pytest.approx(want)
        assert panel.analytic_decode.xData[0] == pytest.approx(want)
        pre = costs.prefill_cost(cfg, 512, batch=batch, weight_dtype="fp16").intensity
        assert panel.analytic_prefill.xData[0] == pytest.approx(pre)
        intensity[batch] = want
        label = panel.analytic_decode_text.textItem.toPlainText()
        assert roofline.fmt_intensity(want) in label and "memory-bound" in label  # ridge ≈ 295 on H100 fp16
        assert "compute-bound" in panel.analytic_prefill_text.textItem.toPlainText()
        assert f"batch {batch}" in panel.takeaway.text() and "ridge 295" in panel.takeaway.text()
        # a catalogue model is not what the engine ran: its measured points are hidden, and the takeaway says so
        assert n_points(panel.measured_decode) == 0 and n_points(panel.measured_prefill) == 0
        assert panel.prefill_text.textItem.toPlainText() == panel.decode_text.textItem.toPlainText() == ""
        assert "hidden" in panel.takeaway.text()
    ratio = intensity[256] / intensity[1]
    assert 0.6 * 256 < ratio <= 256  # about linear: B× the FLOPs over the same weights (plus B× the KV reads)
    assert "still memory-bound" in panel.takeaway.text()

    panel.select_model(roofline.LOADED)  # back to the engine's model: measured points return
    panel.flush()
    assert n_points(panel.measured_decode) > 0 and "% of roof" in panel.decode_text.textItem.toPlainText()
    assert panel.analytic_costs()["decode"].intensity == pytest.approx(
        costs.decode_cost(loaded.cfg, ctx, batch=256, weight_dtype="fp16").intensity)


def test_roofline_measures_this_machine_in_the_engine_process(qtbot, loaded):
    from app.panels import roofline

    with qtbot.waitSignal(loaded.sig_this_machine, timeout=30_000) as answer:  # the engine answers: not measured
        panel = make_panel(qtbot, roofline, loaded)
    assert answer.args[0][2] is None
    panel.hw_combo.setCurrentIndex(0)  # this machine, not measured yet (the test cache is private)
    panel.flush()
    assert panel.roofs() is None and "Measure" in panel.hw_label.text()
    panel.measure_kwargs = {"quick": True}
    progress = []
    loaded.sig_measure_progress.connect(lambda f, m: progress.append(f))
    with qtbot.waitSignal(panel.sig_measured, timeout=30_000):
        panel.measure()
        assert not panel.measure_button.isEnabled() and panel.progress.isVisible()
    qtbot.waitUntil(lambda: panel.measure_button.isEnabled(), timeout=5_000)
    assert progress and progress == sorted(progress)
    panel.flush()
    hw = panel.hardware()
    assert hw.measured and panel.roofs()[2] == pytest.approx(costs.ridge_point(hw.peak_for("fp32"),
                                                                               hw.bandwidth_bytes_per_s))
    # a second panel finds the cached measurement at once
    again = make_panel(qtbot, roofline, loaded)
    assert again.hw_combo.currentData() == roofline.THIS_MACHINE and again.hardware() is not None


def test_roofline_measurement_can_be_cancelled(qtbot, loaded):
    from app.panels import roofline

    panel = make_panel(qtbot, roofline, loaded)
    with qtbot.waitSignal(loaded.sig_measure_progress, timeout=30_000):
        panel.measure()  # the full measurement: seconds, with a stop check between its timed runs
    with qtbot.waitSignal(loaded.sig_measure_done, timeout=30_000) as done:
        panel.cancel_measure()
    assert done.args == ["cancelled"]
    assert panel.measure_button.isEnabled() and "cancelled" in panel.hw_label.text()


def test_closing_stops_a_measurement(qtbot):
    """The window closing (Bridge.shutdown) ends a running measurement: the engine exits on its own, exit code 0."""
    from app.bridge import Bridge

    b = Bridge()
    with qtbot.waitSignal(b.sig_measure_progress, timeout=30_000):
        b.measure_machine("cpu", "float32")
    assert b.shutdown(timeout_ms=20_000)
    assert b.process.exitcode == 0  # quit was read between timed runs (a terminate would give -15)


# ---- every panel on the real model, rendered ---------------------------------------------------------------------
@pytest.mark.slow
def test_render_panels_on_the_real_model(qtbot, bridge, real_lm, tmp_path):
    from app.panels import attention, kv_cache, roofline, sampling, timeline

    bridge.replay(Loaded(real_lm.info, real_lm.tokenizer, real_lm.cfg))
    last = real_lm.cfg.n_layers - 1
    mods = {"sampling": sampling, "attention": attention, "kv_cache": kv_cache, "timeline": timeline,
            "roofline": roofline}
    panels = {name: make_panel(qtbot, m, bridge) for name, m in mods.items()}
    events = Session(real_lm).generate("Explain what a KV cache is in two sentences.", chat=True,
                                       max_new_tokens=20,
                                       capture=Capture(attention_layers=frozenset({last}), residual_norms=True,
                                                       funnel_top=20, logits=True))
    feed(bridge, events)
    qtbot.wait(50)
    for name, panel in panels.items():
        panel.flush()
        out = tmp_path / f"panel_{name}.png"
        assert panel.grab().save(str(out))
        assert not_blank(out), name
    assert panels["attention"].matrix().shape[0] == real_lm.cfg.n_heads
    assert "46,080 bytes" in panels["kv_cache"].formula.text()
