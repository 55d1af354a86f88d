"""Sampling: from raw logits to one token, as small pure functions.

The stages, in order, each over the whole vocabulary (V,):
  1. penalties and bias: repetition penalty on tokens already in the context (positive logits divided by the
     penalty, negative ones multiplied), then an additive logit bias;
  2. temperature: p = softmax(logits / T); T = 0 means greedy (all mass on the argmax);
  3. top-k: keep the tokens whose probability is at least the k-th largest (ties at the boundary are all kept);
     k = 0 is off;
  4. top-p (nucleus): keep the smallest set of most probable tokens whose cumulative probability reaches p (never
     empty); p = 1 is off;
  5. min-p: keep the tokens with probability ≥ min_p · (largest probability); 0 is off.
After each truncation the survivors are renormalised. `funnel` returns every intermediate distribution (what the
app's funnel plot shows); `sample` draws one token from the last one with an explicit torch.Generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.protocol import SamplingParams

__all__ = ["SamplingParams", "FunnelStages", "funnel", "sample", "choose", "make_generator"]


@dataclass(frozen=True)
class FunnelStages:
    """Every stage's distribution over the whole vocabulary (V,), float32, and how many tokens each kept."""

    logits: torch.Tensor  # raw
    adjusted: torch.Tensor  # after repetition penalty and logit bias
    p_raw: torch.Tensor  # softmax(raw logits)
    p_temperature: torch.Tensor
    p_top_k: torch.Tensor
    p_top_p: torch.Tensor
    p_final: torch.Tensor
    kept_top_k: int
    kept_top_p: int
    kept_final: int


def apply_penalties(
    logits: torch.Tensor, context_ids: torch.Tensor | None, penalty: float,
    bias: tuple[tuple[int, float], ...] = (),
) -> torch.Tensor:
    """Repetition penalty on tokens seen in the context, then additive logit bias. Returns a new tensor."""
    out = logits.clone()
    if penalty != 1.0 and context_ids is not None and context_ids.numel():
        seen = torch.unique(context_ids.to(logits.device))
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    for token, b in bias:
        if not 0 <= token < out.shape[-1]:
            raise ValueError(f"logit bias names token {token}, outside the vocabulary of {out.shape[-1]}")
        out[token] += b
    return out


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T); T = 0 gives a one-hot distribution on the argmax."""
    if temperature == 0.0:
        p = torch.zeros_like(logits)
        p[torch.argmax(logits)] = 1.0
        return p
    return torch.softmax(logits / temperature, dim=-1)


def top_k_mask(p: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens whose probability is ≥ the k-th largest (ties kept); k = 0 or k ≥ V keeps all."""
    if k <= 0 or k >= p.shape[-1]:
        return torch.ones_like(p, dtype=torch.bool)
    kth = torch.topk(p, k).values[-1]
    return p >= kth


def top_p_mask(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most probable tokens whose cumulative probability reaches top_p (at least one)."""
    if top_p >= 1.0:
        return torch.ones_like(p, dtype=torch.bool)
    n = min(p.shape[-1], 512)
    while True:  # a sorted prefix usually suffices; widen it only when the distribution is flat
        vals, idx = torch.topk(p, n)
        before = torch.cumsum(vals, dim=-1) - vals  # mass of the tokens strictly more probable
        keep = (before < top_p) & (vals > 0)
        keep[0] = True
        if not keep[-1] or n == p.shape[-1]:
            break
        n = min(p.shape[-1], n * 8)
    mask = torch.zeros_like(p, dtype=torch.bool)
    mask[idx[keep]] = True
    return mask


def min_p_mask(p: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tokens with probability ≥ min_p · max probability."""
    if min_p <= 0.0:
        return torch.ones_like(p, dtype=torch.bool)
    return p >= min_p * p.max()


def renormalize(p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    q = torch.where(mask, p, torch.zeros_like(p))
    return q / q.sum()


def funnel(logits: torch.Tensor, params: SamplingParams, context_ids: torch.Tensor | None = None) -> FunnelStages:
    """Run every stage on one step's logits (V,) and keep each intermediate distribution."""
    logits = logits.float()
    adjusted = apply_penalties(logits, context_ids, params.repetition_penalty, params.logit_bias)
    p_temp = apply_temperature(adjusted, params.temperature)
    # Masks accumulate: a token survives a stage only if it survived every earlier one.
    m_k = (p_temp > 0) if params.greedy else top_k_mask(p_temp, params.top_k)
    p_k = renormalize(p_temp, m_k) if params.top_k else p_temp
    m_p = m_k & top_p_mask(p_k, params.top_p)
    p_p = renormalize(p_k, m_p) if params.top_p < 1.0 else p_k
    m_f = m_p & min_p_mask(p_p, params.min_p)
    p_final = renormalize(p_p, m_f) if params.min_p > 0 else p_p
    return FunnelStages(
        logits=logits, adjusted=adjusted, p_raw=torch.softmax(logits, dim=-1), p_temperature=p_temp,
        p_top_k=p_k, p_top_p=p_p, p_final=p_final,
        kept_top_k=int(m_k.sum()), kept_top_p=int(m_p.sum()), kept_final=int(m_f.sum()),
    )


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from the distribution p (V,), which need not sum to 1: the first index whose cumulative mass passes
    a uniform draw (inverse transform sampling). Exactly the categorical distribution, in one pass over V, where
    torch.multinomial on the CPU takes several times longer on a large vocabulary (BENCHMARKS.md, "Sampling").
    A token of zero probability is never drawn: its cumulative mass does not pass the previous token's."""
    c = torch.cumsum(p.double(), dim=-1)
    total = float(c[-1])
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(f"cannot draw a token: the probabilities sum to {total}")
    device = generator.device if generator is not None else p.device
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=device).to(c.device) * c[-1]
    i = int(torch.searchsorted(c, u, right=True))
    if i >= c.shape[-1]:  # the draw met the total itself (rounding): the last token with any mass
        i = int(torch.nonzero(p)[-1])
    return i


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    context_ids: torch.Tensor | None = None,
) -> tuple[int, FunnelStages]:
    """Choose the next token from one step's logits (V,); returns the token id and the funnel it came from."""
    stages = funnel(logits, params, context_ids)
    if params.greedy:
        return int(torch.argmax(stages.p_final)), stages
    return draw(stages.p_final, generator), stages


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    context_ids: torch.Tensor | None = None,
) -> int:
    """The token `sample` would choose (same stages, same random draw), without keeping the funnel."""
    x = logits.float()
    if params.repetition_penalty != 1.0 or params.logit_bias:
        x = apply_penalties(x, context_ids, params.repetition_penalty, params.logit_bias)
    if params.greedy:
        return int(torch.argmax(x))
    p = torch.softmax(x / params.temperature, dim=-1)
    if params.top_k:
        p = renormalize(p, top_k_mask(p, params.top_k))
    if params.top_p < 1.0:
        p = renormalize(p, top_p_mask(p, params.top_p))
    if params.min_p > 0:
        p = renormalize(p, min_p_mask(p, params.min_p))
    return draw(p, generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private random stream: seeded runs repeat exactly; None draws a fresh seed."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
