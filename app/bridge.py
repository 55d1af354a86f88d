"""The one QObject that owns the engine: its process, the thread that relays its events, and typed Qt signals.

The engine runs in its own process (engine.server; why: see there). The GUI thread only sends commands down a
pipe (never blocks); a relay thread owned by the bridge receives the engine's events and emits each through one
signal; the bridge, living in the GUI thread, receives them there (queued connection) and re-emits them as the
typed `sig_…` signals the panels connect to. Between two tokens the engine reads its commands, so pause, step, stop
and new sampling settings act at once.

The engine process can die under the app: the OS kills it for memory (SIGKILL), a native runtime runs an instruction
the CPU or hypervisor has not enabled (SIGILL), native code crashes or a mapped model file changes (SIGSEGV, SIGBUS).
The bridge then says why in one sentence (sig_engine_lost), ends the run cut short as an interrupted run (its steps
stay in the panels, the run store and the autosave), and starts a new engine with the same model and settings; the
model shown stays shown. A model that kills its engine MAX_RESTARTS + 1 times in a row is not restarted again.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
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
    Steered,
    TokenSampled,
)
from engine.labs.schedule_events import SchedPlan, SchedRequestDone, SchedStep, SchedSummary
from engine.labs.spec_events import (
    SpecBaseline,
    SpecFinished,
    SpecPrefilled,
    SpecStarted,
    SpecStep,
    SweepPoint,
    SweepStarted,
)
from engine.protocol import GenerateRequest, PreviewResult, SamplingParams
from engine.remote.backend import ServerMetricsSampled
from engine.server import serve

SCHED_EVENTS = (SchedPlan, SchedStep, SchedRequestDone, SchedSummary)
SPEC_EVENTS = (SpecStarted, SpecPrefilled, SpecStep, SpecBaseline, SpecFinished, SweepStarted, SweepPoint)
__all__ = ["Bridge", "EngineLost", "GenerateRequest", "PreviewResult", "RequestOptions", "death_cause"]

MAX_RESTARTS = 3  # engine deaths in a row (no generation finished between them) that are followed by a restart


class RequestOptions:
    """What the next generation captures and how it is constrained, set by the panels that own each knob (Attention,
    Logit lens, Branches, Constrain output) and read by the Generation panel when it builds the request."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        self.attention_layers: frozenset[int] = frozenset()  # layers a panel asked for
        self.lens_top = 0  # top tokens per layer of the logit lens (0 = none)
        self.score_prompt = False  # score every prompt token (PromptScored)
        self.grammar: dict[str, str] = {}  # {"regex": R} or {"json_schema": S}, or {} for none
        self.steer: P.Steer | None = None  # the steering vector every later generation runs with (None: off)

    def capture_attention(self, layers: Iterable[int]) -> None:
        """Capture these layers' attention in every later generation, and in a running one from its next token."""
        self.attention_layers = frozenset(int(x) for x in layers)
        self._bridge._post(P.CaptureAttention(self.attention_layers))

    def set_lens(self, top: int) -> None:
        """Capture the lens (top tokens a layer; 0: none) in every later generation, and in a running one from its
        next token."""
        top = max(0, int(top))
        if top != self.lens_top:
            self.lens_top = top
            self._bridge._post(P.CaptureLens(top))

    def set_score_prompt(self, on: bool) -> None:
        self.score_prompt = bool(on)

    def set_grammar(self, *, regex: str | None = None, json_schema: str | None = None) -> None:
        """At most one of the two; neither clears the grammar."""
        self.grammar = {"regex": regex} if regex is not None else {"json_schema": json_schema} if json_schema else {}

    def set_steer(self, steer: P.Steer | None) -> None:
        """Steer every later generation with this vector at its scale (None: off). A steered generation running now
        keeps its vector and takes the scale from its next token on: 0 when steering is turned off."""
        was, self.steer = self.steer, steer
        if was is not None or steer is not None:
            self._bridge._post(P.SetSteerScale(steer.scale if steer is not None else 0.0))

    def set_steer_scale(self, scale: float, live: bool = True) -> None:
        """The steering scale of later generations and, with `live`, of a steered one running now from its next
        token on."""
        if self.steer is not None:
            self.steer = self.steer.at(float(scale))
            if live:
                self._bridge._post(P.SetSteerScale(float(scale)))


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


@dataclass(frozen=True)
class EngineLost:
    """The engine process ended without being asked to: why, and what the app did about it."""

    cause: str  # one sentence: why it ended (from its exit signal or code)
    outcome: str  # one sentence: restarted with the same model, or not again
    exitcode: int | None
    runtime: str  # "torch" or "llama.cpp": the runtime the engine was running (or loading)
    restarted: bool
    kept_steps: int = 0  # steps of the run it cut short, kept as an interrupted run
    torch_offer: str = ""  # when the llama.cpp runtime crashed: a sentence offering the torch one ("" none)

    @property
    def message(self) -> str:
        return f"{self.cause} {self.outcome}"


@dataclass(frozen=True)
class _EngineGone:
    """The relay's last message when the pipe broke without a Quit: `unreadable` names a message it could not read."""

    unreadable: str = ""


@dataclass
class _LiveRun:
    """What the bridge keeps of the run in progress, to end it as an interrupted run if the engine dies."""

    prompt_ids: tuple[int, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # each step's, step 0 (the prefill's) first


def _memory_need(info: ModelInfo | None, runtime: str, load: P.Load | None) -> tuple[int, str]:
    """(bytes, what they are) the model needs in memory on `runtime`, from the loaded model's facts or, while it was
    still loading, from its file's header (engine.formats.discover); (0, "") when neither can be read."""
    from engine.formats.runtime_rule import DEFAULT_CONTEXT

    if info is not None:
        if runtime == "llama.cpp":
            positions = min(info.context_length, DEFAULT_CONTEXT)
            return (info.weight_bytes + info.kv_bytes_per_token * positions,
                    f"its file and a KV cache of {positions:,} positions")
        return info.weight_bytes, f"its weights at {info.dtype}"
    if load is None:
        return 0, ""
    from engine.formats.discover import DTYPE_BYTES, read_model_facts
    from engine.formats.locate import resolve_model_path

    try:
        path = resolve_model_path(load.model)
        entry = read_model_facts(path, path.name, "file")
    except Exception:  # noqa: BLE001 — a file that cannot be read only means no figure
        return 0, ""
    if runtime == "llama.cpp":  # the file as it is, and (what "auto" reckons with) its KV cache
        if entry.runtime == "llama.cpp":
            return entry.weight_bytes.get("float32", 0), "its file and its KV cache"
        return entry.file_bytes, "its file"
    dtype = load.dtype if load.dtype in DTYPE_BYTES else "float32"
    return (entry.n_params or 0) * DTYPE_BYTES[dtype], f"its weights at {dtype}"


def death_cause(exitcode: int | None, runtime: str, name: str, need: tuple[int, str], available: int) -> str:
    """Why the engine process ended, in one sentence, from its exit code (-N: killed by signal N)."""
    from app.units import fmt_bytes

    where = "the llama.cpp runtime" if runtime == "llama.cpp" else "the torch runtime"
    if exitcode == -signal.SIGILL:
        return (f"The engine process was killed by SIGILL: {where} ran an instruction this CPU (or its hypervisor) "
                "does not allow.")
    if exitcode == -signal.SIGKILL:
        nbytes, what = need
        figures = (f": {name} needs {fmt_bytes(nbytes)} for {what} on {where}, and {fmt_bytes(available)} of memory "
                   "is available with the engine gone" if nbytes else "")
        return f"The engine process was killed (SIGKILL), most likely by the system for lack of memory{figures}."
    if exitcode in (-signal.SIGSEGV, -signal.SIGBUS):
        kind = signal.Signals(-exitcode).name
        return (f"The engine process crashed ({kind}) in native code of {where}, or the model file changed on disk "
                "while it was mapped.")
    if exitcode is None:
        return "The engine process closed its connection to the app and did not exit."
    if exitcode < 0:
        try:
            kind = signal.Signals(-exitcode).name
        except ValueError:
            kind = f"signal {-exitcode}"
        return f"The engine process was killed by {kind}."
    return f"The engine process exited unexpectedly with code {exitcode}."


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
                    self.sig_raw.emit(_EngineGone("" if isinstance(e, (EOFError, OSError)) else type(e).__name__))
                break
            self.sig_raw.emit(msg)
            if isinstance(msg, P.Stopped):
                break


def settle_heap() -> None:
    """Collect once, then leave what survives (the tokenizer's vocabulary, the panels, the model's facts: about a
    million objects with a 262k-token vocabulary) out of later collections. Python's collector walks every tracked
    object when it collects the oldest generation, holding the GIL throughout: the GUI froze for that walk now and
    then during a run. Frozen objects are still freed when nothing refers to them; a cycle frozen since (age_heap)
    is collected here, at a model's load."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


# Tokens of a live run between two age_heap calls. A run's events stay in the run store; unfrozen, they would join
# the oldest generation, whose walk (triggered each time it grew by a quarter) takes longer the longer the run.
AGE_EVERY = 256


def age_heap() -> None:
    """Collect the two young generations (a walk of the objects made since the last call, not of the run), then
    freeze what survived: the run's events, kept until their run goes, are never walked again. Then hand the C heap's
    free pages back to the system: the engine's messages arrive as many short-lived buffers, and the pages they
    freed would otherwise stay in the process's RSS."""
    gc.collect(1)
    gc.freeze()
    if _malloc_trim is not None:
        _malloc_trim(0)


PIPE_BYTES_MAX = 4 << 20  # a system that allows more gets no more: a few steps' events is all the pipe is for


def widen_pipe(conn) -> int:
    """Let the engine's events pipe hold a few steps' messages (the most a pipe may hold here, Linux's
    /proc/sys/fs/pipe-max-size, 1 MiB unless changed) instead of 64 KiB: a step's events (one layer's attention row
    over the context, the logits) are larger, and a full pipe makes the engine's decode loop wait until the relay
    thread has read them, a chunk at a time, each chunk waiting for the GIL while the GUI thread draws
    (`python -m benchmarks.pipe_wait`). Returns the pipe's size in bytes (0: not known, not Linux)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        return 0
    set_size, get_size = getattr(fcntl, "F_SETPIPE_SZ", None), getattr(fcntl, "F_GETPIPE_SZ", None)
    if set_size is None or get_size is None:
        return 0
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            want = min(int(f.read()), PIPE_BYTES_MAX)
        fcntl.fcntl(conn.fileno(), set_size, want)
    except (OSError, ValueError):  # no /proc, or a size the system refuses: the pipe stays as it was
        pass
    try:
        return fcntl.fcntl(conn.fileno(), get_size)
    except OSError:
        return 0


def _find_malloc_trim():
    """glibc's malloc_trim, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()


def _interrupted(live: _LiveRun) -> Finished:
    """The end of a run the engine's death cut short, from the steps that arrived (reason "engine lost")."""
    decode = live.seconds[1:]
    return Finished(
        reason="engine lost", prompt_ids=np.asarray(live.prompt_ids, dtype=np.int64),
        ids=np.asarray(live.ids, dtype=np.int64), text="".join(live.text),
        ttft_s=live.seconds[0] if live.seconds else 0.0, tpot_s=float(np.mean(decode)) if decode else 0.0,
        step_seconds=np.asarray(decode), total_s=float(sum(live.seconds)),
    )


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
    sig_held_attention = QtCore.Signal(object)
    """engine.protocol.HeldAttention: captures of layers no panel showed, sent once (a layer turned to, a run's end)."""
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
    """Batching lab: one measured engine.labs.batching.BatchRow."""
    sig_batch_done = QtCore.Signal(object)
    """Batching lab ended: engine.protocol.LabDone (done, cancelled, failed or unsupported, and why)."""
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
    """Speculative-decoding lab: one event of engine.labs.spec_events (a pass, the baseline, a sweep point)."""
    sig_spec_done = QtCore.Signal(object)
    """Speculative-decoding lab ended: engine.protocol.LabDone."""
    sig_sched = QtCore.Signal(object)
    """Scheduling lab: one event of engine.labs.schedule_events (the plan, a step, a finished request, a summary)."""
    sig_sched_done = QtCore.Signal(object)
    """Scheduling lab ended: engine.protocol.LabDone."""
    sig_pong = QtCore.Signal(int)
    """The engine handled every command sent before the Ping with this token (ping())."""
    sig_serve_progress = QtCore.Signal(float, str)
    """Load lab: fraction of the requests done and a word on it."""
    sig_serve_request = QtCore.Signal(object)
    """Load lab: one finished request (engine.remote.loadlab.RequestResult)."""
    sig_serve_run = QtCore.Signal(object)
    """Load lab: the figures of one concurrency level (a dict with `vllm bench serve`'s keys)."""
    sig_serve_spans = QtCore.Signal(object)
    """Load lab: a level's requests with the server's spans (engine.protocol.ServeSpans)."""
    sig_serve_blocks = QtCore.Signal(object)
    """Load lab: the server's prefix-cache blocks from its KV events (engine.protocol.ServeBlocks)."""
    sig_serve_done = QtCore.Signal(object)
    """Load lab ended: engine.protocol.LabDone."""
    sig_fleet = QtCore.Signal(object)
    """Fleet panel: one scrape of a router's replicas and who served what (engine.protocol.FleetStatus)."""
    sig_server_tokens = QtCore.Signal(object)
    """engine.protocol.Tokenized: the connected server's own tokenization of a prompt (and of its chat form)."""
    sig_why_progress = QtCore.Signal(float, str)
    """A why-experiment: fraction done and what is being run."""
    sig_why_done = QtCore.Signal(object)
    """A why-experiment ended: engine.protocol.ExperimentDone (its result, or cancelled, or why it failed)."""
    _sig_why_lost = QtCore.Signal(str)  # the engine died during an experiment: why (made an ExperimentDone)
    sig_engine_lost = QtCore.Signal(object)
    """EngineLost: the engine process died (why, whether it is being restarted, an offer of the torch runtime)."""
    sig_engine_restarted = QtCore.Signal(object)
    """The engine started again after dying and has the same model loaded: its ModelInfo (panels keep their run)."""
    sig_recomputed = QtCore.Signal(object)
    """engine.protocol.Recomputed: a step's attention (and lens) run again from the live run's KV cache, or why not."""
    sig_steered = QtCore.Signal(object)
    """Steered: the run is steered (its vector, layers and scale), or its scale changed from a step on."""
    sig_steer_progress = QtCore.Signal(float, str)
    """Building a steering vector from contrast pairs: fraction done and which pair."""
    sig_steer_done = QtCore.Signal(object)
    """engine.protocol.SteerReady: a steering vector built, loaded or saved, or cancelled, or why not."""
    _sig_steer_lost = QtCore.Signal(str)  # the engine died while building a vector: why (made a SteerReady)
    sig_tune_progress = QtCore.Signal(float, str)
    """Fitting the tuned lens: fraction done and the stage (reading residuals, a KL step's loss, judging)."""
    sig_lens_tuned = QtCore.Signal(object)
    """engine.protocol.LensTuned: a tuned lens fitted, in use, dropped, or cancelled, or why not."""
    _sig_tune_lost = QtCore.Signal(str)  # the engine died while fitting a tuned lens: why (made a LensTuned)

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
        self._experiment_id = 0
        self._experiment: P.Experiment | None = None  # the newest experiment sent and not yet done
        self._recompute_id = 0
        self._steer_id = 0
        self._tune_id = 0
        self._machine: dict[tuple[str, str], object] = {}  # (device, dtype) → the engine's answer (None: none)
        self._answered: set[tuple[str, str]] = set()  # keys the engine has answered for
        # What a new engine process needs to stand in for one that died, and what the app knows of the dead one.
        self.runtime = ""  # "torch" or "llama.cpp": what runs the loaded model
        self.deaths = 0  # engine deaths in a row (a finished generation resets the count)
        self._load: P.Load | None = None  # the newest Load sent
        self._shown_load: P.Load | None = None  # the Load whose model the panels show
        self._loads_sent: list[tuple[P.Load, bool]] = []  # each Load not yet answered, oldest first, and whether
        # its answer is quiet (a new engine loading the model the panels show)
        self._threads: int | str | None = None  # the newest SetThreads setting sent
        self._jobs: set[str] = set()  # long jobs started and not yet Done
        self._live: _LiveRun | None = None  # the run in progress
        self._replaying = False
        self._torch_dtype = ""  # the dtype the torch runtime was offered at after a llama.cpp crash
        self._closing = False
        # One table routes every message: its type → the method that takes it (events of a server run are
        # subclasses: the first base found in the table routes them).
        self._routes: dict[type, Callable[[object], None]] = {
            RunStarted: self._on_run_started, PromptTokenized: self._on_prompt,
            AttentionCaptured: self.sig_attention.emit, P.HeldAttention: self.sig_held_attention.emit,
            ResidualNorms: self.sig_norms.emit,
            PromptScored: self.sig_prompt_scores.emit, LensCaptured: self.sig_lens.emit, KVCacheGrew: self.sig_kv.emit,
            PrefillDone: self.sig_prefill.emit, TokenSampled: self._on_token, Finished: self._on_finished,
            ServerMetricsSampled: self.sig_server_metrics.emit, Failed: lambda m: self.sig_failed.emit(m.message),
            PreviewResult: self.sig_preview.emit, P.Progress: self._on_progress, P.Done: self._on_done,
            P.LabDone: self._on_lab_done,
            P.Loaded: self._on_loaded, P.LoadFailed: self._on_load_failed, _EngineGone: self._on_engine_gone,
            P.State: self._on_state, P.BatchMeasured: lambda m: self.sig_batch_row.emit(m.row),
            P.ThisMachine: self._on_this_machine, P.Connected: self._on_connected,
            P.ConnectFailed: lambda m: self.sig_server_failed.emit(m.message), P.Disconnected: self._on_disconnected,
            P.ServeRequestDone: lambda m: self.sig_serve_request.emit(m.result),
            P.ServeMetrics: self.sig_serve_metrics.emit, P.ServeLevelDone: lambda m: self.sig_serve_run.emit(m.figures),
            P.ServeSpans: self.sig_serve_spans.emit, P.ServeBlocks: self.sig_serve_blocks.emit,
            P.FleetStatus: self.sig_fleet.emit,
            P.Tokenized: self.sig_server_tokens.emit, P.Pong: lambda m: self.sig_pong.emit(m.token),
            P.Stopped: lambda m: None, P.ExperimentDone: self._on_experiment_done,
            Steered: self.sig_steered.emit, P.SteerReady: self._on_steer_ready, P.LensTuned: self._on_lens_tuned,
        }
        for cls in SPEC_EVENTS:
            self._routes[cls] = self.sig_spec.emit
        for cls in SCHED_EVENTS:
            self._routes[cls] = self.sig_sched.emit
        self._routes[P.Recomputed] = self.sig_recomputed.emit
        self._progress = {"load": self.sig_load_progress, "batch": self.sig_batch_progress,
                          "measure": self.sig_measure_progress, "serve": self.sig_serve_progress,
                          "serve_model": self.sig_serving_progress, "why": self.sig_why_progress,
                          "steer": self.sig_steer_progress, "tuned_lens": self.sig_tune_progress}
        self._done = {"measure": self.sig_measure_done, "serve_model": self.sig_serving_done,
                      "why": self._sig_why_lost, "steer": self._sig_steer_lost, "tuned_lens": self._sig_tune_lost}
        self._lab_done = {"batch": self.sig_batch_done, "spec": self.sig_spec_done, "sched": self.sig_sched_done,
                          "serve": self.sig_serve_done}  # engine.protocol.LAB_JOBS' names
        self._sig_why_lost.connect(self._on_why_lost)
        self._sig_steer_lost.connect(self._on_steer_lost)
        self._sig_tune_lost.connect(self._on_tune_lost)
        self._start_engine()

    def _start_engine(self) -> None:
        """Start the engine process and the relay thread that receives its messages."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs Qt threads
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        events_recv, events_send = ctx.Pipe(duplex=False)
        widen_pipe(events_recv)
        self.process = ctx.Process(target=serve, args=(cmd_recv, events_send), name="inference-lab-engine",
                                   daemon=True)
        with _spawn_without_main():
            self.process.start()
        cmd_recv.close()
        events_send.close()
        self.relay = EventRelay(events_recv)
        if getattr(self, "worker_thread", None) is not None:  # a dead engine's, stopped: let Qt free it
            self.worker_thread.deleteLater()
        self.worker_thread = QtCore.QThread(self)
        self.relay.moveToThread(self.worker_thread)
        self.worker_thread.started.connect(self.relay.run)
        self.relay.sig_raw.connect(self._on_raw, QtCore.Qt.ConnectionType.QueuedConnection)
        self.worker_thread.start()

    def _post(self, cmd: P.Command) -> None:
        if self._commands.closed:  # after shutdown, or an engine not restarted: nobody is listening
            return
        try:
            self._commands.send(cmd)
        except (BrokenPipeError, OSError):
            pass  # the engine died: the relay thread reports it, and why, in a moment (_on_engine_gone)

    @property
    def engine_running(self) -> bool:
        """An engine process is there to take commands (False once one that kept dying was not restarted)."""
        return not self._commands.closed

    # ---- commands (GUI thread; never block) ----
    def load_model(self, model: str | None = None, device: str = "auto", dtype: str = "auto",
                   backend: str = "auto", kernels: str = "exact") -> None:
        """Load a model (on torch in kernel mode `kernels`: engine.model.kernel_cache.KERNEL_MODES); after an
        engine that was not restarted, this starts a new engine for it."""
        if not self.engine_running and not self._closing:
            self.deaths, self._load = 0, None  # the user's own choice: a fresh start
            self._restart()
        self._load = P.Load(model, device, dtype, backend, kernels)
        self._loads_sent.append((self._load, False))
        self._post(self._load)

    def load_on_torch(self) -> None:
        """Load the model again on the torch runtime, at the dtype offered after a crash of the llama.cpp runtime
        (in the kernel mode it was asked for)."""
        if self._load is not None:
            self.load_model(self._load.model, self._load.device, self._torch_dtype or self._load.dtype, "torch",
                            self._load.kernels)

    def reload_in(self, kernels: str) -> bool:
        """Send the newest Load again as it was (model, device, dtype, backend) but in kernel mode `kernels`; False
        where no load was ever sent."""
        if self._load is None:
            return False
        self.load_model(self._load.model, self._load.device, self._load.dtype, self._load.backend, kernels)
        return True

    @property
    def last_load(self) -> P.Load | None:
        """The newest Load sent (answered or not)."""
        return self._load

    @property
    def pending_load(self) -> P.Load | None:
        """The newest Load sent that the engine has not answered yet (None: none is on its way)."""
        return self._loads_sent[-1][0] if self._loads_sent else None

    @property
    def replaying(self) -> bool:
        """The event being routed now is a recorded one (a session being opened, or its model's facts shown), not
        the engine's."""
        return self._replaying

    def set_threads(self, setting: int | str) -> None:
        """Decode threads: "auto" (the engine adapts to the machine's load) or a fixed count."""
        self._threads = setting
        self._post(P.SetThreads(setting))

    def generate(self, req: GenerateRequest) -> None:
        """Start a generation; with steering on (options.set_steer) it runs steered, unless it is an ablated branch
        (a run is one or the other)."""
        self.params = req.params
        if self.options.steer is not None and req.steer is None and req.ablation is None:
            req = replace(req, steer=self.options.steer)
        if not self.engine_running and not self._closing:
            self.sig_failed.emit("the engine is not running: it was not restarted after it kept dying; open a model "
                                 "(File → Open model…) to start a new one")
            return
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

    def run_lab(self, request: P.Lab) -> None:
        """Run a lab in the engine process (after any generation): its events come on the lab's signals, and its
        end, as an engine.protocol.LabDone, on the lab's sig_…_done."""
        self._jobs.add(P.LAB_JOBS[type(request)])
        self._post(request)

    def run_batch_bench(self, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32), prompt_tokens: int = 32,
                        new_tokens: int = 16) -> None:
        self.run_lab(P.BatchBench(tuple(batches), prompt_tokens, new_tokens))

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
        self._jobs.add("measure")
        self._post(P.Measure(str(device), canonical_dtype(dtype), dict(measure_kwargs)))

    def cancel_measure(self) -> None:
        self._post(P.Cancel())

    def connect_server(self, url: str, api_key: str | None = None) -> None:
        """Generate on a server from now on; the key goes to the engine process's memory only, never to disk."""
        self._post(P.Connect(url, api_key))

    def disconnect_server(self) -> None:
        self._post(P.Disconnect())

    def watch_fleet(self, source: str, interval_s: float = 1.0) -> None:
        """Watch a router's replicas (its URL, or a fleet config file): sig_fleet every `interval_s`; "" stops."""
        self._post(P.WatchFleet(source, interval_s))

    def serve_model(self) -> None:
        """Start llama.cpp's server for the loaded model on 127.0.0.1 and connect to it (stops with the app)."""
        self._jobs.add("serve_model")
        self._post(P.ServeModel())

    def cancel_serving(self) -> None:
        self._post(P.Cancel())

    def speculate(self, cmd: P.Speculate) -> None:
        """Run the speculative-decoding lab (sig_spec for each event, sig_spec_done at the end)."""
        self.run_lab(cmd)

    def schedule(self, config: object) -> None:
        """Run the scheduling lab (sig_sched for each event, sig_sched_done at the end)."""
        self.run_lab(P.Schedule(config))

    def cancel_lab(self) -> None:
        self._post(P.Cancel())

    def run_experiment(self, params: object) -> int:
        """Run a why-experiment (engine.protocol's HeadsParams, AblateParams, PatchParams, AttributeParams or
        CompareParams) in the engine process, after any generation; sig_why_progress while it runs, then
        sig_why_done. Returns the request's id."""
        self._experiment_id += 1
        cmd = P.Experiment(self._experiment_id, params)
        self._experiment = cmd
        self._jobs.add("why")
        self._post(cmd)
        return cmd.request_id

    def cancel_experiment(self) -> None:
        self._post(P.Cancel())

    def steer_vector(self, action: str, **fields) -> int:
        """Build a steering vector from contrast pairs (action "build": pairs, layers, method), load one ("load":
        path) or save one ("save": vector, path) in the engine process, after any generation for a build;
        sig_steer_progress while it builds, then sig_steer_done. Returns the request's id."""
        self._steer_id += 1
        cmd = P.SteerVector(self._steer_id, action, **fields)
        if action == "build":
            self._jobs.add("steer")
        self._post(cmd)
        return cmd.request_id

    def cancel_steer(self) -> None:
        self._post(P.Cancel())

    def tune_lens(self, action: str, **fields) -> int:
        """The tuned lens in the engine process (engine.protocol.TuneLens): "fit" (corpus, tokens, steps, seconds;
        after any generation, sig_tune_progress while it runs), "use" the saved one, or "off"; then sig_lens_tuned.
        Returns the request's id."""
        self._tune_id += 1
        cmd = P.TuneLens(self._tune_id, action, **fields)
        if action == "fit":
            self._jobs.add("tuned_lens")
        self._post(cmd)
        return cmd.request_id

    def cancel_tune_lens(self) -> None:
        self._post(P.Cancel())

    def run_serve_bench(self, config: dict) -> None:
        """Load lab: `config` holds concurrency (list), num_prompts, max_new_tokens, request_rate, time_limit_s."""
        self.run_lab(P.ServeBench(dict(config)))

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

    def recompute(self, step: int, ids: Iterable[int], layers: Iterable[int] = (), lens_top: int = 0,
                  token: int = -1) -> int:
        """Ask the engine to run step `step` again from its KV cache (`ids`: the run's tokens at positions 0…p, the
        step's query last): these layers' attention, and the lens when lens_top > 0 (`token`: the step's chosen
        one). sig_recomputed answers, between two tokens if a generation runs. Returns the request's id."""
        self._recompute_id += 1
        self._post(P.Recompute(self._recompute_id, int(step), tuple(int(i) for i in ids),
                               frozenset(int(i) for i in layers), int(lens_top), int(token)))
        return self._recompute_id

    def show_model(self, info: ModelInfo | None, cfg, tokenizer, announce: bool = True) -> None:
        """Stand a model's facts in for the loaded one (a session opened without its model) and tell the panels;
        announce=False puts the loaded model's facts back quietly after a replay."""
        self.info, self.cfg = info, cfg
        if tokenizer is not None:
            self.tokenizer = tokenizer
        if announce and info is not None:
            before, self._replaying = self._replaying, True  # a recorded model's facts, not a load: `replaying`
            try:
                self.sig_model_loaded.emit(info)
            finally:
                self._replaying = before

    def replay(self, message: object) -> None:
        """Route a recorded event (or a step's list of them) exactly as a live one (a session being opened): a
        replayed server run keeps its source, but no connection stands behind it."""
        self._replaying = True
        try:
            self._on_raw(message)
        finally:
            self._replaying = False
        if isinstance(message, RunStarted):
            self.run_server = None

    def shutdown(self, timeout_ms: int = 10_000) -> bool:
        """Stop the engine between tokens, end its process and the relay thread, and wait for both."""
        self._closing = True  # a death from here on is the end it was asked for: no restart
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
        if not self._replaying:
            self._live = _LiveRun()
        self.run_source = ev.source
        self.run_server = self.server if ev.source.measured_by_server else None
        self.sig_run_started.emit(ev)

    def _on_prompt(self, ev: PromptTokenized) -> None:
        if not self._replaying:
            if self._live is None or self._live.prompt_ids:  # a run without RunStarted (an older session's)
                self._live = _LiveRun()
            self._live.prompt_ids = tuple(int(i) for i in ev.ids)
        self.sig_prompt.emit(ev)

    def _on_token(self, ev: TokenSampled) -> None:
        if self._live is not None and not self._replaying:
            self._live.ids.append(int(ev.token_id))
            self._live.text.append(ev.text)
            self._live.seconds.append(float(ev.seconds))
            if len(self._live.ids) % AGE_EVERY == 0:
                age_heap()
        self.sig_token.emit(ev)

    def _on_finished(self, ev: Finished) -> None:
        if not self._replaying:
            self._live = None
            age_heap()
            self.deaths = 0  # the model ran a generation to its end: its engine is sound
        self.sig_finished.emit(ev)

    def _on_progress(self, m: P.Progress) -> None:
        if m.job == "load" and self._loads_sent and self._loads_sent[0][1]:
            return  # the model shown is being loaded again into a new engine: the panels keep showing it
        sig = self._progress.get(m.job)
        if sig is not None:
            sig.emit(float(m.fraction), str(m.message))

    def _on_done(self, m: P.Done) -> None:
        self._jobs.discard(m.job)
        sig = self._done.get(m.job)
        if sig is not None:
            sig.emit(m.message)

    def _on_lab_done(self, m: P.LabDone) -> None:
        self._jobs.discard(m.job)
        self._lab_done[m.job].emit(m)

    def _on_experiment_done(self, m: P.ExperimentDone) -> None:
        if self._experiment is not None and m.request_id == self._experiment.request_id:
            self._experiment = None
            self._jobs.discard("why")
        self.sig_why_done.emit(m)

    def _on_steer_ready(self, m: P.SteerReady) -> None:
        if m.action == "build":
            self._jobs.discard("steer")
        self.sig_steer_done.emit(m)

    def _on_lens_tuned(self, m: P.LensTuned) -> None:
        if m.action == "fit":
            self._jobs.discard("tuned_lens")
        self.sig_lens_tuned.emit(m)

    def _on_tune_lost(self, message: str) -> None:
        self.sig_lens_tuned.emit(P.LensTuned(self._tune_id, "fit", error=message))

    def _on_steer_lost(self, message: str) -> None:
        self.sig_steer_done.emit(P.SteerReady(self._steer_id, "build", error=message))

    def _on_why_lost(self, message: str) -> None:
        cmd, self._experiment = self._experiment, None
        if cmd is not None:
            self.sig_why_done.emit(P.ExperimentDone(cmd.request_id, cmd.kind, cmd.params, failure=message))

    def _on_loaded(self, m: P.Loaded) -> None:
        cmd, quiet = self._loads_sent.pop(0) if self._loads_sent else (None, False)
        same = quiet and self.info is not None and m.info.sha256 == self.info.sha256  # not a file changed on disk
        self.info, self.tokenizer, self.cfg = m.info, m.tokenizer, m.cfg
        self.runtime = m.runtime
        self._shown_load = cmd
        if same:
            self.sig_engine_restarted.emit(self.info)
        else:
            self.sig_model_loaded.emit(self.info)
        settle_heap()

    def _on_load_failed(self, m: P.LoadFailed) -> None:
        if self._loads_sent:
            self._loads_sent.pop(0)
        self.sig_load_failed.emit(m.message)

    # ---- an engine that died ----
    def _on_engine_gone(self, m: _EngineGone) -> None:
        """Say why the engine died, end the run it cut short as an interrupted run, and start a new engine with the
        same model and settings (unless this model has killed its engine too often in a row)."""
        if self._closing:
            return
        self.process.join(5)
        if self.process.is_alive():  # it sent something unreadable, or closed its end and went on: end it
            self.process.kill()
            self.process.join(5)
        self.worker_thread.quit()
        self.worker_thread.wait(5_000)
        self._commands.close()
        self.relay.events.close()
        loading = self._loads_sent[0][0] if self._loads_sent else None  # a load it died in
        runtime, load = self.runtime, loading or self._shown_load
        info = self.info if loading is None else None
        name = info.name if info is not None else (Path(load.model).name if load is not None and load.model else
                                                  "the default model")
        if loading is not None:
            runtime = self._runtime_of(loading)
        if m.unreadable:
            cause = f"The engine process sent a message the app could not read ({m.unreadable}) and was stopped."
        else:
            from engine.formats.discover import memory_available

            cause = death_cause(self.process.exitcode, runtime, name, _memory_need(info, runtime, load),
                                memory_available())
        self.deaths += 1
        restart = self.deaths <= MAX_RESTARTS
        live, self._live = self._live, None
        kept = len(live.ids) if live is not None else 0
        if restart:
            steps = f"; the {kept} step{'s' if kept != 1 else ''} that arrived are kept" if live is not None else ""
            outcome = f"A new engine is starting with {name} and the same settings{steps}."
        else:
            outcome = (f"It has now stopped {self.deaths} times in a row, so it is not restarted again: open a model "
                       "(File → Open model…) to start a new engine.")
        lost = EngineLost(cause=cause, outcome=outcome, exitcode=self.process.exitcode, runtime=runtime,
                          restarted=restart, kept_steps=kept,
                          torch_offer=self._torch_offer(info, name) if runtime == "llama.cpp" else "")
        if restart:  # first, so that what the signals below make panels ask for reaches the new engine
            self._restart()
        self.sig_engine_lost.emit(lost)
        if live is not None and live.prompt_ids:  # the same path as a run's end: panels, run store, autosave
            self.sig_finished.emit(_interrupted(live))
        for job in sorted(self._jobs):
            if job in self._lab_done:
                self._lab_done[job].emit(P.LabDone(job, "failed", f"the engine process stopped: {cause}"))
            else:
                self._done[job].emit(f"the engine process stopped: {cause}")
        self._jobs.clear()
        self._machine = {k: v for k, v in self._machine.items() if v is not None or k in self._answered}
        self.state = "idle"
        self.sig_state.emit("idle")
        if self.server is not None:  # the connection lived in the dead process
            self._on_disconnected(P.Disconnected())

    def _restart(self) -> None:
        """A new engine process, sent what the dead one had been told: threads, the model, sampling, captures."""
        self._start_engine()
        self._loads_sent = []
        if self._threads is not None:
            self._post(P.SetThreads(self._threads))
        load = self._load
        if load is not None:
            self._loads_sent.append((load, load == self._shown_load and self.info is not None))
            self._post(load)
        self._post(P.SetParams(self.params))
        if self.options.attention_layers:
            self._post(P.CaptureAttention(self.options.attention_layers))

    def _runtime_of(self, load: P.Load) -> str:
        from engine.backends import choose

        try:
            return choose(load.model, load.backend)
        except ValueError:
            return "torch"

    def _torch_offer(self, info: ModelInfo | None, name: str) -> str:
        """After a crash of the llama.cpp runtime: a sentence offering the torch runtime when the model's weights fit
        in the memory available at float32, or else at bfloat16; "" when they fit at neither (the picker's rule)."""
        from app.units import fmt_bytes
        from engine.formats.discover import DTYPE_BYTES, memory_available

        n_params = info.n_params if info is not None else 0
        if not n_params and self._load is not None:
            try:
                from engine.formats.discover import read_model_facts
                from engine.formats.locate import resolve_model_path

                path = resolve_model_path(self._load.model)
                n_params = read_model_facts(path, path.name, "file").n_params or 0
            except Exception:  # noqa: BLE001 — no figure, no offer
                return ""
        available = memory_available()
        wanted = self._load.dtype if self._load is not None and self._load.dtype in DTYPE_BYTES else "float32"
        for dtype in dict.fromkeys((wanted, "float32", "bfloat16")):
            need = n_params * DTYPE_BYTES[dtype]
            if n_params and need <= available:
                self._torch_dtype = dtype
                return (f"The torch runtime would hold {name}'s weights in {fmt_bytes(need)} at {dtype} "
                        f"({fmt_bytes(available)} of memory available).")
        return ""

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
