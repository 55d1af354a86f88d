"""The events of speculative decoding (engine.labs.speculative): frozen dataclasses of plain numbers and numpy
arrays. Kept apart from the loop so the app's process can read them without importing torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.events import Failed, StepCost


@dataclass(frozen=True, kw_only=True)
class SpecStarted:
    prompt_ids: np.ndarray  # (T,) int64
    k: int
    source: str
    source_label: str  # e.g. "early exit after layer 15 of 30"
    greedy: bool
    max_new_tokens: int
    model: str
    dtype: str


@dataclass(frozen=True, kw_only=True)
class SpecPrefilled:
    """The prompt in one pass; its logits give the first token (nothing is drafted for it)."""

    n_tokens: int
    seconds: float  # TTFT, the draft model's prefill included
    cost: StepCost
    token_id: int
    piece: str


@dataclass(frozen=True, kw_only=True)
class SpecStep:
    """One full pass of the model over the pending token and the k guesses after it."""

    step: int  # 1, 2, … (full passes after the prefill)
    position: int  # position of the pending token, the first of the pass
    drafted: np.ndarray  # (n,) int64: the guesses (n ≤ k: lookup may find fewer, the end of the run allows fewer)
    drafted_pieces: tuple[str, ...]
    n_accepted: int  # the guesses kept: drafted[:n_accepted]
    accept_probs: np.ndarray  # (n,) float32: the chance each judged guess had, min(1, p/q) (greedy: 1 or 0)
    p_model: np.ndarray  # (n,) float32: the model's probability of each judged guess (NaN where not judged)
    token_id: int  # the model's own token after the accepted guesses
    piece: str
    emitted: np.ndarray  # (m,) int64: accepted guesses + the model's token (cut at an end-of-text token)
    text: str  # the text they add
    draft_s: float
    verify_s: float  # the forward pass over the k + 1 positions
    seconds: float  # the whole pass: drafting, verifying, accepting
    verify_cost: StepCost  # FLOPs and bytes of the verify pass (engine.costs.formulas.prefill_cost)
    decode_cost: StepCost  # one plain decode step at the same position, for comparison

    @property
    def tokens_gained(self) -> int:
        return len(self.emitted)


@dataclass(frozen=True, kw_only=True)
class SpecBaseline:
    """Plain decoding of the same prompt with the same settings, for the speedup."""

    ids: np.ndarray  # (m,) int64
    tokens_per_s: float  # 1 / mean decode step (prefill excluded)
    tpot_s: float
    reason: str


# Top-1 − top-2 logit gap under which a greedy choice counts as a near-tie: a pass over k + 1 positions and a
# one-position step sum their products in another order, and their logits parted by up to 0.56 (SmolLM2, torch
# bfloat16) and 0.99 (SmolLM2 Q4_1 on llama.cpp) over 24 tokens of a code prompt at k = 5; float32 parts by ~1e-5
NEAR_TIE = 1.0
NEAR_TIE_FLOAT32 = 1e-3


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """Where a greedy speculative run first parts from plain greedy decoding of the same prompt, and why it can."""

    index: int  # into the generated ids (0: the prefill's token)
    position: int  # in the whole sequence: prompt length + index
    spec_token: int  # -1: the run had ended there
    spec_piece: str
    plain_token: int
    plain_piece: str
    margin: float  # plain decoding's top-1 − top-2 logit at that step, from a one-position step (NaN: it had ended)
    dtype: str  # what the model ran in (a llama.cpp file's type)

    @property
    def near_tie(self) -> bool:
        return self.margin < (NEAR_TIE_FLOAT32 if self.dtype == "float32" else NEAR_TIE)

    def sentence(self) -> str:
        """One sentence for the panel and the CLI."""
        head = f"differs from position {self.position}: {self.spec_piece!r} vs {self.plain_piece!r} (plain)"
        if self.margin != self.margin:
            return f"{head}, where one run had ended"
        if self.near_tie:
            return (f"{head}, a near-tie (margin {self.margin:.2f}) — a k + 1-position verify pass rounds differently "
                    f"from a one-position step in {self.dtype}")
        return (f"{head}, not a near-tie (margin {self.margin:.2f}): more than {self.dtype}'s rounding explains, "
                f"so the speculative path is at fault")

    def to_dict(self) -> dict:
        return {**asdict(self), "margin": None if self.margin != self.margin else round(self.margin, 6),
                "near_tie": self.near_tie, "sentence": self.sentence()}


@dataclass(frozen=True, kw_only=True)
class SpecFinished:
    reason: str  # eos, length, context, stopped
    source: str
    source_label: str
    k: int
    prompt_ids: np.ndarray
    ids: np.ndarray  # generated ids, the prefill's token first
    text: str
    ttft_s: float
    n_passes: int
    decode_s: float  # all full passes together
    draft_s: float
    verify_s: float
    drafted_by_position: np.ndarray  # (k,) int64: passes that drafted a guess at position i
    accepted_by_position: np.ndarray  # (k,) int64: … and kept it
    baseline_tokens_per_s: float  # 0 when no baseline ran
    matches_baseline: bool | None  # greedy: the same tokens as plain decoding (None: not comparable)
    differs: Divergence | None = None  # greedy and not the same tokens: where and why

    @property
    def tokens_per_s(self) -> float:
        """Tokens after the first per second of full passes (comparable with plain decoding's 1 / TPOT)."""
        return (len(self.ids) - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return (len(self.ids) - 1) / self.n_passes if self.n_passes else 0.0

    @property
    def acceptance_rate(self) -> float:
        drafted = int(self.drafted_by_position.sum())
        return int(self.accepted_by_position.sum()) / drafted if drafted else 0.0

    @property
    def acceptance_by_position(self) -> np.ndarray:
        """(k,) accepted / drafted at each guess position (NaN where nothing was drafted)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.accepted_by_position / np.where(self.drafted_by_position, self.drafted_by_position, np.nan)

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.baseline_tokens_per_s if self.baseline_tokens_per_s > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class SweepStarted:
    ks: tuple[int, ...]
    source: str
    source_label: str
    max_new_tokens: int


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    k: int
    acceptance_rate: float
    acceptance_by_position: np.ndarray  # (k,)
    tokens_per_pass: float
    tokens_per_s: float
    baseline_tokens_per_s: float
    speedup: float
    matches_baseline: bool | None
    differs: Divergence | None = None


SpecEvent = SpecStarted | SpecPrefilled | SpecStep | SpecBaseline | SpecFinished | SweepStarted | SweepPoint | Failed
