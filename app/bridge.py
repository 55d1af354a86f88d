"""The one QObject that owns the engine's worker thread and turns engine events into typed Qt signals.

The worker runs a plain command loop in a QThread: the GUI thread only puts commands on a queue (never blocks),
the worker runs the model and emits each engine event through one signal; the bridge, living in the GUI thread,
receives them there (queued connection) and re-emits them as the typed `sig_…` signals the panels connect to.
Between two tokens the worker reads its queue, so pause, step, stop and new sampling settings act at once.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, replace

from PySide6 import QtCore

from engine.events import (
    AttentionCaptured,
    Failed,
    Finished,
    Funnel,
    KVCacheGrew,
    ModelInfo,
    PrefillDone,
    PromptTokenized,
    ResidualNorms,
    TokenSampled,
)
from engine.sampling import SamplingParams
from engine.session import Capture


@dataclass(frozen=True)
class GenerateRequest:
    text: str
    chat: bool = True
    max_new_tokens: int = 64
    params: SamplingParams = SamplingParams()
    capture: Capture = Capture()
    ignore_eos: bool = False
    start_paused: bool = False  # prefill, then wait for Step or Resume


@dataclass(frozen=True)
class PreviewResult:
    """Next-token candidates for the text being typed (no generation)."""

    request_id: int
    text: str
    n_tokens: int
    n_reused: int  # prompt tokens whose K/V came from the previous preview (prefix caching)
    n_computed: int
    seconds: float
    funnel: Funnel


@dataclass(frozen=True)
class _Cmd:
    kind: str
    arg: object = None


class EngineWorker(QtCore.QObject):
    """Lives in the worker thread; everything here runs there except the `post` method."""

    sig_raw = QtCore.Signal(object)  # any engine event or a bridge notice, emitted from the worker thread

    def __init__(self) -> None:
        super().__init__()
        self._q: queue.Queue[_Cmd] = queue.Queue()
        self._quit = threading.Event()
        self._cancel_bench = threading.Event()  # set from the GUI thread, read between decode steps
        self.session = None
        self.params = SamplingParams()

    def post(self, kind: str, arg: object = None) -> None:
        """Thread-safe: queue a command for the worker."""
        if kind == "quit":
            self._quit.set()
        self._q.put(_Cmd(kind, arg))

    @QtCore.Slot()
    def run(self) -> None:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        while not self._quit.is_set():
            try:
                cmd = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            cmd = self._latest_preview(cmd)
            try:
                self._dispatch(cmd, None)
            except Exception as e:  # noqa: BLE001 — the thread must survive anything a command does
                self.sig_raw.emit(Failed(f"{type(e).__name__}: {e}"))
        self.sig_raw.emit(("stopped", None))

    def _latest_preview(self, cmd: _Cmd) -> _Cmd:
        """Previews are superseded by newer ones: drop stale requests queued behind this one."""
        if cmd.kind != "preview":
            return cmd
        rest = []
        while True:
            try:
                nxt = self._q.get_nowait()
            except queue.Empty:
                break
            if nxt.kind == "preview":
                cmd = nxt
            else:
                rest.append(nxt)
        for r in rest:
            self._q.put(r)
        return cmd

    def _dispatch(self, cmd: _Cmd, gen) -> None:
        if cmd.kind == "load":
            self._load(*cmd.arg)
        elif cmd.kind == "generate":
            self._generate(cmd.arg)
        elif cmd.kind == "preview":
            self._preview(*cmd.arg)
        elif cmd.kind == "batch_bench":
            self._batch_bench(*cmd.arg)
        elif cmd.kind == "params":
            self.params = cmd.arg
            if gen is not None:
                gen.params = replace(cmd.arg, seed=gen.params.seed) if cmd.arg.seed == gen.params.seed else cmd.arg

    def _load(self, model, device: str, dtype: str) -> None:
        from engine.loaders import ModelLoadError, load
        from engine.session import Session

        self.sig_raw.emit(("load_progress", (0.0, "loading model")))
        try:
            lm = load(model, device=device, dtype=dtype,
                      progress=lambda f, m: self.sig_raw.emit(("load_progress", (f, m))))
        except ModelLoadError as e:
            self.sig_raw.emit(("load_failed", str(e)))
            return
        except Exception as e:  # noqa: BLE001
            self.sig_raw.emit(("load_failed", f"cannot load the model: {type(e).__name__}: {e}"))
            return
        self.session = Session(lm)
        self.sig_raw.emit(("load_progress", (0.97, "warming up (first-call costs are not the model's)")))
        self.session.warm_up()
        self.sig_raw.emit(("loaded", (lm.info, lm.tokenizer, lm.cfg)))

    def _batch_bench(self, batches: tuple[int, ...], prompt_tokens: int, new_tokens: int) -> None:
        import psutil

        from engine.batching import Cancelled, bench_batch

        if self.session is None:
            self.sig_raw.emit(("batch_done", "the model is not loaded yet"))
            return
        def should_stop() -> bool:
            return self._cancel_bench.is_set() or self._quit.is_set()

        try:
            bench_batch(
                self.session.lm, batches, prompt_tokens, new_tokens,
                progress=lambda f, m: self.sig_raw.emit(("batch_progress", (f, m))), should_stop=should_stop,
                memory_limit_bytes=psutil.virtual_memory().available * 0.5,
                on_row=lambda row: self.sig_raw.emit(("batch_row", row)),
            )
        except Cancelled:
            self.sig_raw.emit(("batch_done", "cancelled"))
            return
        except Exception as e:  # noqa: BLE001 — the panel must learn that the run ended
            self.sig_raw.emit(("batch_done", f"failed: {type(e).__name__}: {e}"))
            return
        self.sig_raw.emit(("batch_done", ""))

    def _preview(self, request_id: int, text: str, chat: bool, top: int) -> None:
        import time

        if self.session is None or not text:
            return
        t0 = time.perf_counter()
        from engine.sampling import funnel

        tok = self.session.tokenize(text, chat)
        if not tok.ids or len(tok.ids) >= self.session.cfg.context_length:
            return
        logits, reused, _ = self.session.next_token_logits(tok.ids)
        stages = funnel(logits, self.params)
        f = self.session.make_funnel(stages, self.params, top)
        self.sig_raw.emit(PreviewResult(request_id, text, len(tok.ids), reused, len(tok.ids) - reused,
                                        time.perf_counter() - t0, f))

    def _generate(self, req: GenerateRequest) -> None:
        if self.session is None:
            self.sig_raw.emit(Failed("the model is not loaded yet"))
            self.sig_raw.emit(("state", "idle"))
            return
        try:
            gen = self.session.generate(req.text, req.params, req.max_new_tokens, req.capture, chat=req.chat,
                                        ignore_eos=req.ignore_eos)
        except ValueError as e:
            self.sig_raw.emit(Failed(str(e)))
            self.sig_raw.emit(("state", "idle"))
            return
        self.params = req.params
        paused, steps = req.start_paused, 0
        self.sig_raw.emit(("state", "paused" if paused else "generating"))
        for ev in gen:
            self.sig_raw.emit(ev)
            if not isinstance(ev, TokenSampled):
                continue
            # Between two tokens: act on every queued command; while paused, wait for one.
            while True:
                try:
                    cmd = self._q.get(timeout=0.05) if (paused and steps == 0) else self._q.get_nowait()
                except queue.Empty:
                    if self._quit.is_set():
                        gen.stop()
                        break
                    if paused and steps == 0:
                        continue
                    break
                if cmd.kind == "pause":
                    paused, steps = True, 0
                    self.sig_raw.emit(("state", "paused"))
                elif cmd.kind == "resume":
                    paused, steps = False, 0
                    self.sig_raw.emit(("state", "generating"))
                elif cmd.kind == "step":
                    paused, steps = True, 1
                elif cmd.kind in ("stop", "quit"):
                    gen.stop()
                    break
                elif cmd.kind == "capture":
                    gen.capture = cmd.arg
                elif cmd.kind == "params":
                    self._dispatch(cmd, gen)
                elif cmd.kind in ("generate", "load"):
                    gen.stop()
                    self._q.put(cmd)  # run it once this generation has ended
                    break
                # previews are dropped while generating: the cache belongs to the generation
            if steps:
                steps -= 1
        self.sig_raw.emit(("state", "idle"))


class Bridge(QtCore.QObject):
    """Owns the worker thread; the GUI's only door to the engine."""

    sig_load_progress = QtCore.Signal(float, str)
    """Model loading: fraction done and what is happening."""
    sig_model_loaded = QtCore.Signal(object)
    """A model is ready: ModelInfo."""
    sig_load_failed = QtCore.Signal(str)
    """The model could not be loaded: one sentence for the user."""
    sig_state = QtCore.Signal(str)
    """Generation state: "idle", "generating" or "paused"."""
    sig_prompt = QtCore.Signal(object)
    """A generation began: PromptTokenized."""
    sig_attention = QtCore.Signal(object)
    """AttentionCaptured for one subscribed layer of one step."""
    sig_norms = QtCore.Signal(object)
    """ResidualNorms of one step."""
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
    """Batching lab: one measured engine.batching.BatchRow."""
    sig_batch_done = QtCore.Signal(str)
    """Batching lab ended: "" when complete, else why it stopped ("cancelled", an error)."""
    sig_params = QtCore.Signal(object)
    """The sampling settings changed (SamplingParams); panels re-draw the funnel without re-running the model."""

    _ROUTES = (
        (PromptTokenized, "sig_prompt"), (AttentionCaptured, "sig_attention"), (ResidualNorms, "sig_norms"),
        (KVCacheGrew, "sig_kv"), (PrefillDone, "sig_prefill"), (TokenSampled, "sig_token"),
        (Finished, "sig_finished"), (PreviewResult, "sig_preview"),
    )

    def __init__(self, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self.info: ModelInfo | None = None
        self.tokenizer = None  # the loaded model's tokenizer: fast and thread-safe, used by the GUI for typing
        self.cfg = None
        self.state = "idle"
        self.params = SamplingParams()
        self.attention_layers: set[int] | None = None  # layers whose attention the next generation captures
        self._preview_id = 0
        self.worker = EngineWorker()
        self.worker_thread = QtCore.QThread(self)
        self.worker.moveToThread(self.worker_thread)
        self.worker_thread.started.connect(self.worker.run)
        self.worker.sig_raw.connect(self._on_raw, QtCore.Qt.ConnectionType.QueuedConnection)
        self.worker_thread.start()

    # ---- commands (GUI thread; never block) ----
    def load_model(self, model: str | None = None, device: str = "auto", dtype: str = "auto") -> None:
        self.worker.post("load", (model, device, dtype))

    def generate(self, req: GenerateRequest) -> None:
        self.params = req.params
        self.worker.post("generate", req)

    def preview(self, text: str, chat: bool, top: int = 10) -> int:
        self._preview_id += 1
        self.worker.post("preview", (self._preview_id, text, chat, top))
        return self._preview_id

    def pause(self) -> None:
        self.worker.post("pause")

    def resume(self) -> None:
        self.worker.post("resume")

    def step(self) -> None:
        self.worker.post("step")

    def stop(self) -> None:
        self.worker.post("stop")

    def set_params(self, params: SamplingParams) -> None:
        self.params = params
        self.worker.post("params", params)
        self.sig_params.emit(params)

    def run_batch_bench(self, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32), prompt_tokens: int = 32,
                        new_tokens: int = 16) -> None:
        self.worker._cancel_bench.clear()  # before posting: a cancel right after Run must not be lost
        self.worker.post("batch_bench", (tuple(batches), prompt_tokens, new_tokens))

    def cancel_batch_bench(self) -> None:
        self.worker._cancel_bench.set()

    def set_capture(self, capture: Capture) -> None:
        self.worker.post("capture", capture)

    def select_step(self, step: int) -> None:
        self.sig_step_selected.emit(int(step))

    def shutdown(self, timeout_ms: int = 10_000) -> bool:
        """Stop the worker between tokens, end its thread and wait for it (call before the window goes)."""
        if not self.worker_thread.isRunning():
            return True
        self.worker.post("quit")
        self.worker_thread.quit()
        return self.worker_thread.wait(timeout_ms)

    # ---- events (GUI thread) ----
    @QtCore.Slot(object)
    def _on_raw(self, ev: object) -> None:
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
            elif kind == "state":
                self.state = arg
                self.sig_state.emit(arg)
            return
        if isinstance(ev, Failed):
            self.sig_failed.emit(ev.message)
            return
        for cls, name in self._ROUTES:
            if isinstance(ev, cls):
                getattr(self, name).emit(ev)
                return
