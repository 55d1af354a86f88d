"""A server as a backend (engine.backend): generations, previews and tokenization run on an OpenAI-compatible
server (vLLM, llama.cpp), and the load lab measures it. The API key lives in the engine process's memory only.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from engine.backend import Backend, Run, ShouldStop, Unsupported
from engine.events import CAPABILITIES, Event, PromptTokenized, RunSource, RunStarted
from engine.protocol import (
    LAB_JOBS,
    LAB_NAMES,
    GenerateRequest,
    Lab,
    PreviewResult,
    Progress,
    SamplingParams,
    ServeBench,
    ServeBlocks,
    ServeLevelDone,
    ServeMetrics,
    ServeRequestDone,
    ServeSpans,
)
from engine.remote.backend import RemoteBackend, RemoteGeneration, RemoteTokenSampled, ServerConnected
from engine.remote.client import RemoteError, ServerInfo
from engine.remote.shapes import server_model_config

SERVER_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs is 20; llama.cpp has no such cap
# A server streams tokens and their top-N log-probabilities: nothing of its forward pass.
SERVER_CANNOT = tuple(c for c in CAPABILITIES)


def connect(url: str, api_key: str | None) -> ServerBackend:
    """Probe the server (RemoteError with one sentence when it cannot be used) and read its model's shapes."""
    client = RemoteBackend(url, api_key=api_key or None)
    info = client.probe()
    cfg, note = server_model_config(info.model, info.root, loopback=info.loopback)
    return ServerBackend(client, dataclasses.replace(info, config=cfg, config_note=note))


class ServerRun:
    """A server's generation as a Run: RunStarted first, then the server's events."""

    def __init__(self, gen: RemoteGeneration, source: RunSource, capture: object) -> None:
        self.gen, self.source, self.capture = gen, source, capture

    @property
    def params(self) -> SamplingParams:
        return self.gen.params

    @params.setter
    def params(self, value: SamplingParams) -> None:
        self.gen.params = value  # the request is already sent: the server keeps its settings; the funnel follows

    def stop(self) -> None:
        self.gen.stop()

    def __iter__(self) -> Iterator[Event]:
        yield RunStarted(source=self.source)
        for ev in self.gen:
            if not isinstance(ev, ServerConnected):  # the probe's result came with Connected already
                yield ev


class ServerBackend(Backend):
    def __init__(self, client: RemoteBackend, info: ServerInfo) -> None:
        self.client, self.info = client, info

    @property
    def source(self) -> RunSource:
        u = urlsplit(self.info.url)
        host = f"{u.hostname}:{u.port}" if u.port else (u.hostname or self.info.url)
        return RunSource(kind="server", name=f"{self.info.model} @ {host}", cannot=SERVER_CANNOT,
                         token_ids_are_local=False, measured_by_server=True)

    def generate(self, req: GenerateRequest) -> Run:
        if req.forced:
            raise ValueError("a server samples its own tokens: forcing a token (branching) works on the local model")
        if req.prompt_ids:
            raise ValueError("a server takes the prompt as text: branching from token ids works on the local model")
        if req.regex is not None or req.json_schema is not None:
            raise ValueError("constrained output runs on the local model: disconnect from the server to use it")
        top = getattr(req.capture, "funnel_top", 0) or 10
        gen = self.client.generate(req.text, req.params, req.max_new_tokens, chat=req.chat,
                                   top_logprobs=min(top, SERVER_TOP_LOGPROBS), ignore_eos=req.ignore_eos)
        return ServerRun(gen, self.source, req.capture)

    def preview(self, request_id: int, text: str, chat: bool, top: int, params: SamplingParams) -> PreviewResult | None:
        t0 = time.perf_counter()
        n, f = 0, None
        for ev in self.client.generate(text, params, 1, chat=chat, top_logprobs=min(top, SERVER_TOP_LOGPROBS)):
            if type(ev).__name__ == "Finished":
                n = len(ev.prompt_ids)
            if isinstance(ev, RemoteTokenSampled) and ev.funnel is not None:
                f = ev.funnel
        if f is None:
            return None
        return PreviewResult(request_id=request_id, text=text, n_tokens=n, n_reused=0, n_computed=n,
                             seconds=time.perf_counter() - t0, funnel=f)

    def tokenize(self, text: str, chat: bool = False) -> PromptTokenized:
        try:
            return self.client.tokenize(text, chat)
        except (KeyError, TypeError, ValueError) as e:
            raise RemoteError(f"the server's tokenize answer was not understood ({e})") from None

    def run_lab(self, request: Lab, send: Callable[[object], None], should_stop: ShouldStop) -> None:
        """The load lab measures this server; the other labs run the model's own forward passes, which a server
        does not expose."""
        if not isinstance(request, ServeBench):
            name = LAB_NAMES[LAB_JOBS[type(request)]]
            raise Unsupported(f"{name} runs on the local model: disconnect from the server to use it")
        self._serve_bench(request.config, send, should_stop)

    def _serve_bench(self, config: dict, send: Callable[[object], None], should_stop: ShouldStop) -> None:
        """Run the load benchmark in a thread while this one watches for Cancel, so Cancel acts at once."""
        from engine.remote import loadlab

        cancel = threading.Event()
        levels = list(config.get("concurrency") or [1, 2, 4])
        n = int(config.get("num_prompts", 8))
        total = len(levels) * n
        done = [0]
        error: list[Exception] = []

        def on_request(r) -> None:
            done[0] += 1
            send(ServeRequestDone(r))
            send(Progress("serve", min(1.0, done[0] / total), f"{done[0]} of {total} requests"))

        receiver = None
        if config.get("spans_port") is not None:  # the server exports its spans to this engine process
            from engine.remote.otlp import OTLPError, receiver_on

            try:
                receiver = receiver_on(int(config["spans_port"]))
            except OTLPError as e:
                raise ValueError(str(e)) from None

        kv = None
        if config.get("kv_events_port") is not None:  # the server publishes its KV-cache events to this process
            from engine.remote.kvevents import KVEventError, snapshot, subscriber_on

            try:
                kv = subscriber_on(int(config["kv_events_port"]), config.get("kv_replay_port"))
            except KVEventError as e:
                raise ValueError(str(e)) from None

        def on_metrics(t: float, m) -> None:
            send(ServeMetrics(t, m))
            if kv is not None:  # the blocks beside the usage of the same scrape
                send(ServeBlocks(t, snapshot(kv.pool), m.kv_usage))

        def on_spans(results) -> None:
            send(ServeSpans(tuple(results), receiver.endpoint, tuple(receiver.problems())))

        def work() -> None:
            try:
                for c in levels:
                    if cancel.is_set():
                        break
                    rate = config.get("request_rate") or math.inf
                    prompts = None
                    if config.get("prompt_set") == "shared_prefix":  # groups sharing a long prefix (a fleet's test)
                        from engine.remote.fleet import next_salt, shared_prefix_prompts

                        # prefixes no earlier level or run sent: what one warmed in a cache cannot favour the next
                        prompts = [text for _, text in shared_prefix_prompts(max(1, n), salt=next_salt())]
                    run = loadlab.run_once(
                        self.client, c, n, int(config.get("max_new_tokens", 32)), request_rate=rate,
                        burstiness=float(config.get("burstiness", 1.0)), seed=int(config.get("seed", 0)),
                        time_limit_s=float(config.get("time_limit_s", 60.0)), slo_ms=config.get("slo_ms"),
                        cancel=cancel, on_request=on_request, on_metrics=on_metrics,
                        spans=receiver, on_spans=on_spans if receiver is not None else None, prompts=prompts)
                    d = run.to_dict()
                    d["request_rate"] = None if math.isinf(rate) else rate
                    if not cancel.is_set():
                        send(ServeLevelDone(d))
            except Exception as e:  # noqa: BLE001 — the panel must learn that the run ended
                error.append(e)  # raised again in this thread: the lab's outcome says it failed, and why

        t = threading.Thread(target=work, daemon=True, name="serve-bench")
        t.start()
        while t.is_alive():
            t.join(0.1)
            if should_stop():
                cancel.set()
        if cancel.is_set():
            raise InterruptedError("cancelled")
        if error:
            raise error[0]
