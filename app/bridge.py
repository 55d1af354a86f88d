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
from collections.abc import Callable, Iterable

from PySide6 import QtCore

from app.guard import guarded
from engine import protocol as P
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
    RunSource,
    RunStarted,
    TokenSampled,
)
from engine.protocol import GenerateRequest, PreviewResult, SamplingParams
from engine.remote.backend import ServerMetricsSampled
from engine.run.schedule_events import SchedPlan, SchedRequestDone, SchedStep, SchedSummary
from engine.run.spec_events import (
    SpecBaseline,
    SpecFinished,
    SpecPrefilled,
    SpecStarted,
    SpecStep,
    SweepPoint,
    SweepStarted,
)
from engine.server import serve

SCHED_EVENTS = (SchedPlan, SchedStep, SchedRequestDone, SchedSummary)
SPEC_EVENTS = (SpecStarted, SpecPrefilled, SpecStep, SpecBaseline, SpecFinished, SweepStarted, SweepPoint)
__all__ = ["Bridge", "GenerateRequest", "PreviewResult", "RequestOptions"]


class RequestOptions:
    """What the next generation captures and how it is constrained, set by the panels that own each knob (Attention,
    Logit lens, Branches, Constrain output) and read by the Generation panel when it builds the request."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        self.attention_layers: frozenset[int] = frozenset()  # layers a panel asked for
        self.lens_top = 0  # top tokens per layer of the logit lens (0 = none)
        self.score_prompt = False  # score every prompt token (PromptScored)
        self.grammar: dict[str, str] = {}  # {"regex": R} or {"json_schema": S}, or {} for none

    def capture_attention(self, layers: Iterable[int]) -> None:
        """Capture these layers' attention in every later generation, and in a running one from its next token."""
        self.attention_layers = frozenset(int(x) for x in layers)
        self._bridge._post(P.CaptureAttention(self.attention_layers))

    def set_lens(self, top: int) -> None:
        self.lens_top = max(0, int(top))

    def set_score_prompt(self, on: bool) -> None:
        self.score_prompt = bool(on)

    def set_grammar(self, *, regex: str | None = None, json_schema: str | None = None) -> None:
        """At most one of the two; neither clears the grammar."""
        self.grammar = {"regex": regex} if regex is not None else {"json_schema": json_schema} if json_schema else {}


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
            except Exception as e:  # noqa: BLE001 — a closed pipe or an unreadable message: the engine is lost
                if not self.stopping.is_set():
                    why = "stopped unexpectedly" if isinstance(e, (EOFError, OSError)) else (
                        f"sent a message that could not be read ({type(e).__name__})")
                    self.sig_raw.emit(Failed(message=f"the engine process {why}; restart the app"))
                break
            self.sig_raw.emit(msg)
            if isinstance(msg, P.Stopped):
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
    """ServerMetricsSampled: the server's /metrics scraped during a generation on it."""
    sig_serve_metrics = QtCore.Signal(object)
    """Load lab: engine.protocol.ServeMetrics, the server's /metrics scraped during a load run."""
    sig_serving_progress = QtCore.Signal(float, str)
    """Serve this model: llama.cpp's server starting for the loaded model (fraction, a word on it)."""
    sig_serving_done = QtCore.Signal(str)
    """Serve this model ended: "" when the server answers and the app is connected to it, else why not."""
    sig_spec = QtCore.Signal(object)
    """Speculative-decoding lab: one event of engine.run.spec_events (a pass, the baseline, a sweep point)."""
    sig_spec_done = QtCore.Signal(str)
    """Speculative-decoding lab ended: "" when complete, else why it stopped."""
    sig_sched = QtCore.Signal(object)
    """Scheduling lab: one event of engine.run.schedule_events (the plan, a step, a finished request, a summary)."""
    sig_sched_done = QtCore.Signal(str)
    """Scheduling lab ended: "" when complete, else why it stopped."""
    sig_pong = QtCore.Signal(int)
    """The engine handled every command sent before the Ping with this token (ping())."""
    sig_serve_progress = QtCore.Signal(float, str)
    """Load lab: fraction of the requests done and a word on it."""
    sig_serve_request = QtCore.Signal(object)
    """Load lab: one finished request (engine.remote.loadlab.RequestResult)."""
    sig_serve_run = QtCore.Signal(object)
    """Load lab: the figures of one concurrency level (a dict with `vllm bench serve`'s keys)."""
    sig_serve_done = QtCore.Signal(str)
    """Load lab ended: "" when complete, else why it stopped."""
    sig_server_tokens = QtCore.Signal(object)
    """engine.protocol.Tokenized: the connected server's own tokenization of a prompt (and of its chat form)."""

    def __init__(self, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self.info: ModelInfo | None = None
        self.tokenizer = None  # the loaded model's tokenizer: fast and thread-safe, used by the GUI for typing
        self.cfg = None
        self.state = "idle"
        self.server = None  # the ServerInfo of the connected server (where the next run goes), None: local
        self.run_source: RunSource | None = None  # where the run on display came from (live or replayed)
        self.run_server = None  # the ServerInfo of the server that run came from, when it ran live on one
        self.params = SamplingParams()
        self.options = RequestOptions(self)
        self._preview_id = 0
        self._tokenize_id = 0
        self._ping = 0
        self._machine: dict[tuple[str, str], object] = {}  # (device, dtype) → the engine's answer (None: none)
        self._answered: set[tuple[str, str]] = set()  # keys the engine has answered for
        # One table routes every message: its type → the method that takes it (events of a server run are
        # subclasses: the first base found in the table routes them).
        self._routes: dict[type, Callable[[object], None]] = {
            RunStarted: self._on_run_started, PromptTokenized: self.sig_prompt.emit,
            AttentionCaptured: self.sig_attention.emit, ResidualNorms: self.sig_norms.emit,
            PromptScored: self.sig_prompt_scores.emit, LensCaptured: self.sig_lens.emit, KVCacheGrew: self.sig_kv.emit,
            PrefillDone: self.sig_prefill.emit, TokenSampled: self.sig_token.emit, Finished: self.sig_finished.emit,
            ServerMetricsSampled: self.sig_server_metrics.emit, Failed: lambda m: self.sig_failed.emit(m.message),
            PreviewResult: self.sig_preview.emit, P.Progress: self._on_progress, P.Done: self._on_done,
            P.Loaded: self._on_loaded, P.LoadFailed: lambda m: self.sig_load_failed.emit(m.message),
            P.State: self._on_state, P.BatchMeasured: lambda m: self.sig_batch_row.emit(m.row),
            P.ThisMachine: self._on_this_machine, P.Connected: self._on_connected,
            P.ConnectFailed: lambda m: self.sig_server_failed.emit(m.message), P.Disconnected: self._on_disconnected,
            P.ServeRequestDone: lambda m: self.sig_serve_request.emit(m.result),
            P.ServeMetrics: self.sig_serve_metrics.emit, P.ServeLevelDone: lambda m: self.sig_serve_run.emit(m.figures),
            P.Tokenized: self.sig_server_tokens.emit, P.Pong: lambda m: self.sig_pong.emit(m.token),
            P.Stopped: lambda m: None,
        }
        for cls in SPEC_EVENTS:
            self._routes[cls] = self.sig_spec.emit
        for cls in SCHED_EVENTS:
            self._routes[cls] = self.sig_sched.emit
        self._progress = {"load": self.sig_load_progress, "batch": self.sig_batch_progress,
                          "measure": self.sig_measure_progress, "serve": self.sig_serve_progress,
                          "serve_model": self.sig_serving_progress}
        self._done = {"batch": self.sig_batch_done, "measure": self.sig_measure_done, "serve": self.sig_serve_done,
                      "serve_model": self.sig_serving_done, "spec": self.sig_spec_done,
                      "sched": self.sig_sched_done}
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

    def _post(self, cmd: P.Command) -> None:
        if self._commands.closed:  # after shutdown: nobody is listening any more
            return
        try:
            self._commands.send(cmd)
        except (BrokenPipeError, OSError):
            self.sig_failed.emit("the engine process is not running; restart the app")

    # ---- commands (GUI thread; never block) ----
    def load_model(self, model: str | None = None, device: str = "auto", dtype: str = "auto") -> None:
        self._post(P.Load(model, device, dtype))

    def set_threads(self, setting: int | str) -> None:
        """Decode threads: "auto" (the engine adapts to the machine's load) or a fixed count."""
        self._post(P.SetThreads(setting))

    def generate(self, req: GenerateRequest) -> None:
        self.params = req.params
        self._post(P.Generate(req))

    def preview(self, text: str, chat: bool, top: int = 10) -> int:
        self._preview_id += 1
        self._post(P.Preview(self._preview_id, text, chat, top))
        return self._preview_id

    def pause(self) -> None:
        self._post(P.Pause())

    def resume(self) -> None:
        self._post(P.Resume())

    def step(self) -> None:
        self._post(P.Step())

    def stop(self) -> None:
        self._post(P.Stop())

    def ping(self) -> int:
        """Ask the engine to answer (sig_pong) once it has handled everything sent before; returns the token."""
        self._ping += 1
        self._post(P.Ping(self._ping))
        return self._ping

    def set_params(self, params: SamplingParams) -> None:
        self.params = params
        self._post(P.SetParams(params))
        self.sig_params.emit(params)

    def run_batch_bench(self, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32), prompt_tokens: int = 32,
                        new_tokens: int = 16) -> None:
        self._post(P.BatchBench(tuple(batches), prompt_tokens, new_tokens))

    def cancel_batch_bench(self) -> None:
        self._post(P.Cancel())

    def capture_attention(self, layers: Iterable[int]) -> None:
        """Ask for the attention weights of these layers (RequestOptions.capture_attention)."""
        self.options.capture_attention(layers)

    def this_machine(self, device: str, dtype: str):
        """This machine's cached measurement (engine.costs.catalog.Hardware) for (device, dtype), or None: not
        measured, or the engine has not answered yet (sig_this_machine tells when it does). Never measures."""
        key = (str(device), canonical_dtype(dtype))
        if key not in self._machine:
            self._machine[key] = None
            self._post(P.AskThisMachine(*key))
        return self._machine[key]

    def this_machine_answered(self, device: str, dtype: str) -> bool:
        """Whether the engine has answered for (device, dtype) yet (this_machine() is then its answer)."""
        key = (str(device), canonical_dtype(dtype))
        return key in self._machine and self._machine[key] is not None or key in self._answered

    def measure_machine(self, device: str, dtype: str, **measure_kwargs) -> None:
        """Measure this machine in the engine process (after any generation); progress and the result come as
        sig_measure_progress, sig_this_machine and sig_measure_done."""
        self._post(P.Measure(str(device), canonical_dtype(dtype), dict(measure_kwargs)))

    def cancel_measure(self) -> None:
        self._post(P.Cancel())

    def connect_server(self, url: str, api_key: str | None = None) -> None:
        """Generate on a server from now on; the key goes to the engine process's memory only, never to disk."""
        self._post(P.Connect(url, api_key))

    def disconnect_server(self) -> None:
        self._post(P.Disconnect())

    def serve_model(self) -> None:
        """Start llama.cpp's server for the loaded model on 127.0.0.1 and connect to it (stops with the app)."""
        self._post(P.ServeModel())

    def cancel_serving(self) -> None:
        self._post(P.Cancel())

    def speculate(self, cmd: P.Speculate) -> None:
        """Run the speculative-decoding lab (sig_spec for each event, sig_spec_done at the end)."""
        self._post(cmd)

    def schedule(self, config: object) -> None:
        """Run the scheduling lab (sig_sched for each event, sig_sched_done at the end)."""
        self._post(P.Schedule(config))

    def cancel_lab(self) -> None:
        self._post(P.Cancel())

    def run_serve_bench(self, config: dict) -> None:
        """Load lab: `config` holds concurrency (list), num_prompts, max_new_tokens, request_rate, time_limit_s."""
        self._post(P.ServeBench(dict(config)))

    def cancel_serve_bench(self) -> None:
        self._post(P.Cancel())

    def server_tokenize(self, text: str, chat: bool = False) -> int:
        """Ask the engine process for the connected server's tokenization of `text` (sig_server_tokens answers;
        only the newest request queued is served)."""
        self._tokenize_id += 1
        self._post(P.Tokenize(self._tokenize_id, text, bool(chat)))
        return self._tokenize_id

    def select_step(self, step: int) -> None:
        self.sig_step_selected.emit(int(step))

    def show_model(self, info: ModelInfo | None, cfg, tokenizer, announce: bool = True) -> None:
        """Stand a model's facts in for the loaded one (a session opened without its model) and tell the panels;
        announce=False puts the loaded model's facts back quietly after a replay."""
        self.info, self.cfg = info, cfg
        if tokenizer is not None:
            self.tokenizer = tokenizer
        if announce and info is not None:
            self.sig_model_loaded.emit(info)

    def replay(self, message: object) -> None:
        """Route a recorded event (or a step's list of them) exactly as a live one (a session being opened): a
        replayed server run keeps its source, but no connection stands behind it."""
        self._on_raw(message)
        if isinstance(message, RunStarted):
            self.run_server = None

    def shutdown(self, timeout_ms: int = 10_000) -> bool:
        """Stop the engine between tokens, end its process and the relay thread, and wait for both."""
        if not self.worker_thread.isRunning() and not self.process.is_alive():
            return True
        self.relay.stopping.set()  # from here on, the pipe closing is expected, not an error
        self._post(P.Quit())
        self.process.join(timeout_ms / 1000)
        if self.process.is_alive():  # busy in a long load: it holds nothing worth saving
            self.process.terminate()
            self.process.join(2)
        if self.process.is_alive():  # SIGTERM not heeded (stuck in native code): the window must still close
            self.process.kill()
            self.process.join(2)
        self.worker_thread.quit()
        ok = self.worker_thread.wait(timeout_ms)
        self._commands.close()
        if ok:
            self.relay.events.close()
        return ok and not self.process.is_alive()

    # ---- messages (GUI thread) ----
    @QtCore.Slot(object)
    @guarded
    def _on_raw(self, msg: object) -> None:
        if isinstance(msg, list):  # a generation step's events arrive together (engine.server)
            for one in msg:
                self._on_raw(one)
            return
        for cls in type(msg).__mro__:
            route = self._routes.get(cls)
            if route is not None:
                route(msg)
                return

    def _on_run_started(self, ev: RunStarted) -> None:
        self.run_source = ev.source
        self.run_server = self.server if ev.source.kind == "server" else None
        self.sig_run_started.emit(ev)

    def _on_progress(self, m: P.Progress) -> None:
        sig = self._progress.get(m.job)
        if sig is not None:
            sig.emit(float(m.fraction), str(m.message))

    def _on_done(self, m: P.Done) -> None:
        sig = self._done.get(m.job)
        if sig is not None:
            sig.emit(m.message)

    def _on_loaded(self, m: P.Loaded) -> None:
        self.info, self.tokenizer, self.cfg = m.info, m.tokenizer, m.cfg
        self.sig_model_loaded.emit(self.info)

    def _on_state(self, m: P.State) -> None:
        self.state = m.state
        self.sig_state.emit(m.state)

    def _on_this_machine(self, m: P.ThisMachine) -> None:
        if m.hardware is not None:  # a measurement exists now: "none" answers (the float32 fallback) may change
            self._machine = {k: v for k, v in self._machine.items() if v is not None or k[0] != m.device}
        self._machine[(m.device, canonical_dtype(m.dtype))] = m.hardware
        self._answered.add((m.device, canonical_dtype(m.dtype)))
        self.sig_this_machine.emit((m.device, m.dtype, m.hardware))

    def _on_connected(self, m: P.Connected) -> None:
        self.server = m.info
        self.sig_server_connected.emit(m.info)

    def _on_disconnected(self, _m: P.Disconnected) -> None:
        self.server = None
        self.sig_server_disconnected.emit()
