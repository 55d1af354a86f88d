"""Server-sent events and the OpenAI streaming chunk formats, as pure functions (tested on recorded streams).

One SSE event is `data: {json}` lines ended by a blank line; the stream ends with `data: [DONE]`. One chunk may
carry several tokens (vLLM batches them when the client reads slower than the server decodes), so a chunk is
parsed into a list of `StreamToken`s, never assumed to be one token.

Two log-probability formats exist:
- chat completions: `choices[0].logprobs.content = [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]`
- legacy completions: `choices[0].logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{t: lp}]}`
vLLM adds `token_ids` (and `prompt_token_ids` in the first chunk) when asked with `return_token_ids`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


class StreamFormatError(Exception):
    """A chunk that is not what an OpenAI-compatible server sends; the message says what was wrong."""


@dataclass(frozen=True)
class Candidate:
    """One of the server's top-N alternatives at a step: its text, id when known, and log-probability."""

    token: str
    logprob: float
    id: int | None = None
    raw: bytes | None = None  # the token's bytes, when the server says them


@dataclass(frozen=True)
class StreamToken:
    """One generated token as the server streamed it."""

    text: str  # the text this token adds (may be "" for a partial UTF-8 character)
    id: int | None = None
    logprob: float | None = None
    top: tuple[Candidate, ...] = ()
    raw: bytes | None = None


@dataclass(frozen=True)
class Chunk:
    """One parsed SSE chunk: its tokens (possibly several), and what else it said."""

    tokens: tuple[StreamToken, ...] = ()
    text: str = ""  # all the text the chunk carries (also when it carries no per-token logprobs)
    finish_reason: str | None = None
    usage: dict | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    model: str | None = None
    timings: dict | None = None  # llama.cpp's server reports its own prompt/decode timings
    extra: dict = field(default_factory=dict)
    id: str | None = None  # the response's id (vLLM names its request, and that request's spans, after it)


def sse_data(lines: Iterable[bytes], max_event: int | None = None) -> Iterator[str]:
    """The `data:` payloads of an SSE byte stream, one per event (multi-line data joined with newlines).

    An event longer than `max_event` characters is a StreamFormatError (a stream that never ends an event must not
    grow without bound)."""
    buf: list[str] = []
    size = 0
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if buf:
                yield "\n".join(buf)
                buf, size = [], 0
            continue
        if line.startswith(":"):
            continue  # a comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            buf.append(value[1:] if value.startswith(" ") else value)
        elif name == "error":
            buf.append(value.strip())
        else:
            continue
        size += len(buf[-1]) + 1
        if max_event is not None and size > max_event:
            raise StreamFormatError(f"the server sent a stream event over {max_event >> 20} MB: not an event stream")
    if buf:
        yield "\n".join(buf)


# ---------------------------------------------------------------------------------------- checked field readers
# A server's chunk is checked field by field: a wrong type is one sentence (StreamFormatError), never a traceback.

MAX_TOKEN_ID = 2**31 - 1


def _bad(what: str, v) -> StreamFormatError:
    shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:39] + "…"
    return StreamFormatError(f"the server sent a chunk with a malformed {what} ({shown}): not an OpenAI-compatible "
                             "stream")


def _str(v, what: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise _bad(what, v)


def _id(v, what: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID:
        return v
    raise _bad(what, v)


def _ids(v, what: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise _bad(what, v)
    return tuple(_id(i, what) for i in v)


def _logprob(v, what: str) -> float | None:
    """A log-probability, or None when the server did not report a usable one: NaN, +inf and clearly positive
    values are no log-probability (treated as not reported); -inf is probability 0."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(what, v)
    try:
        f = float(v)
    except OverflowError:
        raise _bad(what, v) from None
    if math.isnan(f) or f > 1e-3:
        return None
    return min(f, 0.0)  # rounding may give a hair above 0 for a certain token


def _token_id(token: str, given=None) -> int | None:
    if given is not None:
        return _id(given, "token id")
    if token.startswith("token_id:"):  # vLLM with return_tokens_as_token_ids
        try:
            i = int(token[9:])
        except ValueError:
            return None
        return i if 0 <= i <= MAX_TOKEN_ID else None
    return None


def _raw(tok: str, b) -> bytes | None:
    """A token's bytes as the server gives them. vLLM 0.32 with return_tokens_as_token_ids sends, for the chat top-N,
    the bytes of the string "token_id:N" itself: those are no token's bytes, so they count as unknown."""
    if b is None:
        return None
    if not isinstance(b, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 256
                                          for x in b):
        raise _bad("token bytes", b)
    raw = bytes(b)
    return None if tok.startswith("token_id:") and raw == tok.encode() else raw


def _dict(v, what: str) -> dict:
    if isinstance(v, dict):
        return v
    raise _bad(what, v)


def _candidates(entries) -> tuple[Candidate, ...]:
    """Chat top_logprobs entries; one without a usable log-probability is left out (not reported)."""
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise _bad("top_logprobs", entries)
    out = []
    for d in entries:
        d = _dict(d, "top_logprobs entry")
        tok = _str(d.get("token"), "candidate token") or ""
        lp = _logprob(d.get("logprob"), "candidate logprob")
        if lp is not None:
            out.append(Candidate(token=tok, logprob=lp, id=_token_id(tok, d.get("id")), raw=_raw(tok, d.get("bytes"))))
    return tuple(out)


def parse_chunk(payload: str) -> Chunk:
    """Parse one `data:` payload of a chat or legacy completions stream (StreamFormatError, one sentence, when it is
    not one)."""
    try:
        d = json.loads(payload)
    except (ValueError, RecursionError):
        raise StreamFormatError(f"the server sent a chunk that is not JSON: {payload[:80]!r}") from None
    try:
        return _chunk(d, payload)
    except StreamFormatError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise StreamFormatError(f"the server sent a malformed chunk ({type(e).__name__})") from None


def _chunk(d, payload: str) -> Chunk:
    if not isinstance(d, dict):
        raise StreamFormatError(f"the server sent a chunk that is not a JSON object: {payload[:80]!r}")
    if "error" in d and "choices" not in d:
        err = d["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise StreamFormatError(f"the server reported an error mid-stream: {msg if isinstance(msg, str) else msg!r}")
    choices = d.get("choices")
    if choices is None:
        raise StreamFormatError("the server sent a chunk without 'choices': not an OpenAI-compatible stream")
    if not isinstance(choices, list):
        raise _bad("'choices'", choices)
    usage = _numbers(d.get("usage"), ints=True)
    timings = _numbers(d.get("timings"), ints=False)
    model = d.get("model") if isinstance(d.get("model"), str) else None
    rid = d["id"][:200] if isinstance(d.get("id"), str) else None
    if not choices:
        return Chunk(usage=usage, model=model, timings=timings, id=rid)
    c = _dict(choices[0], "choice")
    if "delta" in c:
        delta = c.get("delta") or {}
        text = _str(_dict(delta, "delta").get("content"), "delta content") or ""
    else:
        text = _str(c.get("text"), "text") or ""
    ids = _ids(c.get("token_ids"), "token_ids")
    prompt_ids = _ids(c.get("prompt_token_ids") or d.get("prompt_token_ids"), "prompt_token_ids")
    tokens = _tokens(c.get("logprobs"), text, ids)
    return Chunk(
        tokens=tokens, text=text, finish_reason=_str(c.get("finish_reason"), "finish_reason"), usage=usage,
        prompt_token_ids=prompt_ids or None, model=model, timings=timings, id=rid,
    )


def _numbers(v, ints: bool) -> dict | None:
    """usage / timings with only the entries that are plain numbers (counts: non-negative ints; else finite)."""
    if not isinstance(v, dict):
        return None
    out = {}
    for k, x in v.items():
        if isinstance(x, bool) or not isinstance(x, int | float):
            continue
        if ints:
            if not isinstance(x, int) or not 0 <= x <= 2**53:
                continue
        elif (isinstance(x, int) and abs(x) > 2**53) or (isinstance(x, float) and not math.isfinite(x)):
            continue
        out[str(k)] = x
    return out


def _tokens(lp, text: str, ids: tuple[int, ...] | None) -> tuple[StreamToken, ...]:
    out: list[StreamToken] = []
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):  # chat format
        for i, e in enumerate(lp["content"]):
            e = _dict(e, "logprobs entry")
            tok = _str(e.get("token"), "token") or ""
            raw = _raw(tok, e.get("bytes"))
            tid = _token_id(tok, ids[i] if ids and i < len(ids) else None)
            out.append(StreamToken(text=tok if not tok.startswith("token_id:") else "", id=tid,
                                   logprob=_logprob(e.get("logprob"), "logprob"),
                                   top=_candidates(e.get("top_logprobs")), raw=raw))
    elif isinstance(lp, dict) and isinstance(lp.get("tokens"), list):  # legacy completions format
        toks = lp["tokens"]
        lps = lp.get("token_logprobs") or [None] * len(toks)
        tops = lp.get("top_logprobs") or [None] * len(toks)
        if not isinstance(lps, list) or not isinstance(tops, list):
            raise _bad("logprobs", lps if not isinstance(lps, list) else tops)
        for i, tok in enumerate(toks):
            tok = _str(tok, "token") or ""
            tid = _token_id(tok, ids[i] if ids and i < len(ids) else None)
            top_d = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            cands = []
            for k, v in top_d.items():
                lpv = _logprob(v, "candidate logprob")
                if lpv is not None:
                    cands.append(Candidate(token=str(k), logprob=lpv, id=_token_id(str(k))))
            out.append(StreamToken(text=tok if not tok.startswith("token_id:") else "", id=tid,
                                   logprob=_logprob(lps[i] if i < len(lps) else None, "logprob"),
                                   top=tuple(sorted(cands, key=lambda c: -c.logprob))))
    elif lp is not None and not isinstance(lp, dict):
        raise _bad("logprobs", lp)
    elif ids:
        out = [StreamToken(text="", id=i) for i in ids]
        if len(out) == 1:
            out[0] = StreamToken(text=text, id=out[0].id)
    elif text:
        out = [StreamToken(text=text)]  # no per-token detail: the chunk counts as one token
    if out and ids and len(ids) == len(out):
        out = [t if t.id is not None else StreamToken(text=t.text, id=ids[i], logprob=t.logprob, top=t.top,
                                                       raw=t.raw) for i, t in enumerate(out)]
    # Chunk text is authoritative for what is shown; spread it over the tokens when they carry none.
    if out and text and not any(t.text for t in out):
        out[0] = StreamToken(text=text, id=out[0].id, logprob=out[0].logprob, top=out[0].top, raw=out[0].raw)
    return tuple(out)
