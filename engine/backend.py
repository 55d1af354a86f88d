"""The backend seam: what the engine process runs generations on.

A backend is the local model (engine.backends.local.LocalBackend) or a server (engine.remote.served.ServerBackend); a
third (another local runtime) is one more subclass. The engine process (engine.server) holds one backend and never
asks which kind it is: it asks the backend, and a backend that cannot do something says so in one sentence
(Unsupported). The labs come as one typed request (engine.protocol.Lab) to one method, run_lab, and end with one
typed outcome (engine.protocol.LabDone). Every generation starts with RunStarted, whose RunSource says where it ran
and what it could and could not report, so a panel draws a replayed or disconnected run as what it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from engine.events import Event, PromptTokenized, RunSource
from engine.protocol import LAB_JOBS, LAB_NAMES, GenerateRequest, Lab, PreviewResult, SamplingParams

if TYPE_CHECKING:
    from engine.run.session import Engine


class Unsupported(Exception):
    """This backend cannot do what was asked; the message says why and what to do instead, in one sentence."""


# What a session's runtime may be able to do beyond generating (a session's `can` names those it can): each an
# experiment's precondition, stated once with the words its refusal uses.
CAPABILITIES = {
    "gradients": "gradients (a backward pass) and the weights as torch tensors",
    "recompute": "the torch engine's KV cache, which a step is recomputed from",
    "exit_logits": "a runtime that can stop after some of its layers",
    "edit": "writes into the forward pass",
}


def require(session: Engine, capability: str, purpose: str,
            instead: str = "load the model with --backend torch") -> None:
    """Unsupported, in one sentence naming what `purpose` needs and what to do `instead`, unless the session's
    runtime can do `capability` (one of CAPABILITIES)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}")
    if capability not in session.can:
        raise Unsupported(f"{purpose} needs {CAPABILITIES[capability]}, which the {session.runtime_name} runtime "
                          f"does not give: {instead}")


class Run(Protocol):
    """A running generation: iterate it for events; its knobs may change between tokens."""

    params: SamplingParams
    capture: object  # engine.protocol.Capture

    def __iter__(self) -> Iterator[Event]: ...

    def stop(self) -> None:
        """End the run at the next token; safe to call from another thread (a server's stalled stream ends too)."""


class WrappedRun:
    """A run around another (a generation kept ablated or steered): its knobs and Stop are the inner run's, so the
    sampling panel's settings and capture act between tokens as on any run."""

    def __init__(self, run: Run) -> None:
        self._run = run

    @property
    def params(self) -> SamplingParams:
        return self._run.params

    @params.setter
    def params(self, value: SamplingParams) -> None:
        self._run.params = value

    @property
    def capture(self) -> object:
        return self._run.capture

    @capture.setter
    def capture(self, value: object) -> None:
        self._run.capture = value

    def stop(self) -> None:
        self._run.stop()


Progress = Callable[[float, str], None]
ShouldStop = Callable[[], bool]


class Backend(ABC):
    """Where generations run. Methods a backend cannot serve raise Unsupported."""

    @property
    @abstractmethod
    def source(self) -> RunSource:
        """Where runs come from, and what this backend cannot report."""

    @abstractmethod
    def generate(self, req: GenerateRequest) -> Run:
        """Start a generation (ValueError with one sentence on a bad request); iterate the result to run it."""

    @abstractmethod
    def preview(self, request_id: int, text: str, chat: bool, top: int, params: SamplingParams) -> PreviewResult | None:
        """Next-token candidates for `text`, or None when there is nothing to show (empty or too long)."""

    @abstractmethod
    def tokenize(self, text: str, chat: bool = False) -> PromptTokenized:
        """The backend's own tokenization of `text` (chat: of the prompt its chat template makes)."""

    def set_threads(self, controller: object) -> None:
        """Use this thread controller (engine.model.threads.AdaptiveThreads) from the next step on."""
        return None  # a backend whose threads are not ours (a server) ignores it

    def run_lab(self, request: Lab, send: Callable[[object], None], should_stop: ShouldStop) -> None:
        """Run one lab (engine.protocol.Lab: BatchBench, Speculate, Schedule or ServeBench): its events, progress
        and rows go out through `send` as they come; `should_stop` is polled between steps. Returns when done; a lab
        stopped early raises (any exception once should_stop() is true is a cancellation), a bad setting raises
        ValueError with one sentence, and a lab this backend cannot run raises Unsupported with one sentence."""
        raise Unsupported(f"{LAB_NAMES[LAB_JOBS[type(request)]]} does not run on {self.source.name}")

    def why_session(self) -> object:
        """The loaded model's session the why-experiments run on (engine.server.run_experiment): a session of either
        runtime, whose `can` says which experiments it runs."""
        raise Unsupported("the why-experiments look inside the local model: disconnect from the server to run them")

    def close(self) -> None:
        """Release what the backend holds (connections); the local model is kept by whoever owns it."""
        return None
