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


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The `data:` payloads of an SSE byte stream, one per event (multi-line data joined with newlines)."""
    buf: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue  # a comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            buf.append(value[1:] if value.startswith(" ") else value)
        elif name == "error":
            buf.append(value.strip())
    if buf:
        yield "\n".join(buf)


def _token_id(token: str, given: int | None = None) -> int | None:
    if given is not None:
        return int(given)
    if token.startswith("token_id:"):  # vLLM with return_tokens_as_token_ids
        try:
            return int(token[9:])
        except ValueError:
            return None
    return None


def _raw(tok: str, b) -> bytes | None:
    """A token's bytes as the server gives them. vLLM 0.32 with return_tokens_as_token_ids sends, for the chat top-N,
    the bytes of the string "token_id:N" itself: those are no token's bytes, so they count as unknown."""
    raw = bytes(b) if isinstance(b, list) else None
    return None if raw is not None and tok.startswith("token_id:") and raw == tok.encode() else raw


def _candidate(d: dict) -> Candidate:
    tok = str(d.get("token", ""))
    raw = _raw(tok, d.get("bytes"))
    return Candidate(token=tok, logprob=float(d.get("logprob", float("-inf"))), id=_token_id(tok, d.get("id")),
                     raw=raw)


def parse_chunk(payload: str) -> Chunk:
    """Parse one `data:` payload of a chat or legacy completions stream."""
    try:
        d = json.loads(payload)
    except json.JSONDecodeError:
        raise StreamFormatError(f"the server sent a chunk that is not JSON: {payload[:80]!r}") from None
    if not isinstance(d, dict):
        raise StreamFormatError(f"the server sent a chunk that is not a JSON object: {payload[:80]!r}")
    if "error" in d and "choices" not in d:
        err = d["error"]
        msg = err.get("message") if isinstance(err, dict) else str(err)
        raise StreamFormatError(f"the server reported an error mid-stream: {msg}")
    choices = d.get("choices")
    if choices is None:
        raise StreamFormatError("the server sent a chunk without 'choices': not an OpenAI-compatible stream")
    usage = d.get("usage") if isinstance(d.get("usage"), dict) else None
    timings = d.get("timings") if isinstance(d.get("timings"), dict) else None
    if not choices:
        return Chunk(usage=usage, model=d.get("model"), timings=timings)
    c = choices[0]
    if "delta" in c:
        text = (c.get("delta") or {}).get("content") or ""
    else:
        text = c.get("text") or ""
    ids = c.get("token_ids")
    prompt_ids = c.get("prompt_token_ids") or d.get("prompt_token_ids")
    tokens = _tokens(c.get("logprobs"), text, ids)
    return Chunk(
        tokens=tokens, text=text, finish_reason=c.get("finish_reason"), usage=usage,
        prompt_token_ids=tuple(int(i) for i in prompt_ids) if prompt_ids else None,
        model=d.get("model"), timings=timings,
    )


def _tokens(lp, text: str, ids) -> tuple[StreamToken, ...]:
    ids = list(ids) if isinstance(ids, list) else None
    out: list[StreamToken] = []
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):  # chat format
        for i, e in enumerate(lp["content"]):
            tok = str(e.get("token", ""))
            raw = _raw(tok, e.get("bytes"))
            tid = _token_id(tok, ids[i] if ids and i < len(ids) else None)
            top = tuple(_candidate(t) for t in e.get("top_logprobs") or ())
            out.append(StreamToken(text=tok if not tok.startswith("token_id:") else "", id=tid,
                                   logprob=float(e["logprob"]) if e.get("logprob") is not None else None,
                                   top=top, raw=raw))
    elif isinstance(lp, dict) and isinstance(lp.get("tokens"), list):  # legacy completions format
        toks = lp["tokens"]
        lps = lp.get("token_logprobs") or [None] * len(toks)
        tops = lp.get("top_logprobs") or [None] * len(toks)
        for i, tok in enumerate(toks):
            tid = _token_id(str(tok), ids[i] if ids and i < len(ids) else None)
            top_d = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            top = tuple(sorted((Candidate(token=str(k), logprob=float(v), id=_token_id(str(k)))
                                for k, v in top_d.items()), key=lambda c: -c.logprob))
            lpv = lps[i] if i < len(lps) else None
            out.append(StreamToken(text=str(tok) if not str(tok).startswith("token_id:") else "", id=tid,
                                   logprob=None if lpv is None else float(lpv), top=top))
    elif ids:
        out = [StreamToken(text="", id=int(i)) for i in ids]
        if len(out) == 1:
            out[0] = StreamToken(text=text, id=out[0].id)
    elif text:
        out = [StreamToken(text=text)]  # no per-token detail: the chunk counts as one token
    if out and ids and len(ids) == len(out):
        out = [t if t.id is not None else StreamToken(text=t.text, id=int(ids[i]), logprob=t.logprob, top=t.top,
                                                       raw=t.raw) for i, t in enumerate(out)]
    # Chunk text is authoritative for what is shown; spread it over the tokens when they carry none.
    if out and text and not any(t.text for t in out):
        out[0] = StreamToken(text=text, id=out[0].id, logprob=out[0].logprob, top=out[0].top, raw=out[0].raw)
    return tuple(out)
