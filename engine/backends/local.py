"""The local model as a backend (engine.backend): a Session, its KV cache kept between runs, and the labs that run
on the model itself (batched decode, speculative decoding, scheduling)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.backend import Backend, Run, ShouldStop, Unsupported
from engine.costs.memory import LAB_MEMORY_SHARE
from engine.events import Failed, ModelInfo, PromptTokenized, RunSource
from engine.protocol import (
    BatchBench,
    BatchMeasured,
    GenerateRequest,
    Lab,
    PreviewResult,
    Progress,
    SamplingParams,
    Schedule,
    ServeBench,
    Speculate,
)
from engine.run.sampling import funnel
from engine.run.session import Session, prompt_event


class LocalBackend(Backend):
    """A model on this machine: the torch engine's Session, or a runtime with its interface (engine.backends)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @property
    def info(self) -> ModelInfo:
        return self.session.info

    @property
    def source(self) -> RunSource:
        return RunSource(kind="local", name=self.info.name, cannot=self.session.cannot)

    def generate(self, req: GenerateRequest) -> Run:
        if req.ablation is not None:  # the hooks that keep it on wrap the run: engine.why.ablated
            raise ValueError("an ablated generation starts with engine.why.ablated.generate_ablated")
        s = self.session
        constraint = None
        if req.regex is not None or req.json_schema is not None:
            from engine.run.constrain import Constraint

            eos = [*s.tokenizer.eos_ids, *sorted(set(s.stop_ids) - set(s.tokenizer.eos_ids))]
            constraint = Constraint.build(s.tokenizer, s.cfg.vocab_size, eos, regex=req.regex,
                                          json_schema=req.json_schema)
        prompt = list(req.prompt_ids) if req.prompt_ids else req.text
        return s.generate(prompt, req.params, req.max_new_tokens, req.capture, chat=req.chat,
                          ignore_eos=req.ignore_eos, forced=dict(req.forced), constraint=constraint)

    def preview(self, request_id: int, text: str, chat: bool, top: int, params: SamplingParams) -> PreviewResult | None:
        s = self.session
        t0 = time.perf_counter()
        tok = s.tokenize(text, chat)
        if not tok.ids or len(tok.ids) >= s.cfg.context_length:
            return None
        logits, reused, _ = s.next_token_logits(tok.ids)
        # The prompt is the context of the first token: penalties apply to it exactly as in Generate's step 0.
        context = torch.tensor(tok.ids, dtype=torch.long)
        f = s.make_funnel(funnel(logits, params, context), params, top)
        return PreviewResult(request_id, text, len(tok.ids), reused, len(tok.ids) - reused, time.perf_counter() - t0,
                             f)

    def tokenize(self, text: str, chat: bool = False) -> PromptTokenized:
        return prompt_event(self.session.tokenize(text, chat))

    def set_threads(self, controller: object) -> None:
        if self.session.threads is not None:  # None on a GPU: torch's own threads only feed it
            self.session.threads = controller

    def run_lab(self, request: Lab, send: Callable[[object], None], should_stop: ShouldStop) -> None:
        """The batching, speculative-decoding and scheduling labs on this model (the torch engine's or a runtime's:
        engine.runtime picks the one the session runs on); the load lab measures a server, not this model."""
        import psutil

        memory_limit = psutil.virtual_memory().available * LAB_MEMORY_SHARE
        if isinstance(request, BatchBench):
            from engine.labs.batching import bench_batch

            bench_batch(self.session, request.batches, request.prompt_tokens, request.new_tokens,
                        progress=lambda f, m: send(Progress("batch", f, m)), should_stop=should_stop,
                        memory_limit_bytes=memory_limit, on_row=lambda row: send(BatchMeasured(row)))
        elif isinstance(request, Speculate):
            from engine.labs.speculative import SpecConfig, speculate, sweep

            s = self.session
            cfg = SpecConfig(k=request.k, source=request.source, exit_layer=request.exit_layer)
            run = sweep if request.sweep else speculate
            for ev in run(s, s.prompt_text(request.text, request.chat), cfg, request.params, request.max_new_tokens,
                          should_stop=should_stop):
                if isinstance(ev, Failed):  # the lab's own sentence: its outcome, not a generation's failure
                    raise ValueError(ev.message)
                send(ev)
        elif isinstance(request, Schedule):
            from engine.labs.scheduler import schedule

            for ev in schedule(self.session, request.config, should_stop, memory_limit_bytes=memory_limit):
                send(ev)
        elif isinstance(request, ServeBench):
            raise Unsupported("the load lab measures a server: connect to one first (File → Connect to server…)")
        else:
            super().run_lab(request, send, should_stop)

    def why_session(self) -> object:
        return self.session
