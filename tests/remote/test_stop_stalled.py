"""Stop reaches a generation on a server that has stalled mid-stream: the engine process ends the run within about a
second and stays usable (a stub server on loopback stalls after two tokens and never sends more)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine import protocol as P
from engine.events import Finished, RunStarted, TokenSampled
from engine.protocol import GenerateRequest, SamplingParams
from tests.engine.test_server import Client

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "someone"}]}).encode()


def chunk(text: str) -> bytes:
    d = {"id": "x", "object": "text_completion", "model": "m",
         "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(d).encode() + b"\n\n"


class Stalling(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):  # noqa: N802
        body = MODELS if self.path == "/v1/models" else b'{"detail": "Not Found"}'
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not self.path.startswith("/v1/"):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(chunk("Hello") + chunk(" there"))
        self.wfile.flush()
        self.server.release.wait(60)  # stall: no more bytes until the test ends


def test_stop_ends_a_run_on_a_stalled_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    httpd.release = threading.Event()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    c = Client()  # the engine server in a thread, as the app drives it
    try:
        c.send(P.Connect(f"http://127.0.0.1:{httpd.server_address[1]}"))
        connected = c.until(lambda m: isinstance(m, (P.Connected, P.ConnectFailed)), 30)[-1]
        assert isinstance(connected, P.Connected), connected
        c.send(P.Generate(GenerateRequest("hi", chat=False, max_new_tokens=50,
                                          params=SamplingParams.greedy_params())))
        seen = c.until(lambda m: isinstance(m, TokenSampled) and m.step == 1, 30)  # both tokens, then the stall
        c.send(P.Stop())
        # The contract is about a second; 10 s is only a hang guard on a busy machine (no timing is asserted).
        fin = c.until(lambda m: isinstance(m, Finished), 10)[-1]
        assert fin.reason == "stopped" and len(fin.ids) == 2
        c.until(lambda m: m == P.State("idle"), 10)
        source = next(m for m in seen if isinstance(m, RunStarted)).source
        assert source.kind == "server" and not source.can("attention")
        c.send(P.Ping(1))  # the engine is free again
        c.until(lambda m: isinstance(m, P.Pong), 10)
    finally:
        httpd.release.set()
        c.send(P.Quit())
        c.thread.join(10)
        httpd.shutdown()
    assert not c.thread.is_alive()
