"""A step's attention (and logit lens) recomputed on demand from the KV cache the live run left in the session.

A long run cannot keep every step's attention (heads × position × layers a step: it grows with the square of the
run), so the app keeps a bounded part and asks for the rest when a step is selected. The session's cache still
holds the keys and values of every position of the live run, so the token fed at position p can be run again
through the model's own forward pass, one token at position p, reading the cached keys and values 0…p: its query at
every layer meets exactly the keys it met in the step, and its reads record the same weights a capture would have.

Nothing is written: the cache is read through `ReadOnlyCache`, which hands the model views of the positions the
step read (a sliding-window layer's band, as in the forward pass) and ignores the new key and value (they equal the
ones cached at p: the same token through the same weights at the same position).

Cost: the weights of the layers up to the last one asked for, plus attention over p + 1 keys per layer; with the
lens, one whole decode step and L + 1 LM-head products (`python -m benchmarks.recompute` measures it at 7,000
positions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.backend import Unsupported
from engine.events import AttentionCaptured, LensCaptured
from engine.model.kv_cache import ReadOnlyCache
from engine.model.seam import Reads
from engine.protocol import Recompute, Recomputed
from engine.run.lens import lens_event

if TYPE_CHECKING:
    from engine.run.session import Engine

LLAMACPP_REFUSAL = ("kept steps only on llama.cpp: its KV cache lives inside llama.cpp, where a step cannot be run "
                    "again without changing it")


@dataclass
class Recomputation:
    """The session's last recompute: every layer it ran (it reads each, whichever were asked for), so a switch to
    another of them is answered without running the model again. Valid while `key` holds: the cache not truncated or
    replaced since (KVCache.epoch), the same query position and step, thread count and forced kernel. A pass that
    ran every layer keeps what the logit lens needs too."""

    key: tuple
    attention: dict[int, AttentionCaptured]  # by layer
    stream: object = None  # the residual stream (n_layers + 1, d) and the logits (V,) when the pass ran every layer:
    logits: object = None  # what the logit lens is computed from
    hits: int = 0  # requests answered from it


class CacheGone(ValueError):
    """The session's KV cache no longer holds what the step read (the message says why, in one sentence)."""


def check_cache(session: Engine, ids: Sequence[int]) -> int:
    """The query position p = len(ids) − 1 when the session's cache holds exactly these tokens at 0…p (and every
    layer still holds the keys position p read); else CacheGone, or Unsupported on a runtime other than torch's."""
    if "recompute" not in session.can:
        raise Unsupported(LLAMACPP_REFUSAL)
    p = len(ids) - 1
    cache = session.cache
    if p < 0:
        raise ValueError("no position to recompute: the step's context is empty")
    if cache is None or cache.batch != 1 or cache.pos <= p or session.cached_ids[:p + 1] != [int(i) for i in ids]:
        raise CacheGone("the engine's KV cache no longer holds this run (another run, a preview or an experiment "
                        "replaced it): only the steps the app kept can be shown")
    if not cache.reads_back(p):
        raise CacheGone(f"the sliding-window layers of the KV cache keep only their last {cache.local_slots:,} "
                        f"positions, and no longer hold the {cache.window:,} keys position {p:,} read")
    return p


@torch.inference_mode()
def recompute(
    session: Engine, ids: Sequence[int], step: int, layers: Iterable[int], lens_top: int = 0, token: int = -1,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[list[AttentionCaptured], LensCaptured | None]:
    """The attention of `layers` (and the logit lens, lens_top > 0) of the step whose query is the last of `ids`
    (the run's tokens at positions 0…p), exactly as a capture at that step gives them: each AttentionCaptured is
    (heads, 1, keys) at query_start p, keys = p + 1 (a sliding-window layer: its window). `token` is the token the
    step chose (the lens gives its probability in every row; −1: not known). The cache is left as it was.
    `meanwhile` is called between the pass and the lens (the engine answers from the pass what came in meanwhile)."""
    p = check_cache(session, ids)
    cfg, model = session.cfg, session.lm.model
    wanted = sorted({int(i) for i in layers})
    outside = [i for i in wanted if not 0 <= i < cfg.n_layers]
    if outside:
        raise ValueError(f"layer {outside[0]} is not in this model (layers 0…{cfg.n_layers - 1})")
    if lens_top < 0:
        raise ValueError(f"lens_top must be 0 (no lens) or a positive number of tokens, got {lens_top}")
    key = pass_key(session, p, step)
    memo = session.recomputed
    if memo is not None and memo.key == key and all(i in memo.attention for i in wanted) \
            and (not lens_top or memo.stream is not None):
        memo.hits += 1
    else:
        memo = session.recomputed = run_pass(session, ids, step, p, key, wanted, lens_top)
    lens = None
    if lens_top:
        if meanwhile is not None:
            meanwhile()
        lens = lens_event(model, session.tokenizer, step, p, memo.stream, memo.logits, lens_top,
                          None if token < 0 else token)
    return [memo.attention[i] for i in wanted], lens


def run_pass(session: Engine, ids: Sequence[int], step: int, p: int, key: tuple, wanted: list[int],
             lens_top: int) -> Recomputation:
    """One token at position p through the model's layers, every one of them read: what `recompute` answers."""
    cfg, model = session.cfg, session.lm.model
    # Every layer the pass runs is read, not only the wanted ones: a read layer computes its attention weights
    # explicitly, an unread one through the fused kernel, and the two round differently; a run that captured every
    # layer (the app does for a prompt under 64 tokens) is matched only when each layer runs as it ran then (the
    # bfloat16 activations of the int4/int8 decode kernels amplify the difference to ~1e-3).
    # A pass through the last layer goes on through the LM head and keeps the residual stream: the Logit lens panel
    # asks for the same step a moment later, and then needs no pass of its own.
    full = bool(lens_top) or cfg.n_layers - 1 in wanted
    last = cfg.n_layers - 1 if full else (wanted[-1] if wanted else -1)
    reads = Reads(range(last + 1), stream=full)
    tokens = torch.tensor([[int(ids[p])]], dtype=torch.long, device=session.lm.device)  # (1, 1)
    # The decode kernel of each product is chosen per thread count (engine.model.kernels: int4 at one thread, int8 at
    # two, for some of SmolLM2's), so the step is run at the count it ran at (threads "auto" switches between steps)
    before = torch.get_num_threads()
    torch.set_num_threads(key[3])
    cache = ReadOnlyCache(session.cache, p)
    try:  # past the last layer asked for only when the lens needs every layer and the output; logits (V,)
        logits = model(tokens, cache, reads, layers=last + 1, head=full)
        logits = None if logits is None else logits[0]
    finally:
        torch.set_num_threads(before)
    phase = "prefill" if step == 0 else "decode"
    every = {i: AttentionCaptured(step=step, phase=phase, layer=i, query_start=p,
                                  weights=reads.pattern[i][0], group_size=cfg.group_size)
             for i in range(last + 1)}  # batch row 0: (H, 1, S)
    return Recomputation(key, every, reads.stream[0] if full else None, logits)


def pass_key(session: Engine, p: int, step: int) -> tuple:
    """What a pass's results hold for (Recomputation.key): the cache's epoch, the position, the step, the thread count
    and the forced kernel."""
    from engine.model import kernels

    return session.cache.epoch, p, step, run_threads(session, p), kernels.forced_name()


def from_last_pass(session: Engine, cmd: Recompute) -> bool:
    """Whether the session's last pass answers `cmd` without running the model: attention of layers it ran, of the
    same step, and no lens (the lens's products over the vocabulary are most of a lens's time)."""
    if "recompute" not in session.can:
        return False
    memo = session.recomputed
    if memo is None or cmd.lens_top or not cmd.ids or session.cache is None:
        return False
    return memo.key == pass_key(session, len(cmd.ids) - 1, cmd.step) and all(i in memo.attention for i in cmd.layers)


def answer(session: Engine, cmd: Recompute, meanwhile: Callable[[], None] | None = None) -> Recomputed:
    """The engine process's reply to a Recompute: the events, or one sentence saying why not. `meanwhile`: as in
    `recompute`."""
    t0 = time.perf_counter()
    memo = session.recomputed if "recompute" in session.can else None
    hits = memo.hits if memo is not None else 0
    try:
        attention, lens = recompute(session, cmd.ids, cmd.step, cmd.layers, cmd.lens_top, cmd.token, meanwhile)
    except (Unsupported, ValueError) as e:
        return Recomputed(cmd.request_id, cmd.step, error=str(e), seconds=time.perf_counter() - t0)
    reused = session.recomputed is memo and memo is not None and memo.hits > hits
    return Recomputed(cmd.request_id, cmd.step, tuple(attention), lens, seconds=time.perf_counter() - t0,
                      threads=run_threads(session, len(cmd.ids) - 1), reused=reused)


def run_threads(session: Engine, p: int) -> int:
    """The thread count a recompute of position p runs at: the one its step ran at, else the run's current one
    (threads "auto" adapts it), else torch's."""
    return session.threads_at(p) or (session.threads.current if session.threads is not None
                                     else torch.get_num_threads())
