"""Every way a server can fail gives one clear line, from the client and from the CLI (a misbehaving stub server on
loopback stands in for the failures a real server rarely shows on demand; real servers are in test_real_servers)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.remote.backend import RemoteBackend
from engine.remote.client import Client, RemoteError
from engine.run.sampling import SamplingParams

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "someone"}]}).encode()


def chunk(text: str, finish: str | None = None) -> bytes:
    d = {"id": "x", "object": "text_completion", "model": "m",
         "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(d).encode() + b"\n\n"


class Handler(BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *a):  # quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        mode = self.server.mode
        if mode == "html":
            self._send(200, b"<html>hello</html>", "text/html")
        elif mode == "401":
            self._send(401, b'{"error": "Unauthorized"}')
        elif self.path == "/v1/models":
            self._send(200, MODELS)
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def do_POST(self):  # noqa: N802
        mode = self.server.mode
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path.startswith("/extras") or self.path.startswith("/tokenize"):
            self._send(404, b'{"detail": "Not Found"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(chunk("Hello") + chunk(" there"))
        if mode == "drop":
            self.wfile.flush()
            self.connection.shutdown(2)  # the connection dies mid-stream
            return
        if mode == "error":
            self.wfile.write(b'data: {"error": {"message": "out of KV cache", "code": 500}}\n\n')
            return
        self.wfile.write(chunk("!", "length") + b"data: [DONE]\n\n")


@pytest.fixture
def stub():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.mode = "ok"
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def events(srv):
    return list(RemoteBackend(url(srv)).generate("hi", SamplingParams(temperature=0.0), 8))


def test_generic_server_streams(stub):
    evs = events(stub)
    assert type(evs[0]).__name__ == "ServerConnected" and evs[0].info.kind == "openai-compatible"
    fin = evs[-1]
    assert type(fin).__name__ == "Finished" and fin.text == "Hello there!" and fin.reason == "length"
    toks = [e for e in evs if type(e).__name__ == "RemoteTokenSampled"]
    assert [t.token_id for t in toks] == [-1, -1, -1] and all(t.funnel is None for t in toks)


@pytest.mark.parametrize("mode, words", [
    ("drop", "dropped"), ("error", "out of KV cache"),
])
def test_mid_stream_failures_keep_what_arrived(stub, mode, words):
    stub.mode = mode
    evs = events(stub)
    assert type(evs[-1]).__name__ == "Failed" and words in evs[-1].message, evs[-1]
    assert [e.text for e in evs if type(e).__name__ == "RemoteTokenSampled"] == ["Hello", " there"]


def test_not_openai_and_401(stub):
    stub.mode = "html"
    with pytest.raises(RemoteError, match="not an OpenAI-compatible server"):
        RemoteBackend(url(stub)).probe()
    stub.mode = "401"
    with pytest.raises(RemoteError, match="HTTP 401.*API key"):
        RemoteBackend(url(stub), api_key="wrong").probe()


def test_bad_urls():
    with pytest.raises(RemoteError, match="not a server URL"):
        Client("ftp://example.org")
    assert Client("127.0.0.1:8000/v1/").url == "http://127.0.0.1:8000"
    assert "secret" not in repr(Client("http://h:1", api_key="secret"))


@pytest.mark.parametrize("mode", ["drop", "401", "html"])
def test_cli_one_line(stub, mode):
    stub.mode = mode
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--url", url(stub), "--prompt", "hi", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
