"""Plain data that crosses between the app and the engine process besides the events: what the app asks for
(sampling settings, what to capture) and the batching lab's rows. Imports neither torch nor Qt, so the GUI
process can use it without loading torch (a test holds it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model.probe import Probe

FUNNEL_TOP = 20  # candidates kept in each step's sampling funnel by the app and the benchmark
ATTENTION_MAX_BYTES = 16 * 2**20  # float32 attention weights kept per layer and step


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 10.0):
            raise ValueError(f"temperature must be between 0 and 10 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or a positive number of tokens, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive (1 = off), got {self.repetition_penalty}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy_params(cls) -> SamplingParams:
        return cls(temperature=0.0)


@dataclass(frozen=True, kw_only=True)
class Capture:
    """What to record per step. Everything is off by default: the forward pass then takes the fast path."""

    attention_layers: frozenset[int] = field(default_factory=frozenset)
    attention_max_bytes: int = ATTENTION_MAX_BYTES  # per layer and step; a long prefill keeps its last rows
    residual_norms: bool = False
    funnel_top: int = 0  # candidates in each step's funnel (0 = no funnel)
    logits: bool = False  # the full raw logits, so a UI can re-run the funnel with other settings
    lens_top: int = 0  # top tokens per layer in each step's logit lens (0 = no lens; it costs L + 1 LM heads)
    prompt_scores: bool = False  # the prefill keeps every position's logits: each prompt token's probability

    @classmethod
    def everything(cls, n_layers: int, funnel_top: int = FUNNEL_TOP) -> Capture:
        return cls(attention_layers=frozenset(range(n_layers)), residual_norms=True, funnel_top=funnel_top, logits=True)

    def probe(self) -> Probe | None:
        from engine.model.probe import Probe  # torch: only the engine process builds probes

        if not self.attention_layers and not self.residual_norms and not self.lens_top:
            return None
        return Probe.for_capture(self.attention_layers, self.residual_norms, residual_stream=self.lens_top > 0,
                                 max_attention_bytes=self.attention_max_bytes)


@dataclass(frozen=True)
class BatchRow:
    batch: int
    context: int  # positions attended by the middle decode step
    tpot_s: float  # median time of one decode step (every stream waits this long per token)
    tokens_per_s_per_stream: float
    tokens_per_s_system: float
    flops_per_step: float
    bytes_per_step: float
    intensity: float  # analytic FLOP per byte of one decode step at this batch
    achieved_flops: float  # flops_per_step / tpot_s
    achieved_bandwidth: float  # bytes_per_step / tpot_s
    kv_bytes: float  # cache at the end of the run, all sequences

    def to_dict(self) -> dict:
        return asdict(self)
