"""Model configuration: the handful of shapes that determine everything else, and the few per-family differences.

A config completes itself: `head_dim`, the GQA group size and the layer types are derived in `__post_init__`.
Families differ in a few explicit places, each a field below and one small branch in engine/model/transformer.py:

| field | Llama/SmolLM2 | Qwen2 | Qwen3 | Phi-3 | Mistral | Gemma 3 |
|---|---|---|---|---|---|---|
| qkv_bias | no | yes | no | no | no | no |
| qk_norm (RMSNorm per head before RoPE) | no | no | yes | no | no | yes |
| post_norms (norm on attention and MLP outputs) | no | no | no | no | no | yes |
| mlp_activation | silu | silu | silu | silu | silu | gelu_tanh |
| embedding_scale | 1 | 1 | 1 | 1 | 1 | √d_model |
| attn_scale (0 = 1/√head_dim) | 0 | 0 | 0 | 0 | 0 | query_pre_attn_scalar^-½ |
| sliding_window, layer_types | – | – | – | window, all local | window, all local | 512; every 6th global |
| rope_base_local | – | – | – | – | – | 10,000 (global layers: rope_base) |

Gemma's RMSNorm scales by (1 + w) in Hugging Face checkpoints; llama.cpp's converter stores 1 + w in the GGUF, and
the Hugging Face loader adds the 1 likewise, so the model's RMSNorm is x / rms(x) · w for every family.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

# Sane limits for every size a model file can claim, checked before anything is allocated. The largest open models
# stay well inside them (Llama 3.1 405B: 126 layers, d_model 16,384, 128 heads, ffn 53,248; Gemma 3: vocabulary
# 262,144; Llama 4 Scout: a 10M context); a value outside is a damaged or hostile header.
LIMITS: dict[str, tuple[int, int]] = {
    "n_layers": (1, 1024),
    "d_model": (1, 65_536),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),
    "head_dim": (2, 1024),
    "ffn_dim": (1, 262_144),
    "vocab_size": (1, 4_194_304),
    "context_length": (1, 16_777_216),
}


def checked_int(value: object, what: str, limits: tuple[int, int]) -> int:
    """`value` as an int within `limits`, else ValueError naming `what` (the key as the file spells it)."""
    lo, hi = limits
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= int(value) <= hi:
        raise ValueError(f"{what} must be an integer in {lo:,}…{hi:,}, got {value!r}")
    return int(value)


def checked_float(value: object, what: str, lo: float, hi: float) -> float:
    """`value` as a finite float with lo < value < hi, else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) \
            or not lo < float(value) < hi:
        raise ValueError(f"{what} must be a number between {lo:g} and {hi:g}, got {value!r}")
    return float(value)


@dataclass
class ModelConfig:
    """Shapes of a decoder of the Llama family (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2/3, Phi-3) or Gemma 3."""

    name: str = "model"
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 means "same as n_heads" (no GQA)
    ffn_dim: int = 128
    vocab_size: int = 256
    context_length: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    head_dim: int = 0  # 0 means d_model // n_heads
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # ---- per-family differences (see the table above) ----
    qk_norm: bool = False
    post_norms: bool = False
    mlp_activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh approximation)
    embedding_scale: float = 1.0
    attn_scale: float = 0.0  # 0 means 1/√head_dim
    sliding_window: int = 0  # 0: no window; else a local layer's query sees the last `sliding_window` positions
    layer_types: tuple[str, ...] = ()  # "global" or "local" per layer; () means all local if windowed, else global
    rope_base_local: float = 0.0  # RoPE base of local layers; 0 means rope_base
    # Divisors of RoPE's per-pair frequencies on global layers (Llama 3.1's "llama3" scaling, linear scaling,
    # GGUF's rope_freqs tensor); () means none. Length head_dim / 2.
    rope_freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "ffn_dim", "vocab_size", "context_length"):
            checked_int(getattr(self, name), name, LIMITS[name])
        for name in ("n_kv_heads", "head_dim"):  # 0 means "derive it"
            if getattr(self, name) != 0:
                checked_int(getattr(self, name), name, LIMITS[name])
        checked_float(self.rope_base, "rope_base", 0.0, math.inf)
        checked_float(self.norm_eps, "norm_eps", 0.0, 1.0)
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
            self.head_dim = self.d_model // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        self.eos_token_ids = tuple(self.eos_token_ids)
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"mlp_activation must be 'silu' or 'gelu_tanh', got {self.mlp_activation!r}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be ≥ 0, got {self.sliding_window}")
        if not self.layer_types:
            self.layer_types = ("local" if self.sliding_window else "global",) * self.n_layers
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= {"global", "local"}:
            raise ValueError(f"layer_types must be 'global' or 'local' for each of {self.n_layers} layers")
        if "local" in self.layer_types and not self.sliding_window:
            raise ValueError("local layers need a sliding_window")
        if self.rope_base_local == 0.0:
            self.rope_base_local = self.rope_base
        self.rope_freq_factors = tuple(float(f) for f in self.rope_freq_factors)
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            n = len(self.rope_freq_factors)
            raise ValueError(f"rope_freq_factors has {n} values, expected {self.head_dim // 2}")

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (GQA); 1 means plain multi-head attention."""
        return self.n_heads // self.n_kv_heads

    def is_local(self, layer: int) -> bool:
        """A local layer attends to the last `sliding_window` positions only (Gemma 3, Mistral)."""
        return self.layer_types[layer] == "local"

    @property
    def n_local_layers(self) -> int:
        return sum(t == "local" for t in self.layer_types)

    @property
    def n_global_layers(self) -> int:
        return self.n_layers - self.n_local_layers

    @property
    def softmax_scale(self) -> float:
        """The factor on q·k before the softmax: attn_scale, or 1/√head_dim."""
        return self.attn_scale or self.head_dim**-0.5

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for name in ("eos_token_ids", "layer_types", "rope_freq_factors"):
            if name in kw:
                kw[name] = tuple(kw[name])
        return cls(**kw)


PRESETS: dict[str, ModelConfig] = {
    # A model small enough to build in milliseconds; tests use it with random weights.
    "tiny-test": ModelConfig(
        name="tiny-test", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=96,
        vocab_size=300, context_length=256, rope_base=10000.0, tied_embeddings=False,
    ),
}
