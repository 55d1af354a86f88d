"""The typed event stream: the only thing that crosses from the engine into the app or the CLI.

Every event is a frozen dataclass that carries plain numbers and numpy arrays (never live tensors), so a consumer
in another thread can keep it as long as it likes. A generation yields, in order:

    RunStarted → PromptTokenized → [AttentionCaptured…, ResidualNorms, LensCaptured] → KVCacheGrew → PrefillDone
        → TokenSampled
    then per decode step: [AttentionCaptured…, ResidualNorms, LensCaptured] → KVCacheGrew → TokenSampled
    and finally Finished (or Failed). A steered run (engine.why.steered) adds Steered after PromptTokenized, and
    again before the events of the first step at a new scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Phase = Literal["prefill", "decode"]
FinishReason = Literal["eos", "length", "stopped", "context", "engine lost"]  # engine lost: its process died (app)


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """Facts about the loaded model, as shown by `python -m engine info` and the app's status bar."""

    name: str
    path: str
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    n_params: int
    dtype: str
    device: str
    weight_bytes: int
    kv_bytes_per_token: int
    file_type: str
    load_s: float
    from_cache: bool
    # sliding-window attention (Gemma 3, Mistral): 0 and all "global" when the model has none
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    rope_base_local: float = 0.0
    # KV bytes one position adds in the global and in the local layers (the local part only while the context is
    # shorter than the window); kv_bytes_per_token above is the average per position at the full context_length
    kv_bytes_per_token_global: int = 0
    kv_bytes_per_token_local: int = 0
    # the file's own storage: bytes and values by tensor type (GGUF: Q4_K, Q6_K, F32, …; safetensors: BF16, …)
    file_bytes_by_type: dict[str, int] = field(default_factory=dict)
    file_params_by_type: dict[str, int] = field(default_factory=dict)
    file_bits_per_weight: dict[str, float] = field(default_factory=dict)
    # weights one decode step streams: at the file's format (as llama.cpp would) and at the running dtype
    decode_weight_bytes_file: int = 0
    decode_weight_bytes: int = 0
    # SHA-256 of the weights file (a folder: its config.json and *.safetensors), hashed once by the engine at load;
    # a saved session names its model by it
    sha256: str = ""
    # how the decode products computed (engine.model.kernel_cache.KERNEL_MODES): "exact" (the file's weights,
    # dequantized exactly, in `dtype`), "file" (a GGUF's Q4 blocks as they are, as llama.cpp runs them), "fast"
    # (requantized forms allowed too)
    kernels: str = "exact"


# What a backend may be unable to report about a run; panels that draw one of these say so instead of drawing.
Capability = Literal["attention", "residual_norms", "costs", "full_logits", "lens", "forced_tokens", "prompt_scores"]
CAPABILITIES: tuple[Capability, ...] = ("attention", "residual_norms", "costs", "full_logits", "lens", "forced_tokens",
                                        "prompt_scores")


@dataclass(frozen=True, kw_only=True)
class RunSource:
    """Where a run came from: the local model or a server, named as the user would recognise it (a URL is shown
    without credentials), what that source could not report, and how to read what it did report. The app asks these
    facts, never `kind` (tests/test_seams.py holds it): a third source states its own."""

    kind: Literal["local", "server"]  # for the record; ask the facts below
    name: str  # the model's name; for a server "model @ host:port"
    cannot: tuple[Capability, ...] = ()
    # The token ids index the loaded model's vocabulary (its tokenizer can name them); a server's ids belong to its
    # own tokenizer, and are -1 where it names none.
    token_ids_are_local: bool | None = None
    # The run's times and figures were measured by a server, not by this engine: each token's seconds is the gap
    # between its stream's chunks (0 for the later tokens of a chunk), and the server's /metrics describe its KV.
    measured_by_server: bool | None = None

    def __post_init__(self) -> None:
        # A run recorded before a source stated these facts: the facts of its kind's backends then
        remote = self.kind == "server"
        if self.token_ids_are_local is None:
            object.__setattr__(self, "token_ids_are_local", not remote)
        if self.measured_by_server is None:
            object.__setattr__(self, "measured_by_server", remote)

    def can(self, what: Capability) -> bool:
        return what not in self.cannot


@dataclass(frozen=True, kw_only=True)
class RunStarted:
    """The first event of every generation: where it runs. A replayed run carries the source it was recorded from."""

    source: RunSource


@dataclass(frozen=True, kw_only=True)
class PromptTokenized:
    """The prompt as the model sees it: ids, their text pieces and where each came from in the text."""

    text: str
    ids: np.ndarray  # (T,) int64
    pieces: tuple[str, ...]
    offsets: np.ndarray  # (T, 2) character offsets into `text`
    byte_offsets: np.ndarray  # (T, 2) offsets into text.encode("utf-8")
    special: np.ndarray  # (T,) bool: control tokens such as <|im_start|>
    unrepresentable: tuple[tuple[int, int], ...] = ()  # (byte offset, byte value) the vocabulary cannot encode


@dataclass(frozen=True, kw_only=True)
class StepCost:
    """Analytical cost of one forward step, from the model's real shapes (see engine.costs.formulas)."""

    flops: float  # floating-point operations (a multiply-add counts as 2)
    weight_bytes: float  # weights read from memory
    kv_read_bytes: float  # keys and values cached before this step that its attention reads
    kv_write_bytes: float  # new keys and values written to the cache
    activation_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        """Total bytes moved to or from memory."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte."""
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True, kw_only=True)
class AttentionCaptured:
    """Attention weights of one layer for the queries of one step.

    prefill: weights is (heads, T, T) with the causal upper triangle exactly zero;
    decode: weights is (heads, 1, position + 1): the new row.
    """

    step: int  # 0 is the prefill, then 1, 2, … for decode steps
    phase: Phase
    layer: int
    query_start: int  # absolute position of the first query row
    weights: np.ndarray  # (n_heads, n_queries, n_keys) float32
    group_size: int  # query heads per KV head: head h reads KV head h // group_size
    rows_skipped: int = 0  # the first query rows left out to bound memory (engine.model.seam.Reads); 0: all here


@dataclass(frozen=True, kw_only=True)
class ResidualNorms:
    """L2 norm of the residual stream after the embedding (index 0) and after each layer, for the newest token."""

    step: int
    norms: np.ndarray  # (n_layers + 1,) float32


@dataclass(frozen=True, kw_only=True)
class PromptScored:
    """How surprising each prompt token was to the model, from the prefill's logits at every position (one pass).

    Token i is scored by the logits at position i − 1; the first token, and prompt tokens whose keys and values
    were reused from the KV cache (not recomputed), have no score: scores start at `first`.
    """

    first: int  # index of the first scored prompt token
    ids: np.ndarray  # (n,) int64: the scored tokens, prompt[first:]
    probs: np.ndarray  # (n,) float32: p(token | the tokens before it)
    surprise_bits: np.ndarray  # (n,) float32: −log₂ p
    entropy_bits: np.ndarray  # (n,) float32: entropy of the distribution it was drawn against
    top_ids: np.ndarray  # (n,) int64: what the model expected most at that position


@dataclass(frozen=True, kw_only=True)
class LensCaptured:
    """The logit lens of one step, for the newest position: the residual stream after the embedding (row 0) and
    after each layer (rows 1…L) projected through the final norm and the LM head, and the model's own output
    distribution (row L + 1). Probabilities are plain softmax, before any sampling setting.
    """

    step: int
    position: int  # position whose next token the rows predict about
    ids: np.ndarray  # (n_layers + 2, N) int64: each row's top tokens, most probable first
    probs: np.ndarray  # (n_layers + 2, N) float32
    entropy_bits: np.ndarray  # (n_layers + 2,) float32: entropy of each row's whole distribution, in bits
    pieces: tuple[tuple[str, ...], ...] = ()  # readable text of `ids`, row by row
    token_id: int = -1  # the token this step chose (-1: not known)
    token_probs: np.ndarray | None = None  # (n_layers + 2,) its probability in every row
    kl_bits: np.ndarray | None = None  # (n_layers + 2,) float32: KL(output ‖ row) in bits (None: not computed)
    tuned: LensCaptured | None = None  # the same step through the tuned lens (engine.run.lens.TunedLens), when in use


@dataclass(frozen=True, kw_only=True)
class KVCacheGrew:
    """The KV cache after a step: positions held and bytes used / allocated (all layers, keys and values)."""

    step: int
    n_tokens: int
    bytes_used: int
    bytes_allocated: int
    batch: int = 1
    local_slots: int = 0  # positions a sliding-window layer's buffer holds (2 × window, or all); 0: none, or not said


@dataclass(frozen=True, kw_only=True)
class PrefillDone:
    """The whole prompt went through the model in one forward pass; the cache holds it."""

    n_tokens: int  # tokens computed in this prefill
    n_reused: int  # prompt tokens whose K/V were reused from the previous run (prefix caching)
    seconds: float
    cost: StepCost


@dataclass(frozen=True, kw_only=True)
class Funnel:
    """The sampling funnel for one step, over the candidates (the top tokens by raw logit, plus the sampled one).

    Each `p_*` array is the probability of each candidate after that stage (0 where the stage removed it).
    `kept_*` counts the tokens of the whole vocabulary that survive each stage.
    """

    ids: np.ndarray  # (N,) int64, sorted by raw logit, descending
    pieces: tuple[str, ...]
    logits: np.ndarray  # (N,) raw logits
    p_raw: np.ndarray  # plain softmax of the raw logits
    p_temperature: np.ndarray  # after penalties, logit bias and temperature
    p_top_k: np.ndarray
    p_top_p: np.ndarray
    p_final: np.ndarray  # after min-p: the distribution actually sampled from
    kept_top_k: int
    kept_top_p: int
    kept_final: int
    vocab_size: int
    greedy: bool
    kept_grammar: int = -1  # tokens a grammar (regex / JSON schema) allowed at this step; -1 = no grammar


@dataclass(frozen=True, kw_only=True)
class TokenSampled:
    """One token, chosen and appended. step 0 is the token that the prefill produced (it sets TTFT)."""

    step: int
    phase: Phase
    position: int  # position of this token in the sequence
    token_id: int
    piece: str  # the token's text piece (byte-level pieces made readable)
    text: str  # the text this token adds to the output (may be "" until a multi-byte character completes)
    seconds: float  # forward pass + sampling time of this step
    cost: StepCost
    funnel: Funnel | None = None
    # (vocab,) float32 raw logits, when captured: lets a UI re-run the funnel (with the ids before this token, which
    # the consumer builds from its record of the run: prompt ids + the tokens of the earlier steps)
    logits: np.ndarray | None = None
    params: object = None  # the engine.run.sampling.SamplingParams this token was sampled with
    forced: bool = False  # the token was put here by the caller (a fork, --force), not sampled


@dataclass(frozen=True, kw_only=True)
class Finished:
    """Generation ended. Latency = TTFT + (n_generated - 1) · TPOT."""

    reason: FinishReason
    prompt_ids: np.ndarray
    ids: np.ndarray  # generated ids
    text: str
    ttft_s: float
    tpot_s: float  # mean time per output token over the decode steps (0 when only one token)
    step_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))  # decode step times
    total_s: float = 0.0
    # of total_s, the time outside the timed steps: prompt scoring, captures, the logit lens (its L + 1 LM heads)
    outside_steps_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0


MAX_STEER_SCALE = 1e4  # a steering scale's bound either way (engine.why.steer.Steering refuses beyond it)
MAX_STEER_LAYERS = 4096
MAX_STEER_WIDTH = 1 << 16  # d_model
MAX_STEER_NAME = 200  # characters


def steer_problem(name: object, layers: object, directions: object, scale: object) -> str | None:
    """What is wrong with a steering vector's plain data, in one sentence (None: nothing). `directions` may be None
    (a Steered event that only changes the scale, with name "" and no layers)."""
    if not isinstance(name, str) or len(name) > MAX_STEER_NAME:
        return f"its name is not text of at most {MAX_STEER_NAME} characters"
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not abs(scale) <= MAX_STEER_SCALE:
        return f"its scale {scale!r} is not a finite number within ±{MAX_STEER_SCALE:g}"
    if not isinstance(layers, tuple) or len(layers) > MAX_STEER_LAYERS or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers):
        return "its layers are not block indices"
    if list(layers) != sorted(set(layers)):
        return "its layers are not in increasing order, each once"
    if directions is None:
        return None if not layers else "it names layers but holds no directions"
    if not isinstance(directions, np.ndarray) or directions.dtype.kind != "f" or directions.ndim != 2:
        return "its directions are not a 2-D array of floats"
    if not layers or directions.shape[0] != len(layers) or not 1 <= directions.shape[1] <= MAX_STEER_WIDTH:
        return f"its directions have shape {directions.shape} for {len(layers)} layers"
    if not np.isfinite(directions).all():
        return "its directions hold values that are not finite"
    return None


def layers_text(layers: tuple[int, ...]) -> str:
    """Blocks as a person writes them: "10–19", "8, 10", "1"."""
    if not layers:
        return "no layer"
    if len(layers) > 2 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}–{layers[-1]}"
    return ", ".join(str(x) for x in layers)


@dataclass(frozen=True, kw_only=True)
class Steered:
    """A steering vector is on for this run (engine.why.steered): vector × scale is added to the output of each of
    `layers`' blocks in every forward pass. The first one comes right after PromptTokenized and carries the vector;
    a later one says the scale changed between two tokens, from token `step` on (keys and values cached before it
    keep the scale they were computed with)."""

    step: int  # the first step sampled at this scale (0: the prefill's token)
    scale: float
    name: str = ""  # the vector's: a file's name or "built from N pairs" (first event only)
    layers: tuple[int, ...] = ()  # first event only
    directions: np.ndarray | None = None  # (len(layers), d_model) float32, first event only

    def problem(self) -> str | None:
        """What a panel would trip over in this event (a session file's), in one sentence; None when sound."""
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            return f"its step {self.step!r} is not a step"
        return steer_problem(self.name, self.layers, self.directions, self.scale)

    @property
    def label(self) -> str:
        """e.g. "built from 4 pairs at layers 10–19 × +4" (the first event's; a later one: "× −2")."""
        scale = f"× {self.scale:+g}".replace("-", "−")
        if not self.layers:
            return scale
        return f"{self.name} at layer{'s' if len(self.layers) > 1 else ''} {layers_text(self.layers)} {scale}"


@dataclass(frozen=True, kw_only=True)
class Failed:
    """Generation could not go on; `message` is one clear sentence for the user."""

    message: str


Event = (
    RunStarted | PromptTokenized | PromptScored | AttentionCaptured | ResidualNorms | LensCaptured | KVCacheGrew
    | PrefillDone | TokenSampled | Steered | Finished | Failed
)
