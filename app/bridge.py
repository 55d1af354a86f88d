"""The one QObject that owns the engine: its process, the thread that relays its events, and typed Qt signals.

The engine runs in its own process (engine.server; why: see there). The GUI thread only sends commands down a
pipe (never blocks); a relay thread owned by the bridge receives the engine's events and emits each through one
signal; the bridge, living in the GUI thread, receives them there (queued connection) and re-emits them as the
typed `sig_…` signals the panels connect to. Between two tokens the engine reads its commands, so pause, step, stop
and new sampling settings act at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import threading
from collections.abc import Iterable

from PySide6 import QtCore

from app.guard import guarded
from engine.costs.catalog import canonical_dtype
from engine.events import (
    AttentionCaptured,
    Failed,
    Finished,
    KVCacheGrew,
    LensCaptured,
    ModelInfo,
    PrefillDone,
    PromptScored,
    PromptTokenized,
    ResidualNorms,
    RunStarted,
    TokenSampled,
)
from engine.protocol import SamplingParams
from engine.remote.backend import ServerConnected, ServerMetricsSampled
from engine.server import GenerateRequest, PreviewResult, serve

__all__ = ["Bridge", "GenerateRequest", "PreviewResult"]


@contextlib.contextmanager
def _spawn_without_main():
    """The engine process needs nothing from the app's __main__ (Qt, the window): keep spawn from re-importing it."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class EventRelay(QtCore.QObject):
    """Lives in the relay thread: receives the engine process's messages and emits them one by one."""

    sig_raw = QtCore.Signal(object)  # an engine event or a notice, emitted from the relay thread

    def __init__(self, events) -> None:
        super().__init__()
        self.events = events
        self.stopping = threading.Event()

    @QtCore.Slot()
    def run(self) -> None:
        while True:
            try:
                if not self.events.poll(0.1):
                    if self.stopping.is_set():
                        break
                    continue
                msg = self.events.recv()
            except (EOFError, OSError):
                if not self.stopping.is_set():
                    self.sig_raw.emit(Failed(message="the engine process stopped unexpectedly; restart the app"))
                break
            self.sig_raw.emit(msg)
            if msg == ("stopped", None):
                break


class Bridge(QtCore.QObject):
    """Owns the engine process and the thread that relays its events; the GUI's only door to the engine."""

    sig_load_progress = QtCore.Signal(float, str)
    """Model loading: fraction done and what is happening."""
    sig_model_loaded = QtCore.Signal(object)
    """A model is ready: ModelInfo."""
    sig_load_failed = QtCore.Signal(str)
    """The model could not be loaded: one sentence for the user."""
    sig_state = QtCore.Signal(str)
    """Generation state: "idle", "generating" or "paused"."""
    sig_run_started = QtCore.Signal(object)
    """A generation began: RunStarted (where it runs and what that source cannot report)."""
    sig_prompt = QtCore.Signal(object)
    """A generation began: PromptTokenized."""
    sig_attention = QtCore.Signal(object)
    """AttentionCaptured for one subscribed layer of one step."""
    sig_norms = QtCore.Signal(object)
    """ResidualNorms of one step."""
    sig_prompt_scores = QtCore.Signal(object)
    """PromptScored: each prompt token's probability from the prefill's logits (when asked for)."""
    sig_lens = QtCore.Signal(object)
    """LensCaptured: the logit lens of one step (every layer's next-token guess)."""
    sig_kv = QtCore.Signal(object)
    """KVCacheGrew after one step."""
    sig_prefill = QtCore.Signal(object)
    """PrefillDone: the prompt went through in one forward pass."""
    sig_token = QtCore.Signal(object)
    """TokenSampled: one token chosen (step 0 comes from the prefill)."""
    sig_finished = QtCore.Signal(object)
    """Finished: the generation ended, with its timings."""
    sig_failed = QtCore.Signal(str)
    """A generation or command failed: one sentence for the user."""
    sig_preview = QtCore.Signal(object)
    """PreviewResult: next-token candidates for the text being typed."""
    sig_step_selected = QtCore.Signal(int)
    """The user picked a step (0 = prefill) in some panel; every panel shows that step."""
    sig_batch_progress = QtCore.Signal(float, str)
    """Batching lab: fraction done and what is being measured."""
    sig_batch_row = QtCore.Signal(object)
    """Batching lab: one measured engine.run.batching.BatchRow."""
    sig_batch_done = QtCore.Signal(str)
    """Batching lab ended: "" when complete, else why it stopped ("cancelled", an error)."""
    sig_this_machine = QtCore.Signal(object)
    """(device, dtype, Hardware or None): this machine's cached or new measurement, from the engine process."""
    sig_measure_progress = QtCore.Signal(float, str)
    """Measuring this machine: fraction done and what is being measured."""
    sig_measure_done = QtCore.Signal(str)
    """Measuring this machine ended: "" when measured, else why not ("measurement cancelled", an error)."""
    sig_params = QtCore.Signal(object)
    """The sampling settings changed (SamplingParams); panels re-draw the funnel without re-running the model."""
    sig_server_connected = QtCore.Signal(object)
    """Connected to a server: engine.remote.client.ServerInfo (generations now run there)."""
    sig_server_disconnected = QtCore.Signal()
    """Disconnected from the server: generations (and tokenization) are the local model's again."""
    sig_server_failed = QtCore.Signal(str)
    """Connecting to a server failed: one sentence for the user."""
    sig_server_metrics = QtCore.Signal(object)
    """ServerMetricsSampled during a remote generation, or (t, ServerMetrics) during a load-lab run."""
    sig_serve_progress = QtCore.Signal(float, str)
    """Load lab: fraction of the requests done and a word on it."""
    sig_serve_request = QtCore.Signal(object)
    """Load lab: one finished request (engine.remote.bench.RequestResult)."""
    sig_serve_run = QtCore.Signal(object)
    """Load lab: the figures of one concurrency level (a dict with `vllm bench serve`'s keys)."""
    sig_serve_done = QtCore.Signal(str)
    """Load lab ended: "" when complete, else why it stopped."""
    sig_server_tokens = QtCore.Signal(object)
    """The server's tokenization of a prompt: (request_id, text, PromptTokenized or None, error, chat
    PromptTokenized or None, chat error), from the engine process."""

    _ROUTES = (
        (RunStarted, "sig_run_started"), (PromptTokenized, "sig_prompt"), (AttentionCaptured, "sig_attention"),
        (ResidualNorms, "sig_norms"),
        (PromptScored, "sig_prompt_scores"), (LensCaptured, "sig_lens"), (KVCacheGrew, "sig_kv"),
        (PrefillDone, "sig_prefill"), (TokenSampled, "sig_token"),
        (Finished, "sig_finished"), (PreviewResult, "sig_preview"),
        (ServerMetricsSampled, "sig_server_metrics"),
    )

    def __init__(self, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self.info: ModelInfo | None = None
        self.tokenizer = None  # the loaded model's tokenizer: fast and thread-safe, used by the GUI for typing
        self.cfg = None
        self.state = "idle"
        self.server = None  # the ServerInfo of the connected server, None while generating locally
        self.params = SamplingParams()
        self.attention_layers: frozenset[int] = frozenset()  # layers a panel asked for (capture_attention)
        self.score_prompt = False  # the next generation scores every prompt token (PromptScored)
        self.lens_top = 0  # top tokens per layer of the logit lens the next generation captures (0 = none)
        self.grammar: dict[str, str] | None = None  # {"regex": R} or {"json_schema": S} for the next generation
        self._preview_id = 0
        self._machine: dict[tuple[str, str], object] = {}  # (device, dtype) → the engine's answer (None: none)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs Qt threads
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        events_recv, events_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=serve, args=(cmd_recv, events_send), name="inference-lab-engine",
                                   daemon=True)
        with _spawn_without_main():
            self.process.start()
        cmd_recv.close()
        events_send.close()
        self.relay = EventRelay(events_recv)
        self.worker_thread = QtCore.QThread(self)
        self.relay.moveToThread(self.worker_thread)
        self.worker_thread.started.connect(self.relay.run)
        self.relay.sig_raw.connect(self._on_raw, QtCore.Qt.ConnectionType.QueuedConnection)
        self.worker_thread.start()

    def _post(self, kind: str, arg: object = None) -> None:
        if self._commands.closed:  # after shutdown: nobody is listening any more
            return
        try:
            self._commands.send((kind, arg))
        except (BrokenPipeError, OSError):
            self.sig_failed.emit("the engine process is not running; restart the app")

    # ---- commands (GUI thread; never block) ----
    def load_model(self, model: str | None = None, device: str = "auto", dtype: str = "auto") -> None:
        self._post("load", (model, device, dtype))

    def set_threads(self, setting: int | str) -> None:
        """Decode threads: "auto" (the engine adapts to the machine's load) or a fixed count."""
        self._post("threads", setting)

    def generate(self, req: GenerateRequest) -> None:
        self.params = req.params
        self._post("generate", req)

    def preview(self, text: str, chat: bool, top: int = 10) -> int:
        self._preview_id += 1
        self._post("preview", (self._preview_id, text, chat, top))
        return self._preview_id

    def pause(self) -> None:
        self._post("pause")

    def resume(self) -> None:
        self._post("resume")

    def step(self) -> None:
        self._post("step")

    def stop(self) -> None:
        self._post("stop")

    def set_params(self, params: SamplingParams) -> None:
        self.params = params
        self._post("params", params)
        self.sig_params.emit(params)

    def run_batch_bench(self, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32), prompt_tokens: int = 32,
                        new_tokens: int = 16) -> None:
        self._post("batch_bench", (tuple(batches), prompt_tokens, new_tokens))

    def cancel_batch_bench(self) -> None:
        self._post("cancel_bench")

    def capture_attention(self, layers: Iterable[int]) -> None:
        """Ask for the attention weights of these layers: every later Generate captures them, and a running
        generation adds them from its next token on."""
        self.attention_layers = frozenset(int(x) for x in layers)
        self._post("attention_layers", self.attention_layers)

    def this_machine(self, device: str, dtype: str):
        """This machine's cached measurement (engine.costs.catalog.Hardware) for (device, dtype), or None: not
        measured, or the engine has not answered yet (sig_this_machine tells when it does). Never measures."""
        key = (str(device), canonical_dtype(dtype))
        if key not in self._machine:
            self._machine[key] = None
            self._post("this_machine", key)
        return self._machine[key]

    def measure_machine(self, device: str, dtype: str, **measure_kwargs) -> None:
        """Measure this machine in the engine process (after any generation); progress and the result come as
        sig_measure_progress, sig_this_machine and sig_measure_done."""
        self._post("measure", (str(device), canonical_dtype(dtype), measure_kwargs))

    def cancel_measure(self) -> None:
        self._post("cancel_measure")

    def connect_server(self, url: str, api_key: str | None = None) -> None:
        """Generate on a server from now on; the key goes to the engine process's memory only, never to disk."""
        self._post("connect", (url, api_key))

    def disconnect_server(self) -> None:
        self._post("disconnect")

    def run_serve_bench(self, config: dict) -> None:
        """Load lab: `config` holds concurrency (list), num_prompts, max_new_tokens, request_rate, time_limit_s."""
        self._post("serve_bench", dict(config))

    def cancel_serve_bench(self) -> None:
        self._post("cancel_serve_bench")

    def server_tokenize(self, text: str, chat: bool = False) -> int:
        """Ask the engine process for the connected server's tokenization of `text` (sig_server_tokens answers;
        only the newest request queued is served)."""
        self._tokenize_id = getattr(self, "_tokenize_id", 0) + 1
        self._post("server_tokenize", (self._tokenize_id, text, bool(chat)))
        return self._tokenize_id

    def select_step(self, step: int) -> None:
        self.sig_step_selected.emit(int(step))

    def shutdown(self, timeout_ms: int = 10_000) -> bool:
        """Stop the engine between tokens, end its process and the relay thread, and wait for both."""
        if not self.worker_thread.isRunning() and not self.process.is_alive():
            return True
        self.relay.stopping.set()  # from here on, the pipe closing is expected, not an error
        self._post("quit")
        self.process.join(timeout_ms / 1000)
        if self.process.is_alive():  # busy in a long load: it holds nothing worth saving
            self.process.terminate()
            self.process.join(2)
        self.worker_thread.quit()
        ok = self.worker_thread.wait(timeout_ms)
        self._commands.close()
        if ok:
            self.relay.events.close()
        return ok and not self.process.is_alive()

    # ---- events (GUI thread) ----
    @QtCore.Slot(object)
    @guarded
    def _on_raw(self, ev: object) -> None:
        if isinstance(ev, list):  # a generation step's events arrive together (engine.server)
            for one in ev:
                self._on_raw(one)
            return
        if isinstance(ev, tuple):
            kind, arg = ev
            if kind == "load_progress":
                self.sig_load_progress.emit(float(arg[0]), str(arg[1]))
            elif kind == "loaded":
                self.info, self.tokenizer, self.cfg = arg
                self.sig_model_loaded.emit(self.info)
            elif kind == "load_failed":
                self.sig_load_failed.emit(arg)
            elif kind == "batch_progress":
                self.sig_batch_progress.emit(float(arg[0]), str(arg[1]))
            elif kind == "batch_row":
                self.sig_batch_row.emit(arg)
            elif kind == "batch_done":
                self.sig_batch_done.emit(arg)
            elif kind == "this_machine":
                device, dtype, hw = arg
                if hw is not None:  # a measurement exists now: "none" answers (the float32 fallback) may change
                    self._machine = {k: v for k, v in self._machine.items() if v is not None or k[0] != device}
                self._machine[(device, canonical_dtype(dtype))] = hw
                self.sig_this_machine.emit(arg)
            elif kind == "measure_progress":
                self.sig_measure_progress.emit(float(arg[0]), str(arg[1]))
            elif kind == "measure_done":
                self.sig_measure_done.emit(arg)
            elif kind == "connected":
                self.server = arg
                self.sig_server_connected.emit(arg)
            elif kind == "connect_failed":
                self.sig_server_failed.emit(arg)
            elif kind == "disconnected":
                self.server = None
                self.sig_server_disconnected.emit()
            elif kind == "serve_progress":
                self.sig_serve_progress.emit(float(arg[0]), str(arg[1]))
            elif kind == "serve_request":
                self.sig_serve_request.emit(arg)
            elif kind == "serve_metrics":
                self.sig_server_metrics.emit(arg)
            elif kind == "serve_run":
                self.sig_serve_run.emit(arg)
            elif kind == "serve_done":
                self.sig_serve_done.emit(arg)
            elif kind == "server_tokens":
                self.sig_server_tokens.emit(arg)
            elif kind == "state":
                self.state = arg
                self.sig_state.emit(arg)
            return
        if isinstance(ev, ServerConnected):
            return  # the probe's result already came as the "connected" notice
        if isinstance(ev, Failed):
            self.sig_failed.emit(ev.message)
            return
        for cls, name in self._ROUTES:
            if isinstance(ev, cls):
                getattr(self, name).emit(ev)
                return
