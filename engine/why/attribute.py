"""Which prompt tokens drove the next token: gradient × input, integrated gradients, occlusion.

Every method scores each prompt token for one target token's log-probability, log p(target | prompt), where the
target is the greedy next token unless one is given.

- grad-input: x · ∂ log p / ∂x, one forward and one backward pass.
- ig (integrated gradients): (x − x₀) · ∫₀¹ ∂ log p / ∂x (x₀ + α (x − x₀)) dα, the integral by Gauss–Legendre
  quadrature on `steps` points (Captum's default method, "gausslegendre"), the points run as rows of a batch. Its
  weights sum to 1 and it is exact for polynomials of degree 2·steps − 1; Captum's "riemann_trapezoid" takes steps
  of 1/n, so its weights sum to (n − 1)/n and its scores fall short of completeness by construction.
  The scores sum to log p(target | x) − log p(target | x₀) up to the rule's error: the completeness check reports
  both sides (x and x₀ are two more rows of the batch, with weight 0).
- occlusion: log p(target | prompt) − log p(target | prompt with token i replaced by the end-of-text token), one
  pass per word plus one for the prompt itself; it needs only logits, so it also runs on llama.cpp, which has no
  gradients.

Special tokens (a BOS, the chat template's markers) are not words of the prompt: they keep their place in every
baseline and are never occluded, so their score is 0 by construction. Replacing them would mostly measure the model
losing its bearings (Gemma's <bos>, the attention sink, moved to <eos> scored −17.9 for " the" after "The capital of
France is" by integrated gradients, larger than every word), and the question is which words drove the answer.

x is the embedding-table row of each prompt token (B, T, d), taken in by a forward hook on `model.tok_embeddings`;
a model's embedding scale (Gemma: × √d) is applied after it, as in every forward pass, and being linear it leaves
the scores unchanged. A token's score is the attribution summed over the embedding dimension d.

The baseline x₀ of ig is the prompt with every word replaced by the end-of-text token (the same token occlusion puts
in a word's place), so log p(target | x₀) is that of a real input. The zero embedding, the textbook and Captum
default, fails on these models: RMSNorm divides by the norm, so near x₀ = 0 the output jumps (measured on SmolLM2:
log p of " Paris" −10.8 at α = 0, −13.2 at α = 10⁻⁶, gradients of 4·10⁷ there and NaN at 0), and the integral sits
in a sliver of the path that no affordable number of steps resolves. Even from this baseline the path is not smooth:
for " Rome" after SmolLM2's "The Eiffel Tower is in Paris and the Colosseum is in" (14 tokens) the scores missed
log p(x) − log p(x₀) = 18.8 nats by 8.3, 14.8 and 2.3 at 8, 32 and 64 steps, so read the completeness gap before
the scores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.why import Progress, ShouldStop, Unsupported, check_stop, require

if TYPE_CHECKING:
    import torch

METHODS = ("ig", "grad-input", "occlusion")
GRADIENT_METHODS = ("ig", "grad-input")
DEFAULT_STEPS = 32
MAX_STEPS = 1024  # points of the integral (each a row of a forward and backward pass)
PASS_TOKENS = 512  # rows × prompt tokens per forward/backward pass: bounds the activations kept for backward
MAX_ROWS = 16  # interpolation points per pass at most (short prompts): fewer passes, each a larger product
COMPLETE_WITHIN = 0.1  # the text output suggests more steps when Σ scores misses the difference by more than this


def _baseline_token(tokenizer) -> int:
    """The token occlusion puts in a token's place: the tokenizer's first end-of-text token.

    Every model has one, it carries no word of the prompt, its embedding is trained (a pad row often is not), and
    unlike the zero embedding it can be fed to a runtime that takes only token ids (llama.cpp).
    """
    if not tokenizer.eos_ids:
        raise Unsupported("occlusion replaces a token by the end-of-text token, and this tokenizer names none")
    return int(tokenizer.eos_ids[0])


@contextlib.contextmanager
def _differentiable_products() -> Iterator[None]:
    """Every matrix product through F.linear for the duration of a block.

    oneDNN's fused linear (engine.model.kernels.ONEDNN_LINEAR), which the engine runs for prefill and may have
    chosen for decode, registers no backward: torch only warns, and the gradient through it is wrong. The engine
    process runs one command at a time, so setting the module's choice here and back does not race a generation.
    """
    from engine.model import kernels

    saved = kernels.ONEDNN_LINEAR
    kernels.ONEDNN_LINEAR = None
    try:
        with kernels.forced("linear"):
            yield
    finally:
        kernels.ONEDNN_LINEAR = saved


def _log_probs(session, ids: list[int], embeds: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (B, V) of the token after `ids`, the embedding rows replaced by `embeds` (B, T, d).

    A fresh KV cache per pass: the session's own cache (prefix caching) is left as it was.
    """
    import torch

    from engine.model.kv_cache import KVCache

    lm = session.lm
    B, T = embeds.shape[:2]
    tokens = torch.tensor([ids] * B, dtype=torch.long, device=lm.device)  # (B, T)
    hook = lm.model.tok_embeddings.register_forward_hook(lambda _m, _i, _o: embeds)
    try:
        if session.threads is not None:
            session.threads.begin_step()
        logits = lm.model(tokens, KVCache(lm.cfg, B, T, lm.dtype, lm.device))  # (B, V) float32
    finally:
        hook.remove()
    return torch.log_softmax(logits.float(), dim=-1)


def _gradient_scores(session, ids: list[int], kept: list[bool], method: str, steps: int, target: int | None,
                     progress: Progress | None, should_stop: ShouldStop | None) -> dict:
    import numpy as np
    import torch

    model = session.lm.model
    table = model.tok_embeddings.weight
    if table.is_inference():
        raise Unsupported("this model's weights were loaded under torch.inference_mode, so no gradient can flow "
                          "through them: load it outside inference mode to attribute with gradients")
    T = len(ids)
    x = table[torch.tensor(ids, device=table.device)].detach().float()  # (T, d): the input
    if method == "grad-input":  # x · ∂ log p / ∂x: no path, so no baseline (equivalently x₀ = 0)
        baseline = torch.zeros_like(x)
    else:
        occluder = _baseline_token(session.tokenizer)
        keep = torch.tensor(kept, device=x.device)[:, None]  # (T, 1): special tokens stay
        baseline = torch.where(keep, x, table[occluder].detach().float())  # (T, d): see the module's docstring
    if method == "grad-input":
        alphas, weights = [1.0], [1.0]
    else:  # Gauss–Legendre on [0, 1], then the two ends (weight 0) for the completeness check
        nodes, w = np.polynomial.legendre.leggauss(steps)
        alphas = [1.0, 0.0, *(0.5 * (1 + nodes)).tolist()]
        weights = [0.0, 0.0, *(0.5 * w).tolist()]
    order = list(range(len(alphas)))  # α = 1 first: its row gives the greedy target
    rows = max(1, min(MAX_ROWS, PASS_TOKENS // T))
    chunks = [order[i:i + rows] for i in range(0, len(order), rows)]
    total = torch.zeros_like(x)  # (T, d): Σ_k w_k ∂ log p / ∂x at x₀ + α_k (x − x₀)
    logp_at: dict[int, float] = {}
    t0 = time.perf_counter()
    with torch.inference_mode(False), torch.enable_grad(), _differentiable_products():
        for n, chunk in enumerate(chunks):
            check_stop(should_stop)
            a = torch.tensor([alphas[k] for k in chunk], device=x.device)[:, None, None]  # (B, 1, 1)
            point = (baseline + a * (x - baseline)).to(table.dtype).requires_grad_(True)  # (B, T, d)
            lp = _log_probs(session, ids, point)  # (B, V)
            if target is None:
                target = int(lp[0].argmax())  # chunk 0 starts with α = 1: the prompt itself
            chosen = lp[:, target]  # (B,)
            (grad,) = torch.autograd.grad(chosen.sum(), point)  # rows are independent: each row's own gradient
            w = torch.tensor([weights[k] for k in chunk], device=x.device)[:, None, None]
            total += (w * grad.float()).sum(dim=0)
            for k, v in zip(chunk, chosen.tolist(), strict=True):
                logp_at[k] = v
            if progress is not None:
                progress((n + 1) / len(chunks), f"pass {n + 1} of {len(chunks)} ({len(chunk)} of {len(alphas)} "
                                                 f"points)")
    seconds = time.perf_counter() - t0
    scores = ((x - baseline) * total).sum(dim=-1)  # (T,)
    out = {
        "target_id": target, "scores": scores.tolist(),
        "score": ("(x − x₀) · Σ_k w_k ∂ log p(target)/∂x at x₀ + α_k (x − x₀), summed over the embedding "
                  "dimension" if method == "ig" else "x · ∂ log p(target)/∂x, summed over the embedding dimension"),
        "logprob": logp_at[order[0]],
        "cost": {"forward_passes": len(chunks), "backward_passes": len(chunks), "rows": len(alphas),
                 "seconds": seconds},
    }
    if method == "ig":
        end, start = logp_at[0], logp_at[1]
        total_score = float(scores.sum())
        out["steps"] = steps
        out["rule"] = "Gauss–Legendre quadrature on steps points in (0, 1) (Captum's gausslegendre)"
        out["baseline"] = {"kind": "every word replaced by a token (special tokens kept)", "id": occluder,
                           "piece": session.tokenizer.piece(occluder),
                           "why": "a real input that names no word of the prompt; the zero embedding sits where "
                                  "RMSNorm divides by ~0 (NaN gradient at α = 0)"}
        out["completeness"] = {"sum_of_scores": total_score, "logprob_input": end, "logprob_baseline": start,
                               "difference": end - start, "gap": total_score - (end - start)}
    return out


def _occlusion_scores(session, ids: list[int], kept: list[bool], target: int | None, progress: Progress | None,
                      should_stop: ShouldStop | None) -> dict:
    """N + 1 next-token passes through the session's own forward. Prefix caching re-runs only the tokens from the
    occluded one on; occluding the last token first, pass k re-runs k tokens: N + N(N + 1)/2 tokens in all."""
    import torch

    occluder = _baseline_token(session.tokenizer)
    last_first = [i for i in range(len(ids) - 1, -1, -1) if not kept[i]]
    runs = [list(ids)] + [ids[:i] + [occluder] + ids[i + 1:] for i in last_first]
    logps, tokens_run = [], 0
    t0 = time.perf_counter()
    for n, run in enumerate(runs):
        check_stop(should_stop)
        logits, reused, _ = session.next_token_logits(run)
        tokens_run += len(run) - reused
        lp = torch.log_softmax(logits.float(), dim=-1)
        if target is None:
            target = int(lp.argmax())  # run 0 is the prompt itself
        logps.append(float(lp[target]))
        if progress is not None:
            progress((n + 1) / len(runs), f"pass {n + 1} of {len(runs)}")
    seconds = time.perf_counter() - t0
    scores = [0.0] * len(ids)
    for i, v in zip(last_first, logps[1:], strict=True):
        scores[i] = logps[0] - v
    return {
        "target_id": target, "scores": scores, "logprob": logps[0],
        "score": "log p(target | prompt) − log p(target | prompt with this token replaced by the occluder)",
        "baseline": {"kind": "each word in turn replaced by a token (special tokens kept)", "id": occluder,
                     "piece": session.tokenizer.piece(occluder),
                     "why": "the tokenizer's end-of-text token: in every vocabulary, no word of the prompt, and a "
                            "token id, which llama.cpp takes"},
        "cost": {"forward_passes": len(runs), "backward_passes": 0, "tokens_run": tokens_run, "seconds": seconds},
    }


def attribute(session, prompt: str, method: str = "ig", steps: int = DEFAULT_STEPS, target: int | None = None,
              chat: bool = False, progress: Progress | None = None, should_stop: ShouldStop | None = None) -> dict:
    """Score every prompt token for the next token's log-probability; the JSON-ready dict the CLI prints.

    `session`: engine.run.session.Session (every method) or engine.backends.llamacpp.LlamaCppSession (occlusion).
    ValueError (one sentence) on a bad prompt, method, step count or target; Unsupported for a gradient method on a
    runtime without gradients; engine.why.Cancelled when should_stop() turns true between passes.
    """
    if method not in METHODS:
        raise ValueError(f"unknown attribution method {method!r}: choose ig, grad-input or occlusion")
    if method == "ig" and not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"integrated gradients takes 1 to {MAX_STEPS} steps (the quadrature's points), got {steps}")
    if method in GRADIENT_METHODS:
        require(session, "gradients", method, "use --method occlusion there, or --backend torch")
    tok = session.tokenize(prompt, chat)
    ids = [int(i) for i in tok.ids]
    session.check_prompt(ids)
    vocab = session.cfg.vocab_size
    if target is not None and not 0 <= target < vocab:
        raise ValueError(f"target token {target} is outside this model's vocabulary (0…{vocab - 1})")
    given = target is not None
    special = [bool(k) for k in tok.special]
    kept = special if method != "grad-input" else [False] * len(ids)  # grad-input replaces nothing
    if all(kept):
        raise ValueError("the prompt holds only special tokens (BOS, template markers): no word to attribute")
    if method == "occlusion":
        result = _occlusion_scores(session, ids, kept, target, progress, should_stop)
    else:
        result = _gradient_scores(session, ids, kept, method, steps, target, progress, should_stop)
    target = result.pop("target_id")
    return {
        "method": method, "backend": session.runtime_name,
        "tokens": {"ids": ids, "pieces": list(tok.pieces), "special": special},
        "target": {"id": target, "piece": session.tokenizer.piece(target), "logprob": result.pop("logprob"),
                   "chosen": "given" if given else "greedy"},
        **result,
    }


# ---- the command line -------------------------------------------------------------------------------------------
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    from engine.cliargs import add_model_args, add_threads_arg, int_in

    q = sub.add_parser("attribute", help="which prompt tokens drove the next token (integrated gradients, "
                                         "gradient × input, occlusion)")
    add_model_args(q)
    q.add_argument("--prompt", required=True)
    q.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template first")
    q.add_argument("--method", choices=METHODS, default="ig")
    q.add_argument("--steps", type=int_in(1, MAX_STEPS), default=DEFAULT_STEPS,
                   help=f"integrated gradients' points on the path from the baseline (default {DEFAULT_STEPS})")
    q.add_argument("--target-id", type=int_in(0), default=None,
                   help="the token to explain (default: the greedy next token)")
    add_threads_arg(q)
    q.set_defaults(func=_cmd, local_only="runs the model itself (gradients or one pass per token), which a server "
                                         "does not offer")


def _cmd(a: argparse.Namespace) -> int:
    from engine.backends import session_from_args
    from engine.cliargs import EXACT_PRODUCTS, UsageError, one_line, stamped
    from engine.why import Cancelled

    if not a.prompt.strip():
        raise UsageError("the prompt is empty: give --prompt some text")
    session = session_from_args(a)
    if a.target_id is not None and a.target_id >= session.cfg.vocab_size:
        raise UsageError(f"--target-id {a.target_id} is past this model's vocabulary (0 to "
                         f"{session.cfg.vocab_size - 1})")
    try:
        with one_line(Unsupported, ValueError):
            result = attribute(session, a.prompt, a.method, a.steps, a.target_id, a.chat)
    except Cancelled:
        return 130
    if a.json:
        print(json.dumps(stamped(result, session.info, None if a.method == "occlusion" else EXACT_PRODUCTS)))
        return 0
    t, cost = result["target"], result["cost"]
    print(f"next token {t['piece']!r} (id {t['id']}, {t['chosen']}), log p = {t['logprob']:.4f}; "
          f"{a.method} on {result['backend']}: {cost['forward_passes']} forward, {cost['backward_passes']} backward "
          f"passes, {cost['seconds']:.2f} s")
    scores = result["scores"]
    top = max((abs(s) for s in scores), default=0.0) or 1.0
    for piece, s in zip(result["tokens"]["pieces"], scores, strict=True):
        bar = "+" * round(10 * max(s, 0) / top) or "-" * round(10 * max(-s, 0) / top)
        print(f"{piece!r:>16} {s:+10.4f} {bar}")
    if "completeness" in result:
        c = result["completeness"]
        print(f"completeness: Σ scores {c['sum_of_scores']:+.4f} against log p(x) − log p(x₀) "
              f"{c['difference']:+.4f} (gap {c['gap']:+.4f}; baseline: every word replaced by "
              f"{result['baseline']['piece']!r})")
        if abs(c["gap"]) > COMPLETE_WITHIN * max(abs(c["difference"]), 1.0):
            print(f"the gap is over {COMPLETE_WITHIN:.0%} of the difference: the path is not resolved by "
                  f"{a.steps} steps; more --steps bring the sum closer", file=sys.stderr)
    if not all(math.isfinite(s) for s in scores):
        print("warning: some scores are not finite", file=sys.stderr)
    return 0
