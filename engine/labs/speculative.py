"""Speculative decoding as a lab: draft k tokens cheaply, check them with one forward pass of the full model.

Single-stream decode is memory-bound: a step reads every weight once to produce one token, and the arithmetic
units wait. A pass over k + 1 positions reads the same weights once and does k + 1 times the arithmetic, which a
memory-bound step has to spare, so it costs about one decode step. Given k guessed tokens d₁…d_k, one pass over
[last token, d₁, …, d_k] yields the model's own distribution at each of those k + 1 positions; the longest prefix of
guesses the model agrees with is kept, plus one token of the model's own from the first position where it disagreed
(or after the last guess): between 1 and k + 1 tokens per full pass. The KV cache positions of rejected guesses
are given back (engine.runtime's Runtime.remove); the next pass writes over them. The loop runs on any runtime
(the torch engine or llama.cpp); early-exit drafting needs the model's own layers, so only the torch engine's.

Greedy: a guess is accepted when it is the model's argmax, so the output is plain greedy decoding, token for token.
Sampling: a guess d drawn with draft probability q(d) is accepted with probability min(1, p(d) / q(d)); on rejection
the token is drawn from max(0, p − q) renormalised (Leviathan et al., Chen et al., 2023). Every token is then
distributed exactly as p, the model's own sampling distribution (temperature, top-k, top-p, min-p, penalties).
A deterministic draft (prompt lookup, early-exit argmax) has a one-hot q: accept with probability p(d), else draw
from p with d removed.

Draft sources:
  lookup       the tokens that followed the latest earlier occurrence of the context's last n-gram (n = ngram_max
               down to 1): no model at all, and good on text that repeats itself (code, lists, edits of a prompt);
  early-exit   the same model stopped after layer J: its residual through the final norm and the LM head (the logit
               lens, engine.run.lens) gives the argmax guess. A guess costs J / L of a pass. Layers < J write the
               guesses' keys and values; the verify pass recomputes all layers for the k + 1 positions, so it
               overwrites those and fills layers ≥ J;
  draft-model  a smaller model with the same vocabulary, with its own KV cache, rolled back like the main one.

`speculate` is a generator of frozen events, like Session.generate: SpecStarted → SpecPrefilled → SpecStep per full
pass → SpecBaseline (plain decoding of the same prompt, for the speedup) → SpecFinished, or Failed.
`sweep` runs k = 1…8 and yields SweepStarted → SpecBaseline → SweepPoint per k.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engine.backend import require
from engine.events import Failed, Finished
from engine.labs.spec_events import (  # noqa: F401 — the events are part of this module's interface
    Divergence,
    SpecBaseline,
    SpecEvent,
    SpecFinished,
    SpecPrefilled,
    SpecStarted,
    SpecStep,
    SweepPoint,
    SweepStarted,
)
from engine.run.sampling import SamplingParams, apply_penalties, choose, draw, funnel, make_generator
from engine.run.session import Session, check_finite
from engine.runtime import Row, Runtime, runtime_of
from engine.tokenizer import StreamDecoder

SOURCES = ("lookup", "early-exit", "draft-model")
MAX_K = 16
SWEEP_KS = tuple(range(1, 9))


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How to draft: k guesses per full pass, from `source`."""

    k: int = 4
    source: str = "lookup"
    exit_layer: int = 0  # early-exit: layers run for a guess, 1…n_layers (0: half the model)
    ngram_max: int = 3  # lookup: the longest context suffix matched
    # draft-model: the smaller model's session (a llama.cpp session drafts on llama.cpp)
    draft: object | None = field(default=None, compare=False)
    baseline: bool = True  # also decode the prompt plainly, to measure the speedup
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"k (tokens drafted per pass) must be between 1 and {MAX_K}, got {self.k}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown draft source {self.source!r} (choose {', '.join(SOURCES)})")
        if self.exit_layer < 0:
            raise ValueError(f"the early-exit layer must be positive, got {self.exit_layer}")
        if self.ngram_max < 1:
            raise ValueError(f"the lookup n-gram must be at least 1 token, got {self.ngram_max}")
        if self.source == "draft-model" and self.draft is None:
            raise ValueError("the draft-model source needs a draft model loaded beside the main one")


def parse_source(text: str) -> tuple[str, int]:
    """'lookup', 'early-exit', 'early-exit:J' or 'draft-model' → (source, exit layer; 0 = default)."""
    name, sep, layer = text.partition(":")
    if name not in SOURCES or (sep and name != "early-exit"):
        raise ValueError(f"unknown draft source {text!r} (choose lookup, early-exit[:J] or draft-model)")
    if not sep:
        return name, 0
    try:
        j = int(layer)
    except ValueError:
        raise ValueError(f"early-exit:J takes a layer number, got {layer!r}") from None
    if j < 1:
        raise ValueError(f"the early-exit layer must be at least 1, got {j}")
    return name, j


# ---- drafts ------------------------------------------------------------------------------------------------------
def lookup_draft(ids: Sequence[int], k: int, ngram_max: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    arr = np.asarray(ids, dtype=np.int64)
    for n in range(min(ngram_max, len(arr) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # (len - n, n): starts before the suffix
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            s = int(hits[-1]) + n
            return arr[s:s + k].tolist()
    return []


class _Drafter:
    """Guesses up to k tokens after `ids` (its last token is pending: not yet in the main cache)."""

    def prefill(self, ids: Sequence[int]) -> None:
        pass

    def draft(self, ids: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """The guesses and, for a sampled draft, their distributions q (n, V) (None: one-hot on the guesses)."""
        raise NotImplementedError

    def keep(self, n_valid: int) -> None:
        """The first n_valid tokens of the context are final; forget anything drafted after them."""


class _Lookup(_Drafter):
    def __init__(self, ngram_max: int) -> None:
        self.ngram_max = ngram_max

    def draft(self, ids: list[int], k: int) -> tuple[list[int], None]:
        return lookup_draft(ids, k, self.ngram_max), None


class _EarlyExit(_Drafter):
    """The main runtime's first `layers` layers guess (TorchRuntime.exit_logits); their keys and values are given
    back before the verify pass, which recomputes every layer at those positions."""

    def __init__(self, rt: Runtime, layers: int) -> None:
        self.rt, self.layers = rt, layers

    def draft(self, ids: list[int], k: int) -> tuple[list[int], None]:
        pos, token, out = self.rt.length(0), ids[-1], []
        for _ in range(k):
            token = int(torch.argmax(self.rt.exit_logits(0, token, self.layers)))
            out.append(token)
        self.rt.remove(0, pos)
        return out, None


class _DraftModel(_Drafter):
    """Another model of the same vocabulary on its own runtime, its cache rolled back like the main one's."""

    def __init__(self, rt: Runtime, params: SamplingParams, generator: torch.Generator) -> None:
        self.rt, self.params, self.generator = rt, params, generator

    def prefill(self, ids: Sequence[int]) -> None:
        self.rt.forward([Row(0, list(ids))])

    def draft(self, ids: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        out, qs = [], []
        feed = ids[self.rt.length(0):]  # at least the pending token
        for _ in range(k):
            logits = self.rt.forward([Row(0, feed)])[0].to(self.generator.device)  # (V,)
            context = _context(ids + out, self.params, logits.device)
            if self.params.greedy:
                token = choose(logits, self.params, None, context)
            else:
                q = funnel(logits, self.params, context).p_final  # (V,)
                token = draw(q, self.generator)
                qs.append(q)
            out.append(token)
            feed = [token]
        return out, (torch.stack(qs) if qs else None)

    def keep(self, n_valid: int) -> None:
        self.rt.remove(0, n_valid)


def _context(ids: Sequence[int], params: SamplingParams, device: torch.device) -> torch.Tensor | None:
    """The ids a repetition penalty looks at (None when there is none: building the tensor costs a copy)."""
    if params.repetition_penalty == 1.0:
        return None
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def check_draft_model(main, draft) -> None:
    """Raise ValueError unless the draft model shares the main model's vocabulary (size and the tokens' bytes)."""
    if draft.cfg.vocab_size != main.cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft.cfg.vocab_size:,} tokens, the model's "
                         f"{main.cfg.vocab_size:,}: a draft model must share the vocabulary")
    probe = range(0, main.cfg.vocab_size, max(1, main.cfg.vocab_size // 97))
    if any(main.tokenizer.token_bytes(i) != draft.tokenizer.token_bytes(i) for i in probe):
        raise ValueError("the draft model's tokenizer maps ids to other tokens than the model's")


# ---- the loop ------------------------------------------------------------------------------------------------------
def _accept(
    logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, ids: list[int], params: SamplingParams,
    generator: torch.Generator,
) -> tuple[int, int, list[float], list[float]]:
    """Judge the guesses against the verify pass's logits (n + 1, V); → (n accepted, the model's token, accept
    probabilities and model probabilities of the judged guesses)."""
    chances, probs = [], []
    for i in range(len(drafts) + 1):
        context = _context(ids + drafts[:i], params, logits.device)
        if params.greedy:
            x = logits[i] if context is None and not params.logit_bias else apply_penalties(
                logits[i], context, params.repetition_penalty, params.logit_bias)
            best = int(torch.argmax(x))
            if i == len(drafts) or drafts[i] != best:
                if i < len(drafts):
                    chances.append(0.0)
                    probs.append(float(torch.softmax(x, -1)[drafts[i]]))
                return i, best, chances, probs
            chances.append(1.0)
            probs.append(float(torch.softmax(x, -1)[best]))
            continue
        p = funnel(logits[i], params, context).p_final  # (V,): exactly what plain sampling would draw from
        if i == len(drafts):
            return i, draw(p, generator), chances, probs
        d = drafts[i]
        qd = 1.0 if q is None else float(q[i, d])
        chance = min(1.0, float(p[d]) / qd) if qd > 0 else 1.0
        chances.append(chance)
        probs.append(float(p[d]))
        if float(torch.rand((), generator=generator, device=generator.device)) < chance:
            continue
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - q[i], min=0.0)
        if float(residual.sum()) <= 0.0:  # p ≤ q everywhere means p == q: the guess was accepted surely above
            residual = p
        return i, draw(residual, generator), chances, probs
    raise AssertionError("unreachable")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt_ids(s: Session, prompt: str | Sequence[int], max_new_tokens: int) -> list[int]:
    ids = s.tokenize(prompt).ids if isinstance(prompt, str) else [int(i) for i in prompt]
    s.check_prompt(ids, max_new_tokens)
    if len(ids) + 1 >= s.cfg.context_length:
        raise ValueError(f"the prompt is {len(ids)} tokens; this model's context holds {s.cfg.context_length}, "
                         "which leaves no room to generate")
    return list(ids)


def describe_source(cfg: SpecConfig, n_layers: int) -> str:
    if cfg.source == "lookup":
        return f"prompt lookup (n-grams of up to {cfg.ngram_max} tokens)"
    if cfg.source == "early-exit":
        return f"early exit after layer {_exit_layer(cfg, n_layers)} of {n_layers}"
    return f"draft model {cfg.draft.info.name}"


def _exit_layer(cfg: SpecConfig, n_layers: int) -> int:
    return cfg.exit_layer or max(1, n_layers // 2)


def speculate(
    session: Session, prompt: str | Sequence[int], cfg: SpecConfig | None = None,
    params: SamplingParams | None = None, max_new_tokens: int = 64, should_stop: Callable[[], bool] | None = None,
) -> Iterator[SpecEvent]:
    """Start a speculative generation; iterate it to run. Bad settings raise ValueError now, with the reason.

    The prompt is a text or token ids. `should_stop` is polled between passes. With cfg.baseline the same prompt is
    then decoded plainly (Session.generate) to measure the speedup; greedy runs also report whether the tokens agree.
    """
    s = session
    cfg = cfg or SpecConfig()
    params = params or SamplingParams.greedy_params()
    ids = _prompt_ids(s, prompt, max_new_tokens)
    if cfg.source == "early-exit" and not 1 <= _exit_layer(cfg, s.cfg.n_layers) <= s.cfg.n_layers:
        raise ValueError(f"the early-exit layer must be between 1 and {s.cfg.n_layers}, got {cfg.exit_layer}")
    if cfg.source == "draft-model":
        check_draft_model(s, cfg.draft)
    if cfg.source == "early-exit":
        require(s, "exit_logits", "early-exit drafting",
                "draft by lookup or with a draft model, or load the model with --backend torch")
    return _run(s, ids, cfg, params, max_new_tokens, should_stop or (lambda: False))


def _run(
    s: Session, ids: list[int], cfg: SpecConfig, params: SamplingParams, max_new_tokens: int,
    should_stop: Callable[[], bool],
) -> Iterator[SpecEvent]:
    """The runtimes are made when the run starts (a sweep builds its runs ahead) and freed when it ends."""
    capacity = min(s.cfg.context_length, len(ids) + max_new_tokens)
    rt = runtime_of(s, 1, capacity)
    draft_rt = runtime_of(cfg.draft, 1, capacity) if cfg.source == "draft-model" else None
    try:
        yield from _passes(s, rt, draft_rt, ids, cfg, params, max_new_tokens, should_stop)
    finally:
        rt.close()
        if draft_rt is not None:
            draft_rt.close()


@torch.inference_mode()
def _passes(
    s: Session, rt: Runtime, draft_rt: Runtime | None, ids: list[int], cfg: SpecConfig, params: SamplingParams,
    max_new_tokens: int, should_stop: Callable[[], bool],
) -> Iterator[SpecEvent]:
    """One loop for every runtime: the prefill, then draft → verify k + 1 positions in one forward → accept → give
    the rejected positions back (Runtime.remove), until the tokens are all there."""
    mcfg, tok, device, dtype = s.cfg, s.tokenizer, rt.device, rt.dtype_name
    n_prompt, k, label = len(ids), cfg.k, describe_source(cfg, mcfg.n_layers)
    prompt_ids = np.asarray(ids, dtype=np.int64)
    yield SpecStarted(prompt_ids=prompt_ids, k=k, source=cfg.source, source_label=label, greedy=params.greedy,
                      max_new_tokens=max_new_tokens, model=rt.info.name, dtype=dtype)
    generator = make_generator(params.seed, device)
    try:
        if cfg.source == "lookup":
            drafter: _Drafter = _Lookup(cfg.ngram_max)
        elif cfg.source == "early-exit":
            drafter = _EarlyExit(rt, _exit_layer(cfg, mcfg.n_layers))
        else:
            drafter = _DraftModel(draft_rt, params, generator)
        t0 = time.perf_counter()
        logits = rt.forward([Row(0, ids)])[0]  # (V,)
        check_finite(logits, n_prompt - 1, dtype)
        token = choose(logits, params, generator, _context(ids, params, device))
        drafter.prefill(ids)
        _sync(device)
        ttft = time.perf_counter() - t0
        decoder = StreamDecoder(tok)
        text = [] if token in s.stop_ids and not cfg.ignore_eos else [decoder.push(token)]
        yield SpecPrefilled(n_tokens=n_prompt, seconds=ttft, cost=rt.step_cost(n_prompt, 0), token_id=token,
                            piece=tok.piece(token))
        ids.append(token)
        out = [token]
        drafted_at, accepted_at = np.zeros(k, np.int64), np.zeros(k, np.int64)
        times = {"decode": 0.0, "draft": 0.0, "verify": 0.0}
        n_passes = 0
        reason = "eos" if token in s.stop_ids and not cfg.ignore_eos else ""
        while not reason:
            if len(out) >= max_new_tokens:
                reason = "length"
            elif len(ids) >= mcfg.context_length:
                reason = "context"
            elif should_stop():
                reason = "stopped"
            if reason:
                break
            pos = rt.length(0)  # the pending token's position: the cache holds 0…pos−1
            room = min(k, max_new_tokens - len(out) - 1, mcfg.context_length - 2 - pos)
            if s.threads is not None:
                s.threads.begin_step()
            t0 = time.perf_counter()
            drafts, q = drafter.draft(ids, room) if room > 0 else ([], None)
            _sync(device)
            t1 = time.perf_counter()
            every = rt.forward([Row(0, [ids[-1], *drafts], all_logits=True)])[0]  # (n + 1, V)
            check_finite(every, pos, dtype)
            _sync(device)
            t2 = time.perf_counter()
            n, token, chances, probs = _accept(every, drafts, q, ids, params, generator)
            rt.remove(0, pos + 1 + n)  # the pending token and the accepted guesses stay; the rest is rolled back
            drafter.keep(pos + 1 + n)
            emitted = [*drafts[:n], token]
            stop = next((i for i, t in enumerate(emitted) if t in s.stop_ids), None)
            if stop is not None and not cfg.ignore_eos:
                emitted, reason = emitted[:stop + 1], "eos"
            _sync(device)
            seconds = time.perf_counter() - t0
            verify_cost = rt.step_cost(len(drafts) + 1, pos, all_logits=True)
            if s.threads is not None:
                s.threads.end_step(seconds, verify_cost.bytes)
            n_passes += 1
            times["decode"] += seconds
            times["draft"] += t1 - t0
            times["verify"] += t2 - t1
            drafted_at[:len(drafts)] += 1
            accepted_at[:n] += 1
            delta = "".join(decoder.push(t) for t in emitted if t not in s.stop_ids or cfg.ignore_eos)
            text.append(delta)
            ids.extend(emitted)
            out.extend(emitted)
            judged = np.full(len(drafts), np.nan, np.float32)
            judged[:len(probs)] = probs
            yield SpecStep(
                step=n_passes, position=pos, drafted=np.asarray(drafts, np.int64),
                drafted_pieces=tuple(tok.piece(d) for d in drafts), n_accepted=n,
                accept_probs=np.asarray(chances, np.float32), p_model=judged, token_id=token, piece=tok.piece(token),
                emitted=np.asarray(emitted, np.int64), text=delta, draft_s=t1 - t0, verify_s=t2 - t1,
                seconds=seconds, verify_cost=verify_cost,
                decode_cost=rt.step_cost(1, pos),
            )
        text.append(decoder.flush())
    except Exception as e:  # noqa: BLE001 — the consumer gets one clear message instead of a dead thread
        message = str(e) if isinstance(e, ValueError) else f"speculative decoding failed: {type(e).__name__}: {e}"
        yield Failed(message=message)
        return
    baseline, matches, differs = 0.0, None, None
    if cfg.baseline and reason != "stopped":
        fin = None
        for ev in plain_decode(s, prompt_ids.tolist(), params, max_new_tokens, cfg.ignore_eos, should_stop):
            if isinstance(ev, Failed):
                yield ev
                return
            fin = ev
        if fin is not None:
            yield fin
            baseline = fin.tokens_per_s
            matches, differs = _against(s, prompt_ids.tolist(), out, fin, params.greedy, dtype)
    yield SpecFinished(
        reason=reason, source=cfg.source, source_label=label, k=k, prompt_ids=prompt_ids,
        ids=np.asarray(out, np.int64), text="".join(text), ttft_s=ttft, n_passes=n_passes,
        decode_s=times["decode"], draft_s=times["draft"], verify_s=times["verify"],
        drafted_by_position=drafted_at, accepted_by_position=accepted_at, baseline_tokens_per_s=baseline,
        matches_baseline=matches, differs=differs,
    )


def _against(s: Session, prompt: list[int], ids: list[int], base: SpecBaseline | None, greedy: bool,
             dtype: str) -> tuple[bool | None, Divergence | None]:
    """Whether greedy speculative `ids` are plain greedy decoding's, and where they part (None, None: not comparable:
    sampled, or no finished baseline)."""
    if not greedy or base is None or base.reason == "stopped":
        return None, None
    differs = divergence(s, prompt, ids, base.ids.tolist(), dtype)
    return differs is None, differs


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where two runs' ids differ (one ending early differs there); None: the same ids."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def divergence(
    s: Session, prompt: list[int], spec: Sequence[int], plain: Sequence[int], dtype: str,
) -> Divergence | None:
    """Where greedy speculative output `spec` first parts from plain greedy decoding's `plain` (None: nowhere), with
    plain decoding's top-1 − top-2 logit margin at that step, computed as plain decoding computed it: a prefill for
    the first token, a one-position step on the cached prefix for a later one."""
    spec, plain = [int(t) for t in spec], [int(t) for t in plain]
    i = first_difference(spec, plain)
    if i is None:
        return None
    margin = math.nan
    if i < len(plain):
        prefix = [*prompt, *plain[:i]]
        if i == 0:
            s.forget_cache()  # the prefill's token: the whole prompt in one pass, as plain decoding ran it
        else:
            s.next_token_logits(prefix[:-1])  # the cache then holds all but the newest position
        top = torch.topk(s.next_token_logits(prefix)[0].float(), 2).values
        margin = float(top[0] - top[1])
    tok = s.tokenizer

    def side(ids: list[int]) -> tuple[int, str]:
        return (ids[i], tok.piece(ids[i])) if i < len(ids) else (-1, "(end)")

    (st, sp), (pt, pp) = side(spec), side(plain)
    return Divergence(index=i, position=len(prompt) + i, spec_token=st, spec_piece=sp, plain_token=pt,
                      plain_piece=pp, margin=margin, dtype=dtype)


def plain_decode(
    s: Session, ids: list[int], params: SamplingParams, max_new_tokens: int, ignore_eos: bool,
    should_stop: Callable[[], bool],
) -> Iterator[SpecBaseline | Failed]:
    """Decode the prompt one token per pass (Session.generate, the independent path); yields one SpecBaseline."""
    gen = s.generate(ids, params, max_new_tokens, ignore_eos=ignore_eos)
    for ev in gen:
        if should_stop():
            gen.stop()
        if isinstance(ev, Failed):
            yield ev
        elif isinstance(ev, Finished):
            yield SpecBaseline(ids=ev.ids, tokens_per_s=ev.tokens_per_s, tpot_s=ev.tpot_s, reason=ev.reason)


def sweep(
    session: Session, prompt: str | Sequence[int], cfg: SpecConfig | None = None,
    params: SamplingParams | None = None, max_new_tokens: int = 64, ks: Sequence[int] = SWEEP_KS,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[SpecEvent]:
    """Speculate with each k in `ks` against one plain-decoding baseline; yields SweepStarted, SpecBaseline, then
    one SweepPoint per k (or Failed). Settings are checked now (ValueError)."""
    s = session
    cfg = cfg or SpecConfig()
    params = params or SamplingParams.greedy_params()
    stop = should_stop or (lambda: False)
    runs = [speculate(s, prompt, replace(cfg, k=k, baseline=False), params, max_new_tokens, stop) for k in ks]
    ids = _prompt_ids(s, prompt, max_new_tokens)

    def run() -> Iterator[SpecEvent]:
        yield SweepStarted(ks=tuple(ks), source=cfg.source, source_label=describe_source(cfg, s.cfg.n_layers),
                           max_new_tokens=max_new_tokens)
        base = None
        for ev in plain_decode(s, ids, params, max_new_tokens, cfg.ignore_eos, stop):
            yield ev
            if isinstance(ev, Failed):
                return
            base = ev
        for k, events in zip(ks, runs, strict=True):
            if stop():
                return
            fin, dtype = None, ""
            for ev in events:
                if isinstance(ev, Failed):
                    yield ev
                    return
                if isinstance(ev, SpecStarted):
                    dtype = ev.dtype
                if isinstance(ev, SpecFinished):
                    fin = ev
            if fin is None or fin.reason == "stopped":
                return
            rate = base.tokens_per_s if base is not None else 0.0
            matches, differs = _against(s, ids, fin.ids.tolist(), base, params.greedy, dtype)
            yield SweepPoint(
                k=k, acceptance_rate=fin.acceptance_rate, acceptance_by_position=fin.acceptance_by_position,
                tokens_per_pass=fin.tokens_per_pass, tokens_per_s=fin.tokens_per_s, baseline_tokens_per_s=rate,
                speedup=fin.tokens_per_s / rate if rate > 0 else 0.0,
                matches_baseline=matches, differs=differs,
            )

    return run()
