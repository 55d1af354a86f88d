"""An OTLP/HTTP trace receiver on loopback: a serving engine's spans, kept by request id (engine.remote.spans).

vLLM exports one span per finished request when started with `--otlp-traces-endpoint URL` and, for this receiver,
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (its default is gRPC): the OpenTelemetry SDK POSTs protobuf
ExportTraceServiceRequests to URL (`SpanReceiver.endpoint`, ".../v1/traces"), in batches (OTEL_BSP_SCHEDULE_DELAY,
5 s unless set lower).

Whatever a sender does, the receiver stays bounded and says what happened in one line per kind of trouble
(`problems()`): a body over `max_body` bytes (or inflating past it) is refused with 413; one that is not an
ExportTraceServiceRequest (truncated, not protobuf) with 400; OTLP/JSON with 415; a span whose attributes have the
wrong types is skipped; more than `max_in_flight` exports at once are refused with 503 (a flood); a client that
sends its body slower than `read_timeout_s` is dropped; at most `max_spans` spans are kept (the oldest go first).
It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.remote.spans import COUNTS, LATENCIES, REQUEST_ID, ServerSpan

MAX_BODY = 4 << 20  # one export: the SDK's batches are 512 spans of ~1 kB
MAX_SPANS = 20_000
MAX_IN_FLIGHT = 8  # exports parsed at once
MAX_CONNECTIONS = 32  # connections open at once (idle or slow ones included)
READ_TIMEOUT_S = 5.0
MAX_PROBLEMS = 20  # distinct kinds of trouble remembered (each with its count)
PATH = "/v1/traces"


class OTLPError(ValueError):
    """An export could not be read; the message is one sentence."""


def _value(v) -> tuple[str, object]:
    """An OTLP AnyValue as (its kind, its Python value)."""
    kind = v.WhichOneof("value")
    return (kind or "empty"), (getattr(v, kind) if kind else None)


_KIND_WORDS = {"string_value": "text", "bool_value": "a boolean", "int_value": "an integer",
               "double_value": "a number", "array_value": "a list", "kvlist_value": "a map",
               "bytes_value": "bytes", "empty": "empty"}


def parse_export(body: bytes) -> tuple[list[ServerSpan], list[str]]:
    """The request spans of one ExportTraceServiceRequest (protobuf), and one sentence per span skipped.

    Spans without gen_ai.request.id are not requests' and are left out silently. OTLPError when the body is not
    an export at all."""
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        req = ExportTraceServiceRequest.FromString(body)
    except (DecodeError, RecursionError, ValueError) as e:
        raise OTLPError(f"an export that is not an OTLP trace request was refused ({type(e).__name__}: "
                        f"{str(e)[:80] or 'truncated or not protobuf'})") from None
    spans, skipped = [], []
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for sp in ss.spans:
                try:
                    span = _span(sp)
                except OTLPError as e:
                    skipped.append(str(e))
                    continue
                if span is not None:
                    spans.append(span)
    return spans, skipped


def _span(sp) -> ServerSpan | None:
    attrs = {}
    for kv in sp.attributes:
        attrs[kv.key] = _value(kv.value)
    if REQUEST_ID not in attrs:
        return None
    kind, rid = attrs[REQUEST_ID]
    if kind != "string_value" or not rid:
        raise OTLPError(f"a span's {REQUEST_ID} is {_KIND_WORDS.get(kind, kind)}, not text: that span is skipped")
    fields: dict = {}
    for key, name in LATENCIES.items():
        if key in attrs:
            kind, v = attrs[key]
            if kind not in ("double_value", "int_value") or v != v or abs(v) > 1e9:
                raise OTLPError(f"span {rid[:60]}: {key} is {_KIND_WORDS.get(kind, kind)}, not a number of "
                                "seconds: that span is skipped")
            fields[name] = float(v)
    for key, name in COUNTS.items():
        if key in attrs:
            kind, v = attrs[key]
            if kind != "int_value" or not 0 <= v <= 2**53:
                raise OTLPError(f"span {rid[:60]}: {key} is {_KIND_WORDS.get(kind, kind)}, not a token count: "
                                "that span is skipped")
            fields[name] = int(v)
    start, end = sp.start_time_unix_nano, sp.end_time_unix_nano
    if not start or end < start:
        raise OTLPError(f"span {rid[:60]} has no start time or ends before it starts: that span is skipped")
    return ServerSpan(request_id=rid[:200], start_wall_s=start / 1e9, end_wall_s=end / 1e9, name=sp.name[:100],
                      **fields)


def _inflate(data: bytes, encoding: str, cap: int) -> bytes:
    """A gzip/deflate body, inflated to at most `cap` bytes (OTLPError past it: a zip bomb stays small)."""
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, cap + 1)
    except zlib.error as e:
        raise OTLPError(f"an export's {encoding} body could not be inflated ({e})") from None
    if len(out) > cap:
        raise OTLPError(f"an export inflated past {cap >> 20} MB was refused")
    return out


class SpanReceiver:
    """The receiver: `start()`, give vLLM `endpoint`, read `span(id)` / `wait_for(ids)`, `stop()` (or `with`)."""

    def __init__(self, port: int = 0, max_body: int = MAX_BODY, max_spans: int = MAX_SPANS,
                 max_in_flight: int = MAX_IN_FLIGHT, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.max_body, self.max_spans, self.read_timeout_s = max_body, max_spans, read_timeout_s
        self._spans: OrderedDict[str, ServerSpan] = OrderedDict()
        self._problems: OrderedDict[str, int] = OrderedDict()
        self._cond = threading.Condition()
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self.exports = 0  # exports accepted
        self._server = _Server(("127.0.0.1", port), _handler(self), self)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        """The URL to give the server (`--otlp-traces-endpoint`)."""
        return f"http://127.0.0.1:{self.port}{PATH}"

    def start(self) -> SpanReceiver:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True, name="otlp-receiver")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> SpanReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what it holds --------------------------------------------------------------------------------------------
    def _add(self, spans: Iterable[ServerSpan]) -> None:
        with self._cond:
            dropped = 0
            for s in spans:
                self._spans.pop(s.request_id, None)
                self._spans[s.request_id] = s
                while len(self._spans) > self.max_spans:
                    self._spans.popitem(last=False)
                    dropped += 1
            self.exports += 1
            self._cond.notify_all()
        if dropped:
            self.problem(f"more than {self.max_spans} spans arrived: the oldest were dropped")

    def problem(self, message: str) -> None:
        """Remember one kind of trouble (counted), at most MAX_PROBLEMS kinds."""
        with self._cond:
            if message in self._problems or len(self._problems) < MAX_PROBLEMS:
                self._problems[message] = self._problems.get(message, 0) + 1

    def problems(self) -> list[str]:
        """One line per kind of trouble since the start, with how often it happened."""
        with self._cond:
            return [m if n == 1 else f"{m} (×{n})" for m, n in self._problems.items()]

    def span(self, request_id: str) -> ServerSpan | None:
        with self._cond:
            return self._spans.get(request_id)

    def __len__(self) -> int:
        with self._cond:
            return len(self._spans)

    def request_ids(self) -> list[str]:
        """The request ids of the spans held, oldest first."""
        with self._cond:
            return list(self._spans)

    def find(self, response_id: str) -> ServerSpan | None:
        """The span of a response (vLLM names the engine request after the response id plus "-<prompt index>")."""
        with self._cond:
            return self._spans.get(response_id) or self._spans.get(f"{response_id}-0")

    def wait_for(self, response_ids: Iterable[str], timeout_s: float) -> dict[str, ServerSpan]:
        """The spans of these responses, waiting up to `timeout_s` for the ones not here yet."""
        import time

        ids = [i for i in response_ids if i]
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                found = {i: s for i in ids if (s := self._spans.get(i) or self._spans.get(f"{i}-0")) is not None}
                left = deadline - time.monotonic()
                if len(found) == len(ids) or left <= 0:
                    return found
                self._cond.wait(left)


class _Server(ThreadingHTTPServer):
    """At most MAX_CONNECTIONS connections at once, each on its own thread; one more is closed at once."""

    daemon_threads = True
    request_queue_size = 16

    def __init__(self, address, handler, receiver: SpanReceiver) -> None:
        super().__init__(address, handler)
        self.receiver = receiver
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._connections.acquire(blocking=False):
            self.receiver.problem(f"more than {MAX_CONNECTIONS} connections to the trace receiver at once: the extra "
                                  "ones were closed")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()


def _handler(receiver: SpanReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = receiver.read_timeout_s  # a body sent a byte at a time ends here
        protocol_version = "HTTP/1.1"

        def log_message(self, *a) -> None:  # quiet: troubles go to problems()
            pass

        def _answer(self, status: int, body: bytes = b"", ctype: str = "application/x-protobuf") -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                if status >= 400:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                self.close_connection = True

        def _refuse(self, status: int, message: str) -> None:
            receiver.problem(message)
            self._answer(status, message.encode(), "text/plain; charset=utf-8")

        def do_GET(self) -> None:  # noqa: N802
            self._refuse(405, "the trace receiver takes OTLP exports (POST /v1/traces), not GET")

        def do_POST(self) -> None:  # noqa: N802
            if not receiver._slots.acquire(blocking=False):
                self._refuse(503, f"more than {MAX_IN_FLIGHT} span exports at once: the extra ones were refused")
                return
            try:
                self._export()
            finally:
                receiver._slots.release()

        def _read(self, n: int) -> bytes:
            """The body, within read_timeout_s in all (a drip of a byte a second ends too)."""
            import time

            deadline = time.monotonic() + receiver.read_timeout_s
            buf = bytearray()
            while len(buf) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                data = self.rfile.read1(min(n - len(buf), 1 << 16))
                if not data:
                    break
                buf += data
            return bytes(buf)

        def _export(self) -> None:
            if self.path.split("?")[0] != PATH:
                self._refuse(404, f"a span export to {self.path[:60]!r} was refused: the receiver listens on {PATH}")
                return
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if ctype != "application/x-protobuf":
                self._refuse(415, f"a span export as {ctype[:40] or 'no content type'} was refused: the receiver "
                                  "reads OTLP protobuf (set OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)")
                return
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self._refuse(411, "a span export without a Content-Length was refused")
                return
            n = int(length)
            if n > receiver.max_body:
                self._refuse(413, f"a span export of {n / 2**20:.1f} MB was refused: more than the "
                                  f"{receiver.max_body / 2**20:.0f} MB an export may be")
                return
            try:
                body = self._read(n)
            except (TimeoutError, OSError):
                receiver.problem(f"a span export was not sent within {receiver.read_timeout_s:.0f} s: dropped")
                self.close_connection = True
                return
            if len(body) < n:
                self._refuse(400, "a span export ended before its Content-Length: refused as truncated")
                return
            encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
            try:
                if encoding in ("gzip", "deflate"):
                    body = _inflate(body, encoding, receiver.max_body)
                elif encoding != "identity":
                    raise OTLPError(f"a span export in {encoding[:20]!r} encoding was refused")
                spans, skipped = parse_export(body)
            except OTLPError as e:
                self._refuse(400, str(e))
                return
            for s in skipped:
                receiver.problem(s)
            receiver._add(spans)
            self._answer(200)  # an empty ExportTraceServiceResponse: nothing rejected that the sender could retry

    return Handler


_RECEIVERS: dict[int, SpanReceiver] = {}
_RECEIVERS_LOCK = threading.Lock()


def receiver_on(port: int) -> SpanReceiver:
    """This process's receiver on 127.0.0.1:`port`, started at the first call and kept for the process's life (a
    server started with its endpoint exports there whenever it finishes a request). OTLPError, one sentence, when the
    port cannot be had."""
    if not 1 <= port <= 65535:
        raise OTLPError(f"the span receiver's port must be between 1 and 65535, not {port}")
    with _RECEIVERS_LOCK:
        rx = _RECEIVERS.get(port)
        if rx is None:
            try:
                rx = SpanReceiver(port).start()
            except OSError as e:
                raise OTLPError(f"the span receiver cannot listen on 127.0.0.1:{port}: {e.strerror or e}") from None
            _RECEIVERS[port] = rx
        return rx
