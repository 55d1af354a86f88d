"""The engine in its own process: commands come in over one pipe, events go out over another.

Why a process and not only a thread: the model loop and a Python GUI (pyqtgraph paints in Python) both need the
interpreter lock. Measured here with all panels live, decode in a GUI-process thread ran at 50–110 ms per token
against 15 ms alone, and the GUI stalled for up to 0.2 s. In its own process the engine keeps its speed and the GUI
thread only waits for the CPU, never for the lock.

Commands are (kind, argument) tuples:
    load (model, device, dtype) · generate GenerateRequest · preview (request_id, text, chat, top)
    pause · resume · step · stop · params SamplingParams · attention_layers frozenset · threads ("auto" or a count)
    batch_bench (batches, prompt_tokens, new_tokens) · cancel_bench · this_machine (device, dtype)
    measure (device, dtype, measure_kwargs) · cancel_measure · quit
    connect (url, api_key) · disconnect · serve_bench dict · cancel_serve_bench (engine.remote.worker)
Out go engine events (engine.events; a generation's come as one list per step), PreviewResult, and notices as
(kind, argument) tuples: load_progress, loaded (ModelInfo, Tokenizer, ModelConfig), load_failed, state,
batch_progress, batch_row, batch_done, this_machine (device, dtype, Hardware or None), measure_progress,
measure_done, stopped. This machine's roofs are measured here, not in the GUI: torch lives in this process, and a
measurement must not run beside a decode.
Both ends are this program's own processes, so pickling over the pipes is safe (no file is ever unpickled).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from engine.events import Failed, Funnel, TokenSampled
from engine.protocol import Capture, SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    text: str
    chat: bool = True
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    capture: Capture = field(default_factory=Capture)
    ignore_eos: bool = False
    start_paused: bool = False  # prefill, then wait for step or resume
    prompt_ids: tuple[int, ...] = ()  # when given, the prompt as token ids (a fork's prefix); `text` is then a label
    forced: tuple[tuple[int, int], ...] = ()  # (step, token id) pairs put in place of sampling (a fork: ((0, id),))
    regex: str | None = None  # the output must match this regular expression (engine.run.constrain)
    json_schema: str | None = None  # … or be JSON valid under this schema (JSON text)


@dataclass(frozen=True)
class PreviewResult:
    """Next-token candidates for the text being typed (no generation)."""

    request_id: int
    text: str
    n_tokens: int
    n_reused: int  # prompt tokens whose K/V came from the previous run (prefix caching)
    n_computed: int
    seconds: float
    funnel: Funnel


class EngineServer:
    def __init__(self, commands: Connection, events: Connection) -> None:
        self.commands, self.events = commands, events
        self.pending: deque[tuple[str, object]] = deque()  # read early, handled later
        self.session = None
        self.params = SamplingParams()
        self.threads: int | str = "auto"  # decode threads: "auto" (engine.run.threads) or a fixed count
        self.quit = False

    # ---- plumbing ----
    def send(self, msg: object) -> None:
        self.events.send(msg)

    def next_command(self, timeout: float | None) -> tuple[str, object] | None:
        """The next command (pending ones first), waiting up to `timeout` seconds (None = forever)."""
        if self.pending:
            return self.pending.popleft()
        try:
            if timeout is not None and not self.commands.poll(timeout):
                return None
            cmd = self.commands.recv()
        except (EOFError, OSError):  # the app went away
            self.quit = True
            return ("quit", None)
        if cmd[0] == "quit":
            self.quit = True
        return cmd

    def latest_preview(self, cmd: tuple[str, object]) -> tuple[str, object]:
        """Previews are superseded by newer ones: drop the stale requests queued behind this one."""
        later = []
        while (nxt := self.next_command(0)) is not None:
            if nxt[0] == "preview":
                cmd = nxt
            elif nxt[0] == "params":
                self.params = nxt[1]  # settings sent before the newest preview apply to it
            else:
                later.append(nxt)
            if nxt[0] == "quit":
                break
        self.pending.extend(later)
        return cmd

    def serve(self) -> None:
        while not self.quit:
            cmd = self.next_command(None)
            if cmd is None:
                continue
            if cmd[0] == "preview":
                cmd = self.latest_preview(cmd)
            try:
                self.dispatch(cmd)
            except Exception as e:  # noqa: BLE001 — the engine must survive anything one command does
                self.send(Failed(message=f"{type(e).__name__}: {e}"))
        self.send(("stopped", None))

    def dispatch(self, cmd: tuple[str, object]) -> None:
        kind, arg = cmd
        if kind == "load":
            self.load(*arg)
        elif kind == "generate":
            self.generate(arg)
        elif kind == "preview":
            self.preview(*arg)
        elif kind == "batch_bench":
            self.batch_bench(*arg)
        elif kind == "this_machine":
            self.this_machine(*arg)
        elif kind == "measure":
            self.measure(*arg)
        elif kind == "params":
            self.params = arg
        elif kind == "threads":
            self.set_threads(arg)
        else:
            from engine.remote import worker

            worker.handle(self, kind, arg)  # connect / disconnect / serve_bench (engine.remote.worker)
        # pause/resume/step/stop/attention_layers/cancel_* outside a generation or a bench: nothing to act on

    # ---- commands ----
    def load(self, model, device: str, dtype: str) -> None:
        from engine.loaders import ModelLoadError, load, preferred_dtype
        from engine.run.session import Session

        self.send(("load_progress", (0.0, "loading model")))
        try:
            if dtype == "auto":  # the app's default: the fastest dtype that keeps float32's greedy outputs
                dtype = preferred_dtype(device)
            lm = load(model, device=device, dtype=dtype, progress=lambda f, m: self.send(("load_progress", (f, m))))
        except ModelLoadError as e:
            self.send(("load_failed", str(e)))
            return
        except Exception as e:  # noqa: BLE001
            self.send(("load_failed", f"cannot load the model: {type(e).__name__}: {e}"))
            return
        self.session = Session(lm, threads=self.threads)
        self.send(("load_progress", (0.97, "warming up (first-call costs are not the model's)")))
        self.session.warm_up()
        self.send(("loaded", (lm.info, lm.tokenizer, lm.cfg)))

    def set_threads(self, setting: int | str) -> None:
        """Use `setting` from the next step on (also in a running generation)."""
        from engine.run.threads import AdaptiveThreads

        try:
            controller = AdaptiveThreads(setting)
        except ValueError as e:
            self.send(Failed(message=str(e)))
            return
        self.threads = setting
        if self.session is not None and self.session.threads is not None:
            self.session.threads = controller

    def preview(self, request_id: int, text: str, chat: bool, top: int) -> None:
        import torch

        from engine.run.sampling import funnel

        if self.session is None or not text:
            return
        if getattr(self.session, "is_remote", False):
            self.session.preview(self, request_id, text, chat, top)
            return
        t0 = time.perf_counter()
        tok = self.session.tokenize(text, chat)
        if not tok.ids or len(tok.ids) >= self.session.cfg.context_length:
            return
        logits, reused, _ = self.session.next_token_logits(tok.ids)
        # The prompt is the context of the first token: penalties apply to it exactly as in Generate's step 0.
        context = torch.tensor(tok.ids, dtype=torch.long)
        f = self.session.make_funnel(funnel(logits, self.params, context), self.params, top)
        self.send(PreviewResult(request_id, text, len(tok.ids), reused, len(tok.ids) - reused,
                                time.perf_counter() - t0, f))

    def generate(self, req: GenerateRequest) -> None:
        if self.session is None:
            self.send(Failed(message="the model is not loaded yet"))
            self.send(("state", "idle"))
            return
        try:
            prompt = list(req.prompt_ids) if req.prompt_ids else req.text
            constraint = None
            if req.regex is not None or req.json_schema is not None:
                from engine.run.constrain import Constraint

                s = self.session
                eos = [*s.tokenizer.eos_ids, *sorted(set(s.stop_ids) - set(s.tokenizer.eos_ids))]
                constraint = Constraint.build(s.tokenizer, s.cfg.vocab_size, eos, regex=req.regex,
                                              json_schema=req.json_schema)
            gen = self.session.generate(prompt, req.params, req.max_new_tokens, req.capture, chat=req.chat,
                                        ignore_eos=req.ignore_eos, forced=dict(req.forced), constraint=constraint)
        except ValueError as e:
            self.send(Failed(message=str(e)))
            self.send(("state", "idle"))
            return
        self.params = req.params
        paused, steps = req.start_paused, 0
        deferred_preview = None  # the newest preview asked for during the generation, run once it has ended
        deferred_tokenize = None  # the newest server tokenization asked for meanwhile (one HTTP call at a time)
        self.send(("state", "paused" if paused else "generating"))
        step_events: list[object] = []
        for ev in gen:
            # One message per step, not one per event: a step with every capture on is ~33 events (30 layers of
            # attention), and each message costs a pickle, a pipe write and a wake-up of the app's relay thread,
            # which takes a core from the decode (measured: 15.5 → 18–21 ms per token with the app's captures).
            step_events.append(ev)
            if not isinstance(ev, TokenSampled):
                continue
            self.send(step_events)
            step_events = []
            # Between two tokens: act on every command that came in; while paused, wait for one.
            while True:
                waiting = paused and steps == 0
                cmd = self.next_command(0.1 if waiting else 0)
                if cmd is None:
                    if waiting:
                        continue
                    break
                kind, arg = cmd
                if kind == "pause":
                    paused, steps = True, 0
                    self.send(("state", "paused"))
                elif kind == "resume":
                    paused, steps = False, 0
                    self.send(("state", "generating"))
                elif kind == "step":
                    if not paused:
                        self.send(("state", "paused"))
                    paused, steps = True, steps + 1
                elif kind in ("stop", "quit"):
                    gen.stop()
                    break
                elif kind == "attention_layers":  # the app asks for more layers: captured from the next token
                    gen.capture = replace(gen.capture, attention_layers=gen.capture.attention_layers | frozenset(arg))
                elif kind == "threads":
                    self.set_threads(arg)
                elif kind == "params":
                    self.params = arg
                    gen.params = arg if arg.seed != gen.params.seed else replace(arg, seed=gen.params.seed)
                elif kind in ("this_machine", "measure"):
                    self.pending.append(cmd)  # answered once this generation has ended (a measurement beside a
                    # decode would time both wrong)
                elif kind in ("generate", "load", "batch_bench"):
                    gen.stop()
                    self.pending.append(cmd)  # run it once this generation has ended
                    break
                elif kind == "preview":
                    deferred_preview = cmd  # the KV cache belongs to the generation until it ends
                elif kind == "server_tokenize":
                    deferred_tokenize = cmd
            if steps:
                steps -= 1
        if step_events:
            self.send(step_events)
        self.send(("state", "idle"))
        if deferred_preview is not None:
            self.pending.append(deferred_preview)
        if deferred_tokenize is not None:
            self.pending.append(deferred_tokenize)

    def batch_bench(self, batches: tuple[int, ...], prompt_tokens: int, new_tokens: int) -> None:
        import psutil

        from engine.run.batching import Cancelled, bench_batch

        if self.session is None:
            self.send(("batch_done", "the model is not loaded yet"))
            return
        if getattr(self.session, "is_remote", False):
            self.send(("batch_done", "the batching lab runs the local model: use the Load lab for a server"))
            return

        later: list[tuple[str, object]] = []  # commands that arrive during the bench, run after it
        should_stop = self._stop_check("cancel_bench", later)
        try:
            bench_batch(
                self.session.lm, batches, prompt_tokens, new_tokens,
                progress=lambda f, m: self.send(("batch_progress", (f, m))), should_stop=should_stop,
                memory_limit_bytes=psutil.virtual_memory().available * 0.5,
                on_row=lambda row: self.send(("batch_row", row)),
            )
        except Cancelled:
            self.send(("batch_done", "cancelled"))
        except Exception as e:  # noqa: BLE001 — the panel must learn that the run ended
            self.send(("batch_done", f"failed: {type(e).__name__}: {e}"))
        else:
            self.send(("batch_done", ""))
        finally:
            self.pending.extend(later)

    def _stop_check(self, cancel: str, later: list[tuple[str, object]]):
        """A should_stop() for a long job: True on `cancel` or quit; other commands wait in `later`."""

        def should_stop() -> bool:
            try:
                while self.commands.poll(0):
                    cmd = self.commands.recv()
                    if cmd[0] in (cancel, "quit"):
                        self.quit = self.quit or cmd[0] == "quit"
                        return True
                    later.append(cmd)
            except (EOFError, OSError):
                self.quit = True
                return True
            return False

        return should_stop

    def this_machine(self, device: str, dtype: str) -> None:
        """Answer with this machine's cached measurement for (device, dtype), or None; never measures."""
        from engine.costs.hardware import this_machine

        try:
            hw = this_machine(device, dtype)  # the one policy: the dtype's own run, else float32's
        except Exception:  # noqa: BLE001 — a broken cache only means "not measured"
            hw = None
        self.send(("this_machine", (device, dtype, hw)))

    def measure(self, device: str, dtype: str, measure_kwargs: dict) -> None:
        """Measure this machine's bandwidth and FLOP/s (cached), with progress; cancel_measure or quit stops it."""
        from engine.costs.hardware import MeasurementCancelled, cached_this_machine

        later: list[tuple[str, object]] = []
        try:
            hw = cached_this_machine(device, dtype, refresh=True, progress=lambda f, m: self.send(
                ("measure_progress", (f, m))), should_stop=self._stop_check("cancel_measure", later),
                **measure_kwargs)
        except MeasurementCancelled:
            self.send(("measure_done", "measurement cancelled"))
        except Exception as e:  # noqa: BLE001 — the panel must learn that the run ended
            self.send(("measure_done", f"measuring failed: {type(e).__name__}: {e}"))
        else:
            self.send(("this_machine", (device, dtype, hw)))
            self.send(("measure_done", ""))
        finally:
            self.pending.extend(later)


def serve(commands: Connection, events: Connection, threads: int = 0) -> None:
    """The engine process's entry point (multiprocessing target)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in the terminal is the app's to handle
    import torch

    threads = threads or int(os.environ.get("INFERENCE_LAB_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
    try:
        EngineServer(commands, events).serve()
    except (BrokenPipeError, EOFError, OSError):
        pass  # the app went away
