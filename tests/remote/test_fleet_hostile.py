"""The fleet's reading of configs, a router's listing and replicas' /metrics, held to hand-made answers and hostile
ones from fake servers on loopback: truncated, oversized, wrong types, a flood, a drip. Each gets one FleetError
sentence, what is good beside it is still read, and nothing waits past its bound."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from engine.remote import fleet as fl
from engine.remote.fleet import Fleet, FleetError, Replica

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:generation_tokens_total{engine="0",model_name="m"} 640.0
"""


class Fake:
    """A loopback HTTP server whose answer per path is a function (handler) -> None."""

    def __init__(self, routes: dict):
        routes = routes

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                fn = routes.get(self.path)
                if fn is None:
                    self.send_error(404)
                    return
                try:
                    fn(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def body(data: bytes | str, status: int = 200, length: bool = True):
    raw = data.encode() if isinstance(data, str) else data

    def send(h):
        h.send_response(status)
        if length:
            h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)
    return send


def endless(h):
    """A /metrics that never ends (no length, closed only by the reader)."""
    h.send_response(200)
    h.end_headers()
    line = b"vllm:num_requests_running 1\n" * 4096
    for _ in range(100_000):
        h.wfile.write(line)


def drip(h):
    """Headers a byte at a time, slower than any deadline."""
    for ch in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 1000:
        h.wfile.write(bytes([ch]))
        h.wfile.flush()
        time.sleep(0.2)


def one_sentence(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg and 0 < len(msg) < 300, msg
    return msg


# ------------------------------------------------------------------------------------------------------ configs

def test_a_json_and_a_toml_config_give_the_same_fleet():
    j = fl.parse_config(json.dumps({"router": "http://127.0.0.1:30000", "replicas": [
        "127.0.0.1:8001", {"url": "http://127.0.0.1:8002/", "name": "b", "spans_port": 4319}]}))
    t = fl.parse_config('router = "http://127.0.0.1:30000"\nreplicas = ["127.0.0.1:8001"]\n'
                        '[[more]]\n')  # a table the fleet does not use is ignored
    assert j.router == t.router == "http://127.0.0.1:30000"
    assert j.replicas == (Replica("http://127.0.0.1:8001", "replica 1"), Replica("http://127.0.0.1:8002", "b", 4319))
    assert t.replicas[0] == j.replicas[0]


@pytest.mark.parametrize("text, words", [
    ('{"router": "http://127.0.0.1:1", "replicas": ["http://127.0.0.1:2"', "not valid JSON"),  # truncated
    ('router = "http://x:1"\nreplicas = [', "neither JSON nor valid TOML"),
    ('[1, 2]', "neither JSON nor valid TOML"),
    ('{"replicas": ["http://127.0.0.1:2"]}', "names no router"),
    ('{"router": 5, "replicas": ["http://127.0.0.1:2"]}', "int, not a URL"),
    ('{"router": "ftp://127.0.0.1:1", "replicas": ["http://127.0.0.1:2"]}', "not a server URL"),
    ('{"router": "http://127.0.0.1:1", "replicas": "http://127.0.0.1:2"}', "not a list"),
    ('{"router": "http://127.0.0.1:1", "replicas": []}', "no replica"),
    ('{"router": "http://127.0.0.1:1", "replicas": [{"url": "http://127.0.0.1:2", "spans_port": "4318"}]}',
     "not a port"),
    ('{"router": "http://127.0.0.1:1", "replicas": [{"url": "http://127.0.0.1:2", "spans_port": true}]}',
     "not a port"),
    ('{"router": "http://127.0.0.1:1", "replicas": [{"url": "http://127.0.0.1:2", "name": ["x"]}]}',
     "not text"),
    ('{"router": "http://127.0.0.1:1", "replicas": ["http://127.0.0.1:2", "127.0.0.1:2"]}', "twice"),
    ('{"router": "http://127.0.0.1:1", "replicas": [null]}', "NoneType, not a URL"),
    ("{\"router\": " + "[" * 60_000, "not valid JSON"),  # deep nesting, within the size bound
])
def test_a_bad_config_is_one_sentence(text, words):
    with pytest.raises(FleetError) as e:
        fl.parse_config(text)
    assert words in one_sentence(e.value)


def test_an_oversized_or_binary_config_is_refused_unread(tmp_path):
    with pytest.raises(FleetError, match="at most 64 KiB"):
        fl.parse_config(b"{" + b" " * (fl.MAX_CONFIG + 1))
    with pytest.raises(FleetError, match="UTF-8"):
        fl.parse_config(b"\xff\xfe{}")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (10 * fl.MAX_CONFIG))
    with pytest.raises(FleetError, match="at most 64 KiB"):
        fl.load_config(big)
    with pytest.raises(FleetError, match="cannot read"):
        fl.load_config(tmp_path / "none.toml")


# ---------------------------------------------------------------------------------------------- router listing

def test_vllm_routers_listing_becomes_the_replicas():
    got = fl.parse_listing(b'{"urls":["http://127.0.0.1:50269","http://127.0.0.1:43599"]}')  # as 0.1.17 answers
    assert [r.url for r in got] == ["http://127.0.0.1:50269", "http://127.0.0.1:43599"]
    assert [r.name for r in got] == ["replica 1", "replica 2"]


@pytest.mark.parametrize("raw, words", [
    (b'{"urls":["http://127.0.0.1:1"', "not JSON"),
    (b'<html>502</html>', "not JSON"),
    (b'{"workers": []}', "no \"urls\""),
    (b'{"urls": "http://127.0.0.1:1"}', "not a list"),
    (b'{"urls": [1, 2]}', "int, not a URL"),
    (json.dumps({"urls": [f"http://127.0.0.1:{p}" for p in range(1000, 11000)]}).encode(), "at most 16"),  # flood
    (b'{"urls": [' + b'"http://127.0.0.1:1",' * 20000 + b'"x"]}', "over 256 KiB"),
])
def test_a_bad_listing_is_one_sentence(raw, words):
    with pytest.raises(FleetError) as e:
        fl.parse_listing(raw)
    assert words in one_sentence(e.value)


def test_a_router_that_lists_badly_over_http_is_one_sentence():
    routes = {"/list_workers": body('{"urls": [7]}')}
    with Fake(routes) as router:
        with pytest.raises(FleetError, match="replica 1 is int"):
            Fleet.from_router(router.url)
        routes["/list_workers"] = body("no", status=500)
        with pytest.raises(FleetError, match="answered HTTP 500"):
            Fleet.from_router(router.url)
        routes["/list_workers"] = body(json.dumps({"urls": [router.url]}))
        assert Fleet.from_router(router.url).replicas == (Replica(router.url, "replica 1"),)


# -------------------------------------------------------------------------------------------- replicas' /metrics

def test_figures_from_a_scrape_by_hand():
    m = fl.parse_prometheus(VLLM_METRICS)
    f = fl.figures("a", "http://x", m, previous=(10.0, 580.0), now_s=12.0)
    # by hand: 3 waiting, 2 running, KV 0.25, 100 of 400 prefix queries hit, (640 - 580) / 2 s, 7 + 1 requests
    assert (f.waiting, f.running, f.kv_usage, f.prefix_hit_rate) == (3.0, 2.0, 0.25, 0.25)
    assert f.tokens_per_s == 30.0 and f.requests_done == 8.0
    assert fl.figures("a", "x", m, None, 12.0).tokens_per_s is None  # no scrape before: no rate
    assert fl.figures("a", "x", m, (10.0, 700.0), 12.0).tokens_per_s is None  # a counter that went back: restarted


def test_wrong_numbers_in_metrics_are_left_out():
    m = fl.parse_prometheus("vllm:kv_cache_usage_perc 7\nvllm:prefix_cache_queries_total 10\n"
                            "vllm:prefix_cache_hits_total 11\nvllm:num_requests_running NaN\n"
                            "vllm:num_requests_waiting x\n")
    f = fl.figures("a", "x", m, None, 0.0)
    assert f.kv_usage is None and f.prefix_hit_rate is None and f.running is None and f.waiting is None


def test_a_hostile_replica_gets_one_line_and_the_good_one_is_still_read():
    routes = {"/metrics": body(VLLM_METRICS)}
    bad_routes: dict = {}
    with Fake(routes) as good, Fake(bad_routes) as bad:
        f = Fleet(router=good.url, replicas=(Replica(good.url, "good"), Replica(bad.url, "bad")))
        cases = [
            (body("x" * (fl.MAX_METRICS + 1)), "at most 4096 KiB"),  # oversized, announced
            (endless, "more than 4096 KiB"),  # oversized, never ending (a flood of samples)
            (body(b"\xff\xfe" * 100, length=False), "not UTF-8"),
            (body("process_cpu_seconds_total 1\n"), "no vllm: figures"),  # not a vLLM
            (body("", status=503), "answered HTTP 503"),
            (body('{"vllm:num_requests_running": "two"}'), "no vllm: figures"),  # wrong types: JSON, not text
        ]
        for handler, words in cases:
            bad_routes["/metrics"] = handler
            good_fig, bad_fig = f.scrape()
            assert words in one_sentence(bad_fig.error), bad_fig.error
            assert bad_fig.running is None
            assert good_fig.error == "" and good_fig.running == 2.0 and good_fig.requests_done == 8.0


def test_a_replica_that_drips_is_cut_at_the_deadline():
    with Fake({"/metrics": drip}) as slow:
        f = Fleet(router=slow.url, replicas=(Replica(slow.url, "slow"),))
        (fig,) = f.scrape(timeout_s=0.5)
        assert "did not finish its answer within 0.5 s" in one_sentence(fig.error)


def test_nothing_listening_is_one_sentence():
    from engine.remote.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"
    (fig,) = Fleet(router=url, replicas=(Replica(url, "gone"),)).scrape()
    assert "could not be read" in one_sentence(fig.error)


# ------------------------------------------------------------------------------------------- what a run shows

def test_p50_is_numpys_median():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 64):
        xs = list(rng.exponential(50.0, n))
        assert fl.p50(xs) == pytest.approx(float(np.percentile(xs, 50)))
    assert fl.p50([]) is None


def test_prefix_affinity_by_hand():
    groups = [0, 1, 0, 1, 0, 1, 0, 1]
    assert fl.prefix_affinity(groups, ["a", "b"] * 4) == 1.0  # each group stayed on one replica
    assert fl.prefix_affinity(groups, ["a", "a", "b", "b"] * 2) == 0.5  # round-robin against 2 groups
    assert fl.prefix_affinity(groups, ["a", None, "a", None, "b", None, None, None]) == pytest.approx(2 / 3)
    assert fl.prefix_affinity(groups, [None] * 8) is None


def test_shared_prefix_prompts_share_their_group_prefix_and_a_salt_separates_runs():
    ps = fl.shared_prefix_prompts(16, 4)
    assert [g for g, _ in ps] == [0, 1, 2, 3] * 4
    assert all(t.startswith(fl.PREFIXES[g]) for g, t in ps)
    assert len({t for _, t in ps}) == 16  # each a different question
    other = fl.shared_prefix_prompts(16, 4, salt=1)
    assert all(not a.startswith(b[:20]) for (_, a), (_, b) in zip(ps, other, strict=True))


def test_the_cli_says_one_line_for_a_bad_config(tmp_path):
    cfg = tmp_path / "fleet.toml"
    cfg.write_text('router = "http://127.0.0.1:1"\nreplicas = [3]\n')
    p = subprocess.run([sys.executable, "-m", "engine", "fleet", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == ["error: replica 1 is int, not a URL"]


def test_the_cli_prints_each_replicas_figures_from_the_routers_listing():
    with Fake({"/metrics": body(VLLM_METRICS)}) as replica, \
            Fake({"/list_workers": body(json.dumps({"urls": [replica.url]}))}) as router:
        p = subprocess.run([sys.executable, "-m", "engine", "fleet", "--router", router.url, "--json"],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (fig,) = json.loads(p.stdout)["replicas"]
    # by hand, from VLLM_METRICS
    assert (fig["url"], fig["waiting"], fig["running"], fig["kv_usage"], fig["prefix_hit_rate"],
            fig["requests_done"], fig["error"]) == (replica.url, 3.0, 2.0, 0.25, 0.25, 8.0, "")
