"""The generation loop as a generator of events: prefill once, then decode one token per step.

One generator, two drivers: the CLI prints the events, the app drives the same generator in its engine process
(engine.server). A `Generation` can be advanced one event at a time, paused simply by not advancing it, stopped
between tokens, and its sampling settings and capture can change between tokens.

A `Session` keeps the KV cache between runs: when a new prompt starts with the tokens already cached, their keys
and values are reused and only the new tokens are prefilled (prefix caching).

`Generation._run` is the engine's one generation loop, on either runtime (engine.runtime's Runtime: the llama.cpp
backend's session hands it llama.cpp's runtime instead of the torch engine's).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

import numpy as np
import torch

from engine.costs import formulas as costs
from engine.events import (
    AttentionCaptured,
    Event,
    Failed,
    Finished,
    Funnel,
    ModelInfo,
    PrefillDone,
    PromptScored,
    PromptTokenized,
    ResidualNorms,
    RunSource,
    RunStarted,
    StepCost,
    TokenSampled,
)
from engine.loaders import LoadedModel
from engine.model.kv_cache import KVCache, ReadOnlyCache
from engine.model.threads import AdaptiveThreads
from engine.protocol import ATTENTION_MAX_BYTES, FUNNEL_TOP, Capture  # noqa: F401 — constants re-exported
from engine.run.branching import check_forced, tokenization_of
from engine.run.constrain import Constraint
from engine.run.lens import lens_event
from engine.run.sampling import FunnelStages, SamplingParams, choose, make_generator, sample
from engine.runtime.base import Row, Runtime
from engine.runtime.torch import ContiguousRuntime
from engine.tokenizer import StreamDecoder, Tokenization, Tokenizer

CACHE_GRANULE = 256  # the cache grows in steps of this many positions, so it is rarely reallocated


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def condense_funnel(
    stages: FunnelStages, params: SamplingParams, top: int, tokenizer, sampled: int | None = None
) -> Funnel:
    """Condense a full-vocabulary funnel to the top candidates by raw logit (plus the sampled token)."""
    ids = torch.topk(stages.logits, min(top, stages.logits.shape[-1])).indices
    if sampled is not None and sampled not in ids.tolist():
        ids = torch.cat([ids, torch.tensor([sampled], device=ids.device)])
    idx = ids.cpu().numpy()

    def pick(t: torch.Tensor) -> np.ndarray:
        return t[ids].cpu().numpy().astype(np.float32)

    return Funnel(
        ids=idx.astype(np.int64), pieces=tuple(tokenizer.piece(int(i)) for i in idx),
        logits=pick(stages.logits), p_raw=pick(stages.p_raw), p_temperature=pick(stages.p_temperature),
        p_top_k=pick(stages.p_top_k), p_top_p=pick(stages.p_top_p), p_final=pick(stages.p_final),
        kept_top_k=stages.kept_top_k, kept_top_p=stages.kept_top_p, kept_final=stages.kept_final,
        vocab_size=int(stages.logits.shape[-1]), greedy=params.greedy,
    )


def prompt_event(tok: Tokenization) -> PromptTokenized:
    """A tokenization as the event the panels draw."""
    return PromptTokenized(
        text=tok.text, ids=np.asarray(tok.ids, dtype=np.int64), pieces=tuple(tok.pieces),
        offsets=np.asarray(tok.offsets, dtype=np.int64).reshape(-1, 2),
        byte_offsets=np.asarray(tok.byte_offsets, dtype=np.int64).reshape(-1, 2),
        special=np.asarray(tok.special, dtype=bool),
        unrepresentable=tuple(tuple(u) for u in tok.unrepresentable),
    )


class NonFiniteLogits(ValueError):
    """A forward pass gave NaN or infinite logits; the message says where."""


def check_finite(logits: torch.Tensor, position: int, dtype_name: str) -> None:
    """NonFiniteLogits when a step's logits hold NaN or ±∞: sampling would fail obscurely, argmax pick garbage."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(
            f"the model produced NaN or infinite logits at position {position} "
            f"(damaged weights, or values beyond {dtype_name}'s range)"
        )


class Engine:
    """What a session does whatever runs its model: tokenize, check a prompt, generate, fork, condense the funnel,
    warm up. A runtime-specific session (Session: the torch engine; engine.backends.llamacpp.LlamaCppSession)
    gives the model's facts (`cfg`, `tokenizer`, `info`, `stop_ids`), its one-sequence `runtime`, and says what it
    can do beyond generating (`can`, engine.backend.CAPABILITIES) and what it cannot capture (`cannot`)."""

    runtime_name = ""
    can: frozenset[str] = frozenset()
    cannot: tuple = ()
    _rt: Runtime | None = None  # the one-sequence runtime generations run on (`runtime`), once made

    def prompt_text(self, text: str, chat: bool = False) -> str:
        return self.tokenizer.chat_prompt(text) if chat else text

    def tokenize(self, text: str, chat: bool = False) -> Tokenization:
        return self.tokenizer.encode(self.prompt_text(text, chat))

    def check_prompt(self, ids: Sequence[int], max_new_tokens: int = 1) -> None:
        if len(ids) == 0:
            raise ValueError("the prompt is empty: type something first")
        if len(ids) >= self.cfg.context_length:
            raise ValueError(
                f"the prompt is {len(ids)} tokens; this model's context holds {self.cfg.context_length}"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max new tokens must be at least 1, got {max_new_tokens}")
        outside = next((int(i) for i in ids if not 0 <= int(i) < self.cfg.vocab_size), None)
        if outside is not None:  # a tokenizer larger than the model's embedding (mismatched files), or bad ids
            raise ValueError(
                f"the prompt holds token id {outside}, outside this model's vocabulary (0…{self.cfg.vocab_size - 1}):"
                " do its tokenizer and weights match?"
            )

    def make_funnel(
        self, stages: FunnelStages, params: SamplingParams, top: int, sampled: int | None = None
    ) -> Funnel:
        return condense_funnel(stages, params, top, self.tokenizer, sampled)

    def generate(
        self, prompt: str | Tokenization | Sequence[int], params: SamplingParams | None = None,
        max_new_tokens: int = 64, capture: Capture | None = None, chat: bool = False, ignore_eos: bool = False,
        forced: Mapping[int, int] | None = None, constraint: Constraint | None = None,
    ) -> Generation:
        """Start a generation; iterate it to run. The prompt is checked now (ValueError on bad input).

        The prompt is a text, a Tokenization or token ids. `forced` maps steps to token ids that replace the
        sampled token at those steps (the funnel still shows what the model would have sampled).
        """
        if isinstance(prompt, Tokenization):
            tok = prompt
        elif isinstance(prompt, str):
            tok = self.tokenize(prompt, chat)
        else:
            tok = tokenization_of(self.tokenizer, prompt)
        self.check_prompt(tok.ids, max_new_tokens)
        force = check_forced(forced or {}, self.cfg.vocab_size, max_new_tokens)
        return Generation(self, tok, params or SamplingParams(), max_new_tokens, capture or Capture(), ignore_eos,
                          force, constraint)

    def fork(
        self, prompt_ids: Sequence[int], generated_ids: Sequence[int], step: int, token: int,
        params: SamplingParams | None = None, max_new_tokens: int = 64, capture: Capture | None = None,
        ignore_eos: bool = False,
    ) -> Generation:
        """Branch a finished (or paused) generation at `step` with `token` and continue from there.

        The new generation's prompt is prompt_ids + generated_ids[:step] and its step 0 is `token`. The KV cache
        keeps every position of that prefix it already holds, so only the last prefix token is run again.
        """
        if not 0 <= step <= len(generated_ids):
            raise ValueError(f"cannot fork at step {step}: the generation has steps 0..{len(generated_ids) - 1}")
        prefix = [int(i) for i in prompt_ids] + [int(i) for i in generated_ids[:step]]
        return self.generate(prefix, params, max_new_tokens, capture, ignore_eos=ignore_eos, forced={0: token})

    @property
    def cached_ids(self) -> list[int]:
        """The tokens whose K/V the cache holds, positions 0…len − 1 (the runtime's own record)."""
        return [] if self._rt is None else self._rt.held(0)

    def _forward(self, new_ids: Sequence[int], start: int, every: bool = False) -> torch.Tensor:
        """Logits (V,) of the last new token, or (T, V) of every one with `every`; `start` must be where the cache
        ends (one count of positions: the runtime's). After a failed step the cache is not trusted: it is forgotten."""
        rt = self._rt
        held = 0 if rt is None else rt.length(0)
        if rt is None or start != held:
            raise ValueError(f"a step at position {start}, but the cache holds {held} positions")
        try:
            logits = rt.forward([Row(0, list(new_ids), every)])[0]
            check_finite(logits[-1] if every else logits, start + len(new_ids) - 1, rt.kv_dtype)
        except Exception:
            self.forget_cache()
            raise
        return logits

    def next_token_logits(self, ids: Sequence[int]) -> tuple[torch.Tensor, int, float]:
        """Logits for the token after `ids`, reusing the cached prefix; returns (logits, tokens reused, seconds)."""
        self.check_prompt(ids)
        t0 = time.perf_counter()
        reuse = self.runtime(len(ids) + 1).reuse(0, ids)
        logits = self._forward(ids[reuse:], reuse)
        _sync(self.device)
        return logits, reuse, time.perf_counter() - t0

    def warm_up(self) -> float:
        """Pay the first-call costs (kernel choice, thread pools, buffers) once, so the first TTFT shown is honest.

        Runs a few tokens through both attention paths, then forgets the cache. Returns the seconds it took.
        """
        t0 = time.perf_counter()
        prompt = self.tokenizer.encode("Hello, world. The quick brown fox")
        for capture in (Capture(), Capture.everything(self.cfg.n_layers, funnel_top=5)):
            for _ in self.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=0), 3, capture,
                                   ignore_eos=True):
                pass
        self.forget_cache()
        return time.perf_counter() - t0


class Session(Engine):
    """A loaded model plus the KV cache it keeps between generations: a one-sequence runtime over the contiguous
    cache (engine.runtime.torch.ContiguousRuntime), whose positions are the only count of what it holds."""

    def __init__(self, lm: LoadedModel, threads: int | str = "auto") -> None:
        self.lm = lm
        self.threads = AdaptiveThreads(threads) if lm.device.type == "cpu" else None
        self.recomputed = None  # engine.run.recompute.Recomputation: the last step run again, every layer it ran
        self.cfg = lm.cfg
        self.tokenizer = lm.tokenizer
        self._rt: ContiguousRuntime | None = None
        self.dtype_name = str(lm.dtype).removeprefix("torch.")
        self._bytes_saved: dict[tuple[int, str | None], int] = {}  # (threads, forced kernel) -> decode_bytes_saved
        self.stop_ids = frozenset(self.tokenizer.eos_ids) | frozenset(self.cfg.eos_token_ids)

    @property
    def info(self) -> ModelInfo:
        """The loaded model's facts (as LlamaCppSession.info)."""
        return self.lm.info

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def source(self) -> RunSource:
        """What a generation on this session says it runs on (RunStarted)."""
        return RunSource(kind="local", name=self.lm.info.name)

    @property
    def cache(self) -> KVCache | None:
        return None if self._rt is None else self._rt.cache

    def threads_at(self, p: int) -> int | None:
        """The thread count the step that wrote position p ran at (None: the cache does not hold p)."""
        at = b"" if self._rt is None else self._rt.threads_at
        return at[p] if 0 <= p < len(at) else None

    def decode_weight_bytes(self) -> float:
        """Weights one decode step streams with the kernels in use now, in bytes: engine.costs' figure for the
        model's dtype, less what a quantized form saves where its kernel runs (engine.model.kernels)."""
        formula = costs.step_weight_bytes(self.cfg, self.dtype_name, rows=1)
        if self.lm.device.type != "cpu":
            return formula
        from engine.model import kernels

        key = (torch.get_num_threads(), kernels.forced_name())
        if key not in self._bytes_saved:  # a walk over the model's products: once per thread count
            self._bytes_saved[key] = self.lm.model.decode_bytes_saved(key[0])
        return formula - self._bytes_saved[key]

    # ---- what this runtime can do, and the seam ---------------------------------------------------------------
    runtime_name = "torch"
    can = frozenset({"gradients", "recompute", "exit_logits", "edit"})  # engine.backend.CAPABILITIES

    def run_points(self, prompts: Sequence[Sequence[int]], edits: Iterable = (), record: Iterable = (),
                   every: bool = False) -> tuple[torch.Tensor, object]:
        """The float32 logits (B, V) of each prompt's last position (with `every`, (B, T, V) of every position) and
        the seam's recorded points (B, T, W) (engine.model.seam.Recording): the B prompts, all of one length T, run
        as the rows of one step of a fresh runtime with `edits` applied.

        The products are the float ones (F.linear on the weights as loaded), whatever form a decode step would
        take: the experiments that use this are held to references that run the weights as they are."""
        from engine.model import kernels
        from engine.model.seam import check_prompts, edited

        rows = check_prompts(prompts)
        with self.new_runtime(len(rows), len(rows[0])) as rt, edited(self.lm.model, edits, record) as rec, \
                kernels.forced("linear"):
            out = rt.forward([Row(b, r, all_logits=every) for b, r in enumerate(rows)])
        return torch.stack(out), rec

    def sibling(self, path: str) -> Session:
        """A session of another model file on this runtime, with this one's device, dtype and kernel mode."""
        from engine.loaders import load

        return Session(load(path, device=self.lm.device.type, dtype=self.dtype_name, kernels=self.info.kernels))

    def new_runtime(self, n_seq: int = 1, capacity: int | None = None, page_size: int | None = None) -> Runtime:
        """A runtime of `n_seq` sequences of up to `capacity` positions over this model (the weights shared, the cache
        new); `page_size`: the cache as one pool of pages of that many positions."""
        from engine.runtime.torch import PAGE_SIZE, TorchRuntime

        return TorchRuntime(self.lm, n_seq, capacity, page_size=page_size or PAGE_SIZE)

    def intervened(self, edits: Iterable) -> contextlib.AbstractContextManager:
        """The seam's `edits` applied to every forward pass this session runs inside the `with` block (a generation
        iterated inside it continues from the intervened model)."""
        from engine.model.seam import edited

        return edited(self.lm.model, edits)

    # ---- the cache ---------------------------------------------------------------------------------------------
    def runtime(self, capacity: int) -> ContiguousRuntime:
        """The one-sequence runtime generations run on, with room for `capacity` positions (kept when it has it)."""
        capacity = min(self.cfg.context_length, -(-capacity // CACHE_GRANULE) * CACHE_GRANULE)
        if self._rt is None or not self._rt.fits(capacity):
            with torch.inference_mode():
                self._rt = ContiguousRuntime(self.lm, capacity, self.decode_weight_bytes)
        return self._rt

    def forget_cache(self) -> None:
        self._rt = None

    def close(self) -> None:
        """Let go of the cache (the model's weights are the LoadedModel's, kept by whoever holds it)."""
        self.forget_cache()

    # ---- one-off next-token preview ----------------------------------------------------------------------------
    @torch.inference_mode()
    def next_token_logits(self, ids: Sequence[int]) -> tuple[torch.Tensor, int, float]:
        self.check_prompt(ids)
        t0 = time.perf_counter()
        p, cache = len(ids) - 1, self.cache
        if not (cache is not None and cache.batch == 1 and len(self.cached_ids) > len(ids) and cache.reads_back(p)
                and self.cached_ids[:len(ids)] == [int(i) for i in ids]):
            return super().next_token_logits(ids)
        # The cache holds these tokens and more (a preview of the prompt after its run): read it and write nothing,
        # so the run's cache stays whole for recomputing its steps and for the next Generate to reuse.
        tokens = torch.tensor([[int(ids[-1])]], dtype=torch.long, device=self.lm.device)
        logits = self.lm.model(tokens, ReadOnlyCache(cache, p))[0]
        _sync(self.lm.device)
        return logits, p, time.perf_counter() - t0

class RunLoop:
    """What a local generation keeps between steps, whichever runtime computes them (this engine or llama.cpp): the
    ids so far (and as a tensor, for penalties), the random stream, the text decoded so far, each step's time, the
    time spent outside the generator (the consumer's: a pause) and outside the timed steps (prompt scores, captures,
    the lens), and why the run ends. The runtime computes a step's logits; this turns them into the step's events."""

    def __init__(self, gen: Generation, tokenizer: Tokenizer, context_length: int,
                 device: torch.device | None = None) -> None:
        self.gen, self.tok, self.device = gen, tokenizer, device
        self.ids = list(gen.prompt.ids)
        self.n_prompt = len(self.ids)
        self.context_length = context_length
        self.capacity = min(context_length, self.n_prompt + gen.max_new_tokens)
        self.context = torch.zeros(self.capacity, dtype=torch.long, device=device)  # ids so far, for penalties
        self.context[:self.n_prompt] = torch.tensor(self.ids, dtype=torch.long)
        self.generator = make_generator(gen.params.seed, device)
        self.seed_used = gen.params.seed
        self.decoder = StreamDecoder(tokenizer)
        self.out_ids: list[int] = []
        self.text_parts: list[str] = []
        self.step_times: list[float] = []
        self.ttft = 0.0
        self.suspended = 0.0
        self.outside = 0.0
        self.t_start = time.perf_counter()
        self.step = 0

    @property
    def pos(self) -> int:
        """The position of the next token to be produced: the ids so far, not a second count."""
        return len(self.ids)

    def begin_step(self) -> tuple[str, SamplingParams, Capture]:
        """(phase, sampling settings, captures) of the step about to run: the knobs as they are now."""
        params = self.gen.params
        if params.seed != self.seed_used:  # a new seed restarts the random stream from here
            self.generator, self.seed_used = make_generator(params.seed, self.device), params.seed
        return ("prefill" if self.step == 0 else "decode"), params, self.gen.capture

    def pick(self, logits: torch.Tensor, params: SamplingParams, capture: Capture,
             make_funnel) -> tuple[int, Funnel | None, bool, int | None]:
        """(token, condensed funnel, grammar complete, the forced token or None) from the step's logits (V,): sampled
        (or forced), under the grammar when there is one, with the condensed funnel when capture.funnel_top asks."""
        force, constraint, context = self.gen.forced.get(self.step), self.gen.constraint, self.context[:self.pos]
        allowed_logits, kept_grammar = logits, -1
        if constraint is not None:  # the grammar's stage comes first: −∞ for what it forbids
            allowed_logits, kept_grammar = constraint.mask_logits(logits)
        condensed = None
        if capture.funnel_top:
            token, stages = sample(allowed_logits, params, self.generator, context)
            token = token if force is None else force
            if constraint is not None:  # the funnel still starts from the model's own logits
                # a stage that is off keeps "everything", which under a grammar means what the grammar kept
                stages = replace(
                    stages, logits=logits.float(), p_raw=torch.softmax(logits.float(), dim=-1),
                    kept_top_k=min(stages.kept_top_k, kept_grammar), kept_top_p=min(stages.kept_top_p, kept_grammar),
                    kept_final=min(stages.kept_final, kept_grammar))
            condensed = make_funnel(stages, params, capture.funnel_top, token)
            if constraint is not None:
                condensed = replace(condensed, kept_grammar=kept_grammar)
        else:
            token = choose(allowed_logits, params, self.generator, context)
            token = token if force is None else force
        if constraint is not None:
            constraint.advance(token)
        return token, condensed, constraint is not None and constraint.stopped, force

    def emit(self, event: Event) -> Iterator[Event]:
        t = time.perf_counter()
        yield event
        self.suspended += time.perf_counter() - t

    def untimed(self, events: Iterator[Event]) -> Iterator[Event]:
        """Emit events whose making is work outside the timed step (prompt scores, captures, the lens)."""
        t, before = time.perf_counter(), self.suspended
        for event in events:
            yield from self.emit(event)
        self.outside += time.perf_counter() - t - (self.suspended - before)

    def end_step(self, *, phase: str, token: int, seconds: float, cost: StepCost, n_fed: int, reuse: int,
                 funnel: Funnel | None, logits: np.ndarray | None, params: SamplingParams, forced: bool,
                 grammar_done: bool) -> Iterator[Event]:
        """The step's PrefillDone (the first) and TokenSampled; returns why the run ends now, or None."""
        gen, step, pos = self.gen, self.step, self.pos
        if step == 0:
            self.ttft = seconds
            yield from self.emit(PrefillDone(n_tokens=n_fed, n_reused=reuse, seconds=seconds, cost=cost))
        else:
            self.step_times.append(seconds)
        is_stop = token in gen.session.stop_ids and (not gen.ignore_eos or grammar_done)
        delta = "" if is_stop else self.decoder.push(token)
        self.text_parts.append(delta)
        self.out_ids.append(token)
        yield from self.emit(TokenSampled(
            step=step, phase=phase, position=pos, token_id=token, piece=self.tok.piece(token), text=delta,
            seconds=seconds, cost=cost, funnel=funnel, logits=logits, params=params, forced=forced,
        ))
        self.ids.append(token)
        if pos < self.capacity:
            self.context[pos] = token
        self.step += 1
        if is_stop or grammar_done:
            return "eos"
        if len(self.out_ids) >= gen.max_new_tokens:
            return "length"
        if self.pos >= self.context_length:
            return "context"
        if gen._stop:
            return "stopped"
        return None

    def failed(self, session: Engine, error: Exception) -> Failed:
        """The run broke: its cache is no longer trusted, and the consumer gets one sentence."""
        session.forget_cache()
        if isinstance(error, NonFiniteLogits):
            return Failed(message=str(error))
        return Failed(message=f"generation failed: {type(error).__name__}: {error}")

    def finished(self, reason: str) -> Finished:
        self.text_parts.append(self.decoder.flush())
        return Finished(
            reason=reason, prompt_ids=np.asarray(self.ids[:self.n_prompt], dtype=np.int64),
            ids=np.asarray(self.out_ids, dtype=np.int64), text="".join(self.text_parts), ttft_s=self.ttft,
            tpot_s=float(np.mean(self.step_times)) if self.step_times else 0.0,
            step_seconds=np.asarray(self.step_times),
            total_s=time.perf_counter() - self.t_start - self.suspended, outside_steps_s=self.outside,
        )


class Generation:
    """One running generation: an iterator of events with knobs that may change between tokens."""

    def __init__(
        self, session: Session, prompt: Tokenization, params: SamplingParams, max_new_tokens: int,
        capture: Capture, ignore_eos: bool, forced: Mapping[int, int] | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        self.session, self.prompt = session, prompt
        self.params, self.capture = params, capture
        self.max_new_tokens, self.ignore_eos = max_new_tokens, ignore_eos
        self.forced: dict[int, int] = dict(forced or {})  # step → token id that replaces the sampled one
        self.constraint = constraint  # a regex / JSON schema the output must match (engine.run.constrain)
        self._stop = False
        self._events = self._run()

    def stop(self) -> None:
        """Ask the loop to end before the next token (thread-safe: a plain flag read between steps)."""
        self._stop = True

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        return next(self._events)

    @torch.inference_mode()
    def _run(self) -> Iterator[Event]:
        """The one generation loop, on the session's one-sequence runtime (engine.runtime: the torch engine's or
        llama.cpp's): each step forwards the ids past what the cache holds, at the position where it ends."""
        s = self.session
        yield RunStarted(source=s.source())
        yield prompt_event(self.prompt)
        loop = RunLoop(self, s.tokenizer, s.cfg.context_length, s.device)
        ids = loop.ids
        try:
            rt = s.runtime(loop.capacity + 1)
            if self.capture.prompt_scores:  # scoring needs every prompt position's logits: run them all
                rt.remove(0)
            reuse = rt.reuse(0, ids)
            while True:
                phase, params, capture = loop.begin_step()
                step = loop.step
                if s.threads is not None:
                    s.threads.begin_step()
                t0 = time.perf_counter()
                start = rt.length(0)  # the one count of positions: the cache's
                capture = capture.at(start, s.cfg.n_layers)
                feed = ids[start:]
                every = step == 0 and capture.prompt_scores
                cost = rt.step_cost(len(feed), start, all_logits=every)
                out = rt.forward([Row(0, feed, every, capture if self._captures(capture) else None)])[0]
                logits = out[-1] if every else out
                check_finite(logits, start + len(feed) - 1, rt.kv_dtype)
                token, condensed, grammar_done, force = loop.pick(logits, params, capture, s.make_funnel)
                raw = logits.cpu().numpy() if capture.logits else None
                _sync(rt.device)
                seconds = time.perf_counter() - t0
                yield from loop.untimed(self._after(rt, capture, step, phase, start, feed, out if every else None,
                                                    ids[:loop.n_prompt], logits, token))
                yield from loop.emit(rt.kv_event(step))
                if step > 0 and s.threads is not None:
                    s.threads.end_step(seconds, cost.bytes)
                reason = yield from loop.end_step(
                    phase=phase, token=token, seconds=seconds, cost=cost, n_fed=len(feed), reuse=reuse,
                    funnel=condensed, logits=raw, params=params, forced=force is not None, grammar_done=grammar_done)
                if reason is not None:
                    yield loop.finished(reason)
                    return
        except Exception as e:  # noqa: BLE001 — the consumer gets one clear message instead of a dead thread
            yield loop.failed(s, e)

    @staticmethod
    def _captures(capture: Capture) -> bool:
        """Whether a step must record anything in its forward pass (attention, norms, the lens's stream)."""
        return bool(capture.attention_layers) or capture.residual_norms or capture.lens_top > 0

    def _after(self, rt: Runtime, capture: Capture, step: int, phase: str, start: int, feed: list[int],
               every: torch.Tensor | None, prompt: list[int], logits: torch.Tensor, token: int) -> Iterator[Event]:
        """The step's events besides its token: prompt scores, attention and norms, the logit lens."""
        if every is not None:
            yield score_prompt(every, prompt, start)
        if not self._captures(capture):
            return
        got = rt.captured(0)
        for layer, (w, skipped) in sorted(got.attention.items()):
            yield AttentionCaptured(step=step, phase=phase, layer=layer, query_start=start + skipped, weights=w,
                                    group_size=rt.cfg.group_size, rows_skipped=skipped)  # (H, n, S)
        if capture.residual_norms and got.norms is not None:
            yield ResidualNorms(step=step, norms=got.norms)
        if got.stream is not None and capture.lens_top:
            yield lens_event(rt.lens_head(), rt.tokenizer, step, start + len(feed) - 1, got.stream, logits,
                             capture.lens_top, token)


def score_prompt(every: torch.Tensor, prompt: Sequence[int], start: int) -> PromptScored:
    """every (T, V): the prefill's logits at positions start … start + T − 1, each predicting the next token."""
    first = start + 1
    target = torch.tensor(list(prompt[first:]), dtype=torch.long, device=every.device)  # (n,)
    logp = torch.log_softmax(every[:-1].float(), dim=-1)  # (n, V): position i predicts token i + 1
    lp = logp.gather(-1, target[:, None])[:, 0] if len(target) else torch.zeros(0)
    p = logp.exp()
    entropy = -(p * logp).nan_to_num().sum(-1) / math.log(2.0)
    return PromptScored(
        first=first, ids=target.cpu().numpy(), probs=lp.exp().cpu().numpy().astype(np.float32),
        surprise_bits=(-lp / math.log(2.0)).cpu().numpy().astype(np.float32),
        entropy_bits=entropy.cpu().numpy().astype(np.float32), top_ids=logp.argmax(-1).cpu().numpy(),
    )
