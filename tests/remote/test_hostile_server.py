"""A broken or hostile server on 127.0.0.1 cannot hurt the client: every answer ends in one clean sentence (or a
correct result), in bounded time and memory, and stop() ends a generation whatever the server does.

The server is a small threaded http.server written per test; its handlers are bounded (they end when the client
goes away, when the test ends, or after a fixed count) and the server is stopped in teardown. Time bounds here are
hang guards (Event.wait(timeout)), never timing assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

from engine.remote.backend import RemoteBackend
from engine.remote.client import Client, RemoteError, ServerInfo, clean_text, display_url, insecure_key_warning
from engine.remote.shapes import server_model_config
from engine.run.sampling import SamplingParams

KEY = "sk-hostile-test-key"
MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "someone"}]}
VLLM_MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "vllm"}]}
GREEDY = SamplingParams(temperature=0.0)


class Stub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes: dict = {"/v1/models": lambda h: send_json(h, MODELS)}
        self.stopping = threading.Event()  # set in teardown: every long handler loop ends
        self.seen: list[tuple[str, str, dict]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def _route(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(n) if n else b""
        self.server.seen.append((self.command, self.path, dict(self.headers)))
        fn = self.server.routes.get(self.path) or self.server.routes.get("*")
        try:
            if fn is None:
                send_json(self, {"detail": "Not Found"}, 404)
            else:
                fn(self)
        except OSError:  # the client went away (broken pipe, reset): what a hostile server shrugs off
            pass

    do_GET = do_POST = _route


def send(h, status: int, body: bytes, ctype: str = "application/json", headers: dict | None = None) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


def send_json(h, obj, status: int = 200) -> None:
    send(h, status, json.dumps(obj).encode())


def sse_head(h) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.end_headers()
    h.wfile.flush()


def chunk(text: str, finish: str | None = None, logprobs=None) -> bytes:
    d = {"id": "x", "object": "text_completion", "model": "m",
         "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    return b"data: " + json.dumps(d).encode() + b"\n\n"  # json.dumps writes NaN/Infinity as a server may


DONE = b"data: [DONE]\n\n"


def stream_of(*parts: bytes):
    def route(h):
        sse_head(h)
        for p in parts:
            h.wfile.write(p)
        h.wfile.flush()
    return route


@pytest.fixture
def stub():
    srv = Stub()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.stopping.set()
    srv.shutdown()
    srv.server_close()


def run_gen(url: str, max_new_tokens: int = 8, timeout: float = 10.0, **kw) -> list:
    """All events of one generation, in a thread, with a hang guard."""
    out: list = []
    done = threading.Event()

    def work():
        try:
            b = RemoteBackend(url, api_key=kw.pop("api_key", None), timeout=timeout)
            out.extend(b.generate("hi", GREEDY, max_new_tokens, **kw))
        except BaseException as e:  # noqa: BLE001 — recorded: the test fails on it
            out.append(e)
        finally:
            done.set()

    threading.Thread(target=work, daemon=True).start()
    assert done.wait(60), "the generation never ended"
    assert not any(isinstance(e, BaseException) for e in out), out[-1]
    return out


def one_sentence(msg: str) -> None:
    assert msg and "\n" not in msg and "\r" not in msg and "\x1b" not in msg and "Traceback" not in msg, msg
    assert len(msg) <= 700, len(msg)


def failed(evs: list) -> str:
    last = evs[-1]
    assert type(last).__name__ == "Failed", last
    one_sentence(last.message)
    return last.message


def tokens(evs: list) -> list:
    return [e for e in evs if type(e).__name__ == "RemoteTokenSampled"]


def cli(url: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    e.pop("INFERENCE_LAB_API_KEY", None)
    e.pop("OPENAI_API_KEY", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "engine", "generate", "--url", url, "--prompt", "hi", *args],
                          capture_output=True, text=True, timeout=120, env=e)


# ----------------------------------------------------------------------------------------- streams that never end

def endless(h):
    sse_head(h)
    for i in range(100_000):  # bounded: ends when the client hangs up, long before this
        if h.server.stopping.is_set():
            return
        h.wfile.write(chunk(f" t{i}"))
        h.wfile.flush()


def test_endless_stream_stops_past_max_new_tokens(stub):
    stub.routes["/v1/completions"] = endless
    evs = run_gen(stub.url, max_new_tokens=8)
    msg = failed(evs)
    assert "kept streaming past the 8 tokens" in msg
    assert 8 <= len(tokens(evs)) <= 16


def test_endless_stream_cli_exits_with_one_line(stub):
    stub.routes["/v1/completions"] = endless
    r = cli(stub.url, "--max-new-tokens", "8", "--json")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "kept streaming" in r.stderr and "Traceback" not in r.stderr


def test_finish_without_done_ends_after_a_grace(stub):
    """A server that says finish_reason and then holds the connection open: the generation is complete."""
    def route(h):
        sse_head(h)
        h.wfile.write(chunk("Hello") + chunk(" you", "length"))
        h.wfile.flush()
        h.server.stopping.wait(30)
    stub.routes["/v1/completions"] = route
    evs = run_gen(stub.url, timeout=10.0)  # the grace is then its longest, 5 s
    assert type(evs[-1]).__name__ == "Finished" and evs[-1].text == "Hello you" and evs[-1].reason == "length", evs[-1]


@pytest.mark.parametrize("drip", [b"d", b": ping\n\n"], ids=["one-byte", "keep-alive-comments"])
def test_drip_in_the_stream_is_cut(stub, drip):
    """One byte every few tenths of a second, or keep-alive comments forever: no event completes, so it ends."""
    def route(h):
        sse_head(h)
        h.wfile.write(chunk("Hello"))
        h.wfile.flush()
        for _ in range(300):
            if h.server.stopping.wait(0.2):
                return
            h.wfile.write(drip)
            h.wfile.flush()
    stub.routes["/v1/completions"] = route
    evs = run_gen(stub.url, timeout=5.0)
    assert "no complete event for 5 s" in failed(evs)
    assert [t.text for t in tokens(evs)] == ["Hello"]


def drip_inside_an_event(framing: str):
    """A complete first event, then the start of the next one's `data:` line and the rest a byte every two seconds."""
    def route(h):
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        if framing == "chunked":
            h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(data: bytes) -> None:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if framing == "chunked" else data)
            h.wfile.flush()

        event = chunk(" world" * 40)
        send(chunk("Hello") + event[:12])  # the next event's `data: {"id":` at once, then the rest byte by byte
        for b in event[12:]:  # bounded: ends when the client hangs up (a write fails) or the test ends
            if h.server.stopping.wait(2.0):
                return
            send(bytes([b]))
    return route


@pytest.mark.parametrize("framing", ["close-delimited", "chunked"])
def test_drip_inside_an_event_ends_at_the_event_deadline(stub, framing):
    """The deadline is per complete event, not per byte; the fragment read when it cuts the connection is not taken
    for a malformed chunk (a close-delimited stream said "a chunk that is not JSON")."""
    stub.routes["/v1/completions"] = drip_inside_an_event(framing)
    evs = run_gen(stub.url, timeout=5.0)
    assert "no complete event for 5 s" in failed(evs)
    assert [t.text for t in tokens(evs)] == ["Hello"]


def test_drip_inside_an_event_cli_ends_at_its_timeout(stub):
    stub.routes["/v1/completions"] = drip_inside_an_event("close-delimited")
    r = cli(stub.url, "--max-new-tokens", "8", "--timeout", "5")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no complete event for 5 s" in r.stderr and "Traceback" not in r.stderr


def drip_route(head: bytes, body: bytes):
    def route(h):
        h.wfile.write(head)
        h.wfile.flush()
        for b in body:  # one byte at a time, forever as far as the client can tell
            if h.server.stopping.wait(0.3):
                return
            h.wfile.write(bytes([b]))
            h.wfile.flush()
    return route


@pytest.mark.parametrize("head, body", [
    (b"", b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n" + b"X-Slow: " + b"a" * 500),
    (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n",
     json.dumps(MODELS).encode() + b" " * 4000),
], ids=["headers", "body"])
def test_drip_on_models_is_cut(stub, head, body):
    stub.routes["/v1/models"] = drip_route(head, body)
    with pytest.raises(RemoteError) as e:
        RemoteBackend(stub.url, timeout=5.0).probe()
    one_sentence(str(e.value))
    assert "no complete answer" in str(e.value) and "within 5 s" in str(e.value)


# ----------------------------------------------------------------------------------------------- size caps

BLOCK = b"x" * (64 << 10)


def huge_line(h):
    sse_head(h)
    h.wfile.write(chunk("Hello") + b"data: ")
    for _ in range(200 * 16):  # 200 MB, sent lazily: the server never holds it either
        if h.server.stopping.is_set():
            return
        h.wfile.write(BLOCK)


def peak_rss_growth(fn) -> tuple[object, int]:
    """fn()'s result and the most this process's resident memory grew while it ran (sampled)."""
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    running = threading.Event()
    running.set()

    def sample():
        while running.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        running.clear()
        t.join(5)
    return out, peak[0] - base


def test_a_200_mb_line_is_refused_in_bounded_memory(stub):
    stub.routes["/v1/completions"] = stream_of(chunk("Hello", "length"), DONE)
    run_gen(stub.url)  # warm: imports and first allocations outside the measurement
    stub.routes["/v1/completions"] = huge_line
    evs, grew = peak_rss_growth(lambda: run_gen(stub.url, timeout=10))
    assert "stream line over 1 MB" in failed(evs)
    assert grew < 40 << 20, f"resident memory grew {grew >> 20} MB reading a 200 MB line"


def huge_models(h, length: bool):
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    if length:
        h.send_header("Content-Length", str(200 << 20))
    h.end_headers()
    h.wfile.write(b'{"data": [{"id": "')
    for _ in range(200 * 16):
        if h.server.stopping.is_set():
            return
        h.wfile.write(BLOCK)


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "no-length"])
def test_huge_models_body_is_refused(stub, length):
    stub.routes["/v1/models"] = lambda h: huge_models(h, length)

    def probe() -> str:
        with pytest.raises(RemoteError) as e:
            RemoteBackend(stub.url, timeout=10).probe()
        return str(e.value)

    msg, grew = peak_rss_growth(probe)
    one_sentence(msg)
    assert "more than the 16 MB" in msg
    assert grew < 80 << 20, f"resident memory grew {grew >> 20} MB reading a 200 MB body"


# ------------------------------------------------------------------------------------------- bad content

def test_invalid_json_models_and_chunk(stub):
    stub.routes["/v1/models"] = lambda h: send(h, 200, b'{"data": [', "application/json")
    with pytest.raises(RemoteError, match="did not answer with JSON"):
        RemoteBackend(stub.url).probe()
    stub.routes["/v1/models"] = lambda h: send(h, 200, b"[" * 200_000, "application/json")  # nesting too deep
    with pytest.raises(RemoteError, match="did not answer with JSON"):
        RemoteBackend(stub.url).probe()
    stub.routes["/v1/models"] = lambda h: send_json(h, MODELS)
    stub.routes["/v1/completions"] = stream_of(chunk("Hello"), b"data: {not json\n\n", DONE)
    assert "not JSON" in failed(run_gen(stub.url))


def test_dropped_connection_mid_stream(stub):
    def route(h):
        sse_head(h)
        h.wfile.write(chunk("Hello") + chunk(" there"))
        h.wfile.flush()
        h.connection.shutdown(2)
    stub.routes["/v1/completions"] = route
    evs = run_gen(stub.url)
    assert "dropped" in failed(evs) and [t.text for t in tokens(evs)] == ["Hello", " there"]


def nan_logprobs_route(h):
    lp = {"tokens": ["A", "B", "C"], "token_logprobs": [float("nan"), float("-inf"), float("inf")],
          "top_logprobs": [{"A": float("nan"), "Z": -1.0}, {"B": float("-inf")}, {"C": float("inf")}]}
    sse_head(h)
    h.wfile.write(chunk("ABC", logprobs=lp) + chunk("", "length") + DONE)
    h.wfile.flush()


def test_nan_and_inf_logprobs_are_not_reported(stub):
    stub.routes["/v1/completions"] = nan_logprobs_route
    evs = run_gen(stub.url)
    toks = tokens(evs)
    assert [t.text for t in toks] == ["A", "B", "C"]
    assert toks[0].logprob is None and toks[2].logprob is None  # NaN, +inf: no log-probability
    assert toks[1].logprob == float("-inf")  # probability 0
    f0 = toks[0].funnel  # the NaN candidate is left out; the finite one stays
    assert f0 is not None and list(f0.pieces) == ["Z"] and abs(float(f0.p_raw[0]) - 0.36787944) < 1e-6
    assert toks[2].funnel is None


def strict_json(text: str):
    def no_constants(c):
        raise ValueError(f"not JSON: {c}")
    return json.loads(text, parse_constant=no_constants)


def test_nan_logprobs_cli_json_parses_strictly(stub):
    stub.routes["/v1/completions"] = nan_logprobs_route
    r = cli(stub.url, "--max-new-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    d = strict_json(r.stdout)
    assert d["logprobs"] == [None, None, None] and d["text"] == "ABC"


HTML = (b"<!DOCTYPE html>\n<html><head><title>500 Internal\n Server Error</title><style>body{color:red}</style>"
        b"<script>alert(1)</script></head>\n<body>\n<h1>Oops</h1>\n<p>Something\nbroke</p>\n</body></html>\n")


def test_html_500_is_one_line(stub):
    stub.routes["/v1/models"] = lambda h: send(h, 500, HTML, "text/html")
    with pytest.raises(RemoteError) as e:
        RemoteBackend(stub.url).probe()
    msg = str(e.value)
    one_sentence(msg)
    assert "HTTP 500: 500 Internal Server Error" in msg and "<" not in msg and "alert" not in msg
    stub.routes["/v1/models"] = lambda h: send_json(h, MODELS)
    stub.routes["/v1/completions"] = lambda h: send(h, 502, b"<html><body><script>x()</script></body></html>",
                                                   "text/html")
    msg = failed(run_gen(stub.url))
    assert "HTTP 502: the server answered with an HTML page" in msg


ESCAPES = "\x1b[31mred\x1b[0m \x1b]0;owned\x07title\x1b[2J\r\nnext line\x07\x9b31m\u202eevil"


def test_escape_codes_in_errors_never_reach_the_terminal(stub):
    stub.routes["/v1/models"] = lambda h: send_json(h, {"error": {"message": ESCAPES}}, 400)
    with pytest.raises(RemoteError) as e:
        RemoteBackend(stub.url).probe()
    one_sentence(str(e.value))
    assert "red" in str(e.value) and "next line" in str(e.value) and "\x9b" not in str(e.value)
    assert "\u202e" not in str(e.value)
    stub.routes["/v1/models"] = lambda h: send_json(h, MODELS)
    err = json.dumps({"error": {"message": ESCAPES}}).encode()
    stub.routes["/v1/completions"] = stream_of(chunk("Hello"), b"data: " + err + b"\n\n")
    assert "red" in failed(run_gen(stub.url))
    r = cli(stub.url, "--json")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr and "red" in r.stderr


def test_redirects_are_not_followed_and_the_key_never_leaves(stub):
    other = Stub()  # where the redirect points: it must never see the key
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        where = f"http://user:pw-secret@127.0.0.1:{other.server_address[1]}/v1/models"
        stub.routes["*"] = lambda h: send(h, 307, b"", headers={"Location": where})
        stub.routes.pop("/v1/models")
        with pytest.raises(RemoteError) as e:
            RemoteBackend(stub.url, api_key=KEY).probe()
        msg = str(e.value)
        one_sentence(msg)
        assert "HTTP 307" in msg and "does not follow redirects" in msg and "pw-secret" not in msg
        stub.routes["/v1/models"] = lambda h: send_json(h, MODELS)
        assert "HTTP 307" in failed(run_gen(stub.url, api_key=KEY))
        assert other.seen == []
        assert all(hdrs.get("Authorization") == f"Bearer {KEY}" for _, _, hdrs in stub.seen)
    finally:
        other.stopping.set()
        other.shutdown()
        other.server_close()


# ---------------------------------------------------------------------------------------- wrong types anywhere

def lp_chat(entry) -> bytes:
    d = {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [entry]}}]}
    return json.dumps(d).encode()


BAD_CHUNKS = [
    b'{"choices": "x"}',
    b'{"choices": [5]}',
    b'{"choices": [{"text": 5}]}',
    b'{"choices": [{"delta": "x"}]}',
    b'{"choices": [{"delta": {"content": ["a"]}}]}',
    b'{"choices": [{"text": "a", "finish_reason": 3}]}',
    b'{"choices": [{"text": "a", "token_ids": ["x"]}]}',
    b'{"choices": [{"text": "a", "token_ids": [99999999999999999999999]}]}',
    b'{"choices": [{"text": "a", "token_ids": [-5]}]}',
    b'{"choices": [{"text": "a", "token_ids": [true]}]}',
    b'{"choices": [{"text": "a", "prompt_token_ids": "12"}]}',
    b'{"choices": [{"text": "a", "logprobs": 7}]}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": ["x"]}}]}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": [1], "token_logprobs": [-1]}}]}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": "x"}}]}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "top_logprobs": [{"b": "x"}]}}]}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1' + b"0" * 400 + b"]}}]}",
    lp_chat({"token": "a", "logprob": -1, "bytes": [300]}),
    lp_chat({"token": "a", "logprob": -1, "bytes": "ab"}),
    lp_chat({"token": 5, "logprob": -1}),
    lp_chat({"token": "a", "logprob": {"x": 1}}),
    lp_chat({"token": "a", "logprob": -1, "top_logprobs": "x"}),
    lp_chat({"token": "a", "logprob": -1, "top_logprobs": [{"token": "b", "logprob": True}]}),
    lp_chat({"token": "a", "logprob": -1, "top_logprobs": [7]}),
    lp_chat(5),
    b'{"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [{"token": "a", "logprob": -1}]}, '
    b'"token_ids": [1.5]}]}',
    b'{"error": {"message": 5}}',
    b'{"error": [1, 2]}',
    b"[1, 2]",
    b'"text"',
    b"[" * 100_000,
]


@pytest.mark.parametrize("bad", BAD_CHUNKS, ids=range(len(BAD_CHUNKS)))
def test_wrong_types_in_a_chunk_are_one_sentence(stub, bad):
    stub.routes["/v1/completions"] = stream_of(chunk("Hi"), b"data: " + bad + b"\n\n", chunk("!", "length"), DONE)
    evs = run_gen(stub.url)
    failed(evs)
    assert [t.text for t in tokens(evs)] == ["Hi"]


TOLERATED = [  # extras with wrong types that nothing relies on: left out, the generation goes on
    b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": "many", "prompt_tokens": -3}}',
    b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": 100000}}',
    b'{"choices": [{"text": "a"}], "timings": {"predicted_ms": "x", "n": 1e999}, "model": 5}',
    b'{"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [1e999]}}]}',
    b'{"choices": []}',
]


@pytest.mark.parametrize("odd", TOLERATED, ids=range(len(TOLERATED)))
def test_odd_extras_are_left_out(stub, odd):
    stub.routes["/v1/completions"] = stream_of(chunk("Hi"), b"data: " + odd + b"\n\n", chunk("!", "length"), DONE)
    evs = run_gen(stub.url)
    fin = evs[-1]
    assert type(fin).__name__ == "Finished", fin
    assert fin.text in ("Hia!", "Hi!") and fin.tpot_s >= 0
    assert all(t.logprob is None for t in tokens(evs))


BAD_MODELS = [
    {"data": "x"},
    {"data": [5]},
    {"data": [{"id": 5}]},
    {"data": [{"id": ""}]},
    {"data": [{"id": "a\x1b[2Jb"}]},
    {"data": [{"id": "a\nb"}]},
    {"data": [{"id": "m" * 5000}]},
    [1, 2],
]


@pytest.mark.parametrize("bad", BAD_MODELS, ids=range(len(BAD_MODELS)))
def test_wrong_types_in_models_are_one_sentence(stub, bad):
    stub.routes["/v1/models"] = lambda h: send_json(h, bad)
    with pytest.raises(RemoteError) as e:
        RemoteBackend(stub.url).probe()
    one_sentence(str(e.value))


def test_odd_probe_extras_are_left_out(stub):
    models = {"data": [{"id": "m", "owned_by": 5, "max_model_len": "big", "root": ["x"]}]}
    stub.routes["/v1/models"] = lambda h: send_json(h, models)
    stub.routes["/props"] = lambda h: send_json(h, {"n_ctx": True, "default_generation_settings": [1]})
    stub.routes["/version"] = lambda h: send_json(h, {"version": {"x": 1}})
    info = RemoteBackend(stub.url).probe()
    assert (info.kind, info.max_model_len, info.version, info.root) == ("llama.cpp", None, None, None)


BAD_TOKENIZE = [
    {"tokens": "abc"},
    {"tokens": [1.5]},
    {"tokens": [2**40]},
    {"tokens": [True]},
    {"tokens": [1], "token_strs": [5]},
    {"tokens": [1, 2], "token_strs": ["a"]},
    {"tokens": [1], "token_strs": "a"},
    [1, 2],
    {"count": 3},
]


@pytest.mark.parametrize("bad", BAD_TOKENIZE, ids=range(len(BAD_TOKENIZE)))
def test_wrong_types_in_tokenize_are_one_sentence(stub, bad):
    stub.routes["/v1/models"] = lambda h: send_json(h, VLLM_MODELS)
    stub.routes["/tokenize"] = lambda h: send_json(h, bad)
    stub.routes["/detokenize"] = lambda h: send_json(h, {"prompt": 5})
    b = RemoteBackend(stub.url)
    with pytest.raises(RemoteError) as e:
        b.tokenize("hi")
    one_sentence(str(e.value))


def test_wrong_types_in_detokenize_and_llama_tokenize(stub):
    stub.routes["/v1/models"] = lambda h: send_json(h, VLLM_MODELS)
    stub.routes["/tokenize"] = lambda h: send_json(h, {"tokens": [1, 2]})
    stub.routes["/detokenize"] = lambda h: send_json(h, {"prompt": ["a"]})
    with pytest.raises(RemoteError, match="no 'prompt' text"):
        RemoteBackend(stub.url).tokenize("hi")
    stub.routes["/v1/models"] = lambda h: send_json(h, MODELS)
    stub.routes["/props"] = lambda h: send_json(h, {"n_ctx": 2048})
    for bad in ({"tokens": [{"id": "x"}]}, {"tokens": [{"id": 1, "piece": 5}]},
                {"tokens": [{"id": 1, "piece": [999]}]}):
        stub.routes["/tokenize"] = lambda h, bad=bad: send_json(h, bad)
        with pytest.raises(RemoteError) as e:
            RemoteBackend(stub.url).tokenize("hi")
        one_sentence(str(e.value))


# --------------------------------------------------------------------------------------------- stop() at once

def stall(h):
    h.server.stopping.wait(60)


@pytest.mark.parametrize("where", ["tokenize", "headers", "mid-stream"])
def test_stop_from_another_thread_ends_a_stalled_generation(stub, where):
    """The engine's command thread calls stop() while the generation is blocked in a socket read."""
    stub.routes["/props"] = lambda h: send_json(h, {"n_ctx": 2048})  # llama.cpp: the prompt is tokenized first
    stub.routes["/tokenize"] = stall if where == "tokenize" else (lambda h: send_json(h, {"tokens": [7]}))
    stub.routes["/detokenize"] = lambda h: send_json(h, {"content": "hi"})

    def mid(h):
        sse_head(h)
        h.wfile.write(chunk("Hello"))
        h.wfile.flush()
        stall(h)
    stub.routes["/v1/completions"] = mid if where == "mid-stream" else stall
    b = RemoteBackend(stub.url, timeout=120)  # no deadline will end it: only stop() can
    b.probe()
    gen = b.generate("hi", GREEDY, 8)
    evs: list = []
    done, blocked = threading.Event(), threading.Event()

    def work():
        for ev in gen:
            evs.append(ev)
            if type(ev).__name__ == ("ServerConnected" if where == "tokenize" else "RemoteTokenSampled"
                                     if where == "mid-stream" else "PromptTokenized"):
                blocked.set()
        done.set()

    threading.Thread(target=work, daemon=True).start()
    assert blocked.wait(30)
    while not stub.seen or stub.seen[-1][1] != ("/tokenize" if where == "tokenize" else "/v1/completions"):
        time.sleep(0.01)  # the request has reached the server, which now stalls
    gen.stop()
    assert done.wait(10), "stop() did not end the generation"
    assert type(evs[-1]).__name__ == "Finished" and evs[-1].reason == "stopped"
    assert [t.text for t in tokens(evs)] == (["Hello"] if where == "mid-stream" else [])


def test_stop_before_the_stream_starts_sends_nothing(stub):
    stub.routes["/v1/completions"] = stream_of(chunk("Hello", "length"), DONE)
    b = RemoteBackend(stub.url)
    gen = b.generate("hi", GREEDY, 8)
    next(gen)  # ServerConnected
    gen.stop()
    evs = list(gen)
    assert type(evs[-1]).__name__ == "Finished" and evs[-1].reason == "stopped" and tokens(evs) == []
    assert all(path != "/v1/completions" for _, path, _ in stub.seen)


def test_a_set_cancel_sends_nothing_more(stub):
    """After stop(), requests the generation would still make (a token's bytes, /metrics) never leave."""
    from engine.remote.client import Cancel, Cancelled

    c = Cancel()
    c.set()
    with pytest.raises(Cancelled):
        Client(stub.url).request("GET", "/v1/models", cancel=c)
    assert stub.seen == []


# ------------------------------------------------------------------------------------- credentials and paths

def test_credentials_never_shown(stub):
    port = stub.server_address[1]
    c = Client(f"http://alice:pw-secret@127.0.0.1:{port}/v1")
    assert c.url == f"http://127.0.0.1:{port}" and "pw-secret" not in repr(c)
    info = RemoteBackend(f"http://alice:pw-secret@127.0.0.1:{port}").probe()
    assert "pw-secret" not in info.url and "alice" not in info.url
    with pytest.raises(RemoteError) as e:
        Client("http://alice:pw-secret@127.0.0.1:9").request("GET", "/v1/models")
    assert "pw-secret" not in str(e.value) and "connection refused" in str(e.value)
    with pytest.raises(RemoteError) as e:
        Client("ftp://alice:pw-secret@host")
    assert "pw-secret" not in str(e.value)
    assert display_url("https://u:p@ss@example.org:8/v1?q=a@b") == "https://example.org:8/v1?q=a@b"
    assert display_url("u:p@10.0.0.1:8000") == "10.0.0.1:8000"
    assert display_url("http://127.0.0.1:8000/a@b") == "http://127.0.0.1:8000/a@b"


@pytest.mark.parametrize("url, key, warns", [
    ("http://10.0.0.5:8000", KEY, True),
    ("gpu-box:8000", KEY, True),
    ("http://user:pw@example.org", KEY, True),
    ("https://example.org", KEY, False),
    ("http://127.0.0.1:8000", KEY, False),
    ("http://127.8.9.10:8000", KEY, False),
    ("http://localhost:8000", KEY, False),
    ("http://[::1]:8000", KEY, False),
    ("http://10.0.0.5:8000", None, False),
    ("http://10.0.0.5:8000", "", False),
])
def test_insecure_key_warning(url, key, warns):
    w = insecure_key_warning(url, key)
    assert (w is not None) == warns
    if w:
        one_sentence(w)
        assert "unencrypted" in w and KEY not in w and "pw" not in w
        assert Client(url, api_key=key).insecure_key_warning() == w


def test_connect_dialog_asks_before_sending_the_key_in_clear(monkeypatch):
    from app.connect_dialog import key_warning

    monkeypatch.delenv("INFERENCE_LAB_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert key_warning("http://10.0.0.5:8000", None) is None
    assert key_warning("http://127.0.0.1:8000", KEY) is None
    w = key_warning("http://10.0.0.5:8000", KEY)
    assert w is not None and w.startswith("The API key would travel unencrypted")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")  # left empty, the engine process sends the environment's
    assert key_warning("http://10.0.0.5:8000", None) is not None


def test_cli_refuses_the_key_in_clear_unless_allowed(stub, monkeypatch):
    """A command line has no one to ask: the key stays home unless --allow-insecure-key says otherwise."""
    import argparse

    from engine.cliargs import CliError
    from engine.remote import cli as remote_cli

    monkeypatch.setenv("INFERENCE_LAB_API_KEY", KEY)
    a = argparse.Namespace(url="http://192.0.2.1:9", api_key_env="INFERENCE_LAB_API_KEY", allow_insecure_key=False)
    with pytest.raises(CliError, match="--allow-insecure-key"):
        remote_cli._backend(a)
    a = argparse.Namespace(url=stub.url, api_key_env="INFERENCE_LAB_API_KEY", allow_insecure_key=False)
    assert remote_cli._backend(a).info.model == "m"  # loopback: no question


def test_cli_refusal_is_one_line():
    r = subprocess.run([sys.executable, "-m", "engine", "tokenize", "--url", "http://192.0.2.1:9", "--api-key-env", "K",
                        "--text", "x"],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, K=KEY))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--allow-insecure-key" in r.stderr and KEY not in r.stderr


def test_server_named_paths_are_read_only_for_a_loopback_server(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # would be read (and fail) if tried
    cfg, note = server_model_config(str(tmp_path), str(tmp_path), loopback=False)
    assert cfg is None and "another machine" in note and "could not be read" not in note
    _, note = server_model_config(str(tmp_path), str(tmp_path), loopback=True)
    assert "could not be read" in note  # the same paths on loopback are this machine's files: read
    assert ServerInfo(url="http://127.0.0.1:8000", kind="x", model="m").loopback
    assert ServerInfo(url="http://[::1]:8000", kind="x", model="m").loopback
    assert ServerInfo(url="http://localhost:8000", kind="x", model="m").loopback
    assert not ServerInfo(url="http://10.1.2.3:8000", kind="x", model="m").loopback
    assert not ServerInfo(url="http://127.0.0.1.example.org", kind="x", model="m").loopback


def test_clean_text():
    assert clean_text("a\x1b[1;31mb\x1b[0m\nc\td\x00e") == "ab c d e"
    assert clean_text("x" * 500, 10) == "x" * 9 + "…"
    assert clean_text("\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\") == "link"
