"""A small OpenAI-compatible HTTP client (stdlib only) that turns every failure into one clear sentence.

It knows the few extra endpoints real servers add: vLLM's `/tokenize`, `/detokenize`, `/metrics` and `/version`;
llama-cpp-python's `/extras/tokenize`; llama.cpp's `llama-server` `/tokenize`, `/props` and `/slots`.
The API key is taken from the caller (typed, or read from an environment variable) and kept in memory only.

A server may be broken or hostile; whatever it sends, a request ends in bounded time and memory:
- every request has a deadline (a watchdog shuts its socket down when it passes, so a drip of one byte every few
  seconds ends too), a stream a deadline per event (not per byte), and a `Cancel` ends requests from another thread;
- bodies and stream lines are read in bounded pieces up to a cap;
- what the server says that reaches the user (error texts, HTML pages) is cut to one clean line.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from urllib.parse import urlsplit

from engine.protocol import API_KEY_ENV
from engine.remote.sse import Chunk, StreamFormatError, parse_chunk, sse_data
from engine.text import clean_text, display_url, server_address

MAX_BODY = 16 << 20  # a JSON answer: vLLM's /tokenize of a long prompt with its token strings is a few MB
MAX_ERROR_BODY = 64 << 10  # an error page is read only for its message
MAX_LINE = 1 << 20  # one SSE line or event: a chunk of several tokens with top-20 candidates is tens of kB
FINISH_GRACE_S = 5.0  # after a chunk with a finish_reason, how long to wait for the usage chunk and [DONE]
READ_SIZE = 64 << 10


class RemoteError(Exception):
    """Talking to the server failed; the message is one sentence for the user."""


def default_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY") or None


# ------------------------------------------------------------------------------------------- what the user sees


class _HTMLText(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.title: list[str] = []
        self.text: list[str] = []
        self._in: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        self._in.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._in:
            del self._in[len(self._in) - 1 - self._in[::-1].index(tag):]

    def handle_data(self, data: str) -> None:
        if "title" in self._in:
            self.title.append(data)
        elif not {"script", "style", "head"} & set(self._in):
            self.text.append(data)


def html_text(page: str) -> str:
    """An HTML page's title, else its visible text ("" when it has none)."""
    p = _HTMLText()
    try:
        p.feed(page[:MAX_ERROR_BODY])
        p.close()
    except Exception:  # noqa: BLE001 — html.parser is lenient; a page it cannot read has no text to show
        return ""
    return " ".join("".join(p.title).split()) or " ".join(" ".join(p.text).split())


def is_loopback(host: str) -> bool:
    """This machine: localhost, 127.0.0.0/8 or ::1."""
    h = host.strip("[]").lower().rstrip(".")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host(url: str) -> str | None:
    try:
        return urlsplit(url if "://" in url else "http://" + url).hostname
    except ValueError:
        return None


def insecure_key_warning(url: str, api_key: str | None) -> str | None:
    """The one sentence to show before an API key travels unencrypted to another machine; None when it does not
    (no key, https://, or a loopback server)."""
    url = url.strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else "http"
    return _key_warning(scheme, _host(url), api_key)


def _key_warning(scheme: str, host: str | None, api_key: str | None) -> str | None:
    if not api_key or scheme != "http" or not host or is_loopback(host):
        return None
    return (f"the API key would travel unencrypted (http://) to {host}, which is not this machine: anyone on the "
            "network path could read it (use https://, or send it only over a network you trust)")


@dataclass(frozen=True)
class ServerInfo:
    """What the probe found: which server this is, its model, and what it offers."""

    url: str  # without credentials (display_url)
    kind: str  # "vllm", "llama-cpp-python", "llama.cpp" or "openai-compatible"
    model: str
    version: str | None = None
    max_model_len: int | None = None
    tokenize: str | None = None  # the tokenize endpoint, when there is one
    metrics: bool = False  # a Prometheus /metrics endpoint
    slots: bool = False  # llama-server's /slots
    max_logprobs: int | None = None
    cannot: tuple[str, ...] = ("attention maps", "residual norms", "per-step cost", "the full-vocabulary funnel")
    notes: tuple[str, ...] = field(default_factory=tuple)
    root: str | None = None  # vLLM: the directory the model was loaded from
    config: object | None = None  # its ModelConfig when the engine process could read it (engine.remote.shapes)
    config_note: str = ""  # where the config came from, or the one line saying what is missing

    @property
    def loopback(self) -> bool:
        """The server runs on this machine, so the paths it names are this machine's files."""
        host = _host(self.url)
        return bool(host) and is_loopback(host)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "model": self.model, "url": self.url, "version": self.version,
                "max_model_len": self.max_model_len, "tokenize": self.tokenize, "metrics": self.metrics,
                "slots": self.slots}


# ------------------------------------------------------------------------------------------- deadlines and stop

def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it (a connect or a read) at once


class Cancel:
    """Ends the requests made with it, from any thread: `set()` shuts down the socket of each one in flight (a read
    blocked on it ends at once, whatever the server does) and makes new ones end as they start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._watches: set[_Watch] = set()

    def set(self) -> None:
        with self._lock:
            self._set = True
            watches = list(self._watches)
        for w in watches:
            w.fire("cancelled")

    def is_set(self) -> bool:
        return self._set

    def _add(self, w: _Watch) -> bool:
        with self._lock:
            if self._set:
                return False
            self._watches.add(w)
            return True

    def _discard(self, w: _Watch) -> None:
        with self._lock:
            self._watches.discard(w)


class _Watch:
    """One request's socket and deadline. When the deadline passes, or its Cancel is set, the socket is shut down:
    whatever read or connect is blocked on it ends, and `fired` says why ("deadline" or "cancelled").

    It holds a duplicate of the socket's descriptor, so it can act on the connection after TLS wraps the socket,
    and never on a descriptor number that was closed and reused."""

    def __init__(self, seconds: float, cancel: Cancel | None) -> None:
        self._lock = threading.Lock()
        self._dup: socket.socket | None = None
        self._closed = False
        self.fired: str | None = None
        self.period = seconds
        self.deadline = time.monotonic() + seconds
        self.cancel = cancel
        if cancel is not None and not cancel._add(self):
            self.fired = "cancelled"
        self._start(seconds)

    def _start(self, seconds: float) -> None:
        self._timer = threading.Timer(max(0.0, seconds), self._due)
        self._timer.daemon = True
        self._timer.start()

    def _due(self) -> None:
        with self._lock:
            if self._closed or self.fired:
                return
            left = self.deadline - time.monotonic()
            if left > 0.005:  # moved on meanwhile (held, or restarted): look again then
                self._start(min(left, self.period))
                return
        self.fire("deadline")

    def restart(self, seconds: float) -> None:
        """The deadline is `seconds` from now (a stream's next event; the timer catches up when it is due)."""
        self.deadline = time.monotonic() + seconds

    def hold(self) -> None:
        """No deadline while the caller holds the answer (a paused generation does not read)."""
        self.deadline = float("inf")

    def shorten(self, seconds: float) -> None:
        with self._lock:
            self.deadline = time.monotonic() + seconds
            if self._closed or self.fired:
                return
            self._timer.cancel()
            self._start(seconds)

    def attach(self, sock: socket.socket) -> None:
        dup = sock.dup()
        with self._lock:
            if self._dup is not None:
                self._dup.close()
            self._dup = dup
            if self.fired:
                _shut(dup)

    def fire(self, why: str) -> None:
        with self._lock:  # under the lock: close() cannot close the duplicate meanwhile
            if self._closed or self.fired:
                return
            self.fired = why
            if self._dup is not None:
                _shut(self._dup)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._timer.cancel()
            if self._dup is not None:
                self._dup.close()
                self._dup = None
        if self.cancel is not None:
            self.cancel._discard(self)


# ------------------------------------------------------------------------------------------------------ client

class Client:
    """One server. Each call opens its own connection, so threads may share a Client."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        try:
            parts, port = server_address(url)
        except ValueError as e:
            raise RemoteError(str(e)) from None
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = port or (443 if parts.scheme == "https" else 80)
        path = parts.path.rstrip("/")
        self.prefix = path[:-3] if path.endswith("/v1") else path
        self.url = display_url(f"{self.scheme}://{parts.netloc}{self.prefix}")
        self._key = api_key if api_key is not None else default_api_key()
        self.timeout = timeout

    def __repr__(self) -> str:  # never shows the key
        return f"Client({self.url!r}, api_key={'set' if self._key else 'none'})"

    def insecure_key_warning(self) -> str | None:
        """One sentence when this client would send its API key unencrypted to another machine."""
        return _key_warning(self.scheme, self.host, self._key)

    # ------------------------------------------------------------------------------------------- plumbing

    def _conn(self, seconds: float, watch: _Watch) -> http.client.HTTPConnection:
        if self.scheme == "https":
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=seconds,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=seconds)

        def create_connection(address, timeout, source_address=None):  # socket.create_connection, watched
            err: OSError | None = None
            for af, kind, proto, _, addr in socket.getaddrinfo(address[0], address[1], 0, socket.SOCK_STREAM):
                sock = socket.socket(af, kind, proto)
                try:
                    watch.attach(sock)  # before connecting: a deadline or a stop ends the connect too
                    sock.settimeout(timeout)
                    sock.connect(addr)
                    if watch.fired:  # it fired before the connect began, when there was nothing to shut down
                        raise ConnectionAbortedError
                    return sock
                except OSError as e:
                    sock.close()
                    err = e
                    if watch.fired:
                        break
            raise err or OSError(f"no address for {address[0]}")

        conn._create_connection = create_connection
        return conn

    def _headers(self, body: bool) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream"}
        if body:
            h["Content-Type"] = "application/json"
        if self._key:
            h["Authorization"] = f"Bearer {self._key}"
        return h

    def _failure(self, e: BaseException, watch: _Watch, seconds: float, where: str = "",
                 reading: bool = False) -> RemoteError:
        """The one sentence for a failed connection or read."""
        if watch.fired == "cancelled":
            return Cancelled(f"the request to {self.url} was stopped")
        if watch.fired == "deadline":
            return RemoteError(f"no complete answer from {self.url}{where} within {seconds:.0f} s")
        if isinstance(e, ConnectionRefusedError):
            return RemoteError(f"cannot reach {self.url}: connection refused (is the server running?)")
        if isinstance(e, socket.gaierror):
            return RemoteError(f"cannot reach {self.url}: unknown host {self.host!r}")
        if isinstance(e, TimeoutError):
            return RemoteError(f"no answer from {self.url}{where} within {seconds:.0f} s")
        if isinstance(e, ssl.SSLError):
            return RemoteError(f"TLS failed with {self.url}: {clean_text(str(e.reason or e), 120)}")
        if reading:
            return RemoteError(f"the connection to {self.url} dropped{where} ({type(e).__name__})")
        return RemoteError(f"cannot talk to {self.url}: {type(e).__name__}: {clean_text(str(e), 120)}")

    def _open(self, method: str, path: str, payload: dict | None, seconds: float, cancel: Cancel | None):
        watch = _Watch(seconds, cancel)
        if watch.fired:  # stopped already: nothing goes out
            watch.close()
            raise self._failure(EOFError(), watch, seconds)
        conn = self._conn(seconds, watch)
        body = None if payload is None else json.dumps(payload).encode()
        try:
            conn.request(method, self.prefix + path, body=body, headers=self._headers(body is not None))
            resp = conn.getresponse()
        except (http.client.HTTPException, OSError) as e:
            watch.close()
            conn.close()
            raise self._failure(e, watch, seconds) from None
        return conn, resp, watch

    def _read(self, resp: http.client.HTTPResponse, cap: int, path: str, truncate: bool = False) -> bytes:
        """The body, read in bounded pieces: at most `cap` bytes (more is an error, or cut when `truncate`)."""
        if not truncate and resp.length is not None and resp.length > cap:
            raise RemoteError(f"{self.url}{path} answered with {resp.length / 2**20:.0f} MB, more than the "
                              f"{cap >> 20} MB this client reads")
        buf = bytearray()
        while len(buf) <= cap:
            data = resp.read1(READ_SIZE)
            if not data:
                return bytes(buf)
            buf += data
        if truncate:
            return bytes(buf[:cap])
        raise RemoteError(f"{self.url}{path} answered with more than the {cap >> 20} MB this client reads")

    def _refusal(self, method: str, path: str, resp: http.client.HTTPResponse, body: bytes) -> RemoteError:
        """The sentence for an HTTP error or a redirect (never followed: the key must not go elsewhere)."""
        status = resp.status
        if status in (401, 403):
            return RemoteError(
                f"{self.url} refused the request (HTTP {status}): a valid API key is needed "
                f"(type it in Connect, or set {API_KEY_ENV})"
            )
        if 300 <= status < 400:
            where = clean_text(display_url(resp.getheader("Location") or ""), 120) or "another address"
            return RemoteError(f"{self.url} redirects {self.prefix}{path} to {where} (HTTP {status}); this client "
                               "does not follow redirects: connect to that address instead")
        detail = _detail(body, resp.getheader("Content-Type") or "")
        tail = f": {detail}" if detail else ""
        return RemoteError(f"{method} {self.prefix}{path} on {self.url} failed with HTTP {status}{tail}")

    def request(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None,
                expect_json: bool = True, cancel: Cancel | None = None):
        """One request, answered in full within `timeout` s; returns the decoded JSON (or text).
        Raises RemoteError with one sentence."""
        seconds = self.timeout if timeout is None else timeout
        conn, resp, watch = self._open(method, path, payload, seconds, cancel)
        try:
            if resp.status >= 300:
                raise self._refusal(method, path, resp, self._read(resp, MAX_ERROR_BODY, path, truncate=True))
            body = self._read(resp, MAX_BODY, path)
            if watch.fired:  # the body may have ended early because the socket was shut down
                raise self._failure(EOFError(), watch, seconds, f" for {path}")
        except (http.client.HTTPException, OSError) as e:
            raise self._failure(e, watch, seconds, f" while reading {path}", reading=True) from None
        finally:
            watch.close()
            conn.close()
        if not expect_json:
            return body.decode("utf-8", "replace")
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise RemoteError(
                f"{self.url}{path} did not answer with JSON: not an OpenAI-compatible server?"
            ) from None

    def try_request(self, method: str, path: str, payload: dict | None = None, expect_json: bool = True,
                    cancel: Cancel | None = None):
        """Like request, but None when the endpoint is missing or fails (for probing optional features)."""
        try:
            return self.request(method, path, payload, timeout=min(self.timeout, 10.0), expect_json=expect_json,
                                cancel=cancel)
        except RemoteError:
            return None

    def stream(self, path: str, payload: dict, timeout: float | None = None, *, cancel: Cancel | None = None,
               max_tokens: int | None = None) -> Iterator[tuple[float, Chunk]]:
        """POST a streaming request; yields (arrival time from time.perf_counter(), parsed chunk).

        `timeout` bounds the wait for the answer and then for each event (keep-alive comments do not count; the
        time the caller holds a chunk does not either). More tokens than `max_tokens` (default: the payload's
        max_tokens) plus a small margin end the stream with an error, as does a connection that drops before the
        stream says it is done. When `cancel` is set the stream just ends. Closing the generator closes the
        connection, which is how a request is cancelled (servers abort a request whose client went away).
        """
        seconds = self.timeout if timeout is None else timeout
        asked = max_tokens if max_tokens is not None else payload.get("max_tokens")
        limit = asked + max(8, asked // 8) if isinstance(asked, int) and asked > 0 else None
        conn, resp, watch = self._open("POST", path, payload, seconds, cancel)
        n_chunks = n_tokens = 0
        done = finishing = False
        try:
            if resp.status >= 300:
                raise self._refusal("POST", path, resp, self._read(resp, MAX_ERROR_BODY, path, truncate=True))
            ctype = (resp.getheader("Content-Type") or "").lower()
            if "text/event-stream" not in ctype and ("json" in ctype or "html" in ctype):
                detail = _detail(self._read(resp, MAX_ERROR_BODY, path, truncate=True), ctype)
                raise RemoteError(f"{self.url}{path} answered with {'HTML' if 'html' in ctype else 'JSON'} "
                                  f"instead of a stream" + (f": {detail}" if detail else ""))
            watch.restart(seconds)
            for data in sse_data(self._lines(resp), max_event=MAX_LINE):
                if watch.fired:  # the socket was shut mid-event: what was read is a fragment, not an event
                    raise EOFError
                if data.strip() == "[DONE]":
                    done = True
                    break
                chunk = parse_chunk(data)
                n_chunks += 1
                n_tokens += len(chunk.tokens) or (1 if chunk.text else 0)
                if limit is not None and (n_tokens > limit or n_chunks > limit + 8):
                    raise RemoteError(f"{self.url} kept streaming past the {asked} tokens asked for: stopped after "
                                      f"{n_tokens} tokens in {n_chunks} chunks")
                watch.hold()
                yield time.perf_counter(), chunk
                if finishing:
                    watch.restart(min(seconds, FINISH_GRACE_S))
                elif chunk.finish_reason is not None:
                    finishing = True  # only the usage chunk and [DONE] may follow: wait for them briefly
                    watch.shorten(min(seconds, FINISH_GRACE_S))
                else:
                    watch.restart(seconds)
            if watch.fired and not done:
                raise EOFError
        except StreamFormatError as e:
            if watch.fired != "cancelled":
                raise RemoteError(clean_text(str(e), 300)) from None
        except (http.client.HTTPException, OSError, EOFError) as e:
            if watch.fired == "deadline" and finishing:
                return  # the generation was complete; the server did not close the stream
            if watch.fired == "deadline":
                raise RemoteError(f"{self.url} sent no complete event for {seconds:.0f} s mid-stream "
                                  f"(after {n_chunks} chunks)") from None
            if watch.fired != "cancelled":
                raise self._failure(e, watch, seconds, f" mid-stream after {n_chunks} chunks", reading=True) from None
        except RemoteError:
            if watch.fired != "cancelled":
                raise
        finally:
            watch.close()
            conn.close()
        if not (done or finishing or watch.fired == "cancelled"):
            raise RemoteError(
                f"the connection to {self.url} dropped mid-stream after {n_chunks} chunks (no end-of-stream marker)"
            )

    def _lines(self, resp: http.client.HTTPResponse) -> Iterator[bytes]:
        """The body's lines, read in bounded pieces; a line longer than MAX_LINE is an error."""
        buf = bytearray()
        while True:
            data = resp.read1(READ_SIZE)
            if not data:
                if buf:
                    yield bytes(buf)
                return
            start = len(buf)
            buf += data
            while (i := buf.find(b"\n", start)) >= 0:
                if i + 1 > MAX_LINE:
                    break
                yield bytes(buf[: i + 1])
                del buf[: i + 1]
                start = 0
            if len(buf) > MAX_LINE:
                raise RemoteError(f"{self.url} sent a stream line over {MAX_LINE >> 20} MB: not an event stream, "
                                  "stopped reading")


class Cancelled(RemoteError):
    """The request was ended by its Cancel."""


def _detail(body: bytes, ctype: str) -> str:
    """A server's error text as one short clean line (an HTML page as its title or text)."""
    text = body.decode("utf-8", "replace")
    try:
        d = json.loads(text)
    except (ValueError, RecursionError):
        if "html" in ctype.lower() or text.lstrip()[:1] == "<":
            return clean_text(html_text(text), 160) or "the server answered with an HTML page"
        return clean_text(text, 160)
    err = d.get("error", d.get("detail", d)) if isinstance(d, dict) else d
    msg = err.get("message", "") if isinstance(err, dict) else err
    if not isinstance(msg, str):
        try:
            msg = json.dumps(msg)[:400]
        except (TypeError, ValueError, RecursionError):
            msg = ""
    return clean_text(msg, 160)
