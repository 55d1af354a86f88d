"""The Fleet panel: the engine process watches a fleet from a config (two fake replicas on loopback with hand-written
/metrics, one of them exporting a span to its own port through the OpenTelemetry SDK), and the panel's table and
request list say what those answers say. A router that is not there, and a hostile replica, give one line each and the
app keeps running. tests/remote/test_fleet.py holds the attribution to real vLLM replicas' own logs."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.remote.launch import free_port
from engine.remote.loadlab import RequestResult
from tests.remote.test_otlp import VLLM_ATTRS, sdk_export

A = ("vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"
     "vllm:prefix_cache_queries_total 200\nvllm:prefix_cache_hits_total 50\nvllm:request_success_total 12\n")


def replica(text: bytes):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_the_panel_shows_each_replica_and_who_served_a_request(qtbot, window, tmp_path):
    good, bad = replica(A.encode()), replica(b"\xff" * 64)
    port = free_port()
    cfg = tmp_path / "fleet.json"
    cfg.write_text(json.dumps({"router": "http://127.0.0.1:9", "replicas": [
        {"url": f"http://127.0.0.1:{good.server_address[1]}", "name": "a", "spans_port": port},
        {"url": f"http://127.0.0.1:{bad.server_address[1]}", "name": "b"}]}))
    panel = window.panels["fleet"]
    got = []
    window.bridge.sig_fleet.connect(got.append)
    try:
        panel.source.setText(str(cfg))
        panel.watch()
        qtbot.waitUntil(lambda: bool(got) and len(got[-1].replicas) == 2, timeout=30_000)
        # replica a's span for response cmpl-abc (vLLM names the engine request cmpl-abc-0)
        sdk_export(f"http://127.0.0.1:{port}/v1/traces", [("llm_request", VLLM_ATTRS, 1_000_000_000,
                                                             2_500_000_000)])
        qtbot.waitUntil(lambda: bool(got[-1].served), timeout=30_000)
        panel._on_request(RequestResult(ok=True, ttft_s=0.025, output_tokens=4, index=0, request_id="cmpl-abc"))
        panel._on_request(RequestResult(ok=True, ttft_s=0.030, output_tokens=4, index=1, request_id="cmpl-zzz"))
        panel.flush()
        # by hand from A: 1 waiting, 2 running, KV 50%, 50 of 200 prefix queries hit, 12 done, 1 request served
        assert panel.rows()[0] == ("a", "1", "2", "50.0%", "25.0%", "–", "12", "1")
        assert panel.rows()[1][0] == "b ⚠" and "not UTF-8" in panel.summary()
        assert panel.request_rows() == [("1", "–", "30.0", "4"), ("0", "a", "25.0", "4")]
        assert panel.table.item(0, 3).text() == "50.0%" and panel.req_table.item(1, 1).text() == "a"
        assert list(panel.bars.opts["height"]) == [1.0, 0.0]
        # by hand: both requests went to the one server in use (none connected: this machine), TTFT p50 of 25 and 30
        assert panel.router_rows() == [("this machine", "2 of 2", "27.5", "a 1")]
        assert panel.routers.item(0, 2).text() == "27.5"

        got.clear()  # a router that is not there: one line, and the app goes on
        panel.source.setText(f"http://127.0.0.1:{free_port()}")
        panel.watch()
        qtbot.waitUntil(lambda: bool(got) and bool(got[-1].error), timeout=30_000)
        panel.flush()
        assert panel.summary().startswith("⚠ ") and "could not be read" in panel.summary()
        assert "\n" not in panel.summary()
        panel.stop_watching()
        with qtbot.waitSignal(window.bridge.sig_pong, timeout=30_000):  # the engine still answers
            window.bridge.ping()
    finally:
        window.bridge.watch_fleet("")
        good.shutdown()
        bad.shutdown()


def test_the_load_labs_shared_prefixes_are_fresh_for_each_level(qtbot, window):
    """'shared prefixes' in the Load lab: each level sends groups of prompts that share a long prefix
    (engine.remote.fleet.PREFIXES), and no level's prefixes are another's (so one cannot warm a cache for the next)."""
    import io
    import re

    from engine.remote import fleet as fl
    from tests.remote.test_timeline import Stub

    class Recording(Stub):
        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.endswith("/completions"):
                with self.server.lock:
                    self.server.prompts.append(json.loads(raw)["prompt"])
            self.rfile = io.BytesIO(raw)
            super().do_POST()

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    srv.count, srv.lock, srv.prompts = 0, threading.Lock(), []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        window.connect_server(f"http://127.0.0.1:{srv.server_address[1]}")
        qtbot.waitUntil(lambda: window.bridge.server is not None, timeout=30_000)
        lab = window.panels["load_lab"]
        lab.shared_check.setChecked(True)
        cfg = {**lab.config(), "concurrency": [1, 2], "num_prompts": 8, "max_new_tokens": 5}
        with qtbot.waitSignal(window.bridge.sig_serve_done, timeout=60_000):
            assert lab.run(cfg)
        got = srv.prompts
        assert len(got) == 16
        for level in (got[:8], got[8:]):
            groups = sorted(next(g for g, p in enumerate(fl.PREFIXES) if p in text) for text in level)
            assert groups == [0, 0, 1, 1, 2, 2, 3, 3]  # 4 shared prefixes, twice each
        salts = [re.match(r"Session (\d+)\. ", t).group(1) for t in got]
        assert len(set(salts[:8])) == 1 and len(set(salts[8:])) == 1 and salts[0] != salts[8]
    finally:
        srv.shutdown()
        srv.server_close()
