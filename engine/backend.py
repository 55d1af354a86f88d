"""The backend seam: what the engine process runs generations on.

A backend is the local model (engine.run.local.LocalBackend) or a server (engine.remote.served.ServerBackend); a
third (another local runtime) is one more subclass. The engine process (engine.server) holds one backend and never
asks which kind it is: it asks the backend, and a backend that cannot do something says so in one sentence
(Unsupported). Every generation starts with RunStarted, whose RunSource says where it ran and what it could not
report, so a panel draws a replayed or disconnected run as what it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Protocol

from engine.events import Event, PromptTokenized, RunSource
from engine.protocol import BatchRow, GenerateRequest, PreviewResult, SamplingParams


class Unsupported(Exception):
    """This backend cannot do what was asked; the message says why and what to do instead, in one sentence."""


class Run(Protocol):
    """A running generation: iterate it for events; its knobs may change between tokens."""

    params: SamplingParams
    capture: object  # engine.protocol.Capture

    def __iter__(self) -> Iterator[Event]: ...

    def stop(self) -> None:
        """End the run at the next token; safe to call from another thread (a server's stalled stream ends too)."""


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
        """Use this thread controller (engine.run.threads.AdaptiveThreads) from the next step on."""
        return None  # a backend whose threads are not ours (a server) ignores it

    def batch_bench(self, batches: tuple[int, ...], prompt_tokens: int, new_tokens: int, progress: Progress,
                    should_stop: ShouldStop, on_row: Callable[[BatchRow], None]) -> None:
        """The batching lab: batched decode measured at each batch size."""
        raise Unsupported("the batching lab runs the local model: disconnect from the server to use it")

    def speculate(self, cmd: object, send: Callable[[object], None], should_stop: ShouldStop) -> None:
        """The speculative-decoding lab (engine.protocol.Speculate): drafts verified by the model's own passes."""
        raise Unsupported("the speculative-decoding lab runs on the local model: disconnect from the server to use it")

    def schedule(self, config: object, send: Callable[[object], None], should_stop: ShouldStop) -> None:
        """The scheduling lab (engine.labs.scheduler): static and continuous batching with real batched steps."""
        raise Unsupported("the scheduling lab runs on the local model: disconnect from the server to use it")

    def serve_bench(self, config: dict, send: Callable[[object], None], should_stop: ShouldStop) -> None:
        """The load lab: concurrent requests against a server, with its metrics."""
        raise Unsupported("the load lab measures a server: connect to one first (File → Connect to server…)")

    def why_session(self) -> object:
        """The loaded model's session the why-experiments run on (engine.server.run_experiment): the torch engine's
        Session or a runtime with its interface."""
        raise Unsupported("the why-experiments look inside the local model: disconnect from the server to run them")

    def close(self) -> None:
        """Release what the backend holds (connections); the local model is kept by whoever owns it."""
        return None
