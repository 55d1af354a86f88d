"""The Requests panel: the Load lab's requests as a Gantt. Against a loopback stub server (tests/remote/test_timeline's
Stub streams five known chunks per request): what the Gantt draws equals the Load lab's own table, a click shows a
request's tokens, the exports are written, and a session keeps the runs and the timelines."""

from __future__ import annotations

import csv
import json
import threading
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
from PySide6 import QtCore

from app import session_io
from app.panels.load_lab import COLUMNS
from app.panels.requests import ROW_HEIGHT, SERVER_GAP
from tests.remote.test_otlp import export_bytes
from tests.remote.test_timeline import PIECES, Stub


@pytest.fixture
def stub_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    srv.count, srv.lock = 0, threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def drawn(item, dy: float = -ROW_HEIGHT / 2) -> dict[int, tuple[float, float]]:
    """A bar item's bars as {row: (x0, x1)}: what is on the screen (the client's bars start at row - 0.35, the
    server's at row + 0.35)."""
    o = item.opts
    rows = np.rint(np.asarray(o["y0"]) - dy).astype(int)
    return {int(r): (float(a), float(b)) for r, a, b in zip(rows, o["x0"], o["x1"], strict=True)}


def test_the_gantt_draws_the_load_labs_figures_and_a_session_keeps_them(qtbot, window, stub_url, tmp_path):
    window.connect_server(stub_url)
    qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
    lab, req = window.panels["load_lab"], window.panels["requests"]
    with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000):
        assert lab.run({"concurrency": [1, 3], "num_prompts": 3, "max_new_tokens": len(PIECES),
                        "request_rate": None, "burstiness": 1.0, "time_limit_s": 30.0})
    lab.flush()
    req.flush()
    assert len(req.bars) == 6 and all(b.result.ok for b in req.bars)
    waiting, decode = drawn(req.segment_items["waiting"]), drawn(req.segment_items["decode"])
    assert sorted(waiting) == sorted(decode) == list(range(6))
    for b in req.bars:
        (w0, w1), (d0, d1) = waiting[b.number], decode[b.number]
        # the bar's amber part is the request's TTFT, the whole bar its E2EL (to float rounding of the offset)
        assert w1 - w0 == pytest.approx(b.result.ttft_s, abs=1e-9) and w1 == d0
        assert d1 - w0 == pytest.approx(b.result.e2el_s, abs=1e-9)
    # per level, the drawn bars' percentiles are the Load lab table's cells
    for i, run in enumerate(lab.runs):
        level = [b for b in req.bars if b.result.concurrency == run["concurrency"]]
        assert len(level) == 3
        ttft = np.array([waiting[b.number][1] - waiting[b.number][0] for b in level]) * 1e3
        e2el = np.array([decode[b.number][1] - waiting[b.number][0] for b in level]) * 1e3
        assert lab.table.item(i, COLUMNS.index("TTFT p50")).text() == f"{np.median(ttft):.0f}"
        assert lab.table.item(i, COLUMNS.index("TTFT p99")).text() == f"{np.percentile(ttft, 99):.0f}"
        assert lab.table.item(i, COLUMNS.index("E2EL p99")).text() == f"{np.percentile(e2el, 99):.0f}"
        assert run["median_ttft_ms"] == pytest.approx(float(np.median(ttft)), abs=1e-6)
    # the panel's own table shows each request's figures
    assert req.table.rowCount() == 6
    col = [h for h, _ in __import__("app.panels.requests", fromlist=["TABLE"]).TABLE].index("TTFT ms")
    for b in req.bars:
        assert req.table.item(b.number, col).text() == f"{b.result.ttft_s * 1e3:.1f}"

    # a click on row 4 shows that request's tokens and timings
    dock = window.docks["requests"]
    dock.show()
    dock.raise_()
    dock.resize(900, 700)
    qtbot.waitUntil(lambda: req.plot_widget.isVisible() and req.plot_widget.height() > 100, timeout=10_000)
    req.mark_dirty()
    req.flush()
    vb = req.plot.getViewBox()
    vb.autoRange()
    bar = req.bars[4]
    scene = vb.mapViewToScene(QtCore.QPointF(bar.t0_s + bar.result.e2el_s / 2, 4.0))
    pos = req.plot_widget.mapFromScene(scene)
    qtbot.mouseClick(req.plot_widget.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=pos)
    req.flush()
    assert req.selected == 4
    text = req.detail.toPlainText()
    assert text.startswith("request #4") and all(json.dumps(p) in text for p in PIECES)
    assert f"TTFT {bar.result.ttft_s * 1e3:.1f} ms" in text

    # exports: CSV one row per request, JSON with every chunk, a Perfetto trace
    req.export(str(tmp_path / "r.csv"))
    req.export(str(tmp_path / "r.json"))
    req.export(str(tmp_path / "r.perfetto.json"))
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert len(rows) == 6 and float(rows[4]["ttft_ms"]) == pytest.approx(bar.result.ttft_s * 1e3)
    assert len(json.loads((tmp_path / "r.json").read_text())["requests"][0]["token_times_ms"]) == len(PIECES)
    trace = json.loads((tmp_path / "r.perfetto.json").read_text())
    assert sum(1 for e in trace["traceEvents"] if e.get("name") == "request") == 6

    # a session keeps the levels and the timelines; opening it shows them again
    runs, requests = [dict(r) for r in lab.runs], list(req.requests)
    assert session_io.save_session_to(window, tmp_path / "load.ilab"), window.last_error
    lab.restore_results({"runs": []})
    req.restore_results([])
    assert lab.runs == [] and req.requests == []
    assert session_io.open_session_from(window, tmp_path / "load.ilab"), window.last_error
    window.tick_panels(flush=True)
    assert lab.runs == runs and req.requests == requests
    assert lab.table.rowCount() == 2 and len(req.bars) == 6


def test_a_damaged_sessions_load_lab_part_is_one_sentence(qtbot, window):
    lab, req = window.panels["load_lab"], window.panels["requests"]
    msg = req.restore_results([{"ok": True, "ttft_s": "soon"}, 7])
    assert msg == "2 saved load-lab request(s) skipped: its ttft_s is a str, not a float" and req.requests == []
    assert lab.restore_results({"runs": [{"concurrency": 1, "completed": "all"}]}).startswith("1 saved load-lab")
    window.tick_panels(flush=True)
    assert req.status_label.text().startswith("⚠ 2 saved") and lab.status_label.text().startswith("⚠ 1 saved")


class TracedStub(Stub):
    """The stub, which also exports a vLLM-like span for each request to the receiver at server.spans_port, as
    vLLM would: started at the request's arrival, TTFT and E2EL from its own clock."""

    def do_POST(self):  # noqa: N802
        import time

        arrival = time.time()
        super().do_POST()
        if not self.path.endswith("/completions"):
            return
        done = time.time()
        rid = f"{self.rid}-0"  # the engine request's id: the response's, with "-0"
        attrs = {"gen_ai.request.id": rid, "gen_ai.latency.time_to_first_token": 0.0005,
                 "gen_ai.latency.e2e": done - arrival, "gen_ai.latency.time_in_queue": 0.0001,
                 "gen_ai.latency.time_in_model_prefill": 0.0004,
                 "gen_ai.latency.time_in_model_decode": max(0.0, done - arrival - 0.0005),
                 "gen_ai.usage.prompt_tokens": 7, "gen_ai.usage.completion_tokens": len(PIECES)}
        body = export_bytes([("llm_request", attrs, int(arrival * 1e9), int(done * 1e9))])
        import http.client

        c = http.client.HTTPConnection("127.0.0.1", self.server.spans_port, timeout=10)
        c.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
        c.getresponse().read()
        c.close()


def test_the_servers_spans_reach_the_gantt(qtbot, window):
    """With 'server spans' on, the engine process receives the spans (its own receiver on the port asked for), the
    level's requests come back with them, and the Gantt draws the server's phases under each row."""
    from engine.remote.launch import free_port

    srv = ThreadingHTTPServer(("127.0.0.1", 0), TracedStub)
    srv.count, srv.lock, srv.spans_port = 0, threading.Lock(), free_port()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        window.connect_server(f"http://127.0.0.1:{srv.server_address[1]}")
        qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
        lab, req = window.panels["load_lab"], window.panels["requests"]
        lab.spans_check.setChecked(True)
        lab.spans_port.setValue(srv.spans_port)
        cfg = {**lab.config(), "concurrency": [2], "num_prompts": 4, "max_new_tokens": len(PIECES)}
        assert cfg["spans_port"] == srv.spans_port
        with qtbot.waitSignal(window.bridge.sig_serve_spans, timeout=60_000) as spans:
            with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000):
                assert lab.run(cfg)
        notice = spans.args[0]
        assert notice.endpoint == f"http://127.0.0.1:{srv.spans_port}/v1/traces" and notice.problems == ()
        req.flush()
        assert len(req.bars) == 4 and all(b.result.server is not None for b in req.bars)
        for b in req.bars:
            assert b.result.server.request_id == f"{b.result.request_id}-0"
        queue = drawn(req.server_items["queue"], ROW_HEIGHT / 2 + SERVER_GAP)
        assert sorted(queue) == [0, 1, 2, 3]
        assert "4 with the server's spans" in req.status_label.text()
        req.select(1)
        req.flush()
        assert "server: queue" in req.detail.toPlainText()
    finally:
        srv.shutdown()
        srv.server_close()
