"""A generation with a steering vector on: engine.why.steer's vector × scale added in every forward pass of a local
run (either runtime), its scale changeable between two tokens (the app's Steering panel and its slider).

The engine process (engine.server) starts it, as it starts engine.why.ablated's runs, and for the same reason it is
not a LocalBackend method: engine.why reaches the runtimes through the CLI's argument helpers, and the local backend
must not import what imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from engine.backend import Backend, Run, WrappedRun
from engine.events import Event, PromptTokenized, Steered, TokenSampled
from engine.formats.control_vector import ControlVector
from engine.protocol import GenerateRequest, Steer
from engine.why.ablated import edited_session
from engine.why.steer import check_vector, steering

if TYPE_CHECKING:
    from engine.run.session import Engine


def to_vector(steer: Steer, model_hint: str = "") -> ControlVector:
    """The control vector a Steer carries (its scale aside)."""
    return ControlVector(directions={L: steer.directions[i] for i, L in enumerate(steer.layers)},
                         model_hint=model_hint)


def to_steer(vector: ControlVector, name: str, scale: float = 1.0) -> Steer:
    """A control vector as plain data for the pipe: (layers, d_model) float32 directions, layers in order."""
    return Steer(name, vector.layers, np.stack([vector.directions[L] for L in vector.layers]), scale)


def generate_steered(backend: Backend, req: GenerateRequest) -> Run:
    """Start `req` with req.steer on in every forward pass; Unsupported (one sentence) where the forward pass is not
    ours to edit (a server), ValueError (one sentence) for a vector that does not fit the loaded model."""
    st = req.steer
    if st is None:
        raise ValueError("this request names no steering vector")
    if req.ablation is not None:
        raise ValueError("a run is either ablated or steered, not both: turn steering off to continue as a branch")
    s = edited_session(backend, "steering adds a vector to the model's residual stream, which a server does not "
                                "expose: turn steering off, or disconnect from the server")
    vector = to_vector(st, s.cfg.architecture)
    check_vector(vector, s.cfg)
    return SteeredRun(s, backend.generate(replace(req, steer=None)), vector, st)


class SteeredRun(WrappedRun):
    """A local run with a steering vector on: it goes on when the first event is asked for and comes off when the
    run ends, the KV cache forgotten both times (engine.why.steer.steering). `set_scale` between two tokens acts from
    the next token on, and the run says so with a Steered event before that token's events."""

    def __init__(self, session: Engine, run: Run, vector: ControlVector, steer: Steer) -> None:
        super().__init__(run)
        self._session, self._vector, self._steer = session, vector, steer
        self._scale = steer.scale
        self._handle = None  # engine.why.steer.Steering, while the run iterates
        self._changed = False  # the scale changed since the last Steered event

    @property
    def scale(self) -> float:
        return self._scale

    def set_scale(self, scale: float) -> None:
        """From the next token on; call it between two tokens, from the thread that iterates the run. ValueError
        for a scale that is not a finite number within ±10000."""
        if self._handle is not None:
            self._handle.set_scale(scale)
        else:
            self._steer.at(scale)  # checks it
        if float(scale) != self._scale:
            self._scale, self._changed = float(scale), True

    def __iter__(self) -> Iterator[Event]:
        st, step = self._steer, 0
        with steering(self._session, self._vector, self._scale) as handle:
            self._handle = handle
            try:
                for ev in self._run:
                    if self._changed:
                        self._changed = False
                        yield Steered(step=step, scale=self._scale)
                    yield ev
                    if isinstance(ev, PromptTokenized):
                        self._changed = False
                        yield Steered(step=0, scale=self._scale, name=st.name, layers=st.layers,
                                      directions=st.directions)
                    elif isinstance(ev, TokenSampled):
                        step = ev.step + 1
            finally:
                self._handle = None
