"""Per-request timelines (engine.remote.timeline): what a load run keeps of each request, the Gantt's bars, the CSV,
JSON and Perfetto exports, and the plain data a session stores. A loopback stub streams known chunks; the references
are the stub's own script and figures recomputed here by hand, never the module's output."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from engine.remote import loadlab, timeline
from engine.remote.backend import RemoteBackend
from engine.remote.loadlab import RequestResult
from engine.remote.spans import ServerSpan, matches

PIECES = ("Hello", " there", ",", " friend", "!")


def _chunk(rid: str, text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    d = {"id": rid, "object": "text_completion", "model": "m",
         "choices": [{"index": 0, "text": text, "finish_reason": finish}] if usage is None else []}
    if usage is not None:
        d["usage"] = usage
    return f"data: {json.dumps(d)}\n\n".encode()


class Stub(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        body = json.dumps({"data": [{"id": "m", "object": "model"}]}).encode() if self.path == "/v1/models" else b"{}"
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length", 0))
        self.rfile.read(n)
        if not self.path.endswith("/completions"):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with self.server.lock:
            self.server.count += 1
            rid = self.rid = f"cmpl-stub{self.server.count}"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, p in enumerate(PIECES):
            self.wfile.write(_chunk(rid, p, "length" if i == len(PIECES) - 1 else None))
            self.wfile.flush()
        self.wfile.write(_chunk(rid, "", usage={"prompt_tokens": 7, "completion_tokens": len(PIECES),
                                                "total_tokens": 7 + len(PIECES)}))
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    srv.count, srv.lock = 0, threading.Lock()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_load_run_keeps_each_requests_timeline_and_the_gantt_draws_the_tables_figures(stub_url):
    b = RemoteBackend(stub_url)
    got: list[RequestResult] = []
    run = loadlab.run_once(b, 2, 4, len(PIECES), on_request=got.append, time_limit_s=30)
    assert run.completed == 4 and len(got) == 4
    for r in got:
        assert r.ok and r.concurrency == 2
        assert r.request_id.startswith("cmpl-stub")  # the stream's own id, as the stub named it
        assert r.pieces == PIECES and r.chunk_tokens == (1,) * len(PIECES)
        assert r.output_tokens == len(PIECES) and r.prompt_tokens == 7
        assert len(r.token_times_s) == len(PIECES) and not r.timeline_cut
        # the figures the table summarises are the timeline's own ends, the same subtractions
        assert r.token_times_s[0] == r.ttft_s and r.token_times_s[-1] == r.e2el_s
        np.testing.assert_allclose(np.diff(r.token_times_s), r.itl_s, rtol=0, atol=1e-9)
        assert r.end_s >= r.e2el_s and r.sent_wall_s > 0
    assert sorted(r.index for r in got) == [0, 1, 2, 3]
    assert len({r.request_id for r in got}) == 4
    bars = timeline.bars(got)
    assert [b.number for b in bars] == [0, 1, 2, 3]
    assert sorted(b.t0_s for b in bars) == [b.t0_s for b in bars] and bars[0].t0_s == 0.0
    for bar in bars:
        r = bar.result
        (k1, a1, e1), (k2, a2, e2) = bar.segments
        assert (k1, a1, e1) == ("waiting", 0.0, r.ttft_s) and (k2, a2, e2) == ("decode", r.ttft_s, r.e2el_s)
    # the table's percentiles, recomputed from what the Gantt draws, are the table's
    again = loadlab.summarize([b.result for b in bars], run.duration_s, 2, math.inf)
    ttft = np.array([b.segments[0][2] for b in bars]) * 1e3
    e2el = np.array([b.segments[1][2] for b in bars]) * 1e3
    assert again.median_ttft_ms == run.median_ttft_ms == float(np.median(ttft))
    assert run.p99_e2el_ms == float(np.percentile(e2el, 99))


def test_the_timeline_is_bounded(stub_url, monkeypatch):
    monkeypatch.setattr(loadlab, "MAX_TIMELINE", 3)
    monkeypatch.setattr(loadlab, "MAX_PIECES_CHARS", 8)
    got = []
    loadlab.run_once(RemoteBackend(stub_url), 1, 1, len(PIECES), on_request=got.append, time_limit_s=30)
    (r,) = got
    assert r.ok and r.timeline_cut and len(r.token_times_s) == 3 and len(r.itl_s) == len(PIECES) - 1
    assert "".join(r.pieces) == "Hello th"  # 8 characters in all
    bar = timeline.bars([r])[0]
    assert bar.e2el_s == r.e2el_s and bar.segments[-1] == ("decode", r.ttft_s, r.e2el_s)


def _request(sent: float, times: list[float], **kw) -> RequestResult:
    itl = tuple(np.diff(times)) if times else ()
    return RequestResult(ok=kw.pop("ok", True), ttft_s=times[0] if times else 0.0, e2el_s=times[-1] if times else 0.0,
                         itl_s=itl, output_tokens=len(times), sent_wall_s=sent, token_times_s=tuple(times),
                         chunk_tokens=(1,) * len(times), pieces=tuple(f"t{i}" for i in range(len(times))),
                         end_s=(times[-1] if times else 0.0) + 0.001, **kw)


def test_server_phases_sit_at_the_servers_arrival_on_the_clients_axis():
    span = ServerSpan(request_id="cmpl-a-0", start_wall_s=1000.002, end_wall_s=1000.2, ttft_s=0.05, e2el_s=0.19,
                      queue_s=0.01, prefill_s=0.04, decode_s=0.14)
    r = _request(1000.0, [0.055, 0.1, 0.195], request_id="cmpl-a", server=span)
    (bar,) = timeline.bars([r])
    # by hand: arrival 2 ms after sending; queue 10 ms, prefill 40 ms, decode 140 ms, back to back
    expect = [("queue", 0.002, 0.012), ("prefill", 0.012, 0.052), ("decode", 0.052, 0.192)]
    for (k, a, e), (k2, a2, e2) in zip(bar.server, expect, strict=True):
        assert k == k2 and a == pytest.approx(a2, abs=1e-9) and e == pytest.approx(e2, abs=1e-9)
    row = timeline.rows([r])[0]
    assert row["server_queue_ms"] == pytest.approx(10) and row["server_ttft_ms"] == pytest.approx(50)
    assert matches("cmpl-a-0", "cmpl-a") and not matches("cmpl-ab-0", "cmpl-a") and not matches("cmpl-a-x", "cmpl-a")


def test_perfetto_trace_by_hand():
    a = _request(50.0, [0.1, 0.15, 0.3], request_id="cmpl-a", concurrency=2, index=0)
    b = _request(50.25, [0.2, 0.22], request_id="cmpl-b", concurrency=2, index=1)
    failed = RequestResult(ok=False, error="boom", sent_wall_s=50.5, end_s=0.04)
    never = RequestResult(ok=False, error="not sent: time limit reached")
    trace = json.loads(json.dumps(timeline.perfetto([b, failed, never, a])))  # plain JSON, in any order given
    ev = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms"
    for e in ev:  # the trace-event format's required keys, by phase
        assert {"ph", "name", "pid", "tid"} <= set(e)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    slices = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in ev if e["ph"] == "X"]
    # by hand, in µs since the first send (a at 50.0 s): a on thread 1, b on 2 (sent 250 ms later), the failure on 3
    want = [(1, "request", 0, 300_000), (1, "waiting", 0, 100_000), (1, "decode", 100_000, 200_000),
            (1, "chunk 1", 100_000, 50_000), (1, "chunk 2", 150_000, 150_000),
            (2, "request", 250_000, 220_000), (2, "waiting", 250_000, 200_000), (2, "decode", 450_000, 20_000),
            (2, "chunk 1", 450_000, 20_000), (3, "request (failed)", 500_000, 40_000)]
    assert len(slices) == len(want)
    for got, exp in zip(slices, want, strict=True):
        assert got[:2] == exp[:2] and got[2] == pytest.approx(exp[2], abs=0.01) and got[3] == pytest.approx(
            exp[3], abs=0.01)
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[1].startswith("#0 C=2 cmpl-a") and names[2].startswith("#1 C=2 cmpl-b")


def test_csv_and_json_exports():
    a = _request(10.0, [0.1, 0.15, 0.3], request_id="cmpl-a", concurrency=1, index=0)
    import csv
    import io

    (row,) = list(csv.DictReader(io.StringIO(timeline.to_csv([a]))))
    assert float(row["ttft_ms"]) == pytest.approx(100) and float(row["e2el_ms"]) == pytest.approx(300)
    assert float(row["itl_max_ms"]) == pytest.approx(150) and row["request_id"] == "cmpl-a"
    assert row["server_ttft_ms"] == ""
    (j,) = json.loads(json.dumps(timeline.to_json([a]), allow_nan=False))["requests"]
    assert j["token_times_ms"] == pytest.approx([100, 150, 300]) and j["pieces"] == ["t0", "t1", "t2"]


def test_plain_data_round_trip_and_hostile_records():
    span = ServerSpan(request_id="cmpl-a-0", start_wall_s=1.0, end_wall_s=2.0, ttft_s=0.1)
    a = _request(10.0, [0.1, 0.15, 0.3], request_id="cmpl-a", concurrency=3, index=2, server=span)
    back, msg = timeline.restore([timeline.to_plain(a)])
    assert msg == "" and back == [a]
    good = timeline.to_plain(a)
    for bad, words in (({**good, "ttft_s": "fast"}, "ttft_s is a str"),
                       ({**good, "token_times_s": [0.3, 0.1]}, "go backwards"),
                       ({**good, "token_times_s": [float("nan")]}, "not a finite number"),
                       ({**good, "token_times_s": list(range(loadlab.MAX_TIMELINE + 1))}, "at most"),
                       ({**good, "pieces": ["x" * (loadlab.MAX_PIECES_CHARS + 1)]}, "bounded list"),
                       ({**good, "server": {"request_id": 3}}, "server span"),
                       ({**good, "server": {**timeline.to_plain(a)["server"], "ttft_s": "x"}}, "not a number"),
                       ({**good, "chunk_tokens": [1.5, 1, 1]}, "whole numbers"),
                       ("nope", "not a record")):
        got, msg = timeline.restore([good, bad])
        assert got == [a] and msg.startswith("1 saved load-lab request(s) skipped") and words in msg, (words, msg)
    assert timeline.restore({"a": 1}) == ([], "the session's load-lab requests are not a list")


def test_serve_bench_writes_the_timelines_and_receives_spans(stub_url, tmp_path):
    """`serve-bench --requests-out` (CSV, JSON, Perfetto by the name) and `--spans-port` from the command line."""
    import subprocess
    import sys

    from engine.remote.launch import free_port

    port = free_port()
    for name in ("r.csv", "r.json", "r.perfetto.json"):
        out = tmp_path / name
        p = subprocess.run([sys.executable, "-m", "engine", "serve-bench", "--url", stub_url, "--concurrency", "1",
                            "--num-prompts", "2", "--max-new-tokens", str(len(PIECES)), "--requests-out", str(out),
                            "--spans-port", str(port)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert f"receiving the server's spans at http://127.0.0.1:{port}/v1/traces" in p.stderr
    assert (tmp_path / "r.csv").read_text().count("\n") == 3
    assert len(json.loads((tmp_path / "r.json").read_text())["requests"]) == 2
    trace = json.loads((tmp_path / "r.perfetto.json").read_text())
    assert sum(1 for e in trace["traceEvents"] if e["name"] == "request") == 2


def test_a_session_file_keeps_the_timelines_with_their_spans(tmp_path):
    """Through the real session file (engine.session_file), not only the plain data: arrays, text and the span."""
    from engine.session_file import SavedSession, load_session, save_session

    span = ServerSpan("cmpl-a-0", 5.01, 5.3, "llm_request", 0.08, 0.28, 0.0, 0.07, 0.2, 3, 2)
    a = _request(5.0, [0.1, 0.3], request_id="cmpl-a", concurrency=2, index=1, server=span)
    b = RequestResult(ok=False, error="boom", sent_wall_s=5.5, end_s=0.01)
    save_session(tmp_path / "s.ilab", SavedSession(events=[], settings={"load_requests": [timeline.to_plain(a),
                                                                                          timeline.to_plain(b)]}))
    back, msg = timeline.restore(load_session(tmp_path / "s.ilab").settings["load_requests"])
    assert msg == "" and back == [a, b]
