"""The remote backend inside the engine process (engine.server): connect, generate, preview and serve-bench.

Commands: connect (url, api_key) · disconnect · serve_bench dict · cancel_serve_bench ·
server_tokenize (request_id, text, chat).
Notices out: connected ServerInfo · connect_failed str · serve_progress (fraction, message) ·
serve_request RequestResult · serve_metrics (t, ServerMetrics) · serve_run dict · serve_done str ·
server_tokens (request_id, text, PromptTokenized or None, error, chat PromptTokenized or None, chat error).
The API key lives in this process's memory only; it is never written anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

from engine.protocol import SamplingParams
from engine.remote.backend import RemoteBackend, RemoteTokenSampled
from engine.remote.client import RemoteError
from engine.remote.shapes import server_model_config

SERVER_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs is 20; llama.cpp has no such cap


class RemoteSession:
    """Stands where engine.run.session.Session stands in EngineServer, for a server."""

    is_remote = True

    def __init__(self, backend: RemoteBackend, local=None) -> None:
        self.backend = backend
        self.local = local  # the local Session it replaced, restored on disconnect

    def generate(self, text, params: SamplingParams, max_new_tokens: int, capture=None, chat: bool = False,
                 ignore_eos: bool = False, forced: dict | None = None, **_ignored):
        if forced:
            raise ValueError("a server samples its own tokens: forcing a token (branching) works on the local model")
        if not isinstance(text, str):
            raise ValueError("a server takes the prompt as text: branching from token ids works on the local model")
        top = getattr(capture, "funnel_top", 0) or 10
        gen = self.backend.generate(text, params, max_new_tokens, chat=chat,
                                    top_logprobs=min(top, SERVER_TOP_LOGPROBS), ignore_eos=ignore_eos)
        gen.capture = capture  # accepted and ignored: a server has nothing to capture
        return gen

    def preview(self, server, request_id: int, text: str, chat: bool, top: int) -> None:
        from engine.server import PreviewResult

        t0 = time.perf_counter()
        gen = self.backend.generate(text, server.params, 1, chat=chat, top_logprobs=min(top, SERVER_TOP_LOGPROBS))
        n = 0
        for ev in gen:
            if type(ev).__name__ == "Finished":
                n = len(ev.prompt_ids)
            if isinstance(ev, RemoteTokenSampled) and ev.funnel is not None:
                f = ev.funnel
        if "f" in locals():
            server.send(PreviewResult(request_id=request_id, text=text, n_tokens=n, n_reused=0, n_computed=n,
                                      seconds=time.perf_counter() - t0, funnel=f))


def connect(server, url: str, api_key: str | None) -> None:
    try:
        backend = RemoteBackend(url, api_key=api_key or None)
        info = backend.probe()
    except RemoteError as e:
        server.send(("connect_failed", str(e)))
        return
    cfg, note = server_model_config(info.model, info.root)
    info = dataclasses.replace(info, config=cfg, config_note=note)
    local = server.session.local if getattr(server.session, "is_remote", False) else server.session
    server.session = RemoteSession(backend, local)
    server.send(("connected", info))


def disconnect(server) -> None:
    if getattr(server.session, "is_remote", False):
        server.session = server.session.local
    server.send(("disconnected", None))


def serve_bench(server, cfg: dict) -> None:
    """Run the load benchmark in a thread; meanwhile read commands so Cancel acts at once."""
    from engine.remote import bench

    sess = server.session
    if not getattr(sess, "is_remote", False):
        server.send(("serve_done", "connect to a server first (File → Connect to server…)"))
        return
    cancel = threading.Event()
    levels = list(cfg.get("concurrency") or [1, 2, 4])
    n = int(cfg.get("num_prompts", 8))
    total = len(levels) * n
    done = [0]

    def on_request(r) -> None:
        done[0] += 1
        server.send(("serve_request", r))
        server.send(("serve_progress", (min(1.0, done[0] / total), f"{done[0]} of {total} requests")))

    result: dict = {}

    def work() -> None:
        try:
            for c in levels:
                if cancel.is_set():
                    break
                rate = cfg.get("request_rate") or math.inf
                run = bench.run_once(sess.backend, c, n, int(cfg.get("max_new_tokens", 32)), request_rate=rate,
                                     burstiness=float(cfg.get("burstiness", 1.0)), seed=int(cfg.get("seed", 0)),
                                     time_limit_s=float(cfg.get("time_limit_s", 60.0)), slo_ms=cfg.get("slo_ms"),
                                     cancel=cancel, on_request=on_request,
                                     on_metrics=lambda t, m: server.send(("serve_metrics", (t, m))))
                d = run.to_dict()
                d["request_rate"] = None if math.isinf(rate) else rate
                if not cancel.is_set():
                    server.send(("serve_run", d))
        except Exception as e:  # noqa: BLE001 — the panel must learn that the run ended
            result["error"] = f"failed: {type(e).__name__}: {e}"

    t = threading.Thread(target=work, daemon=True, name="serve-bench")
    t.start()
    later = []
    while t.is_alive():
        cmd = server.next_command(0.1)
        if cmd is None:
            continue
        if cmd[0] in ("cancel_serve_bench", "quit"):
            cancel.set()
            if cmd[0] == "quit":
                later.append(cmd)
        else:
            later.append(cmd)
    t.join()
    server.pending.extend(later)
    server.send(("serve_done", "cancelled" if cancel.is_set() else result.get("error", "")))


def server_tokenize(server, request_id: int, text: str, chat: bool) -> None:
    """The server's own tokenization of the prompt (and of its chat form), for the Prompt panel. Superseded
    requests queued behind this one are dropped: only the newest text is asked for."""
    later = []
    while (nxt := server.next_command(0)) is not None:
        if nxt[0] == "server_tokenize":
            request_id, text, chat = nxt[1]
        else:
            later.append(nxt)
        if nxt[0] == "quit":
            break
    server.pending.extend(later)
    sess = server.session
    if not getattr(sess, "is_remote", False):
        server.send(("server_tokens", (request_id, text, None, "not connected to a server", None, "")))
        return
    tok = tok_chat = None
    err = err_chat = ""
    try:
        tok = sess.backend.tokenize(text)
    except (RemoteError, KeyError, TypeError, ValueError) as e:
        err = str(e) if isinstance(e, RemoteError) else f"the server's tokenize answer was not understood ({e})"
    if chat and tok is not None:
        try:
            tok_chat = sess.backend.tokenize(text, chat=True)
        except (RemoteError, KeyError, TypeError, ValueError) as e:
            err_chat = str(e)
    server.send(("server_tokens", (request_id, text, tok, err, tok_chat, err_chat)))


def handle(server, kind: str, arg) -> bool:
    """Run a remote command; False when `kind` is not one."""
    if kind == "connect":
        connect(server, *arg)
    elif kind == "disconnect":
        disconnect(server)
    elif kind == "serve_bench":
        serve_bench(server, arg)
    elif kind == "server_tokenize":
        server_tokenize(server, *arg)
    elif kind == "cancel_serve_bench":
        pass  # no bench running
    else:
        return False
    return True
