"""Re-run a step's sampling funnel with other settings from the logits it captured: numpy only, no model run.

The app's sampling panel redraws the funnel whenever a knob moves, in the GUI process, which never loads torch.
These are engine.run.sampling's stages, stage for stage, in numpy (a test holds the two equal over a grid of
settings); engine.run.sampling stays the one the generation samples with.
"""

from __future__ import annotations

import numpy as np

from engine.events import Funnel, TokenSampled
from engine.protocol import SamplingParams


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _renormalize(p: np.ndarray, mask: np.ndarray) -> np.ndarray:
    q = np.where(mask, p, 0.0)
    return q / q.sum()


def funnel_stages(
    logits: np.ndarray, params: SamplingParams, context_ids: np.ndarray | None = None
) -> dict[str, np.ndarray | int]:
    """Every stage of engine.run.sampling.funnel over the whole vocabulary (V,), computed in float64."""
    raw = np.asarray(logits, dtype=np.float32).astype(np.float64)
    v = raw.shape[-1]
    x = raw.copy()
    if params.repetition_penalty != 1.0 and context_ids is not None and len(context_ids):
        seen = np.unique(np.asarray(context_ids, dtype=np.int64))
        x[seen] = np.where(x[seen] > 0, x[seen] / params.repetition_penalty, x[seen] * params.repetition_penalty)
    for token, b in params.logit_bias:
        if not 0 <= token < v:
            raise ValueError(f"logit bias names token {token}, outside the vocabulary of {v}")
        x[token] += b
    if params.greedy:
        p_temp = np.zeros(v)
        p_temp[int(np.argmax(x))] = 1.0
        m_k = p_temp > 0
    else:
        p_temp = _softmax(x / params.temperature)
        k = params.top_k
        m_k = np.ones(v, bool) if k <= 0 or k >= v else p_temp >= np.partition(p_temp, v - k)[v - k]
    p_k = _renormalize(p_temp, m_k) if params.top_k else p_temp
    m_top_p = np.ones(v, bool)
    if params.top_p < 1.0:
        order = np.argsort(-p_k, kind="stable")
        vals = p_k[order]
        before = np.cumsum(vals) - vals  # mass of the tokens strictly more probable
        keep = (before < params.top_p) & (vals > 0)
        keep[0] = True
        m_top_p = np.zeros(v, bool)
        m_top_p[order[keep]] = True
    m_p = m_k & m_top_p
    p_p = _renormalize(p_k, m_p) if params.top_p < 1.0 else p_k
    m_f = m_p & ((p_p >= params.min_p * p_p.max()) if params.min_p > 0 else np.ones(v, bool))
    p_final = _renormalize(p_p, m_f) if params.min_p > 0 else p_p
    return dict(logits=raw, p_raw=_softmax(raw), p_temperature=p_temp, p_top_k=p_k, p_top_p=p_p, p_final=p_final,
                kept_top_k=int(m_k.sum()), kept_top_p=int(m_p.sum()), kept_final=int(m_f.sum()))


def condense(stages: dict, params: SamplingParams, top: int, tokenizer, sampled: int | None = None) -> Funnel:
    """The top candidates by raw logit (plus the sampled token) of a full-vocabulary funnel."""
    logits = stages["logits"]
    ids = np.argsort(-logits, kind="stable")[: min(top, logits.shape[-1])]
    if sampled is not None and sampled not in ids:
        ids = np.append(ids, sampled)

    def pick(name: str) -> np.ndarray:
        return np.asarray(stages[name][ids], dtype=np.float32)

    return Funnel(
        ids=ids.astype(np.int64), pieces=tuple(tokenizer.piece(int(i)) for i in ids),
        logits=pick("logits"), p_raw=pick("p_raw"), p_temperature=pick("p_temperature"), p_top_k=pick("p_top_k"),
        p_top_p=pick("p_top_p"), p_final=pick("p_final"), kept_top_k=stages["kept_top_k"],
        kept_top_p=stages["kept_top_p"], kept_final=stages["kept_final"], vocab_size=int(logits.shape[-1]),
        greedy=params.greedy,
    )


def refunnel(
    ev: TokenSampled, params: SamplingParams, tokenizer, top: int = 20, context_ids: np.ndarray | None = None
) -> Funnel | None:
    """Re-run a step's sampling funnel with other settings from the logits it captured (no model run).

    context_ids: the ids before this token (prompt + generated), for the repetition penalty; the event does not
    carry them (that would be every previous id at every step), the caller's record of the run does.
    """
    if ev.logits is None:
        return ev.funnel
    stages = funnel_stages(ev.logits, params, context_ids)
    return condense(stages, params, top, tokenizer, ev.token_id)
