"""The app's one record of its runs: every generation and every fork, as the engine sent them, within a memory bound.

The session recorder, the Branches panel, the exports and replay all read this store; nothing else keeps a second
copy of a run's events. Each run is one generation (a fork is a run whose parent is another run); a steered run's name
says what steered it (`steered_name`: the vector, its layers and scales).

Memory policy, so that a long session or many runs cannot grow the GUI process without bound:
- a run keeps every event in arrival order; events are frozen and their arrays are shared read-only with the
  panels, never copied;
- full-vocabulary logits (TokenSampled.logits, vocab × 4 bytes a step) are kept for the newest steps only,
  LOGITS_BYTES across the whole store (`logits_steps(vocab)` steps: 341 at SmolLM2's 49,152, 64 at Gemma 3's
  262,144); an older step keeps its Funnel (the top candidates at every stage of sampling), which is what the
  Branches panel, the exports and a replay draw;
- the context ids are kept once per run (the prompt's ids and the generated ids): `Run.context_ids(step)` gives
  what the engine sampled step `step` against, for re-running a funnel with a repetition penalty;
- a step's attention weights and logit lens are kept within ATTENTION_BYTES a run, because a step's attention costs
  heads × position × layers: keeping every step grows with the square of the run (a 2,000-token run of SmolLM2 with
  every layer captured held gigabytes). The first steps (the prefill and the start of the run, up to
  1/ATTENTION_HEAD of the budget) and the newest steps stay; the oldest steps between them go, one contiguous range
  that `Run.attention_note()` names for the panels. Across runs, once the store holds more than ATTENTION_TOTAL, the
  oldest run not being recorded loses its captures first. They are kept as sent (float32, shared with the panels,
  never copied): converting them to float16 on the GUI thread would stall it for tens of milliseconds a step late in
  a long run (BENCHMARKS.md, "Long runs (issue 26)");
- at most MAX_RUNS runs; a new run makes the oldest one that is neither shown nor being recorded go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from PySide6 import QtCore

from engine.events import (
    AttentionCaptured,
    Finished,
    LensCaptured,
    PromptScored,
    PromptTokenized,
    RunStarted,
    Steered,
    TokenSampled,
)
from engine.protocol import HeldAttention

LOGITS_BYTES = 64 << 20  # full-vocabulary logits kept, newest steps first, across all runs
ATTENTION_BYTES = 128 << 20  # a run's attention weights and logit lens
ATTENTION_HEAD = 8  # 1/8 of a run's attention budget keeps its first steps, the rest its newest
ATTENTION_TOTAL = 2 * ATTENTION_BYTES  # across all runs: older runs lose their captures first
MAX_RUNS = 16  # runs and forks kept
SIGNALS = ("sig_run_started", "sig_prompt", "sig_prompt_scores", "sig_attention", "sig_held_attention", "sig_norms",
           "sig_lens", "sig_kv", "sig_prefill", "sig_token", "sig_steered", "sig_finished")
STEERED = " · steered by "  # a steered run's name: its own, then this, then what steered it
SCALES_NAMED = 3  # a steered run's name lists its scale changes up to this many (the latest ones)

_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # bridge → its window's store


def store_for(bridge: QtCore.QObject) -> RunStore | None:
    """The run store recording `bridge`'s runs (None in a window without one, e.g. a bare panel in a test)."""
    return _STORES.get(bridge)


def logits_steps(vocab_size: int) -> int:
    """How many steps' full-vocabulary logits the store keeps at this vocabulary size (at least one)."""
    return max(1, LOGITS_BYTES // (4 * max(1, int(vocab_size))))


def nbytes(x: object) -> int:
    """Bytes of the numpy arrays `x` holds: an array, an event (with its funnel), or a list or tuple of them."""
    if isinstance(x, np.ndarray):
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return sum(nbytes(getattr(x, f.name)) for f in dataclasses.fields(x))
    return 0


def steered_name(name: str, steered: list[Steered]) -> str:
    """A run's name with what steered it (its Steered events): "run 3 · steered by built from 4 pairs (mean) at
    layers 10–19 × +4", and its later scales ("… × +4 → −2 → +6"); `name` unchanged when there are none."""
    if not steered:
        return name
    changes = [f"{e.scale:+g}".replace("-", "−") for e in steered[1:]]
    if len(changes) > SCALES_NAMED:
        changes = ["…", *changes[-SCALES_NAMED:]]
    return name.split(STEERED)[0] + STEERED + " → ".join([steered[0].label, *changes])


def _capture_nbytes(ev: AttentionCaptured | LensCaptured) -> int:
    """nbytes(ev) for the two per-step captures, without walking their fields (one call per layer and step)."""
    if isinstance(ev, AttentionCaptured):
        return ev.weights.nbytes
    return ev.ids.nbytes + ev.probs.nbytes + ev.entropy_bits.nbytes + (
        ev.token_probs.nbytes if ev.token_probs is not None else 0)


@dataclass(eq=False)
class Run:
    """One generation: its events in arrival order, and where it forked from (parent run id, step, token)."""

    id: int
    name: str
    parent: int | None = None  # id of the run it forked from (None: a run of its own, or its parent is gone)
    step: int = 0  # the parent's step it forked at (its step 0 is the forced token)
    token: int = -1
    events: list = field(default_factory=list)
    _tokens: list[int] = field(default_factory=list)  # index in `events` of each TokenSampled
    _ids: list[int] = field(default_factory=list)  # the generated ids, in step order
    logit_bytes: int = 0
    # the per-step captures (attention, lens) held, each step as (step, its indices in `events`): the first steps,
    # which stay while newer ones can go, and the rest, oldest first. A dropped capture leaves None in `events`.
    _first: list[tuple[int, list[int]]] = field(default_factory=list)
    _rest: deque = field(default_factory=deque)
    _groups: dict[int, list[int]] = field(default_factory=dict)  # step → its indices (the lists in _first, _rest)
    _group_bytes: dict[int, int] = field(default_factory=dict)  # step → its captures' bytes
    _newest: int = -1  # the newest step with captures
    _first_bytes: int = 0
    capture_bytes: int = 0
    dropped: tuple[int, int] | None = None  # (first, last) step whose captures went to bound memory
    steered: list[Steered] = field(default_factory=list)  # its Steered events: the vector, then each new scale

    @property
    def source(self) -> RunStarted | None:
        return next((e for e in self.events[:1] if isinstance(e, RunStarted)), None)

    @property
    def prompt(self) -> PromptTokenized | None:
        return next((e for e in self.events[:2] if isinstance(e, PromptTokenized)), None)

    @property
    def tokens(self) -> list[TokenSampled]:
        return [self.events[i] for i in self._tokens]

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    def tokens_from(self, k: int) -> list[TokenSampled]:
        """The tokens of steps k, k + 1, … (without building the list of all of them)."""
        return [self.events[i] for i in self._tokens[k:]]

    @property
    def scores(self) -> PromptScored | None:
        end = self._tokens[0] if self._tokens else len(self.events)  # the prefill scores the prompt, before a token
        return next((e for e in self.events[:end] if isinstance(e, PromptScored)), None)

    @property
    def finished(self) -> Finished | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, Finished) else None

    def context_ids(self, step: int) -> np.ndarray:
        """The ids step `step` was sampled against: the prompt's and the generated ones before it. (n,) int64"""
        p = self.prompt
        prompt = np.asarray(p.ids, dtype=np.int64) if p is not None else np.zeros(0, np.int64)
        return np.concatenate([prompt, np.asarray(self._ids[:max(0, step)], dtype=np.int64)])

    def nbytes(self) -> int:
        return nbytes(self.events)

    def kept_events(self) -> list:
        """The events held, in arrival order (without the captures dropped to bound memory)."""
        return [e for e in self.events if e is not None]

    def attention_note(self) -> str:
        """Which steps' attention and lens this run holds, in words ("" when none was dropped)."""
        if self.dropped is None:
            return ""
        lo, hi = self.dropped
        groups = [*self._first, *(self._rest[i] for i in (0, -1) if self._rest)]
        first = min((g[0] for g in groups), default=lo)
        last = max((g[0] for g in groups), default=hi)
        kept = [f"{a:,}–{b:,}" if a != b else f"{a:,}" for a, b in ((first, lo - 1), (hi + 1, last)) if a <= b]
        held = f"the attention and lens of steps {' and '.join(kept)}" if kept else "no step's attention or lens"
        return (f"this run holds {held}: steps {lo:,}–{hi:,} were dropped to bound memory ({ATTENTION_BYTES >> 20} "
                f"MiB a run, {ATTENTION_TOTAL >> 20} MiB for all runs)")

    def _add_capture(self, ev: AttentionCaptured | LensCaptured) -> int:
        """Append a capture, grouped with its step's others; its bytes. A capture of an older step (attention the
        engine held for the record: HeldAttention) joins that step's group, or goes if the step's went."""
        group = self._groups.get(ev.step)
        newest = self._newest
        if group is None and ev.step < newest:  # its step's captures were let go to bound memory
            return 0
        self.events.append(ev)
        i, b = len(self.events) - 1, _capture_nbytes(ev)
        budget = ATTENTION_BYTES // ATTENTION_HEAD
        if group is not None:
            group.append(i)
            first = bool(self._first) and ev.step <= self._first[-1][0]
        else:
            first = not self._rest and self._first_bytes < budget
            self._groups[ev.step] = where = [i]
            self._newest = ev.step
            (self._first if first else self._rest).append((ev.step, where))
        self._first_bytes += b if first else 0
        self._group_bytes[ev.step] = self._group_bytes.get(ev.step, 0) + b
        self.capture_bytes += b
        # Late ones came in: the first steps are as they would have been had every capture come live (each began
        # under the budget).
        while ev.step < newest and self._first_bytes > budget and len(self._first) > 1:
            last = self._group_bytes[self._first[-1][0]]
            if self._first_bytes - last < budget:
                break
            self._rest.appendleft(self._first.pop())
            self._first_bytes -= last
        return b

    def _drop_capture(self, everything: bool = False) -> int:
        """Drop the oldest step's captures among the rest, never the newest step; `everything`: any step, the
        first ones last. The bytes freed (0: nothing may go)."""
        if self._rest and (len(self._rest) > 1 or everything):
            step, where = self._rest.popleft()
            first = False
        elif everything and self._first:
            step, where = self._first.pop(0)
            first = True
        else:
            return 0
        self._groups.pop(step, None)
        freed = self._group_bytes.pop(step)
        for i in where:
            self.events[i] = None
        if first:
            self._first_bytes -= freed
        lo, hi = self.dropped if self.dropped is not None else (step, step)
        self.dropped = (min(lo, step), max(hi, step))
        self.capture_bytes -= freed
        return freed


class RunStore(QtCore.QObject):
    """The window's runs (see the module's memory policy); records what the bridge sends, unless replaying."""

    sig_runs_changed = QtCore.Signal()
    """A run was added, removed or the shown run changed (the Branches tree redraws)."""
    sig_run_updated = QtCore.Signal(int)
    """A token or the end of run `id` arrived."""
    sig_finished = QtCore.Signal(int)
    """A live run (not a replay) finished: run id (the autosave listens)."""

    def __init__(self, bridge: QtCore.QObject | None = None, parent: QtCore.QObject | None = None) -> None:
        super().__init__(parent)
        self.runs: list[Run] = []
        self.shown: int | None = None  # id of the run the panels show
        self.recording: int | None = None  # id of the run the incoming events belong to
        self.replaying = False
        self._next_id = 0
        self._roots = 0  # runs started from a prompt so far (names "run 1", "run 2", …)
        self._fork: tuple[int, int, int, str] | None = None  # (parent id, step, token, name) of the next run
        self._logits: deque[tuple[int, int]] = deque()  # (run id, event index) holding logits, oldest first
        self._logit_bytes = 0
        self._capture_bytes = 0
        if bridge is not None:
            _STORES[bridge] = self
            for name, slot in [*((n, self.record) for n in SIGNALS), ("sig_failed", self._on_failed)]:
                sig = getattr(bridge, name, None)
                if sig is not None:
                    sig.connect(slot)

    # ---- reading ----
    def run(self, run_id: int | None) -> Run | None:
        return next((r for r in self.runs if r.id == run_id), None) if run_id is not None else None

    def index(self, run_id: int | None) -> int | None:
        return next((i for i, r in enumerate(self.runs) if r.id == run_id), None)

    def shown_run(self) -> Run | None:
        return self.run(self.shown)

    def events(self) -> list:
        """The shown run's events (what the panels show), in arrival order."""
        r = self.shown_run()
        return r.kept_events() if r is not None else []

    def context_ids(self, step: int) -> np.ndarray | None:
        """The shown run's context for step `step` (prompt ids + generated ids before it); None without a run."""
        r = self.shown_run()
        return r.context_ids(step) if r is not None else None

    def nbytes(self) -> int:
        """Bytes of every array the store holds."""
        return sum(r.nbytes() for r in self.runs)

    # ---- recording ----
    def expect_fork(self, parent: int, step: int, token: int, name: str) -> None:
        """The next run that starts is a fork of run `parent` at `step` with `token`."""
        self._fork = (parent, int(step), int(token), name)

    @QtCore.Slot(str)
    def _on_failed(self, _message: str) -> None:
        # a request the engine refused starts no run: the fork asked for must not name the next run
        self._fork = None

    @QtCore.Slot(object)
    def record(self, ev: object) -> None:
        """Keep one event of the live run (ignored while replaying)."""
        if self.replaying:
            return
        cur = self.run(self.recording)
        if isinstance(ev, HeldAttention):  # captures of earlier steps: each joins its step
            for one in ev.events if cur is not None else ():
                self._append(cur, one)
            return
        if isinstance(ev, RunStarted) or (isinstance(ev, PromptTokenized) and not (
                cur is not None and len(cur.events) == 1 and isinstance(cur.events[0], RunStarted))):
            cur = self._start()
        if cur is None:
            return
        self._append(cur, ev)
        if isinstance(ev, (TokenSampled, Finished)):
            self.sig_run_updated.emit(cur.id)
        if isinstance(ev, Steered):  # the run's name says so
            self.sig_runs_changed.emit()
        if isinstance(ev, Finished):
            self.sig_runs_changed.emit()
            self.sig_finished.emit(cur.id)

    def _start(self) -> Run:
        if self._fork is not None:
            parent, step, token, name = self._fork
            self._fork = None
            r = Run(self._next_id, name, parent if self.run(parent) is not None else None, step, token)
        else:
            self._roots += 1
            r = Run(self._next_id, f"run {self._roots}")
        self._next_id += 1
        self.runs.append(r)
        self.recording = self.shown = r.id
        self._evict()
        self.sig_runs_changed.emit()
        return r

    def _append(self, r: Run, ev: object) -> None:
        if isinstance(ev, (AttentionCaptured, LensCaptured)):
            self._capture_bytes += r._add_capture(ev)
            self._trim_captures(r)
            return
        r.events.append(ev)
        if isinstance(ev, Steered):
            r.steered.append(ev)
            r.name = steered_name(r.name, r.steered)
        if isinstance(ev, TokenSampled):
            r._tokens.append(len(r.events) - 1)
            r._ids.append(int(ev.token_id))
            if ev.logits is not None:
                self._logits.append((r.id, len(r.events) - 1))
                r.logit_bytes += ev.logits.nbytes
                self._logit_bytes += ev.logits.nbytes
                self._trim_logits()

    def _trim_logits(self) -> None:
        while self._logit_bytes > LOGITS_BYTES and len(self._logits) > 1:
            run_id, i = self._logits.popleft()
            r = self.run(run_id)
            if r is None:  # gone with its run (its bytes left then)
                continue
            ev = r.events[i]
            r.events[i] = dataclasses.replace(ev, logits=None)
            r.logit_bytes -= ev.logits.nbytes
            self._logit_bytes -= ev.logits.nbytes

    def _trim_captures(self, r: Run) -> None:
        while r.capture_bytes > ATTENTION_BYTES and (freed := r._drop_capture()):
            self._capture_bytes -= freed
        if self._capture_bytes <= ATTENTION_TOTAL:
            return
        for other in self.runs:  # oldest first
            if other is r or other.id == self.recording:
                continue
            while self._capture_bytes > ATTENTION_TOTAL and (freed := other._drop_capture(everything=True)):
                self._capture_bytes -= freed

    def _evict(self) -> None:
        while len(self.runs) > MAX_RUNS:
            victim = next((r for r in self.runs if r.id not in (self.shown, self.recording)), None)
            if victim is None:
                return
            self.runs.remove(victim)
            self._logit_bytes -= victim.logit_bytes
            self._capture_bytes -= victim.capture_bytes
            for r in self.runs:
                if r.parent == victim.id:
                    r.parent = None

    # ---- showing, sessions ----
    def show(self, run_id: int) -> None:
        if self.run(run_id) is not None and run_id != self.shown:
            self.shown = run_id
            self.sig_runs_changed.emit()

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Events sent through the bridge in here are a replay of stored ones: not recorded again."""
        before, self.replaying = self.replaying, True
        try:
            yield
        finally:
            self.replaying = before

    def load(self, records: list[dict], shown: int | None = None) -> None:
        """Replace every run with those of an opened session: [{"name", "parent" (index), "step", "token",
        "events"}, …]; `shown` is the index of the run the panels show (default: the last)."""
        for _ in self.loading(records, shown):
            pass

    def loading(self, records: list[dict], shown: int | None = None, every: int = 256) -> Iterator[int]:
        """`load` in slices: yields the number of events taken in so far after every `every` of them, so that the
        GUI thread can turn its event loop between slices (app.session_io.Replay). Until it ends no run is shown
        and sig_runs_changed is not emitted; closed early, the store keeps the runs taken in so far."""
        self.clear(notify=False)
        done = 0
        try:
            for i, rec in enumerate(records):
                parent = rec.get("parent")
                parent = int(parent) if isinstance(parent, int) and 0 <= parent < i else None
                r = Run(i, str(rec.get("name") or f"run {i + 1}"), parent, int(rec.get("step", 0)),
                        int(rec.get("token", -1)))
                self.runs.append(r)  # before its events: the caps find the run by its id as they trim
                if rec.get("dropped") is not None:  # steps whose captures the recording store had dropped (this
                    lo, hi = (int(x) for x in rec["dropped"])  # store widens the range if it drops more)
                    r.dropped = (lo, hi)
                self._roots += parent is None
                for ev in rec.get("events", []):
                    self._append(r, ev)
                    done += 1
                    if done % every == 0:
                        yield done
        finally:
            self._next_id = len(self.runs)
            if self.runs:
                self.shown = self.runs[shown if shown is not None and 0 <= shown < len(self.runs) else -1].id
            self._evict()
            self.sig_runs_changed.emit()

    def records(self) -> list[dict]:
        """Every run as a plain record for a session file (parent as an index; references, not copies)."""
        where = {r.id: i for i, r in enumerate(self.runs)}
        return [{"name": r.name, "parent": where.get(r.parent), "step": r.step, "token": r.token,
                 "shown": r.id == self.shown, "events": r.kept_events(),
                 **({"dropped": list(r.dropped)} if r.dropped is not None else {})} for r in self.runs]

    def clear(self, notify: bool = True) -> None:
        self.runs, self.shown, self.recording, self._fork = [], None, None, None
        self._logits.clear()
        self._logit_bytes = self._capture_bytes = 0
        self._roots = 0
        if notify:
            self.sig_runs_changed.emit()
