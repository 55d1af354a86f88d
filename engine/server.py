"""The engine in its own process: commands come in over one pipe, events and notices go out over another.

Why a process and not only a thread: the model loop and a Python GUI (pyqtgraph paints in Python) both need the
interpreter lock; in its own process the engine keeps its speed and the GUI thread only waits for the CPU, never
for the lock (BENCHMARKS.md, "The app against the CLI").

The messages are written down in engine.protocol: commands in, notices out, plus the engine events (a generation
step's events come as one list). The server holds one backend (engine.backend) and never asks which kind it is.
A reader thread takes commands off the pipe as they come, so Stop reaches a running generation at once — a
server's stalled stream included — and Cancel a long job; everything else waits its turn in order. This machine's
roofs are measured here, not in the GUI: torch lives in this process, and a measurement must not run beside a
decode. Both ends are this program's own processes, so pickling over the pipes is safe (no file is ever unpickled).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from engine.backend import Backend, Run, ShouldStop, Unsupported
from engine.backend import Progress as ReportProgress
from engine.events import AttentionCaptured, Failed, TokenSampled
from engine.protocol import (
    LAB_JOBS,
    AskThisMachine,
    BatchBench,
    Cancel,
    CaptureAttention,
    CaptureLens,
    Command,
    Connect,
    Connected,
    ConnectFailed,
    Disconnect,
    Disconnected,
    Done,
    Experiment,
    ExperimentDone,
    FleetStatus,
    Generate,
    HeldAttention,
    Lab,
    LabDone,
    LabOutcome,
    LensTuned,
    Load,
    Loaded,
    LoadFailed,
    Measure,
    Pause,
    Ping,
    Pong,
    Preview,
    Progress,
    Quit,
    Recompute,
    Recomputed,
    Resume,
    SamplingParams,
    ServeBench,
    ServeModel,
    SetParams,
    SetSteerScale,
    SetThreads,
    State,
    SteerReady,
    SteerVector,
    Step,
    Stop,
    Stopped,
    StopServing,
    ThisMachine,
    Tokenize,
    Tokenized,
    TuneLens,
    WatchFleet,
)

if TYPE_CHECKING:
    from engine.run.session import Engine


HELD_BYTES = 128 << 20  # attention held for the record during one generation (the app's run store keeps as much a run)
HELD_FIRST = 8  # …of which 1/8 keeps the run's first steps and the rest its newest, as the run store does
HELD_CHUNK = 8 << 20  # what was held goes to the app in messages of about this size


class ForTheRecord:
    """Attention a generation captures for the record only (every layer of a short run: Capture.every_layer_below)
    in layers no panel shows. A step's message carries what is on screen; these stay here, within HELD_BYTES (the
    first steps and the newest, as the app's run store would keep them), and go to the app at once: the held steps
    of a layer a panel turns to, and everything else when the run ends, before its Finished (HeldAttention)."""

    def __init__(self, shown: frozenset[int], every_layer_below: int) -> None:
        self.shown, self.on = shown, every_layer_below > 0
        self.first: list[AttentionCaptured] = []
        self.rest: deque[AttentionCaptured] = deque()
        self.first_bytes = self.bytes = 0

    def route(self, events: list) -> list:
        """A step's events without the captures to hold, which are held."""
        if not self.on:
            return events
        sent = []
        for ev in events:
            if isinstance(ev, AttentionCaptured) and ev.layer not in self.shown:
                self._hold(ev)
            else:
                sent.append(ev)
        return sent

    def _hold(self, ev: AttentionCaptured) -> None:
        b = ev.weights.nbytes
        first = not self.rest and self.first_bytes + b <= HELD_BYTES // HELD_FIRST
        (self.first if first else self.rest).append(ev)
        self.first_bytes += b if first else 0
        self.bytes += b
        while self.bytes > HELD_BYTES and len(self.rest) > 1:
            self.bytes -= self.rest.popleft().weights.nbytes

    def show(self, layers: frozenset[int]) -> HeldAttention | None:
        """Panels show these layers now: their held captures, to send (None: none held)."""
        self.shown = layers
        out = [e for e in (*self.first, *self.rest) if e.layer in layers]
        if not out:
            return None
        self.first = [e for e in self.first if e.layer not in layers]
        self.rest = deque(e for e in self.rest if e.layer not in layers)
        self.first_bytes = sum(e.weights.nbytes for e in self.first)
        self.bytes = self.first_bytes + sum(e.weights.nbytes for e in self.rest)
        return HeldAttention(tuple(out))

    def end(self) -> list[HeldAttention]:
        """Everything still held, in step and layer order, in messages of about HELD_CHUNK bytes: the app takes each
        in a turn of its event loop, and neither process copies the whole record at once."""
        held = sorted((*self.first, *self.rest), key=lambda e: (e.step, e.layer))
        self.first, self.rest, self.first_bytes, self.bytes = [], deque(), 0, 0
        out, chunk, size = [], [], 0
        for ev in held:
            chunk.append(ev)
            size += ev.weights.nbytes
            if size >= HELD_CHUNK:
                out.append(HeldAttention(tuple(chunk)))
                chunk, size = [], 0
        return [*out, HeldAttention(tuple(chunk))] if chunk else out


class EngineServer:
    def __init__(self, commands: Connection, events: Connection) -> None:
        self.commands, self.events = commands, events
        self.inbox: queue.Queue[tuple[int, Command]] = queue.Queue()  # (arrival number, command), from the reader
        self.pending: deque[tuple[int, Command]] = deque()  # taken early, handled later
        self.local: Backend | None = None  # the loaded model
        self.remote: Backend | None = None  # the server connected to, which generations run on while it is
        self.remote_is_served = False  # whether that server is the one this process started (`served`)
        self.params = SamplingParams()
        self.threads: int | str = "auto"  # decode threads: "auto" (engine.model.threads) or a fixed count
        self.quit = False
        self.running: Run | None = None  # the generation in progress, for the reader's Stop
        # Stop, Cancel and Quit end the long job in progress, or one queued before them: a job started by command
        # number n is cancelled once a cancelling command numbered above n has arrived.
        self._arrived = 0  # commands read so far (the reader's count)
        self._cancelled_at = 0  # number of the latest cancelling command
        self.current = 0  # number of the command being handled
        self._generations_waiting = 0  # Generate commands read but not yet started (a measurement yields to them)
        self._after_generation: list[tuple[int, Command]] = []  # work that yielded to a generation, resumed after
        self._send_lock = threading.Lock()  # the load lab sends from its own thread
        self._handlers = {
            Load: self.load, Generate: self.generate, Preview: self.preview,
            AskThisMachine: self.this_machine, Measure: self.measure, SetParams: self.set_params,
            SetThreads: self.set_threads, Connect: self.connect, Disconnect: self.disconnect,
            Tokenize: self.tokenize, Ping: self.ping, ServeModel: self.serve_model,
            StopServing: self.stop_serving, WatchFleet: self.watch_fleet,
            Experiment: self.experiment, Recompute: self.recompute, SteerVector: self.steer_vector,
            TuneLens: self.tune_lens,
        }
        self._handlers.update(dict.fromkeys(LAB_JOBS, self.lab))  # every lab: one request type, one handler
        self.served = None  # the server this process started for the loaded model (engine.remote.launch)
        self.fleet_watcher = None  # the Fleet panel's watcher (engine.remote.fleet.FleetWatcher)
        # Pause, Resume, Step, Stop, CaptureAttention, CaptureLens and Cancel act inside a generation or a job;
        # outside one there is nothing to act on.
        threading.Thread(target=self._read, daemon=True, name="engine-commands").start()

    # ---- plumbing ----
    def send(self, msg: object) -> None:
        with self._send_lock:
            self.events.send(msg)

    def _read(self) -> None:
        """The reader thread: every command into the inbox; Stop, Cancel and Quit also act at once."""
        while True:
            try:
                cmd = self.commands.recv()
            except (EOFError, OSError):  # the app went away
                cmd = Quit()
            except Exception:  # noqa: BLE001 — a message that cannot be read: the pipe is no longer trustworthy
                cmd = Quit()
            self._arrived += 1
            if isinstance(cmd, Generate):
                self._generations_waiting += 1
            if isinstance(cmd, (Stop, Cancel, Quit)):
                self._cancelled_at = self._arrived
                run = self.running
                if run is not None and not isinstance(cmd, Cancel):
                    run.stop()
            self.inbox.put((self._arrived, cmd))
            if isinstance(cmd, Quit):
                return

    def next_command(self, timeout: float | None) -> Command | None:
        """The next command (pending ones first), waiting up to `timeout` seconds (None = forever)."""
        if self.pending:
            self.current, cmd = self.pending.popleft()
            return cmd
        try:
            self.current, cmd = self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(cmd, Quit):
            self.quit = True
        return cmd

    def cancelled(self, number: int) -> bool:
        return self._cancelled_at > number

    def latest(self, cmd: Command) -> Command:
        """Previews and tokenizations are superseded by newer ones of their kind: drop the stale ones queued."""
        number, later = self.current, []
        while (nxt := self.next_command(0)) is not None:
            if type(nxt) is type(cmd):
                number, cmd = self.current, nxt
            elif isinstance(nxt, SetParams):
                self.params = nxt.params  # settings sent before the newest preview apply to it
            else:
                later.append((self.current, nxt))
            if isinstance(nxt, Quit):
                break
        self.pending.extend(later)
        self.current = number
        return cmd

    def serve(self) -> None:
        while not self.quit:
            cmd = self.next_command(None)
            if cmd is None:
                continue
            if isinstance(cmd, (Preview, Tokenize)):
                cmd = self.latest(cmd)
            handler = self._handlers.get(type(cmd))
            if handler is None:
                continue
            try:
                handler(cmd)
            except Exception as e:  # noqa: BLE001 — the engine must survive anything one command does
                self.send(Failed(message=f"{type(e).__name__}: {e}"))
        self.stop_serving(None)
        self.send(Stopped())

    # ---- commands ----
    def load(self, cmd: Load) -> None:
        from engine.backends import choose
        from engine.loaders import ModelLoadError

        self.send(Progress("load", 0.0, "loading model"))
        try:
            runtime = choose(cmd.model, cmd.backend)
            backend = self._load_torch(cmd) if runtime == "torch" else self._load_llamacpp(cmd)
        except (ModelLoadError, ValueError) as e:
            self.send(LoadFailed(str(e)))
            return
        except Exception as e:  # noqa: BLE001
            self.send(LoadFailed(f"cannot load the model: {type(e).__name__}: {e}"))
            return
        self.send(Progress("load", 0.97, "warming up (first-call costs are not the model's)"))
        backend.session.warm_up()
        was_server = self._set_remote(None)
        self.local = backend
        s = backend.session
        self.send(Loaded(backend.info, s.tokenizer, s.cfg, runtime))
        if was_server:
            self.send(Disconnected())

    def _load_torch(self, cmd: Load) -> Backend:
        from engine.backends.local import LocalBackend
        from engine.loaders import load, preferred_dtype
        from engine.run.session import Session

        # the app's default dtype: the fastest that keeps float32's greedy outputs
        dtype = preferred_dtype(cmd.device) if cmd.dtype == "auto" else cmd.dtype
        lm = load(cmd.model, device=cmd.device, dtype=dtype, kernels=cmd.kernels,
                  progress=lambda f, m: self.send(Progress("load", f, m)))
        return LocalBackend(Session(lm, threads=self.threads))

    def _load_llamacpp(self, cmd: Load) -> Backend:
        from engine.backends.llamacpp import LlamaCppBackend, LlamaCppSession

        self.send(Progress("load", 0.1, "loading the GGUF file with llama.cpp"))
        return LlamaCppBackend(LlamaCppSession(cmd.model, threads=self.threads))

    def set_params(self, cmd: SetParams) -> None:
        self.params = cmd.params

    def set_threads(self, cmd: SetThreads) -> None:
        """Use `cmd.setting` from the next step on (also in a running generation)."""
        from engine.model.threads import AdaptiveThreads

        try:
            controller = AdaptiveThreads(cmd.setting)
        except ValueError as e:
            self.send(Failed(message=str(e)))
            return
        self.threads = cmd.setting
        if self.local is not None:
            self.local.set_threads(controller)

    def preview(self, cmd: Preview) -> None:
        if self.backend is None or not cmd.text:
            return
        result = self.backend.preview(cmd.request_id, cmd.text, cmd.chat, cmd.top, self.params)
        if result is not None:
            self.send(result)

    def recompute(self, cmd: Recompute, edited: str = "") -> None:
        """A step's attention (and lens) run again from the loaded model's KV cache (engine.run.recompute); it reads
        the cache and writes nothing, so it may run between two tokens of a generation. `edited`: how the running
        generation edits its forward pass ("ablated", "steered"), which a recompute would not repeat."""
        from engine.run.recompute import answer

        if self.local is None or edited:  # an edited run's cache holds the edited model's keys and values
            self.send(Recomputed(cmd.request_id, cmd.step, error="load a model first" if self.local is None else
                                 f"an {edited} run's dropped steps cannot be recomputed: its KV cache holds the "
                                 f"{edited} model's keys and values"))
            return
        idle = self.running is None and cmd.lens_top
        self.send(answer(self.local.session, cmd, self._answer_from_pass if idle else None))

    def _answer_from_pass(self) -> None:
        """Between a lens request's pass and its lens: answer the recomputes of attention that came meanwhile and
        that pass holds (a layer switch of the step just selected), so that they do not wait for the lens's
        products over the whole vocabulary (most of its time on Gemma 3's 262,144 tokens). Every other command keeps
        its place."""
        from engine.run.recompute import answer, from_last_pass

        number, later = self.current, []
        while (nxt := self.next_command(0)) is not None:
            if isinstance(nxt, Recompute) and from_last_pass(self.local.session, nxt):
                self.send(answer(self.local.session, nxt))
            else:
                later.append((self.current, nxt))
            if isinstance(nxt, Quit):
                break
        self.pending.extendleft(reversed(later))
        self.current = number

    def ping(self, cmd: Ping) -> None:
        self.send(Pong(cmd.token))

    def generate(self, cmd: Generate) -> None:
        self._generations_waiting -= 1
        try:
            self._generate(cmd)
        finally:
            self.pending.extend(self._after_generation)
            self._after_generation = []

    def _generate(self, cmd: Generate) -> None:
        req = cmd.request
        if self.backend is None:
            self.send(Failed(message="the model is not loaded yet"))
            self.send(State("idle"))
            return
        steered = None  # the run whose steering scale SetSteerScale changes
        try:
            # a backend that cannot edit its forward pass (a server) must refuse an ablation or steering, not ignore it
            if req.steer is not None:
                from engine.why.steered import generate_steered

                gen = steered = generate_steered(self.backend, req)
            elif req.ablation is not None:
                from engine.why.ablated import generate_ablated

                gen = generate_ablated(self.backend, req)
            else:
                gen = self.backend.generate(req)
        except (ValueError, Unsupported) as e:
            self.send(Failed(message=str(e)))
            self.send(State("idle"))
            return
        self.params = req.params
        paused, steps = req.start_paused, 0
        deferred: dict[type, tuple[int, Command]] = {}  # the newest preview / tokenization asked for meanwhile
        held: list[tuple[int, Command]] = []  # other commands that wait for the generation to end, in order
        self.running = gen
        if self.cancelled(self.current):  # a Stop sent after this Generate came before the run was registered
            gen.stop()
        self.send(State("paused" if paused else "generating"))
        step_events: list[object] = []
        record = ForTheRecord(req.capture.attention_layers, req.capture.every_layer_below)
        try:
            for ev in gen:
                # One message per step, not one per event (each costs a pickle, a pipe write and a wake-up of the
                # app's relay thread, which takes a core from the decode), and in it only what panels show.
                step_events.append(ev)
                if not isinstance(ev, TokenSampled):
                    continue
                self.send(record.route(step_events))
                step_events = []
                # Between two tokens: act on every command that came in; while paused, wait for one.
                stop = False
                while True:
                    waiting = paused and steps == 0
                    c = self.next_command(0.1 if waiting else 0)
                    if c is None:
                        if waiting:
                            continue
                        break
                    if isinstance(c, Pause):
                        paused, steps = True, 0
                        self.send(State("paused"))
                    elif isinstance(c, Resume):
                        paused, steps = False, 0
                        self.send(State("generating"))
                    elif isinstance(c, Step):
                        if not paused:
                            self.send(State("paused"))
                        paused, steps = True, steps + 1
                    elif isinstance(c, (Stop, Quit)):
                        gen.stop()
                        stop = True
                        break
                    elif isinstance(c, CaptureAttention):  # captured from the next token on
                        gen.capture = replace(gen.capture, attention_layers=gen.capture.attention_layers | c.layers)
                        if (turned_to := record.show(c.layers)) is not None:
                            self.send(turned_to)
                    elif isinstance(c, CaptureLens):  # from the next token on
                        gen.capture = replace(gen.capture, lens_top=max(0, int(c.top)))
                    elif isinstance(c, SetThreads):
                        self.set_threads(c)
                    elif isinstance(c, SetParams):
                        self.params = c.params
                        p = c.params
                        gen.params = p if p.seed != gen.params.seed else replace(p, seed=gen.params.seed)
                    elif isinstance(c, Ping):
                        self.ping(c)
                    elif isinstance(c, SetSteerScale):  # from the next token on
                        if steered is not None:
                            try:
                                steered.set_scale(c.scale)
                            except ValueError as e:
                                self.send(Failed(message=str(e)))
                    elif isinstance(c, SteerVector) and c.action != "build":  # a file read or written, no model run
                        self.steer_vector(c)
                    elif isinstance(c, TuneLens) and c.action != "fit":  # the next token's lens reads through it
                        self.tune_lens(c)
                    elif isinstance(c, Recompute):  # between two tokens the cache holds every step so far
                        self.recompute(c, edited="ablated" if req.ablation is not None else
                                       "steered" if req.steer is not None else "")
                    elif isinstance(c, (Preview, Tokenize)):
                        deferred[type(c)] = (self.current, c)  # the KV cache (or connection) is the run's until it ends
                    elif isinstance(c, (Generate, Load, BatchBench)):
                        gen.stop()
                        held.append((self.current, c))  # run once this generation has ended
                        stop = True
                        break
                    else:
                        held.append((self.current, c))  # a measurement or a connection waits for the generation
                if steps and not stop:
                    steps -= 1
            step_events = record.route(step_events)  # the end (Finished or Failed), after what was held
            for message in record.end():
                self.send(message)
            if step_events:
                self.send(step_events)
        finally:
            self.running = None
        self.send(State("idle"))
        self.pending.extend(held)  # not into pending during the run: next_command takes pending first
        self.pending.extend(deferred.values())

    def _job(self, job: str, run, quiet=lambda: False) -> None:
        """Run a long job that is not a lab (a measurement) and reports Progress; Cancel, Stop or Quit end it; its
        Done says how it ended (unless quiet() says the job will go on later)."""
        outcome, message, _ = self._outcome(job, run)
        if outcome != "done" or not quiet():
            self.send(Done(job, {"done": "", "cancelled": "cancelled", "failed": f"failed: {message}"}.get(outcome,
                                                                                                   message)))

    def _outcome(self, job: str, run) -> tuple[LabOutcome, str, Any]:
        """Run `run(progress, should_stop)` (progress sends Progress(job, …)) and say how it ended, with what it
        returned: done, cancelled (Cancel, Stop or Quit came after the command that started it, or it stopped at a
        check), failed (one sentence: a ValueError's own, else the exception's type and message) or unsupported (the
        backend's Unsupported sentence)."""
        from engine.costs.hardware import MeasurementCancelled
        from engine.why import Cancelled

        number = self.current

        def should_stop() -> bool:
            return self.cancelled(number)

        try:
            result = run(lambda f, m: self.send(Progress(job, f, m)), should_stop)
        except Unsupported as e:
            return "unsupported", str(e), None
        except Exception as e:  # noqa: BLE001 — the panel must learn that the run ended
            if should_stop() or isinstance(e, (Cancelled, MeasurementCancelled)):
                return "cancelled", "", None
            return "failed", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}", None
        return ("cancelled" if should_stop() else "done"), "", result

    def watch_fleet(self, cmd: WatchFleet) -> None:
        """Start watching a fleet (one at a time: a new source replaces the old), or stop with source ""."""
        from engine.remote.fleet import FleetWatcher

        old, self.fleet_watcher = self.fleet_watcher, None
        if old is not None:
            old.stop()
        if cmd.source.strip():
            self.fleet_watcher = FleetWatcher(cmd.source, lambda kw: self.send(FleetStatus(**kw)),
                                              cmd.interval_s).start()

    def lab(self, cmd: Lab) -> None:
        """One lab (BatchBench, Speculate, Schedule, ServeBench) on the backend in use: its events go out as they
        come, then one LabDone says how it ended."""
        import time

        job, t0 = LAB_JOBS[type(cmd)], time.perf_counter()
        if self.backend is None:
            self.send(LabDone(job, "failed", "connect to a server first (File → Connect to server…)"
                              if isinstance(cmd, ServeBench) else "load a model first"))
            return
        outcome, message, _ = self._outcome(job, lambda _progress, should_stop: self.backend.run_lab(cmd, self.send,
                                                                                                      should_stop))
        self.send(LabDone(job, outcome, message, seconds=time.perf_counter() - t0))

    def experiment(self, cmd: Experiment) -> None:
        """A why-experiment on the loaded model, with Progress("why", …); its ExperimentDone carries the result, or
        says it was cancelled (Cancel, Stop, Quit) or why it failed, in one sentence."""
        import time

        t0 = time.perf_counter()
        if self.backend is None:
            outcome, message, result = "failed", "load a model first", None
        else:
            outcome, message, result = self._outcome("why", lambda progress, should_stop: run_experiment(
                self.backend.why_session(), cmd.params, progress, should_stop, self._open_other))
        self.send(ExperimentDone(cmd.request_id, cmd.kind, cmd.params, result=result, cancelled=outcome == "cancelled",
                                 failure=message, unsupported=outcome == "unsupported",
                                 seconds=time.perf_counter() - t0))

    def steer_vector(self, cmd: SteerVector) -> None:
        """Build a steering vector from contrast pairs (Progress("steer", …); Cancel, Stop or Quit end it between
        forward passes), load one from a control-vector file, or save one; one SteerReady says how it ended."""
        import time
        from pathlib import Path

        import numpy as np

        from engine.formats.control_vector import save
        from engine.why.steer import Pair, build, load_for
        from engine.why.steered import to_steer, to_vector

        t0 = time.perf_counter()

        def run(progress, should_stop) -> tuple:
            try:
                if cmd.action == "save":
                    save(to_vector(cmd.vector, self.local.info.architecture if self.local is not None else ""),
                         cmd.path)
                    return cmd.vector, ()
                if self.backend is None:
                    raise ValueError("load a model first")
                s = self.backend.why_session()
                if cmd.action == "load":
                    vector, name = load_for(s, cmd.path), Path(cmd.path).name
                else:
                    pairs = [Pair(p, n) for p, n in cmd.pairs]
                    vector = build(s, pairs, cmd.layers, cmd.method, progress=progress, should_stop=should_stop)
                    name = f"built from {len(pairs)} pair{'s' if len(pairs) != 1 else ''} ({cmd.method})"
            except OSError as e:
                raise ValueError(f"cannot {'write' if cmd.action == 'save' else 'read'} {cmd.path}: "
                                 f"{e.strerror or e}") from None
            norms = tuple(float(np.linalg.norm(vector.directions[L])) for L in vector.layers)
            return to_steer(vector, name), norms

        outcome, message, result = self._outcome("steer", run)
        if outcome == "unsupported":  # a server
            message = ("a steering vector is read from and checked against the local model's residual stream, which "
                       "a server does not expose: disconnect from the server first")
        steer, norms = result or (None, ())
        self.send(SteerReady(cmd.request_id, cmd.action, path=cmd.path, seconds=time.perf_counter() - t0,
                             cancelled=outcome == "cancelled", error=message, steer=steer, norms=norms))

    def tune_lens(self, cmd: TuneLens) -> None:
        """Fit the loaded model's tuned lens (Progress("tuned_lens", …); Cancel, Stop or Quit end it between steps),
        save and use it; use the one saved for the model file; or stop using one. One LensTuned says how it ended."""
        import time

        from engine.why import tuned_lens as tl

        t0 = time.perf_counter()

        def run(progress, should_stop) -> dict:
            if self.backend is None:
                raise ValueError("load a model first")
            s = self.backend.why_session()
            if cmd.action == "off":
                tl.use(s, None)
                return {}
            if cmd.action == "use":
                fitted = tl.load_for(s)
                if fitted is None:
                    raise ValueError("no tuned lens is saved for this model file yet: fit one first")
            else:
                fitted = tl.fit(s, cmd.corpus or None, tokens=cmd.tokens or tl.DEFAULT_TOKENS,
                                steps=tl.DEFAULT_STEPS if cmd.steps < 0 else cmd.steps,
                                seconds=cmd.seconds or tl.DEFAULT_SECONDS, progress=progress, should_stop=should_stop)
                try:
                    tl.save(fitted, tl.saved_path(s))
                except OSError as e:
                    raise ValueError(f"cannot save the tuned lens: {e.strerror or e}") from None
            tl.use(s, fitted)
            return {"in_use": True, "summary": tl.summary(fitted)}

        outcome, message, result = self._outcome("tuned_lens", run)
        self.send(LensTuned(cmd.request_id, cmd.action, seconds=time.perf_counter() - t0,
                            cancelled=outcome == "cancelled", error=message, **(result or {})))

    def _open_other(self, model: str, backend: str = "auto", kernels: str = "exact") -> object:
        """Another model's session beside the loaded one (a comparison's second side): on llama.cpp as the file is,
        on torch at the loaded model's device and dtype, in kernel mode `kernels`. ValueError with one sentence when
        it cannot be loaded."""
        from engine.backends import choose
        from engine.loaders import ModelLoadError, load
        from engine.run.session import Session

        try:
            if choose(model, backend) == "llama.cpp":
                from engine.backends.llamacpp import LlamaCppSession

                return LlamaCppSession(model, threads=self.threads)
            info = self.local.info
            return Session(load(model, device=info.device, dtype=info.dtype, kernels=kernels), threads=self.threads)
        except ModelLoadError as e:
            raise ValueError(f"cannot load the other model: {e}") from None

    def this_machine(self, cmd: AskThisMachine) -> None:
        """Answer with this machine's cached measurement for (device, dtype), or None; never measures."""
        from engine.costs.hardware import this_machine

        try:
            hw = this_machine(cmd.device, cmd.dtype)  # the one policy: the dtype's own run, else float32's
        except Exception:  # noqa: BLE001 — a broken cache only means "not measured"
            hw = None
        self.send(ThisMachine(cmd.device, cmd.dtype, hw))

    def measure(self, cmd: Measure) -> None:
        """Measure this machine's bandwidth and FLOP/s (cached), with progress; Cancel or Quit stops it. A
        generation asked for meanwhile goes first: the measurement starts again once it has ended (a measurement
        must not run beside a decode, and the user's Generate must not wait for one)."""
        from engine.costs.hardware import MeasurementCancelled, cached_this_machine

        number = self.current
        yielded = []

        def run(progress, should_stop) -> None:
            def stop() -> bool:
                if self._generations_waiting > 0 and not should_stop():
                    yielded.append(True)
                    return True
                return should_stop()

            try:
                hw = cached_this_machine(cmd.device, cmd.dtype, refresh=True, progress=progress, should_stop=stop,
                                         **cmd.options)
            except MeasurementCancelled:
                if yielded:
                    return
                raise
            self.send(ThisMachine(cmd.device, cmd.dtype, hw))

        if self._generations_waiting > 0:
            yielded.append(True)
        else:
            self._job("measure", run, quiet=lambda: bool(yielded))
        if yielded:
            self._after_generation.append((number, cmd))

    def connect(self, cmd: Connect) -> None:
        from engine.remote.client import RemoteError
        from engine.remote.served import connect

        try:
            backend = connect(cmd.url, cmd.api_key)
        except RemoteError as e:
            self.send(ConnectFailed(str(e)))
            return
        self._set_remote(backend)
        self.send(Connected(backend.info))

    @property
    def backend(self) -> Backend | None:
        """Where generations run now: the server connected to, else the loaded model (None: neither)."""
        return self.remote if self.remote is not None else self.local

    def _set_remote(self, backend: Backend | None, served: bool = False) -> bool:
        """Connect generations to `backend` (None: back to the loaded model), closing the server connection there
        was; whether there was one."""
        was = self.remote is not None
        if was:
            self.remote.close()
        self.remote, self.remote_is_served = backend, served and backend is not None
        return was

    def disconnect(self, _cmd: Disconnect) -> None:
        self._set_remote(None)
        self.stop_serving(None)  # a server this process started lives as long as the connection to it
        self.send(Disconnected())

    def serve_model(self, _cmd: ServeModel) -> None:
        """llama.cpp's server on 127.0.0.1 for the loaded model, then connected to: the Load lab and every server view
        work without a terminal. Progress while it starts; Cancel stops it."""
        import tempfile
        import time

        from engine.remote.launch import is_ready, serve_local_model

        if self.local is None:
            self.send(Done("serve_model", "load a model first"))
            return
        self.stop_serving(None)
        info = self.local.info
        number = self.current
        try:
            server = serve_local_model(info.path, tempfile.gettempdir(), info.name)
        except (RuntimeError, OSError) as e:
            self.send(Done("serve_model", str(e).splitlines()[0]))
            return
        self.served = server
        t0, budget = time.monotonic(), 180.0
        try:
            while not is_ready(server):
                waited = time.monotonic() - t0
                if self.cancelled(number) or waited > budget:
                    self.stop_serving(None)
                    self.send(Done("serve_model", "cancelled" if waited <= budget else
                                   f"llama.cpp's server did not answer within {budget:.0f} s"))
                    return
                self.send(Progress("serve_model", min(0.95, waited / 30),
                                   f"starting llama.cpp's server ({waited:.0f} s)"))
                time.sleep(0.5)
        except RuntimeError as e:  # it exited while starting
            self.served = None
            self.send(Done("serve_model", str(e).splitlines()[0]))
            return
        if self._set_remote(None):  # another server was connected: this one takes its place
            self.send(Disconnected())
        self.connect(Connect(server.url))
        connected = self.remote is not None
        self.remote_is_served = connected
        self.send(Done("serve_model", "" if connected else "the server started but did not accept the connection"))

    def stop_serving(self, _cmd: StopServing | None) -> None:
        if self.served is not None:
            server, self.served = self.served, None
            if self.remote_is_served:
                self._set_remote(None)
                self.send(Disconnected())
            server.stop(grace_s=5.0)

    def tokenize(self, cmd: Tokenize) -> None:
        """The backend's own tokenization of the prompt (and of its chat form), for the Prompt panel."""
        if self.backend is None:
            self.send(Tokenized(cmd.request_id, cmd.text, error="no model is loaded"))
            return
        out: dict = {}
        for key, chat in (("prompt", False), ("chat_prompt", True)):
            if chat and (not cmd.chat or out.get("prompt") is None):
                break
            try:
                out[key] = self.backend.tokenize(cmd.text, chat)
            except Exception as e:  # noqa: BLE001 — a backend's refusal or a server's error: one sentence
                out[key.replace("prompt", "error")] = str(e)
        self.send(Tokenized(cmd.request_id, cmd.text, **out))


def run_experiment(session: Engine, params: object, progress: ReportProgress | None = None,
                   should_stop: ShouldStop | None = None,
                   open_model: Callable[[str, str, str], object] | None = None) -> dict:
    """One why-experiment (engine.protocol's HeadsParams, AblateParams, …) on a loaded session, the torch engine's
    or llama.cpp's: the dict its CLI prints. Each module says itself (engine.why.Unsupported) what a runtime cannot.
    `open_model(path, backend, kernels)` gives a comparison's other session; it is closed (where it can be)
    afterwards."""
    from engine import protocol as P

    if isinstance(params, P.HeadsParams):
        from engine.why.heads import head_roles

        return head_roles(session, repeat=params.repeat, seed=params.seed, progress=progress,
                          should_stop=should_stop)
    if isinstance(params, P.AblateParams):
        from engine.why import check_stop
        from engine.why.ablate import ablate

        check_stop(should_stop)  # two forward passes: nothing to stop between them
        return ablate(session, params.prompt, heads=params.heads, attn_layers=params.attn_layers,
                      mlp_layers=params.mlp_layers, mean=params.mean, chat=params.chat, tokens=params.tokens)
    if isinstance(params, P.PatchParams):
        from engine.why.patch import patch

        return patch(session, params.clean, params.corrupt, params.answer, params.wrong, heads=params.heads,
                     progress=progress, should_stop=should_stop)
    if isinstance(params, P.AttributeParams):
        from engine.why.attribute import attribute

        return attribute(session, params.prompt, method=params.method, steps=params.steps, target=params.target,
                         chat=params.chat, progress=progress, should_stop=should_stop)
    if isinstance(params, P.DlaParams):
        from engine.why import check_stop
        from engine.why.dla import dla

        check_stop(should_stop)  # one forward pass (and `step` greedy tokens before it)
        return dla(session, params.prompt, params.answer, params.wrong, step=params.step, chat=params.chat)
    if isinstance(params, P.AtpParams):
        from engine.why.atp import atp

        return atp(session, params.clean, params.corrupt, params.answer, params.wrong, heads=params.heads,
                   exact=params.exact, progress=progress, should_stop=should_stop, ig_steps=params.ig_steps)
    if isinstance(params, P.GalleryParams):
        from engine.why.gallery import run

        return run(session, params.name, progress=progress, should_stop=should_stop)
    if isinstance(params, P.CompareParams):
        from engine.why import check_stop
        from engine.why.compare import compare, compare_corpus, read_corpus

        if open_model is None:
            raise ValueError("a comparison needs a way to open the other model")
        window, cap = params.window or P.CORPUS_WINDOW, params.max_tokens or P.CORPUS_MAX_TOKENS
        text = read_corpus(params.corpus, cap) if params.corpus else ""  # a bad file refused before any loading
        if progress is not None:
            progress(0.0, f"loading {params.other}")
        other = open_model(params.other, params.backend, params.kernels)
        try:
            check_stop(should_stop)
            if params.corpus:
                return compare_corpus(session, other, text, window, cap, name=os.path.basename(params.corpus),
                                      progress=progress, should_stop=should_stop, lens=params.lens)
            return compare(session, other, params.prompt, steps=params.steps, chat=params.chat, progress=progress,
                           should_stop=should_stop)
        finally:
            close = getattr(other, "close", None)
            if close is not None:
                close()
    raise TypeError(f"not the parameters of an experiment: {type(params).__name__}")


def serve(commands: Connection, events: Connection, threads: int = 0) -> None:
    """The engine process's entry point (multiprocessing target)."""
    if threading.current_thread() is threading.main_thread():  # the engine's own process, not a test's thread
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in the terminal is the app's to handle
        # OpenMP keeps libgomp's own spin, as the CLI does. Set to 0, each of a step's many parallel regions woke its
        # second thread from sleep: two threads decoded slower than one, and the tuner's chain timing then capped
        # `auto` at one thread for the CLI too (BENCHMARKS.md, "What the GUI thread pays for a redraw").
    import torch

    threads = threads or int(os.environ.get("INFERENCE_LAB_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    try:
        EngineServer(commands, events).serve()
    except (BrokenPipeError, EOFError, OSError):
        pass  # the app went away
