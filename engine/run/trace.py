"""A generation as a Chrome / Perfetto trace: one slice per prefill and decode step, KV cache bytes as a counter.

The format is the Trace Event Format's JSON object form, `{"traceEvents": [...], "displayTimeUnit": "ms"}`:
complete events ("ph": "X") with a start "ts" and a duration "dur" in microseconds, counter events ("ph": "C") and
metadata events ("ph": "M") naming the process and thread. ui.perfetto.dev and chrome://tracing open it as is.

A step's slice ends when the engine handed its token over and lasts the step's measured seconds (forward pass and
sampling), so gaps between slices are the time spent outside the step (the consumer, a pause). Without arrival
times (events read back from a saved session) the slices are laid end to end. The engine does not time single
layers, so there are no per-layer child slices.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from engine.events import Event, Finished, KVCacheGrew, PrefillDone, PromptTokenized, TokenSampled

PID, TID = 1, 1


class TraceRecorder:
    """Collects events as they arrive (with the arrival time) and writes them as trace-event JSON."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.t0 = clock()
        self.events: list[tuple[float | None, Event]] = []

    def add(self, ev: Event, at: float | None = None) -> None:
        """Record one event; `at` is its arrival time on `clock` (now if omitted)."""
        self.events.append((self.clock() if at is None else at, ev))

    def trace(self) -> dict:
        return trace_events([(t - self.t0, e) for t, e in self.events])

    def write(self, path: str | Path) -> None:
        """Write the trace; OSError with the path and the reason if it cannot be written."""
        try:
            Path(path).write_text(json.dumps(self.trace(), ensure_ascii=False), encoding="utf-8")
        except OSError as e:
            raise OSError(f"cannot write the trace to {path}: {e.strerror or e}") from None


def trace_events(timed: Iterable[tuple[float | None, Event]], name: str = "Inference Lab") -> dict:
    """(seconds since start or None, event) pairs → the trace-event JSON object."""
    out: list[dict] = [
        {"ph": "M", "pid": PID, "tid": TID, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": PID, "tid": TID, "name": "thread_name", "args": {"name": "engine: prefill and decode"}},
    ]
    end = 0.0  # µs, the end of the last slice
    n_prompt = 0
    prefill: PrefillDone | None = None
    for at, ev in timed:
        if isinstance(ev, PromptTokenized):
            n_prompt = len(ev.ids)
        elif isinstance(ev, PrefillDone):
            prefill = ev
        elif isinstance(ev, KVCacheGrew):
            ts = end if at is None else at * 1e6
            out.append({"ph": "C", "pid": PID, "tid": TID, "name": "KV cache", "ts": ts,
                        "args": {"bytes used": ev.bytes_used, "bytes allocated": ev.bytes_allocated}})
        elif isinstance(ev, TokenSampled):
            dur = ev.seconds * 1e6
            stop = end + dur if at is None else max(at * 1e6, end + dur)
            args = {"step": ev.step, "position": ev.position, "token_id": ev.token_id, "token": ev.piece,
                    "flops": ev.cost.flops, "bytes": ev.cost.bytes, "forced": ev.forced}
            if ev.step == 0:
                n = prefill.n_tokens if prefill else n_prompt
                label = f"prefill ({n} token{'s' if n != 1 else ''})"
                if prefill is not None:
                    args.update(tokens_computed=prefill.n_tokens, tokens_reused=prefill.n_reused)
            else:
                label = f"decode {ev.step}"
            out.append({"ph": "X", "pid": PID, "tid": TID, "name": label, "cat": ev.phase, "ts": stop - dur,
                        "dur": dur, "args": args})
            end = stop
        elif isinstance(ev, Finished):
            out.append({"ph": "i", "pid": PID, "tid": TID, "name": f"finished ({ev.reason})", "ts": end, "s": "t",
                        "args": {"ttft_ms": ev.ttft_s * 1e3, "tpot_ms": ev.tpot_s * 1e3, "tokens": len(ev.ids)}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def check_writable(path: str | Path) -> None:
    """OSError now, before a long run, if `path` cannot be written (a missing folder, no permission)."""
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise OSError(f"cannot write the trace to {path}: it is a folder")
    if not folder.is_dir():
        raise OSError(f"cannot write the trace to {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise OSError(f"cannot write the trace to {path}: permission denied")

