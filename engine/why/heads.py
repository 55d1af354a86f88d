"""Head roles on the loaded model: which attention heads look at the previous token, at an earlier copy of the
current token, at the token after that copy (induction), or at the first position (an attention sink).

The sequence: BOS where the model's tokenizer adds one, then N token ids repeated once (T = 2N, or 2N + 1 with BOS).
The N ids are distinct, drawn uniformly without replacement from the vocabulary's non-special tokens by numpy's
default_rng(seed), so the only repeated tokens are the intended ones (query t in the second copy sees its own token
at t − N) and no control token (BOS, EOS, chat markers) sits inside the sequence.

Each score is TransformerLens's head_detector with its defaults (error_measure "mul", exclude_bos and
exclude_current_token False): with A the head's (T, T) attention after softmax and P a 0/1 detection pattern,
    score = Σ A ⊙ P / Σ A,
summed over every query row, so a row that has no pattern key (the first copy, for the duplicate and induction
patterns) counts in the denominator with nothing in the numerator. Σ A = T (each row sums to 1), so a score is the
mean over all T rows of the attention on the pattern's keys. The patterns, as TransformerLens builds them:
    previous_token   key t − 1
    duplicate_token  every earlier key holding the query's token (here t − N)
    induction        the key just after each such earlier copy (here t − N + 1)
    sink             key 0 (not one of TransformerLens's named heads: the same formula with P's first column 1)

Attention comes from one prefill through the session's own capture (engine.model.seam.Reads on the torch engine, the
graph callback on llama.cpp), every layer and every query row.

The confirmation of induction heads (`ablation_loss`): zero-ablate heads (their output z, engine.model.seam) and
measure the mean next-token cross-entropy over the second copy, which induction heads make predictable.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence

import numpy as np

from engine.why import Cancelled, Progress, ShouldStop, Unsupported, check_stop

SCORES = ("previous_token", "duplicate_token", "induction", "sink")
DEFINITIONS = {
    "previous_token": "mean over all query rows t of the attention on key t - 1",
    "duplicate_token": "mean over all query rows t of the attention on earlier keys holding the same token as t "
                       "(t - N in the second copy; rows of the first copy have none and count as 0)",
    "induction": "mean over all query rows t of the attention on the key after an earlier copy of t's token "
                 "(t - N + 1 in the second copy; rows of the first copy count as 0)",
    "sink": "mean over all query rows t of the attention on position 0 (the first token, BOS where the model adds one)",
}
MAX_REPEAT = 256  # 2N + 1 positions: every layer's (heads, T, T) weights stay under ~300 MB on SmolLM2
TOP = 5  # heads listed per score in the text output


# ---- the sequence and the patterns ----------------------------------------------------------------------------
def random_repeated(tokenizer, vocab_size: int, repeat: int, seed: int) -> list[int]:
    """[BOS] + r + r: r is `repeat` distinct non-special ids drawn by default_rng(seed) (see the module docstring)."""
    size = min(vocab_size, tokenizer.vocab_size)
    pool = np.array([i for i in range(size) if not tokenizer.is_special(i)], dtype=np.int64)
    if len(pool) < repeat:
        raise ValueError(f"the vocabulary has {len(pool)} non-special tokens, fewer than the {repeat} asked for")
    r = np.random.default_rng(seed).choice(pool, size=repeat, replace=False).tolist()
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    return bos + r + r


def detection_patterns(tokens: Sequence[int]) -> dict[str, np.ndarray]:
    """Each score's (T, T) 0/1 pattern P (query rows, key columns), as TransformerLens's head_detector builds it."""
    t = np.asarray(tokens)
    T = len(t)
    prev = np.eye(T, k=-1)
    dup = np.tril((t[:, None] == t[None, :]).astype(np.float64), k=-1)  # earlier keys with the query's token
    ind = np.zeros((T, T))
    ind[:, 1:] = dup[:, :-1]  # one key to the right of each earlier copy
    sink = np.zeros((T, T))
    sink[:, 0] = 1
    return {"previous_token": prev, "duplicate_token": dup, "induction": np.tril(ind), "sink": np.tril(sink)}


def pattern_scores(weights: np.ndarray, tokens: Sequence[int]) -> dict[str, np.ndarray]:
    """weights (layers, heads, T, T) → each score (layers, heads): Σ A ⊙ P / Σ A over query rows and keys."""
    a = weights.astype(np.float64)
    total = a.sum(axis=(-1, -2))  # (L, H): T when every row sums to 1
    return {name: np.einsum("lhqk,qk->lh", a, p) / total for name, p in detection_patterns(tokens).items()}


# ---- on the model ------------------------------------------------------------------------------------------------
def attention_all_layers(session, tokens: Sequence[int]) -> np.ndarray:
    """(layers, heads, T, T) attention weights of one prefill of `tokens`, every query row, on either runtime."""
    from engine.events import AttentionCaptured, Failed
    from engine.protocol import Capture, SamplingParams

    cfg = session.cfg
    if "attention" in session.cannot:
        raise Unsupported("this llama.cpp context fuses attention (flash attention), so its weights never exist: "
                          "load the model without flash attention to score heads")
    T = len(tokens)
    capture = Capture(attention_layers=frozenset(range(cfg.n_layers)),
                      attention_max_bytes=cfg.n_heads * T * T * 4)  # one layer's every row, float32
    session.forget_cache()  # a reused prefix would leave its rows out of the capture
    out = np.full((cfg.n_layers, cfg.n_heads, T, T), np.nan, dtype=np.float32)
    for ev in session.generate(list(tokens), SamplingParams(temperature=0.0), 1, capture, ignore_eos=True):
        if isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        if isinstance(ev, AttentionCaptured) and ev.step == 0:
            if ev.rows_skipped or ev.weights.shape[1] != T:
                raise RuntimeError(f"layer {ev.layer}'s capture kept {ev.weights.shape[1]} of {T} query rows")
            out[ev.layer] = ev.weights[:, :, :T]
    missing = [i for i in range(cfg.n_layers) if np.isnan(out[i]).any()]
    if missing:
        raise RuntimeError(f"no attention was captured for layer {missing[0]}")
    return out


def head_roles(session, repeat: int = 24, seed: int = 0, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> dict:
    """Score every head of the loaded model (a torch Session or a LlamaCppSession); the CLI's JSON document."""
    if not 1 <= repeat <= MAX_REPEAT:
        raise ValueError(f"repeat takes 1 to {MAX_REPEAT} tokens, got {repeat}")
    tokens = random_repeated(session.tokenizer, session.cfg.vocab_size, repeat, seed)
    if len(tokens) >= session.cfg.context_length:
        raise ValueError(f"{len(tokens)} positions do not fit this model's context of {session.cfg.context_length}")
    check_stop(should_stop)
    if progress is not None:
        progress(0.0, f"one prefill of {len(tokens)} tokens, attention of every layer")
    weights = attention_all_layers(session, tokens)
    scores = pattern_scores(weights, tokens)
    if progress is not None:
        progress(1.0, "scored")
    return {
        "tokens": tokens, "repeat": repeat, "seed": seed,
        "scores": {k: scores[k].tolist() for k in SCORES},
        "definitions": dict(DEFINITIONS),
    }


def top_heads(scores: Sequence[Sequence[float]], k: int) -> list[tuple[int, int, float]]:
    """The k highest (layer, head, score), highest first."""
    a = np.asarray(scores)
    order = np.argsort(-a, axis=None, kind="stable")[:k]
    return [(int(i // a.shape[1]), int(i % a.shape[1]), float(a.flat[i])) for i in order]


def second_copy_loss(logits, tokens: Sequence[int], repeat: int) -> float:
    """Mean cross-entropy (nats) of predicting the second copy's tokens 2 … N from the logits (T, V) of each
    position; the copy's first token is left out (nothing before it says the sequence repeats)."""
    import torch

    T = len(tokens)
    targets = torch.tensor(tokens[T - repeat + 1:], dtype=torch.long)  # the second copy without its first token
    rows = logits[T - repeat: T - 1].float()  # the position before each target predicts it
    return float(torch.nn.functional.cross_entropy(rows, targets.to(rows.device)))


def ablation_loss(session, tokens: Sequence[int], repeat: int, heads: Sequence[tuple[int, int]]) -> float:
    """second_copy_loss with the heads' outputs (z) set to zero at every position, through the session's seam."""
    from engine.model.seam import Edit, Point

    logits, _ = session.run_points([list(tokens)], [Edit(Point.z(layer, head)) for layer, head in heads], every=True)
    logits = logits[0]  # (T, V)
    return second_copy_loss(logits, tokens, repeat)


def confirm_induction(session, result: dict, k: int, progress: Progress | None = None,
                      should_stop: ShouldStop | None = None) -> dict:
    """Zero-ablate the k heads with the highest induction scores (and, as a control, k heads drawn from the rest by
    the same seed) and report the second copy's loss before and after."""
    tokens, repeat = result["tokens"], result["repeat"]
    top = top_heads(result["scores"]["induction"], k)
    chosen = {(layer, head) for layer, head, _ in top}
    L, H = np.asarray(result["scores"]["induction"]).shape
    rest = [(i, h) for i in range(L) for h in range(H) if (i, h) not in chosen]
    pick = np.random.default_rng(result["seed"]).choice(len(rest), size=min(k, len(rest)), replace=False)
    control = sorted(rest[int(i)] for i in pick)
    losses = []
    for n, heads in enumerate(([], sorted(chosen), control)):
        check_stop(should_stop)
        if progress is not None:
            progress(n / 3, ("no ablation", "top induction heads ablated", "control heads ablated")[n])
        losses.append(ablation_loss(session, tokens, repeat, heads))
    return {
        "heads": [{"layer": layer, "head": head, "induction": s} for layer, head, s in top],
        "loss": losses[0], "loss_ablated": losses[1], "loss_rise": losses[1] - losses[0],
        "control_heads": [{"layer": layer, "head": head} for layer, head in control],
        "loss_control": losses[2],
        "loss_definition": "mean next-token cross-entropy (nats) over the second copy's tokens 2 to N; ablation "
                           "sets the heads' outputs z to zero at every position",
    }


# ---- the command line --------------------------------------------------------------------------------------------
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `heads` to the engine's CLI."""
    from engine.cliargs import MAX_SEED, add_model_args, add_threads_arg, int_in

    q = sub.add_parser("heads", help="head roles: previous-token, duplicate-token, induction and sink scores per "
                                     "layer and head (TransformerLens's head_detector) on a repeated random sequence")
    add_model_args(q)
    add_threads_arg(q)
    q.add_argument("--repeat", type=int_in(1, MAX_REPEAT), default=24, metavar="N",
                   help="random tokens in the sequence, which is then repeated once (default 24)")
    q.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="which random tokens (default 0)")
    q.add_argument("--ablate-top", type=int_in(1, 64), default=None, metavar="K",
                   help="confirm the induction heads: zero-ablate the K best and report the second copy's loss "
                        "before and after (torch engine)")
    q.set_defaults(func=_cmd, local_only="needs every layer's attention, which a server does not report")


def _cmd(a: argparse.Namespace) -> int:
    from engine.backends import session_from_args
    from engine.cliargs import UsageError, one_line, stamped

    s = session_from_args(a)
    with one_line(ValueError, RuntimeError, Unsupported, Cancelled):
        if a.ablate_top is not None and a.ablate_top > s.cfg.n_layers * s.cfg.n_heads:
            raise UsageError(f"--ablate-top {a.ablate_top} is more than this model's "
                             f"{s.cfg.n_layers * s.cfg.n_heads} heads")
        out = head_roles(s, a.repeat, a.seed)
        if a.ablate_top is not None:
            out["ablation"] = confirm_induction(s, out, a.ablate_top)
    if a.json:
        print(json.dumps(stamped(out, s.info)))
        return 0
    n = len(out["tokens"])
    print(f"{n} tokens: {'BOS + ' if n % 2 else ''}{a.repeat} random ids (seed {a.seed}) repeated once")
    for name in SCORES:
        best = ", ".join(f"{layer}.{head} {v:.3f}" for layer, head, v in top_heads(out["scores"][name], TOP))
        print(f"{name:<16} {best}    ({out['definitions'][name]})")
    if "ablation" in out:
        ab = out["ablation"]
        heads = " ".join(f"{h['layer']}.{h['head']}" for h in ab["heads"])
        rise = ab["loss_ablated"] / ab["loss"] if ab["loss"] > 0 else math.inf
        print(f"second copy's loss {ab['loss']:.3f} nats; with heads {heads} zeroed {ab['loss_ablated']:.3f} "
              f"(x{rise:.2f}); with {len(ab['control_heads'])} other heads zeroed {ab['loss_control']:.3f}")
    return 0
