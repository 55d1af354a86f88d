"""A small OpenAI-compatible HTTP client (stdlib only) that turns every failure into one clear sentence.

It knows the few extra endpoints real servers add: vLLM's `/tokenize`, `/detokenize`, `/metrics` and `/version`;
llama-cpp-python's `/extras/tokenize`; llama.cpp's `llama-server` `/tokenize`, `/props` and `/slots`.
The API key is taken from the caller (typed, or read from an environment variable) and kept in memory only.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engine.remote.sse import Chunk, StreamFormatError, parse_chunk, sse_data

API_KEY_ENV = "INFERENCE_LAB_API_KEY"  # read when no key is typed; OPENAI_API_KEY as a fallback


class RemoteError(Exception):
    """Talking to the server failed; the message is one sentence for the user."""


def default_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY") or None


@dataclass(frozen=True)
class ServerInfo:
    """What the probe found: which server this is, its model, and what it offers."""

    url: str
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

    def to_dict(self) -> dict:
        return {"kind": self.kind, "model": self.model, "url": self.url, "version": self.version,
                "max_model_len": self.max_model_len, "tokenize": self.tokenize, "metrics": self.metrics,
                "slots": self.slots}


class Client:
    """One server. Each call opens its own connection, so threads may share a Client."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        url = url.strip()
        if "://" not in url:
            url = "http://" + url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"not a server URL: {url!r} (expected e.g. http://127.0.0.1:8000)")
        self.scheme = parts.scheme
        self.host = parts.hostname
        try:
            self.port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise RemoteError(f"not a server URL: {url!r} (bad port)") from None
        path = parts.path.rstrip("/")
        self.prefix = path[:-3] if path.endswith("/v1") else path
        self.url = f"{self.scheme}://{parts.netloc}{self.prefix}"
        self._key = api_key if api_key is not None else default_api_key()
        self.timeout = timeout

    def __repr__(self) -> str:  # never shows the key
        return f"Client({self.url!r}, api_key={'set' if self._key else 'none'})"

    # ------------------------------------------------------------------------------------------- plumbing

    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        t = self.timeout if timeout is None else timeout
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=t, context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=t)

    def _headers(self, body: bool) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream"}
        if body:
            h["Content-Type"] = "application/json"
        if self._key:
            h["Authorization"] = f"Bearer {self._key}"
        return h

    def _open(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None):
        conn = self._conn(timeout)
        body = None if payload is None else json.dumps(payload).encode()
        try:
            conn.request(method, self.prefix + path, body=body, headers=self._headers(body is not None))
            return conn, conn.getresponse()
        except ConnectionRefusedError:
            conn.close()
            raise RemoteError(f"cannot reach {self.url}: connection refused (is the server running?)") from None
        except socket.gaierror:
            conn.close()
            raise RemoteError(f"cannot reach {self.url}: unknown host {self.host!r}") from None
        except TimeoutError:
            conn.close()
            raise RemoteError(f"no answer from {self.url} within {timeout or self.timeout:.0f} s") from None
        except ssl.SSLError as e:
            conn.close()
            raise RemoteError(f"TLS failed with {self.url}: {e.reason or e}") from None
        except (http.client.HTTPException, OSError) as e:
            conn.close()
            raise RemoteError(f"cannot talk to {self.url}: {type(e).__name__}: {e}") from None

    def _http_error(self, method: str, path: str, status: int, body: bytes) -> RemoteError:
        detail = ""
        try:
            d = json.loads(body)
            err = d.get("error", d.get("detail", d)) if isinstance(d, dict) else d
            detail = err.get("message", "") if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            detail = body[:120].decode("utf-8", "replace").strip()
        if status in (401, 403):
            return RemoteError(
                f"{self.url} refused the request (HTTP {status}): a valid API key is needed "
                f"(type it in Connect, or set {API_KEY_ENV})"
            )
        tail = f": {detail}" if detail else ""
        return RemoteError(f"{method} {self.prefix}{path} on {self.url} failed with HTTP {status}{tail}"[:400])

    def request(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None,
                expect_json: bool = True):
        """One request; returns the decoded JSON (or text). Raises RemoteError with one sentence."""
        conn, resp = self._open(method, path, payload, timeout)
        try:
            body = resp.read()
        except (http.client.HTTPException, OSError) as e:
            raise RemoteError(f"the connection to {self.url} dropped while reading {path} ({type(e).__name__})") \
                from None
        finally:
            conn.close()
        if resp.status >= 400:
            raise self._http_error(method, path, resp.status, body)
        if not expect_json:
            return body.decode("utf-8", "replace")
        try:
            return json.loads(body)
        except ValueError:
            raise RemoteError(
                f"{self.url}{path} did not answer with JSON: not an OpenAI-compatible server?"
            ) from None

    def try_request(self, method: str, path: str, payload: dict | None = None, expect_json: bool = True):
        """Like request, but None when the endpoint is missing or fails (for probing optional features)."""
        try:
            return self.request(method, path, payload, timeout=min(self.timeout, 10.0), expect_json=expect_json)
        except RemoteError:
            return None

    def stream(self, path: str, payload: dict, timeout: float | None = None) -> Iterator[tuple[float, Chunk]]:
        """POST a streaming request; yields (arrival time from time.perf_counter(), parsed chunk).

        Raises RemoteError if the server answers with an error, sends something that is not a stream, or the
        connection drops before the stream says it is done. Closing the generator closes the connection, which
        is how a request is cancelled (servers abort a request whose client went away).
        """
        conn, resp = self._open("POST", path, payload, timeout)
        n_chunks = 0
        done = False
        try:
            if resp.status >= 400:
                raise self._http_error("POST", path, resp.status, resp.read())
            ctype = resp.getheader("Content-Type", "")
            if "text/event-stream" not in ctype and "json" in ctype:
                body = resp.read()
                raise RemoteError(f"{self.url}{path} answered with JSON instead of a stream: {body[:100]!r}")
            for data in sse_data(_lines(resp)):
                if data.strip() == "[DONE]":
                    done = True
                    break
                try:
                    chunk = parse_chunk(data)
                except StreamFormatError as e:
                    raise RemoteError(str(e)) from None
                n_chunks += 1
                yield time.perf_counter(), chunk
                if chunk.finish_reason is not None and not payload.get("stream_options"):
                    done = True
        except TimeoutError:
            raise RemoteError(f"{self.url} stopped sending for {timeout or self.timeout:.0f} s mid-stream") from None
        except (http.client.HTTPException, OSError) as e:
            raise RemoteError(
                f"the connection to {self.url} dropped mid-stream after {n_chunks} chunks ({type(e).__name__})"
            ) from None
        finally:
            conn.close()
        if not done:
            raise RemoteError(
                f"the connection to {self.url} dropped mid-stream after {n_chunks} chunks (no end-of-stream marker)"
            )


def _lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while True:
        line = resp.readline()
        if not line:
            return
        yield line
