"""The OTLP/HTTP span receiver (engine.remote.otlp) against senders on loopback: the OpenTelemetry SDK's own exporter
(the reference encoder: spans go in through the SDK and must come out with the values set), then hostile senders —
truncated, oversized, a zip bomb, wrong types, OTLP/JSON, a drip, a flood of exports and of idle connections. Each
trouble is one line in problems(), memory stays bounded, and the receiver still takes a good export afterwards."""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import time

import pytest

from engine.remote.otlp import MAX_CONNECTIONS, SpanReceiver

VLLM_ATTRS = {"gen_ai.request.id": "cmpl-abc-0", "gen_ai.latency.time_to_first_token": 0.25,
              "gen_ai.latency.e2e": 1.5, "gen_ai.latency.time_in_queue": 0.01,
              "gen_ai.latency.time_in_model_prefill": 0.2, "gen_ai.latency.time_in_model_decode": 1.2,
              "gen_ai.usage.prompt_tokens": 9, "gen_ai.usage.completion_tokens": 32}


def sdk_export(endpoint: str, spans: list[tuple[str, dict, int, int]]) -> None:
    """Send spans (name, attributes, start ns, end ns) through the OpenTelemetry SDK's OTLP/HTTP exporter."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=5)))
    tracer = provider.get_tracer("test")
    for name, attrs, start, end in spans:
        span = tracer.start_span(name, start_time=start, attributes=attrs)
        span.end(end_time=end)
    provider.shutdown()


def export_bytes(spans: list[tuple[str, dict, int, int]]) -> bytes:
    """The protobuf body the SDK would send (its own encoder)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    got = []

    class Keep(SpanExporter):
        def export(self, s):
            got.extend(s)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("test")
    for name, attrs, start, end in spans:
        tracer.start_span(name, start_time=start, attributes=attrs).end(end_time=end)
    provider.shutdown()
    return encode_spans(got).SerializeToString()


def post(rx: SpanReceiver, body: bytes, headers: dict | None = None) -> int:
    c = http.client.HTTPConnection("127.0.0.1", rx.port, timeout=10)
    try:
        h = {"Content-Type": "application/x-protobuf", **(headers or {})}
        c.request("POST", "/v1/traces", body=body, headers=h)
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


@pytest.fixture
def rx():
    with SpanReceiver(max_spans=100, read_timeout_s=1.0) as r:
        yield r


GOOD = [("llm_request", VLLM_ATTRS, 1_700_000_000_000_000_000, 1_700_000_001_500_000_000)]


def test_the_sdks_export_comes_out_with_the_values_set(rx):
    sdk_export(rx.endpoint, GOOD + [("other", {"x": 1}, 5, 6)])  # a span that is no request's is left out
    s = rx.span("cmpl-abc-0")
    assert s is not None and len(rx) == 1 and rx.problems() == []
    assert rx.find("cmpl-abc") is s  # by the response's id, as the client knows it
    assert s.name == "llm_request" and s.start_wall_s == 1_700_000_000.0 and s.end_wall_s == 1_700_000_001.5
    assert (s.ttft_s, s.e2el_s, s.queue_s, s.prefill_s, s.decode_s) == (0.25, 1.5, 0.01, 0.2, 1.2)
    assert (s.prompt_tokens, s.completion_tokens) == (9, 32)
    assert rx.wait_for(["cmpl-abc", "cmpl-missing"], timeout_s=0.05) == {"cmpl-abc": s}


def test_hostile_exports_each_get_one_line_and_the_receiver_goes_on(rx):
    good = export_bytes(GOOD)
    cases = [
        (lambda: post(rx, good[: len(good) // 2]), 400, "not an OTLP trace request"),
        (lambda: post(rx, b"\x00" * 64, {"Content-Length": str(64 << 20)}), 413, "more than the 4 MB"),
        (lambda: post(rx, gzip.compress(b"\x00" * (8 << 20)), {"Content-Encoding": "gzip"}), 400,
         "inflated past 4 MB"),
        (lambda: post(rx, b'{"resourceSpans": []}', {"Content-Type": "application/json"}), 415, "reads OTLP protobuf"),
        (lambda: post(rx, good, {"Content-Encoding": "br"}), 400, "encoding was refused"),
    ]
    for send, status, words in cases:
        before = len(rx.problems())
        assert send() == status
        new = rx.problems()[before:]
        assert len(new) == 1 and words in new[0] and "\n" not in new[0], (words, new)
    wrong = export_bytes([("llm_request", {**VLLM_ATTRS, "gen_ai.latency.e2e": "slow"}, 10, 20),
                          ("llm_request", {**VLLM_ATTRS, "gen_ai.request.id": "cmpl-ok-0"}, 10, 20),
                          ("llm_request", {**VLLM_ATTRS, "gen_ai.request.id": 7}, 10, 20),
                          ("llm_request", {**VLLM_ATTRS, "gen_ai.request.id": "cmpl-n-0",
                                           "gen_ai.usage.completion_tokens": 1.5}, 10, 20)])
    assert post(rx, wrong) == 200
    assert rx.span("cmpl-ok-0") is not None and rx.span("cmpl-abc-0") is None and len(rx) == 1
    p = rx.problems()
    assert any("gen_ai.latency.e2e is text, not a number of seconds" in m for m in p)
    assert any("gen_ai.request.id is an integer, not text" in m for m in p)
    assert any("completion_tokens is a number, not a token count" in m for m in p)
    assert post(rx, good) == 200 and rx.span("cmpl-abc-0") is not None  # still taking exports


def test_a_drip_is_dropped_and_a_flood_stays_bounded(rx):
    s = socket.create_connection(("127.0.0.1", rx.port))
    s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
              b"Content-Length: 100\r\n\r\n")
    for _ in range(4):  # a byte every 0.4 s: past the 1 s the receiver allows for a body
        try:
            s.sendall(b"\x0a")
        except OSError:
            break
        time.sleep(0.4)
    s.close()
    deadline = time.monotonic() + 10
    while not any("not sent within 1 s" in m for m in rx.problems()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("not sent within 1 s" in m for m in rx.problems())

    # a flood of exports: 600 distinct spans from 12 threads; at most max_spans (100) are kept
    def many(k: int) -> None:
        spans = [("llm_request", {**VLLM_ATTRS, "gen_ai.request.id": f"cmpl-f{k}-{i}"}, 10, 20) for i in range(50)]
        body = export_bytes(spans)
        for _ in range(2):
            try:
                post(rx, body)
            except OSError:
                pass  # a refused connection is the flood's own business

    threads = [threading.Thread(target=many, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert 0 < len(rx) <= 100
    assert any("oldest were dropped" in m for m in rx.problems())

    assert post(rx, export_bytes(GOOD)) == 200 and rx.span("cmpl-abc-0") is not None


def test_idle_connections_past_the_cap_are_closed():
    """Idle connections past the cap are closed at once, and the receiver serves again when they go (a receiver
    that waits 10 s for a request: the idle ones hold their places meanwhile)."""
    with SpanReceiver(read_timeout_s=10.0) as rx:
        _idle_flood(rx)


def _idle_flood(rx: SpanReceiver) -> None:
    idle = [socket.create_connection(("127.0.0.1", rx.port)) for _ in range(MAX_CONNECTIONS + 8)]
    deadline = time.monotonic() + 10
    while not any("connections to the trace receiver at once" in m for m in rx.problems()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("connections to the trace receiver at once" in m for m in rx.problems())
    for c in idle:
        c.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if post(rx, export_bytes(GOOD)) == 200:
                break
        except OSError:
            time.sleep(0.1)
    assert rx.span("cmpl-abc-0") is not None
    assert len(rx.problems()) <= 20 and all("\n" not in m for m in rx.problems())
