"""Per-request timelines of a load run: the Gantt's bars, their exports (CSV, JSON, a Perfetto trace) and the plain
data a session keeps.

A bar is one request, from the client's own stream: sent at 0, waiting (queued and prefilled on the server: the
client cannot tell the two apart) until the first content chunk at TTFT, decoding until the last at E2EL; each
chunk's arrival is a tick, and the gap before it is that token's inter-token latency (ITL). The figures are the ones
the lab's table summarises (engine.remote.loadlab: TTFT = token_times_s[0], E2EL = token_times_s[-1]), never
recomputed another way. Where the server exports its own span (engine.remote.spans), the bar gets the server's
phases beside it — queue, prefill, decode — placed at the server's arrival time, on the same wall clock.

The Perfetto trace is Chrome's trace-event JSON (what ui.perfetto.dev and chrome://tracing open): one track per
request under "client", "X" slices in microseconds since the first request was sent, and the server's phases under
"server (spans)".
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

import numpy as np

from engine.remote.loadlab import MAX_PIECES_CHARS, MAX_TIMELINE, RequestResult
from engine.remote.spans import ServerSpan

MAX_REQUESTS = 100_000  # a session or a file holds at most this many requests


@dataclass(frozen=True)
class Bar:
    """One request on the Gantt; times in seconds after `t0_s` (its send time, since the first request was sent)."""

    number: int  # the row: requests in the order they were sent
    result: RequestResult
    t0_s: float
    token_times_s: np.ndarray  # each content chunk's arrival, after sending
    segments: tuple[tuple[str, float, float], ...]  # ("waiting" | "decode" | "failed", start, end)
    server: tuple[tuple[str, float, float], ...] = ()  # ("queue" | "prefill" | "decode", start, end), from its span

    @property
    def ttft_s(self) -> float:
        return float(self.token_times_s[0]) if len(self.token_times_s) else self.result.ttft_s

    @property
    def e2el_s(self) -> float:
        if self.result.timeline_cut or not len(self.token_times_s):
            return self.result.e2el_s
        return float(self.token_times_s[-1])

    @property
    def itl_s(self) -> np.ndarray:
        """The gap before each chunk after the first (the ticks' colours)."""
        return np.diff(self.token_times_s)


def sent(requests: Iterable[RequestResult]) -> list[RequestResult]:
    """The requests that went out (a request never sent, past the time limit, has no timeline), in sending order."""
    return sorted((r for r in requests if r.sent_wall_s > 0), key=lambda r: r.sent_wall_s)


def server_phases(r: RequestResult) -> tuple[tuple[str, float, float], ...]:
    """The server's queue, prefill and decode for `r`, in seconds after the client sent it; () without a span."""
    s = r.server
    if not isinstance(s, ServerSpan):
        return ()
    at = s.start_wall_s - r.sent_wall_s  # the server's arrival, on the client's axis (one machine, one wall clock)
    out = []
    for kind, d in (("queue", s.queue_s), ("prefill", s.prefill_s), ("decode", s.decode_s)):
        if d is None:
            break
        out.append((kind, at, at + max(0.0, d)))
        at += max(0.0, d)
    return tuple(out)


def delivery(r: RequestResult) -> tuple[float, float] | None:
    """How long after the server's own first and last token (its span's arrival + TTFT, arrival + E2EL, placed on
    the client's axis) the client saw them, in seconds: the two accounts of the same two events compared. The raw
    TTFTs differ by more: the client's counts from sending, the server's from its engine's arrival (after the HTTP
    request was read and the prompt tokenized). None without a span that says both."""
    s = r.server
    if not isinstance(s, ServerSpan) or s.ttft_s is None or s.e2el_s is None or not r.ok:
        return None
    at = s.start_wall_s - r.sent_wall_s
    return r.ttft_s - (at + s.ttft_s), r.e2el_s - (at + s.e2el_s)


def bars(requests: Iterable[RequestResult]) -> list[Bar]:
    """The Gantt's rows: every request that was sent, in sending order."""
    rs = sent(requests)
    if not rs:
        return []
    origin = rs[0].sent_wall_s
    out = []
    for i, r in enumerate(rs):
        times = np.asarray(r.token_times_s, dtype=float)
        if not r.ok:
            segs: tuple = (("failed", 0.0, max(r.end_s, float(times[-1]) if len(times) else 0.0)),)
        elif len(times):
            e2el = r.e2el_s if r.timeline_cut else float(times[-1])
            segs = (("waiting", 0.0, float(times[0])), ("decode", float(times[0]), e2el))
        else:
            segs = (("waiting", 0.0, r.e2el_s),)
        out.append(Bar(number=i, result=r, t0_s=r.sent_wall_s - origin, token_times_s=times, segments=segs,
                       server=server_phases(r)))
    return out


# ---- exports --------------------------------------------------------------------------------------------------
ROW_FIELDS = ("number", "concurrency", "index", "request_id", "ok", "sent_s", "ttft_ms", "tpot_ms", "e2el_ms",
              "output_tokens", "prompt_tokens", "chunks", "itl_max_ms", "server_arrival_ms", "server_queue_ms",
              "server_prefill_ms", "server_decode_ms", "server_ttft_ms", "server_e2el_ms", "first_token_delivery_ms",
              "last_token_delivery_ms", "error")


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def rows(requests: Iterable[RequestResult]) -> list[dict]:
    """One row per request sent (CSV and the panel's table): the Gantt's figures, in ms."""
    out = []
    for b in bars(requests):
        r, s = b.result, b.result.server if isinstance(b.result.server, ServerSpan) else None
        itl = b.itl_s
        gaps = delivery(r)
        out.append({
            "number": b.number, "concurrency": r.concurrency, "index": r.index, "request_id": r.request_id,
            "ok": r.ok, "sent_s": b.t0_s, "ttft_ms": b.ttft_s * 1e3 if r.ok else None,
            "tpot_ms": r.tpot_s * 1e3 if r.ok else None, "e2el_ms": b.e2el_s * 1e3 if r.ok else None,
            "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "chunks": len(b.token_times_s),
            "itl_max_ms": float(itl.max()) * 1e3 if len(itl) else None,
            "server_arrival_ms": (s.start_wall_s - r.sent_wall_s) * 1e3 if s else None,
            "first_token_delivery_ms": gaps[0] * 1e3 if gaps else None,
            "last_token_delivery_ms": gaps[1] * 1e3 if gaps else None,
            "server_queue_ms": _ms(s.queue_s) if s else None, "server_prefill_ms": _ms(s.prefill_s) if s else None,
            "server_decode_ms": _ms(s.decode_s) if s else None, "server_ttft_ms": _ms(s.ttft_s) if s else None,
            "server_e2el_ms": _ms(s.e2el_s) if s else None, "error": r.error,
        })
    return out


def to_csv(requests: Iterable[RequestResult]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=ROW_FIELDS)
    w.writeheader()
    for row in rows(requests):
        w.writerow({k: "" if v is None else v for k, v in row.items()})
    return buf.getvalue()


def to_json(requests: Iterable[RequestResult]) -> dict:
    """Every request with its whole timeline (chunk arrivals in ms after sending, tokens and text per chunk)."""
    out = []
    for row, b in zip(rows(requests), bars(requests), strict=True):
        r = b.result
        out.append({**row, "token_times_ms": [t * 1e3 for t in r.token_times_s], "chunk_tokens": list(r.chunk_tokens),
                    "pieces": list(r.pieces), "timeline_cut": r.timeline_cut,
                    "server_phases": [{"phase": k, "start_ms": a * 1e3, "end_ms": e * 1e3} for k, a, e in b.server]})
    return {"requests": out}


def _us(s: float) -> float:
    return round(s * 1e6, 3)


def perfetto(requests: Iterable[RequestResult]) -> dict:
    """Chrome trace-event JSON (ui.perfetto.dev opens it): pid 1 the client, one thread per request, with a
    "request" slice, its "waiting" and "decode" slices and one slice per chunk after the first (its ITL); pid 2 the
    server's phases from its spans."""
    ev: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "client"}},
                      {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "server (spans)"}}]
    for b in bars(requests):
        r, tid, t0 = b.result, b.number + 1, b.t0_s
        label = f"#{b.number} C={r.concurrency} {r.request_id}".strip()
        ev.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": label}})
        end = max(e for _, _, e in b.segments)
        ev.append({"ph": "X", "name": "request" if r.ok else "request (failed)", "cat": "client", "pid": 1,
                   "tid": tid, "ts": _us(t0), "dur": _us(end),
                   "args": {"ttft_ms": b.ttft_s * 1e3, "e2el_ms": b.e2el_s * 1e3, "output_tokens": r.output_tokens,
                            "request_id": r.request_id, "error": r.error}})
        for kind, a, e in b.segments:
            if kind != "failed":
                ev.append({"ph": "X", "name": kind, "cat": "client", "pid": 1, "tid": tid, "ts": _us(t0 + a),
                           "dur": _us(e - a)})
        times = b.token_times_s
        for k in range(1, len(times)):
            ev.append({"ph": "X", "name": f"chunk {k}", "cat": "itl", "pid": 1, "tid": tid,
                       "ts": _us(t0 + times[k - 1]), "dur": _us(times[k] - times[k - 1]),
                       "args": {"itl_ms": (times[k] - times[k - 1]) * 1e3,
                                "tokens": r.chunk_tokens[k] if k < len(r.chunk_tokens) else 1}})
        if b.server:
            ev.append({"ph": "M", "name": "thread_name", "pid": 2, "tid": tid, "args": {"name": label}})
            for kind, a, e in b.server:
                ev.append({"ph": "X", "name": kind, "cat": "server", "pid": 2, "tid": tid, "ts": _us(t0 + a),
                           "dur": _us(e - a)})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


# ---- plain data (sessions) ------------------------------------------------------------------------------------
class TimelineError(ValueError):
    """A saved request is not one; the message is one sentence."""


_SPAN_FIELDS = {f.name for f in fields(ServerSpan)}


def to_plain(r: RequestResult) -> dict:
    """A request as plain values and float arrays (what a session file stores)."""
    d = {f.name: getattr(r, f.name) for f in fields(RequestResult)}
    d["itl_s"] = np.asarray(r.itl_s, dtype=float)
    d["token_times_s"] = np.asarray(r.token_times_s, dtype=float)
    d["chunk_tokens"] = np.asarray(r.chunk_tokens, dtype=np.int64)
    d["pieces"] = list(r.pieces)
    d["server"] = {f: getattr(r.server, f) for f in _SPAN_FIELDS} if isinstance(r.server, ServerSpan) else None
    return d


def _floats(v: object, name: str, limit: int) -> tuple[float, ...]:
    a = np.asarray(v if v is not None else (), dtype=object)
    if a.ndim != 1 or len(a) > limit:
        raise TimelineError(f"its {name} is not a list of at most {limit} numbers")
    try:
        out = np.asarray(a, dtype=float) if len(a) else np.zeros(0)
    except (TypeError, ValueError):
        raise TimelineError(f"its {name} holds something that is not a number") from None
    if any(isinstance(x, bool) or isinstance(x, str) for x in a) or not np.isfinite(out).all():
        raise TimelineError(f"its {name} holds something that is not a finite number")
    return tuple(float(x) for x in out)


def from_plain(d: object) -> RequestResult:
    """The request a session kept (TimelineError, one sentence, when it is not one)."""
    if not isinstance(d, dict):
        raise TimelineError("it is not a record")
    kinds = {"ok": bool, "ttft_s": float, "e2el_s": float, "output_tokens": int, "prompt_tokens": int, "error": str,
             "start_s": float, "index": int, "request_id": str, "sent_wall_s": float, "end_s": float,
             "timeline_cut": bool}
    kw: dict = {}
    for k, kind in kinds.items():
        if k not in d:
            continue
        v = d[k]
        ok = (isinstance(v, bool) if kind is bool else isinstance(v, str) if kind is str
              else isinstance(v, int) and not isinstance(v, bool) if kind is int
              else isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
        if not ok:
            raise TimelineError(f"its {k} is a {type(v).__name__}, not a {kind.__name__}")
        kw[k] = float(v) if kind is float else v
    c = d.get("concurrency")
    if c is not None and not (isinstance(c, int) and not isinstance(c, bool)):
        raise TimelineError(f"its concurrency is a {type(c).__name__}")
    kw["concurrency"] = c
    kw["itl_s"] = _floats(d.get("itl_s"), "inter-token latencies", 16 * MAX_TIMELINE)
    kw["token_times_s"] = _floats(d.get("token_times_s"), "chunk times", MAX_TIMELINE)
    counts = _floats(d.get("chunk_tokens"), "chunk token counts", MAX_TIMELINE)
    if any(x != int(x) or x < 0 for x in counts):
        raise TimelineError("its chunk token counts are not whole numbers")
    kw["chunk_tokens"] = tuple(int(x) for x in counts)
    pieces = d.get("pieces", [])
    if not isinstance(pieces, (list, tuple)) or not all(isinstance(p, str) for p in pieces) \
            or sum(map(len, pieces)) > MAX_PIECES_CHARS or len(pieces) > MAX_TIMELINE:
        raise TimelineError("its text pieces are not a bounded list of strings")
    kw["pieces"] = tuple(pieces)
    if any(b < a for a, b in zip(kw["token_times_s"], kw["token_times_s"][1:], strict=False)):
        raise TimelineError("its chunk times go backwards")
    s = d.get("server")
    if s is not None:
        if not isinstance(s, dict) or not set(s) <= _SPAN_FIELDS or not isinstance(s.get("request_id"), str):
            raise TimelineError("its server span is not one")
        for k, v in s.items():
            if k in ("request_id", "name"):
                if not isinstance(v, str):
                    raise TimelineError(f"its server span's {k} is not text")
            elif v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise TimelineError(f"its server span's {k} is not a number")
        kw["server"] = ServerSpan(**s)
    return RequestResult(**kw)


def restore(saved: object) -> tuple[list[RequestResult], str]:
    """The requests a session kept and "" — or those that could be read and one sentence on the rest."""
    if saved is None:
        return [], ""
    if not isinstance(saved, (list, tuple)):
        return [], "the session's load-lab requests are not a list"
    out, bad, why = [], 0, ""
    for d in saved[:MAX_REQUESTS]:
        try:
            out.append(from_plain(d))
        except TimelineError as e:
            bad, why = bad + 1, why or str(e)
    cut = len(saved) - MAX_REQUESTS
    msg = f"{bad} saved load-lab request(s) skipped: {why}" if bad else ""
    if cut > 0:
        msg = "; ".join(filter(None, [msg, f"{cut} request(s) past the first {MAX_REQUESTS} skipped"]))
    return out, msg
