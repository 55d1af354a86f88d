"""A generation from an ablated model: engine.why.ablate's ablation kept on for every forward pass of a local run
(the Why panel's "Continue as a branch").

The engine process (engine.server) starts it; it is not a LocalBackend method because engine.why.ablate reaches the
runtimes through the CLI's argument helpers, and the local backend must not import what imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.backend import Backend, Run, Unsupported, WrappedRun
from engine.events import Event
from engine.protocol import GenerateRequest
from engine.why.ablate import Ablation, ablation

if TYPE_CHECKING:
    from engine.run.session import Engine


def edited_session(backend: Backend, refusal: str) -> Engine:
    """The backend's local session, whose forward pass a kept edit (an ablation, a steering vector) runs in;
    Unsupported with `refusal` where there is none (a server: nothing of its forward pass is ours to edit)."""
    try:
        return backend.why_session()
    except Unsupported:
        raise Unsupported(refusal) from None


def generate_ablated(backend: Backend, req: GenerateRequest) -> Run:
    """Start `req` with req.ablation on in every forward pass; Unsupported (one sentence) where the forward pass is not
    ours to edit (a server), ValueError (one sentence) for a part not in the model."""
    a = req.ablation
    if a is None:
        raise ValueError("this request names nothing to ablate")
    s = edited_session(backend, "generating from an ablated model edits the model's forward pass, which a server "
                                "does not expose: disconnect from the server to continue as a branch")
    spec = Ablation(a.heads, a.attn_layers, a.mlp_layers, a.mean)
    prompt_ids = list(req.prompt_ids) if req.prompt_ids else s.tokenize(req.text, req.chat).ids
    spec.check(s.cfg, len(prompt_ids))
    return AblatedRun(s, backend.generate(replace(req, ablation=None)), spec, prompt_ids)


class AblatedRun(WrappedRun):
    """A local run with an ablation on: the hooks go on when the first event is asked for and come off when the run
    ends, and the KV cache is forgotten both times, so no key or value of the intact model serves the ablated one
    or the other way round."""

    def __init__(self, session: Engine, run: Run, spec: Ablation, prompt_ids: list[int]) -> None:
        super().__init__(run)
        self._session, self._spec, self._prompt_ids = session, spec, prompt_ids

    def __iter__(self) -> Iterator[Event]:
        with ablation(self._session, self._spec, self._prompt_ids):
            yield from self._run
