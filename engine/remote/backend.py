"""A remote server as a backend: probe it, tokenize with its tokenizer, and stream a generation as the SAME events
a local Session yields (engine.events), each saying what a server could not tell.

What a server gives: its tokenization, the streamed tokens with their arrival times, and the top-N
log-probabilities of every step (raw, before sampling, as vLLM and llama.cpp report them by default). What it does
not: attention weights, residual norms, per-step FLOPs/bytes, the full-vocabulary logits. So no AttentionCaptured or
ResidualNorms events are sent; TokenSampled.cost is all zeros and `funnel` is a `TopNFunnel` re-drawn from the
top-N candidates only (the rest of the vocabulary is unknown), labelled as such.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from engine.events import Event, Failed, Finished, Funnel, PromptTokenized, StepCost, TokenSampled
from engine.protocol import SamplingParams
from engine.remote.client import Cancel, Client, RemoteError, ServerInfo, clean_text
from engine.remote.metrics import ServerMetrics, parse_prometheus, server_metrics
from engine.remote.sse import MAX_TOKEN_ID, Candidate

NO_COST = StepCost(flops=0.0, weight_bytes=0.0, kv_read_bytes=0.0, kv_write_bytes=0.0)


@dataclass(frozen=True, kw_only=True)
class TopNFunnel(Funnel):
    """A funnel re-drawn from the server's top-N log-probabilities only: kept_* count among those N."""

    source: str = "server top-N log-probabilities (rest of the vocabulary unknown)"
    top_n: int = 0


@dataclass(frozen=True, kw_only=True)
class RemoteTokenSampled(TokenSampled):
    """A token as a server streamed it: `seconds` is the gap since the previous token arrived (0 inside a chunk)."""

    arrival_s: float = 0.0  # since the request was sent
    chunk: int = 0  # index of the SSE chunk it came in
    logprob: float | None = None  # the server's log-probability of this token


@dataclass(frozen=True, kw_only=True)
class ServerConnected:
    """The probe's result: the first event of a remote session."""

    info: ServerInfo


@dataclass(frozen=True, kw_only=True)
class ServerMetricsSampled:
    """One scrape of the server's /metrics during a run (seconds since the request was sent)."""

    t: float
    metrics: ServerMetrics


# ---------------------------------------------------------------------------------------------------- helpers

def _bytes_of_vocab_string(s: str) -> bytes:
    """A byte-level BPE vocabulary string (`Ġthe`) as bytes; other strings (added tokens) as their UTF-8."""
    from engine.tokenizer.vocab import _byte_level_tables

    translate, outside = _byte_level_tables()
    if outside.search(s):
        return s.encode("utf-8")
    return s.translate(translate).encode("latin-1")


def _readable(b: bytes) -> str:
    from engine.tokenizer.vocab import _readable as r

    return r(b)


def spans(text: str, piece_bytes: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Byte and character offsets of consecutive pieces laid over `text` (clipped to its end).

    A piece that covers part of a multi-byte character gets that character's whole span, as the local tokenizer does.
    """
    data = text.encode("utf-8")
    char_at = np.zeros(len(data) + 1, dtype=np.int64)  # byte offset -> index of the character holding it
    starts = np.ones(len(data) + 1, dtype=bool)  # byte offset is the first byte of a character
    pos = 0
    for ci, ch in enumerate(text):
        n = len(ch.encode("utf-8"))
        char_at[pos:pos + n] = ci
        starts[pos + 1:pos + n] = False
        pos += n
    char_at[len(data)] = len(text)
    b = np.zeros((len(piece_bytes), 2), dtype=np.int64)
    c = np.zeros((len(piece_bytes), 2), dtype=np.int64)
    pos = 0
    for i, pb in enumerate(piece_bytes):
        s, e = min(pos, len(data)), min(pos + len(pb), len(data))
        b[i] = (s, e)
        c[i] = (char_at[s], char_at[e] if starts[e] else char_at[e] + 1)
        pos += len(pb)
    return b, c


def _is_special(piece: str) -> bool:
    return len(piece) > 2 and ((piece.startswith("<|") and piece.endswith("|>"))
                               or (piece.startswith("<") and piece.endswith(">") and " " not in piece
                                   and not piece.startswith("<0x")))


def funnel_from_top(top: tuple[Candidate, ...], params: SamplingParams) -> TopNFunnel | None:
    """The sampling stages re-run over the server's top-N candidates (log-probabilities used as logits)."""
    if not top:
        return None
    import torch

    from engine.run.sampling import funnel

    cands = sorted(top, key=lambda c: -c.logprob)
    lp = torch.tensor([c.logprob if math.isfinite(c.logprob) else -1e9 for c in cands], dtype=torch.float32)
    st = funnel(lp, params)

    def f(t: torch.Tensor) -> np.ndarray:
        return t.numpy().astype(np.float32)

    return TopNFunnel(
        ids=np.array([c.id if c.id is not None else -1 for c in cands], dtype=np.int64),
        pieces=tuple(_readable(c.raw) if c.raw is not None else c.token for c in cands),
        logits=f(lp), p_raw=np.exp(f(lp)), p_temperature=f(st.p_temperature), p_top_k=f(st.p_top_k),
        p_top_p=f(st.p_top_p), p_final=f(st.p_final), kept_top_k=st.kept_top_k, kept_top_p=st.kept_top_p,
        kept_final=st.kept_final, vocab_size=len(cands), greedy=params.greedy,
        top_n=len(cands),
    )


def _malformed(c: Client, path: str, what: str) -> RemoteError:
    return RemoteError(f"{c.url}{path} answered with {what}: not what an OpenAI-compatible server sends")


def _ids_in(c: Client, path: str, r, key: str) -> list:
    """r[key] as a list (RemoteError when the answer is not an object holding a list there)."""
    v = r.get(key) if isinstance(r, dict) else None
    if not isinstance(v, list):
        raise _malformed(c, path, f"no '{key}' list")
    return v


def _token_id_of(c: Client, path: str, v) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID:
        return v
    raise _malformed(c, path, f"a token id that is {clean_text(repr(v), 40)}")


def _text_in(c: Client, path: str, r, key: str) -> str:
    v = r.get(key, "") if isinstance(r, dict) else None
    if not isinstance(v, str):
        raise _malformed(c, path, f"no '{key}' text")
    return v


# ---------------------------------------------------------------------------------------------------- backend

class RemoteBackend:
    """A connected OpenAI-compatible server."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        self.client = Client(url, api_key=api_key, timeout=timeout)
        self.info: ServerInfo | None = None
        self._token_bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int, cancel: Cancel | None = None) -> bytes | None:
        """A token's text as the server detokenizes it alone (cached; None when the server cannot say)."""
        if token_id not in self._token_bytes:
            try:
                self._token_bytes[token_id] = self._detok_bytes(token_id, cancel)
            except RemoteError:
                return None
        return self._token_bytes[token_id]

    def with_pieces(self, top: tuple[Candidate, ...], cancel: Cancel | None = None) -> tuple[Candidate, ...]:
        """Candidates named only by id (vLLM's return_tokens_as_token_ids) get their bytes from the server."""
        out = []
        for c in top:
            if c.raw is None and c.id is not None and (not c.token or c.token.startswith("token_id:")):
                c = Candidate(token=c.token, logprob=c.logprob, id=c.id, raw=self.token_bytes(c.id, cancel))
            out.append(c)
        return tuple(out)

    # ---- discovery --------------------------------------------------------------------------------------
    def probe(self) -> ServerInfo:
        """GET /v1/models, then the optional endpoints; raises RemoteError when this is no OpenAI-like server."""
        c = self.client
        models = c.request("GET", "/v1/models", timeout=min(c.timeout, 15.0))
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise RemoteError(f"{c.url} answered /v1/models without a model list: not an OpenAI-compatible server")
        m = data[0]
        model = m["id"]
        if not isinstance(model, str) or not model or len(model) > 1000 or clean_text(model, 1000) != model:
            raise RemoteError(f"{c.url} answered /v1/models with a model id that is not one line of text: "
                              "not an OpenAI-compatible server")
        owned = m.get("owned_by") if isinstance(m.get("owned_by"), str) else ""
        max_len = m.get("max_model_len")
        version = c.try_request("GET", "/version")
        metrics_text = c.try_request("GET", "/metrics", expect_json=False)
        has_metrics = isinstance(metrics_text, str) and ("vllm:" in metrics_text or "llamacpp:" in metrics_text)
        kind, tokenize, slots = "openai-compatible", None, False
        if owned == "vllm" or (isinstance(version, dict) and "version" in version and
                               metrics_text and "vllm:" in metrics_text):
            kind, tokenize = "vllm", "/tokenize"
        elif c.try_request("POST", "/extras/tokenize", {"input": "a"}) is not None:
            kind, tokenize = "llama-cpp-python", "/extras/tokenize"
        else:
            props = c.try_request("GET", "/props")
            if isinstance(props, dict) and ("default_generation_settings" in props or "n_ctx" in props):
                kind, tokenize = "llama.cpp", "/tokenize"
                slots = isinstance(c.try_request("GET", "/slots"), list)
                dgs = props.get("default_generation_settings")
                max_len = max_len or (dgs.get("n_ctx") if isinstance(dgs, dict) else None)
        version = version.get("version") if isinstance(version, dict) else None
        self.info = ServerInfo(
            url=c.url, kind=kind, model=model,
            version=clean_text(version, 80) if isinstance(version, str) else None,
            max_model_len=max_len if isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > 0
            else None,
            tokenize=tokenize, metrics=has_metrics, slots=slots,
            root=str(m["root"]) if isinstance(m.get("root"), str) else None,
        )
        return self.info

    def _info(self) -> ServerInfo:
        return self.info or self.probe()

    def metrics(self, cancel: Cancel | None = None) -> ServerMetrics | None:
        if not self._info().metrics:
            return None
        text = self.client.try_request("GET", "/metrics", expect_json=False, cancel=cancel)
        return server_metrics(parse_prometheus(text)) if text else None

    # ---- tokenization ---------------------------------------------------------------------------------------
    def tokenize(self, text: str, chat: bool = False, cancel: Cancel | None = None) -> PromptTokenized:
        """The server's own tokenization of `text` (chat: of the prompt its chat template makes; vLLM only)."""
        info = self._info()
        c = self.client
        if info.tokenize is None:
            raise RemoteError(f"this {info.kind} server offers no tokenize endpoint")
        path = info.tokenize
        if info.kind == "vllm":
            payload: dict = {"model": info.model, "return_token_strs": True}
            if chat:
                payload |= {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
            else:
                payload |= {"prompt": text, "add_special_tokens": True}
            r = c.request("POST", path, payload, cancel=cancel)
            ids = [_token_id_of(c, path, i) for i in _ids_in(c, path, r, "tokens")]
            strs = r.get("token_strs")
            if strs:
                if not isinstance(strs, list) or len(strs) != len(ids) or not all(isinstance(x, str) for x in strs):
                    raise _malformed(c, path, "token strings that do not match its tokens")
                pieces_b = [_bytes_of_vocab_string(x) for x in strs]
            else:
                pieces_b = [self._detok_bytes(i, cancel) for i in ids]
            if chat:
                text = b"".join(pieces_b).decode("utf-8", "replace")
        elif chat:
            raise RemoteError(f"a {info.kind} server cannot show how it tokenizes a chat prompt (its template is "
                              "applied inside the chat endpoint); untick Chat to see a plain prompt's tokens")
        elif info.kind == "llama-cpp-python":
            r = c.request("POST", path, {"input": text}, cancel=cancel)
            ids = [_token_id_of(c, path, i) for i in _ids_in(c, path, r, "tokens")]
            pieces_b = [self._detok_bytes(i, cancel) for i in ids]
        else:  # llama-server
            r = c.request("POST", path, {"content": text, "with_pieces": True, "add_special": True}, cancel=cancel)
            ids, pieces_b = [], []
            for t in _ids_in(c, path, r, "tokens"):
                if isinstance(t, dict):
                    ids.append(_token_id_of(c, path, t.get("id")))
                    p = t.get("piece", "")
                    if isinstance(p, list) and all(isinstance(x, int) and 0 <= x < 256 for x in p):
                        pieces_b.append(bytes(p))
                    elif isinstance(p, str):
                        pieces_b.append(p.encode("utf-8"))
                    else:
                        raise _malformed(c, path, "a token piece that is neither text nor bytes")
                else:
                    ids.append(_token_id_of(c, path, t))
                    pieces_b.append(self._detok_bytes(ids[-1], cancel))
        pieces = tuple(_readable(b) for b in pieces_b)
        bo, co = spans(text, pieces_b)
        return PromptTokenized(
            text=text, ids=np.array(ids, dtype=np.int64), pieces=pieces, offsets=co, byte_offsets=bo,
            special=np.array([_is_special(p) for p in pieces], dtype=bool),
        )

    def _detok_bytes(self, token_id: int, cancel: Cancel | None = None) -> bytes:
        info = self._info()
        c = self.client
        if info.kind == "vllm":
            r = c.request("POST", "/detokenize", {"model": info.model, "tokens": [token_id]}, cancel=cancel)
            return _text_in(c, "/detokenize", r, "prompt").encode("utf-8")
        if info.kind == "llama-cpp-python":
            r = c.request("POST", "/extras/detokenize", {"tokens": [token_id]}, cancel=cancel)
            return _text_in(c, "/extras/detokenize", r, "text").encode("utf-8")
        r = c.request("POST", "/detokenize", {"tokens": [token_id]}, cancel=cancel)
        return _text_in(c, "/detokenize", r, "content").encode("utf-8")

    # ---- generation ---------------------------------------------------------------------------------------
    def request_payload(self, prompt: str | Sequence[int], params: SamplingParams, max_new_tokens: int, chat: bool,
                        top_logprobs: int, ignore_eos: bool = False) -> tuple[str, dict]:
        """The endpoint and body of a request; `prompt` may be token ids for a plain completion (sent as they are)."""
        if not isinstance(prompt, str):
            if chat:
                raise ValueError("a chat request takes text, not token ids")
            prompt = [int(i) for i in prompt]
        info = self._info()
        p: dict = {"model": info.model, "max_tokens": int(max_new_tokens), "stream": True,
                   "stream_options": {"include_usage": True}, "temperature": float(params.temperature)}
        if params.top_p < 1.0:
            p["top_p"] = params.top_p
        if params.top_k:
            p["top_k"] = params.top_k
        if params.min_p > 0:
            p["min_p"] = params.min_p
        if params.seed is not None:
            p["seed"] = params.seed
        if params.repetition_penalty != 1.0:
            p["repetition_penalty" if info.kind == "vllm" else "repeat_penalty"] = params.repetition_penalty
        if params.logit_bias:
            p["logit_bias"] = {str(t): b for t, b in params.logit_bias}
        if info.kind == "vllm":
            p["return_token_ids"] = True
            if top_logprobs:
                p["return_tokens_as_token_ids"] = True  # ids for the top-N too; pieces come from /detokenize
            if ignore_eos:
                p["ignore_eos"] = True
        if chat:
            p["messages"] = [{"role": "user", "content": prompt}]
            if top_logprobs:
                p["logprobs"] = True
                p["top_logprobs"] = int(top_logprobs)
            return "/v1/chat/completions", p
        p["prompt"] = prompt
        if top_logprobs:
            p["logprobs"] = int(top_logprobs)
        return "/v1/completions", p

    def generate(self, prompt: str, params: SamplingParams, max_new_tokens: int = 128, chat: bool = False,
                 top_logprobs: int = 5, ignore_eos: bool = False) -> RemoteGeneration:
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        return RemoteGeneration(self, prompt, params, max_new_tokens, chat, top_logprobs, ignore_eos)


class RemoteGeneration:
    """Iterate for events; `stop()`, from any thread, ends it within moments whatever the server does: it shuts
    down the connection in flight (which also cancels the request: servers abort one whose client went away)."""

    def __init__(self, backend: RemoteBackend, prompt: str, params: SamplingParams, max_new_tokens: int,
                 chat: bool, top_logprobs: int, ignore_eos: bool) -> None:
        self.backend = backend
        self.prompt, self.params, self.max_new_tokens = prompt, params, max_new_tokens
        self.chat, self.top_logprobs, self.ignore_eos = chat, top_logprobs, ignore_eos
        self._stop = False
        self._cancel = Cancel()
        self._gen = self._run()
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.capture = None  # set by the engine process like a local Generation's; a server captures nothing
        self.metrics_every_s = 0.5  # scrape the server's /metrics this often while streaming (0 = never)

    def stop(self) -> None:
        """Safe from any thread: the iterator then ends with Finished(reason="stopped")."""
        self._stop = True
        self._cancel.set()

    def __iter__(self) -> Iterator[Event | ServerConnected]:
        return self._gen

    def __next__(self):
        return next(self._gen)

    def _run(self) -> Iterator:
        b = self.backend
        cancel = self._cancel
        try:
            info = b._info()
        except RemoteError as e:
            yield Failed(message=str(e))
            return
        yield ServerConnected(info=info)
        prompt_ev: PromptTokenized | None = None
        if info.tokenize is not None and (not self.chat or info.kind == "vllm") and not self._stop:
            try:
                prompt_ev = b.tokenize(self.prompt, self.chat, cancel)
                yield prompt_ev
            except RemoteError:
                prompt_ev = None  # the generation itself may still work
        path, payload = b.request_payload(self.prompt, self.params, self.max_new_tokens, self.chat,
                                          self.top_logprobs, self.ignore_eos)
        ids: list[int] = []
        texts: list[str] = []
        gaps: list[float] = []
        prompt_ids = tuple(int(i) for i in prompt_ev.ids) if prompt_ev is not None else ()
        t0 = time.perf_counter()
        last = t0
        ttft = 0.0
        finish = None
        n = 0
        stream = b.client.stream(path, payload, cancel=cancel)
        scrape = info.metrics and self.metrics_every_s > 0
        last_scrape = t0
        try:
            for ci, (t, chunk) in enumerate(() if self._stop else stream):
                if scrape and t - last_scrape >= self.metrics_every_s:
                    last_scrape = t
                    m = b.metrics(cancel)
                    if m is not None:
                        yield ServerMetricsSampled(t=t - t0, metrics=m)
                if chunk.prompt_token_ids and not prompt_ids:
                    prompt_ids = chunk.prompt_token_ids
                if chunk.usage:
                    self.usage = chunk.usage
                if chunk.timings:
                    self.timings = chunk.timings
                finish = chunk.finish_reason or finish
                for k, tok in enumerate(chunk.tokens):
                    if n == 0:
                        ttft = t - t0
                    gap = (t - last) if k == 0 else 0.0
                    if n > 0:
                        gaps.append(gap)
                    text = tok.text
                    raw = tok.raw if tok.raw is not None else (
                        b.token_bytes(tok.id, cancel) if tok.id is not None and info.kind == "vllm" else None)
                    piece = _readable(raw) if raw is not None else text
                    ev = RemoteTokenSampled(
                        step=n, phase="prefill" if n == 0 else "decode", position=len(prompt_ids) + n,
                        token_id=tok.id if tok.id is not None else -1, piece=piece, text=text, seconds=gap,
                        cost=NO_COST,
                        funnel=funnel_from_top(b.with_pieces(tok.top, cancel), self.params),
                        params=self.params, arrival_s=t - t0, chunk=ci, logprob=tok.logprob,
                    )
                    ids.append(ev.token_id)
                    texts.append(text)
                    n += 1
                    yield ev
                last = t
                if self._stop:
                    break
        except RemoteError as e:
            if not self._stop:
                yield Failed(message=str(e) + (f" ({n} token{'s' if n > 1 else ''} had arrived)" if n else ""))
                return
        finally:
            stream.close()
        total = last - t0
        if scrape and not self._stop:
            m = b.metrics(cancel)
            if m is not None:
                yield ServerMetricsSampled(t=time.perf_counter() - t0, metrics=m)
        # The server's count (usage) when it is plausible: chunks without per-token detail count as one token here
        u = (self.usage or {}).get("completion_tokens")
        n_out = u if isinstance(u, int) and not self._stop and n <= u <= 2 * self.max_new_tokens + 16 else n
        tpot = (total - ttft) / (n_out - 1) if n_out > 1 else 0.0
        reason = "stopped" if self._stop else {"stop": "eos", "length": "length"}.get(str(finish), "eos")
        yield Finished(
            reason=reason, prompt_ids=np.array(prompt_ids, dtype=np.int64), ids=np.array(ids, dtype=np.int64),
            text="".join(texts), ttft_s=ttft, tpot_s=tpot, step_seconds=np.array(gaps), total_s=total,
        )
