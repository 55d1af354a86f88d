"""The Scheduling lab panel, fed with the events of a real run of the lab on the tiny random model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from app.panels import scheduling
from engine.labs.schedule_events import SchedConfig, SchedPlan, SchedRequestDone, SchedStep, SchedSummary
from engine.protocol import LabDone
from engine.run.session import Session

CFG = SchedConfig(n_requests=6, rate=math.inf, prompt_len=10, output_len=6, max_batch=3, page_size=4, seed=2)


@pytest.fixture(scope="module")
def events(tiny_lm):
    from engine.labs.scheduler import schedule

    return list(schedule(Session(tiny_lm), CFG))


@pytest.fixture
def panel(qtbot, bridge):
    p = scheduling.PANEL(bridge)
    qtbot.addWidget(p)
    p.resize(900, 500)
    p.show()
    p.flush()
    return p


def bars(panel, policy, state):
    opts = panel.gantts[policy].bars[state].opts
    return np.asarray(opts["x0"], float), np.asarray(opts["width"], float), np.asarray(opts["y"], float)


def test_contract():
    cls = scheduling.PANEL
    assert cls.title and cls.object_name == "panel_scheduling" and "<b>" not in cls.help_text
    assert "paged" in cls.help_text and "TTFT" in cls.help_text


def test_events_fill_the_gantt_table_and_memory(panel, events):
    plan = events[0]
    assert isinstance(plan, SchedPlan)
    first_decode = next(i for i, e in enumerate(events) if isinstance(e, SchedStep) and e.kind == "decode")
    for ev in events[: first_decode + 1]:  # mid-run: static's first batch prefilled and one decode step
        panel.on_event(ev)
    panel.flush()
    assert panel.running and "running" in panel.progress.text()
    assert panel.config() == CFG  # the controls show what is being measured
    x0, width, y = bars(panel, "static", "prefill")
    assert sorted(y.tolist()) == [0, 1, 2] and (width > 0).all()  # the first batch of three
    prefill_start = dict(zip(y.astype(int).tolist(), x0, strict=True))
    x0, width, y = bars(panel, "static", "queued")  # grey until its own prefill, or until now for the next batch
    ends = dict(zip(y.astype(int).tolist(), x0 + width, strict=True))
    assert np.allclose(x0, 0.0) and set(ends) == {1, 2, 3, 4, 5}  # request 0 was prefilled at once
    assert all(ends[r] == pytest.approx(prefill_start[r]) for r in (1, 2))
    assert all(ends[r] == pytest.approx(panel.now["static"]) for r in (3, 4, 5))
    assert bars(panel, "continuous", "decode")[1].sum() == 0
    assert panel.table.item(0, 0).text() == "–"

    for ev in events[first_decode + 1:]:
        panel.on_event(ev)
    panel.flush()
    assert not panel.running and panel.status == "done"
    summaries = {e.policy: e for e in events if isinstance(e, SchedSummary)}
    for policy in ("static", "continuous"):
        done = {e.request_id: e for e in events if isinstance(e, SchedRequestDone) and e.policy == policy}
        x0, width, y = bars(panel, policy, "decode")
        for rid, start, w in zip(y.astype(int), x0, width, strict=True):
            assert start == pytest.approx(done[rid].first_token_s) and start + w == pytest.approx(done[rid].finish_s)
        x0, width, y = bars(panel, policy, "prefill")
        assert sorted(y.astype(int).tolist()) == list(range(CFG.n_requests))
        for rid, start in zip(y.astype(int), x0, strict=True):
            assert start == pytest.approx(done[rid].admitted_s)
    # the table: the same numbers as the summaries, policies side by side
    col = {"static": 0, "continuous": 1}
    for policy, s in summaries.items():
        assert float(panel.table.item(0, col[policy]).text().replace(",", "")) == pytest.approx(s.ttft.p50 * 1e3,
                                                                                              abs=0.006)
        row = [label for label, _ in scheduling.ROWS].index("fit in budget: paged")
        assert panel.table.item(row, col[policy]).text() == str(s.fits_paged)
    assert "continuous batching gives p99 TTFT" in panel.summary.text()
    # memory over time of the chosen policy: one point per step (after a zero start)
    for policy in ("continuous", "static"):
        panel.mem_combo.setCurrentIndex(panel.mem_combo.findData(policy))
        panel.flush()
        steps = [e for e in events if isinstance(e, SchedStep) and e.policy == policy]
        x, paged = panel.paged_curve.getData()
        assert len(x) == len(steps) + 1 and paged[-1] == 0.0
        assert paged.max() == pytest.approx(summaries[policy].peak_paged_bytes / scheduling.MIB)
        _, contiguous = panel.contiguous_curve.getData()
        assert (contiguous >= paged).all()


def test_run_asks_with_the_controls_settings_and_cancel(qtbot, panel, tiny_lm, events):
    assert not panel.run_button.isEnabled()  # no model loaded
    panel.bridge.info, panel.bridge.cfg = tiny_lm.info, tiny_lm.cfg
    panel.bridge.sig_model_loaded.emit(tiny_lm.info)
    assert panel.run_button.isEnabled() and "one position of every request holds" in panel.help_text
    panel.rate_spin.setValue(0.0)
    panel.batch_spin.setValue(3)
    panel.policy_combo.setCurrentIndex(panel.policy_combo.findData("continuous"))
    with qtbot.waitSignal(panel.sig_run_requested) as asked:
        qtbot.mouseClick(panel.run_button, scheduling.QtCore.Qt.MouseButton.LeftButton)
    cfg = asked.args[0]
    assert cfg.policy == "continuous" and math.isinf(cfg.rate) and cfg.max_batch == 3
    assert panel.running and not panel.run_button.isEnabled() and panel.cancel_button.isEnabled()
    with qtbot.waitSignal(panel.sig_cancel_requested):
        qtbot.mouseClick(panel.cancel_button, scheduling.QtCore.Qt.MouseButton.LeftButton)
    for ev in events[:4]:
        panel.on_event(ev)
    panel.finish(LabDone("sched", "cancelled"))
    panel.flush()
    assert not panel.running and panel.run_button.isEnabled() and panel.summary.text() == "cancelled"
    panel.finish(LabDone("sched", "failed", "the engine process stopped"))
    panel.flush()
    assert panel.summary.text() == "failed: the engine process stopped" and panel.outcome == "failed"


def test_settings_the_model_cannot_serve_are_refused_in_one_line(qtbot, panel, tiny_lm):
    panel.bridge.info, panel.bridge.cfg = tiny_lm.info, tiny_lm.cfg
    panel.bridge.sig_model_loaded.emit(tiny_lm.info)
    panel.prompt_spin.setValue(400)  # beyond the tiny model's context of 256
    with qtbot.assertNotEmitted(panel.sig_run_requested):
        panel.run()
    panel.flush()
    assert not panel.running and panel.summary.text().startswith("failed: the longest request")


def test_run_goes_through_the_engine_process(qtbot, window):
    """Run in the panel: the engine process serves the requests on the loaded model under both policies, and the
    panel gets both summaries."""
    panel = window.panels["scheduling"]
    panel.requests_spin.setValue(4)
    panel.prompt_spin.setValue(6)
    panel.output_spin.setValue(4)
    panel.batch_spin.setValue(2)
    with qtbot.waitSignal(window.bridge.sig_sched_done, timeout=180_000) as done:
        panel.run()
    assert done.args[0].outcome == "done" and panel.outcome == "done"
    qtbot.waitUntil(lambda: set(panel.summaries) == {"static", "continuous"}, timeout=10_000)
    assert all(s.n_requests == 4 for s in panel.summaries.values())
    assert not panel.running and panel.run_button.isEnabled()


def vllm_scrape(t: float, usage: float, running: int):
    """A vLLM /metrics scrape as the Load lab relays it: the recorded page with its KV use and running count set."""
    import re
    from pathlib import Path

    from engine.protocol import ServeMetrics
    from engine.remote.metrics import parse_prometheus, server_metrics

    text = (Path(__file__).parents[1] / "remote" / "streams" / "vllm-metrics.txt").read_text()
    text = re.sub(r"^(vllm:kv_cache_usage_perc\{.*\}) \S+$", rf"\g<1> {usage}", text, flags=re.M)
    text = re.sub(r"^(vllm:num_requests_running\{.*\}) \S+$", rf"\g<1> {running}.0", text, flags=re.M)
    return ServeMetrics(t=t, metrics=server_metrics(parse_prometheus(text)))


def test_a_real_servers_kv_use_sits_beside_the_labs(panel, bridge, events):
    assert not panel.served_note.isVisible()  # nothing from a server yet: no line
    for ev in events:
        panel.on_event(ev)
    for t, usage, running in ((0.5, 0.04, 2), (1.0, 0.125, 5), (1.5, 0.06, 1)):
        bridge.sig_serve_metrics.emit(vllm_scrape(t, usage, running))
    panel.flush()
    text = panel.served_note.text()
    assert panel.served_note.isVisible()
    assert "at most 12.5% in use" in text and "with 5 requests running" in text and "6.00% of its cache" in text
    co = panel.summaries["continuous"]
    assert f"peaked at {co.peak_paged_bytes / scheduling.MIB:.2f} MiB" in text
    bridge.sig_serve_done.emit(LabDone("serve"))  # the Load lab's next run replaces the figures
    bridge.sig_serve_metrics.emit(vllm_scrape(0.5, 0.01, 1))
    panel.flush()
    assert "at most 1.0% in use" in panel.served_note.text()
