"""The written protocol between the app and the engine process: what the app asks for (sampling settings, what to
capture, a generation), the commands it sends and the notices it receives besides the engine events, all plain
frozen dataclasses. Imports neither torch nor Qt, so the GUI process can use it without loading torch (a test holds
it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Literal, get_args

import numpy as np

from engine.events import layers_text, steer_problem

# How a model's decode products compute, as the user picks it (--kernels, the app's Engine menu and model picker):
# what each mode means, for the CLI, the app and every output that names the mode that ran.
KERNEL_MODES: dict[str, str] = {
    "exact": "the file's weights, dequantized exactly, in the run's dtype (the default: the model's own numbers)",
    "file": "a GGUF's Q4 blocks as they are, through torch's int4 kernel with bf16 activations, as llama.cpp runs "
            "them; every other weight exact",
    "fast": "also int8 requantizations of the other quantized weights (bf16 activations): the fastest, furthest "
            "from the model's own numbers",
}
DEFAULT_MODE = "exact"
API_KEY_ENV = "INFERENCE_LAB_API_KEY"  # a server's API key is read from here when none is typed

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
    # Every layer's attention, besides attention_layers, for steps whose first query position is below this: a short
    # run keeps all layers at hand, while a long one stops paying L layers × its context a token (a step no longer
    # captured in a layer is recomputed from the KV cache when a panel asks for it).
    every_layer_below: int = 0

    def at(self, position: int, n_layers: int) -> Capture:
        """The capture of a step whose first query position is `position`."""
        if position < self.every_layer_below and len(self.attention_layers) < n_layers:
            return replace(self, attention_layers=frozenset(range(n_layers)))
        return self

    @classmethod
    def everything(cls, n_layers: int, funnel_top: int = FUNNEL_TOP) -> Capture:
        return cls(attention_layers=frozenset(range(n_layers)), residual_norms=True, funnel_top=funnel_top, logits=True)


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


# ---- the pipe between the app and the engine process ---------------------------------------------------------
# Both ends are this program's own processes; every message is one of the frozen dataclasses below (commands in,
# notices out) or an engine event (engine.events; a generation step's events come as one list). The bridge routes
# notices by type through one table (app/bridge.py).


@dataclass(frozen=True)
class GenerateRequest:
    text: str
    chat: bool = True
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    capture: Capture = field(default_factory=Capture)
    ignore_eos: bool = False
    start_paused: bool = False  # prefill, then wait for step or resume
    prompt_ids: tuple[int, ...] = ()  # when given, the prompt as token ids (a fork's prefix); `text` is then a label
    forced: tuple[tuple[int, int], ...] = ()  # (step, token id) pairs put in place of sampling (a fork: ((0, id),))
    regex: str | None = None  # the output must match this regular expression (engine.run.constrain)
    json_schema: str | None = None  # … or be JSON valid under this schema (JSON text)
    ablation: Ablated | None = None  # run every forward pass with these parts ablated (the local torch engine only)
    steer: Steer | None = None  # add this steering vector in every forward pass (a local model, either runtime)


@dataclass(frozen=True)
class Ablated:
    """The parts of the model a generation runs without: zero-ablated, or with `mean` replaced by their mean over
    the prompt's positions in the clean run (engine.why.ablate, kept on for every step of the generation)."""

    heads: tuple[tuple[int, int], ...] = ()  # (layer, head)
    attn_layers: tuple[int, ...] = ()
    mlp_layers: tuple[int, ...] = ()
    mean: bool = False

    def __post_init__(self) -> None:
        if not (self.heads or self.attn_layers or self.mlp_layers):
            raise ValueError("nothing to ablate: name at least one head, attention layer or MLP layer")

    @property
    def label(self) -> str:
        """A run's name for it, e.g. "ablated 18:6, MLP 3" ("mean-ablated …" with `mean`)."""
        parts = ([f"{layer}:{head}" for layer, head in self.heads] + [f"attn {i}" for i in self.attn_layers]
                 + [f"MLP {i}" for i in self.mlp_layers])
        return f"{'mean-' if self.mean else ''}ablated {', '.join(parts)}"


@dataclass(frozen=True, eq=False)
class Steer:
    """A steering vector as it crosses the process boundary: `directions[i]` × `scale` is added to the output of
    block `layers[i]` at every position of every forward pass (engine.why.steer, engine.why.steered). Plain data,
    checked on construction (ValueError in one sentence); the array is a read-only float32 copy."""

    name: str  # where it came from: a file's name, or "built from N pairs"
    layers: tuple[int, ...]
    directions: np.ndarray  # (len(layers), d_model) float32
    scale: float = 1.0

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, (tuple, list)):
            layers = tuple(int(x) if isinstance(x, np.integer) else x for x in layers)
        a = self.directions
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            a = np.array(a, dtype=np.float32)  # a copy: the sender's array stays theirs
            a.setflags(write=False)
        scale = float(self.scale) if isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool) else (
            self.scale)
        problem = steer_problem(self.name, layers, a, scale)
        if problem is not None or a is None:
            raise ValueError(f"not a steering vector: {problem or 'it holds no directions'}")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "directions", a)
        object.__setattr__(self, "scale", scale)

    def at(self, scale: float) -> Steer:
        """The same vector at another scale."""
        return replace(self, scale=scale)

    @property
    def label(self) -> str:
        """e.g. "happy.gguf at layers 10–19 × +4"."""
        s = f"× {self.scale:+g}".replace("-", "−")
        return f"{self.name} at layer{'s' if len(self.layers) > 1 else ''} {layers_text(self.layers)} {s}"


class Command:
    """Base of everything the app sends to the engine process."""


class Notice:
    """Base of everything the engine process sends besides the engine events."""


# -- commands
@dataclass(frozen=True)
class Load(Command):
    model: str | None
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"  # "torch", "llama.cpp" or "auto" (engine.backends.choose)
    kernels: str = "exact"  # the torch runtime's kernel mode (engine.model.kernel_cache.KERNEL_MODES)


@dataclass(frozen=True)
class Generate(Command):
    request: GenerateRequest


@dataclass(frozen=True)
class Preview(Command):
    """Next-token candidates for the text being typed; superseded by a newer Preview."""

    request_id: int
    text: str
    chat: bool
    top: int = 10


@dataclass(frozen=True)
class Pause(Command):
    pass


@dataclass(frozen=True)
class Resume(Command):
    pass


@dataclass(frozen=True)
class Step(Command):
    """While paused: one more token."""


@dataclass(frozen=True)
class Stop(Command):
    """End the running generation (a server's stalled stream included) and any long job."""


@dataclass(frozen=True)
class Quit(Command):
    pass


@dataclass(frozen=True)
class SetParams(Command):
    params: SamplingParams


@dataclass(frozen=True)
class SetSteerScale(Command):
    """The running steered generation's scale, from its next token on (ignored by a run that is not steered)."""

    scale: float


@dataclass(frozen=True)
class CaptureAttention(Command):
    """Capture these layers' attention from the next token on (and in every later generation)."""

    layers: frozenset[int]


@dataclass(frozen=True)
class CaptureLens(Command):
    """Capture the logit lens with this many top tokens a layer (0: none) from the next token on: the Logit lens panel
    asks for it while it is on screen with its capture ticked, and stops asking when it is hidden."""

    top: int


@dataclass(frozen=True)
class SetThreads(Command):
    setting: int | str  # "auto" (engine.model.threads) or a fixed count


@dataclass(frozen=True)
class BatchBench(Command):
    batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class Cancel(Command):
    """Cancel the running long job (batching lab, measurement, load lab); a generation is stopped with Stop."""


@dataclass(frozen=True)
class AskThisMachine(Command):
    """This machine's cached measurement for (device, dtype); never measures."""

    device: str
    dtype: str


@dataclass(frozen=True)
class Measure(Command):
    device: str
    dtype: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Connect(Command):
    url: str
    api_key: str | None = None  # lives in the engine process's memory only


@dataclass(frozen=True)
class Disconnect(Command):
    pass


@dataclass(frozen=True)
class ServeBench(Command):
    """Load lab: concurrency (list), num_prompts, max_new_tokens, request_rate, burstiness, time_limit_s, slo_ms."""

    config: dict


@dataclass(frozen=True)
class Speculate(Command):
    """The speculative-decoding lab on the local model (engine.labs.speculative): one run, or a sweep of k; its
    events go out as they come, then LabDone("spec")."""

    text: str
    chat: bool = False
    k: int = 4
    source: str = "lookup"  # "lookup", "early-exit" (exit_layer: 0 = half the model) or "draft-model"
    exit_layer: int = 0
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams.greedy_params)
    sweep: bool = False


@dataclass(frozen=True)
class Schedule(Command):
    """The scheduling lab on the local model (engine.labs.scheduler): static against continuous batching on the same
    arrivals, with a paged KV cache; its events go out as they come, then LabDone("sched")."""

    config: object  # engine.labs.schedule_events.SchedConfig


# -- labs: one request type each, run by Backend.run_lab; each ends with one LabDone
Lab = BatchBench | Speculate | Schedule | ServeBench
LAB_JOBS: dict[type, str] = {BatchBench: "batch", Speculate: "spec", Schedule: "sched", ServeBench: "serve"}
LAB_NAMES: dict[str, str] = {"batch": "the batching lab", "spec": "the speculative-decoding lab",
                             "sched": "the scheduling lab", "serve": "the load lab"}


# -- why-experiments (engine.why): one request, one outcome; the params' type says which experiment
@dataclass(frozen=True)
class HeadsParams:
    """Head roles scored on `repeat` random tokens repeated once (engine.why.heads)."""

    repeat: int = 24
    seed: int = 0


@dataclass(frozen=True)
class AblateParams:
    """The next-token distribution of `prompt` before and after zero- (or mean-) ablating these parts
    (engine.why.ablate)."""

    prompt: str
    heads: tuple[tuple[int, int], ...] = ()  # (layer, head)
    attn_layers: tuple[int, ...] = ()
    mlp_layers: tuple[int, ...] = ()
    mean: bool = False
    chat: bool = False
    tokens: tuple[int, int] | None = None  # two token ids whose logit difference is reported before and after

    @property
    def ablated(self) -> Ablated:
        """The same parts, for a generation that continues from the ablated model (GenerateRequest.ablation)."""
        return Ablated(self.heads, self.attn_layers, self.mlp_layers, self.mean)


@dataclass(frozen=True)
class PatchParams:
    """Activation patching from the clean prompt into the corrupted one (equal token lengths), scored by the logit
    difference of `answer` over `wrong` (engine.why.patch)."""

    clean: str
    corrupt: str
    answer: str
    wrong: str
    heads: bool = False  # also patch each head's output


@dataclass(frozen=True)
class AttributeParams:
    """Which prompt tokens drove the next token (engine.why.attribute)."""

    prompt: str
    method: str = "ig"  # "ig", "grad-input" or "occlusion"
    steps: int = 32  # integrated gradients' steps
    target: int | None = None  # token id scored (None: the model's greedy next token)
    chat: bool = False


@dataclass(frozen=True)
class CompareParams:
    """The same prompt, or a corpus, through the loaded model and another file of one model (engine.why.compare)."""

    other: str  # path of the other model file or folder
    prompt: str
    steps: int = 16  # greedy steps compared
    backend: str = "auto"  # the other model's runtime: "torch", "llama.cpp" or "auto"
    chat: bool = False
    kernels: str = "exact"  # the other model's kernel mode on torch (the same file under another mode: what it costs)
    corpus: str = ""  # a text file's path: compare over its text in windows (engine.why.compare), not over `prompt`
    window: int = 0  # tokens per window of the corpus (0: CORPUS_WINDOW)
    max_tokens: int = 0  # the corpus's tokens compared at most (0: CORPUS_MAX_TOKENS)
    lens: bool = False  # a corpus comparison also compares the logit lens per layer


# A corpus comparison's default window and cap: llama-perplexity's windows are 512 tokens, but on two cores a
# comparison through both sides has to end while the user waits.
CORPUS_WINDOW = 256
CORPUS_MAX_TOKENS = 2048


@dataclass(frozen=True)
class DlaParams:
    """Direct logit attribution of `answer` over `wrong` (one token each) at generation step `step` of `prompt`: what
    each head, each MLP and the embeddings wrote into their logit difference (engine.why.dla)."""

    prompt: str
    answer: str
    wrong: str
    step: int = 0  # 0: the prompt's last position; N: after N greedy tokens
    chat: bool = False


@dataclass(frozen=True)
class AtpParams:
    """Attribution patching (engine.why.atp): PatchParams' grids estimated from one backward pass, beside the exact
    grids when `exact`, with their correlation and the cells where the two part."""

    clean: str
    corrupt: str
    answer: str
    wrong: str
    heads: bool = False
    exact: bool = True
    ig_steps: int = 0  # > 0: the gradient averaged along the path between the prompts' embeddings (EAP-IG)


@dataclass(frozen=True)
class GalleryParams:
    """One of the gallery's canned experiments (engine.why.gallery.GALLERY) on the loaded model, by name."""

    name: str


EXPERIMENT_KINDS: dict[type, str] = {HeadsParams: "heads", AblateParams: "ablate", PatchParams: "patch",
                                     AttributeParams: "attribute", CompareParams: "compare", DlaParams: "dla",
                                     AtpParams: "atp", GalleryParams: "gallery"}


@dataclass(frozen=True)
class Experiment(Command):
    """Run one why-experiment on the loaded model: Progress("why", …) while it runs, then one ExperimentDone.
    Cancel stops it between forward passes."""

    request_id: int
    params: (HeadsParams | AblateParams | PatchParams | AttributeParams | CompareParams | DlaParams | AtpParams
             | GalleryParams)

    def __post_init__(self) -> None:
        if type(self.params) not in EXPERIMENT_KINDS:
            raise TypeError(f"not the parameters of an experiment: {type(self.params).__name__}")

    @property
    def kind(self) -> str:
        return EXPERIMENT_KINDS[type(self.params)]


STEER_ACTIONS = ("build", "load", "save")


@dataclass(frozen=True)
class SteerVector(Command):
    """A steering vector, made in the engine process: built from contrast pairs (positive, negative) at `layers` by
    `method` ("mean" or "pca", engine.why.steer) on the loaded model, with Progress("steer", …) and Cancel between
    forward passes; loaded from the control-vector file `path` and checked against the loaded model; or `vector`
    saved to `path` as one. Answered by one SteerReady; a build waits for a running generation, a load or a save
    is done between two of its tokens."""

    request_id: int
    action: str = "build"  # one of STEER_ACTIONS
    pairs: tuple[tuple[str, str], ...] = ()
    layers: tuple[int, ...] = ()
    method: str = "mean"
    path: str = ""
    vector: Steer | None = None  # what "save" writes

    def __post_init__(self) -> None:
        if self.action not in STEER_ACTIONS:
            raise ValueError(f"not a steering action: {self.action!r} (choose {', '.join(STEER_ACTIONS)})")
        if self.action == "save" and (self.vector is None or not self.path):
            raise ValueError("saving a steering vector needs the vector and a path")


TUNE_LENS_ACTIONS = ("fit", "use", "off")


@dataclass(frozen=True)
class TuneLens(Command):
    """The tuned lens of the loaded model (engine.why.tuned_lens): "fit" one on `corpus` (a UTF-8 text file; "":
    Python's help text) with Progress("tuned_lens", …) and Cancel between steps, then save it under the model file's
    SHA-256 and use it; "use" the one saved for the model file; "off": the logit lens alone. Answered by one
    LensTuned; a fit waits for a running generation, "use" and "off" act between two of its tokens."""

    request_id: int
    action: str = "use"  # one of TUNE_LENS_ACTIONS
    corpus: str = ""
    tokens: int = 0  # training tokens of a fit (0: the fit's default)
    steps: int = -1  # KL steps of a fit (-1: the fit's default)
    seconds: float = 0.0  # the KL steps' time bound (0: the fit's default)

    def __post_init__(self) -> None:
        if self.action not in TUNE_LENS_ACTIONS:
            raise ValueError(f"not a tuned-lens action: {self.action!r} (choose {', '.join(TUNE_LENS_ACTIONS)})")


@dataclass(frozen=True)
class ServeModel(Command):
    """Start llama.cpp's server on 127.0.0.1 for the loaded model and connect to it (Progress and Done "serve_model");
    it stops on Disconnect, on StopServing and when the engine process ends."""


@dataclass(frozen=True)
class StopServing(Command):
    pass


@dataclass(frozen=True)
class WatchFleet(Command):
    """Watch a fleet (engine.remote.fleet): `source` is a router's URL (its replicas from its listing) or a fleet
    config file (replicas with their spans ports: who served which request); "" stops. FleetStatus every
    `interval_s`."""

    source: str = ""
    interval_s: float = 1.0


@dataclass(frozen=True)
class Tokenize(Command):
    """The running backend's own tokenization of `text` (a server's, when connected); the newest one wins."""

    request_id: int
    text: str
    chat: bool = False


@dataclass(frozen=True)
class Recompute(Command):
    """A step's attention (and lens) run again from the live run's KV cache (engine.run.recompute), for a step whose
    capture the app let go: `ids` are the run's tokens at positions 0…p, the last one the step's query. Answered by
    Recomputed, between two tokens when a generation runs."""

    request_id: int
    step: int
    ids: tuple[int, ...]
    layers: frozenset[int]
    lens_top: int = 0  # top tokens per layer of the logit lens (0: no lens)
    token: int = -1  # the token the step chose (the lens gives its probability), -1: not known


@dataclass(frozen=True)
class Ping(Command):
    """Answered by Pong once every command sent before it has been handled: a test's way to know the engine is idle."""

    token: int


# -- notices
@dataclass(frozen=True)
class Progress(Notice):
    """A long job's progress: job is "load", "batch", "measure", "serve", "why", "steer" or "tuned_lens"; fraction
    in [0, 1]."""

    job: str
    fraction: float
    message: str


@dataclass(frozen=True)
class Done(Notice):
    """A long job that is not a lab ended (measure, serve_model): message "" when complete, else why it stopped
    ("cancelled", an error sentence). A lab ends with LabDone."""

    job: str
    message: str = ""


@dataclass(frozen=True)
class Loaded(Notice):
    info: object  # engine.events.ModelInfo
    tokenizer: object  # engine.tokenizer Tokenizer
    cfg: object  # engine.model.config.ModelConfig
    runtime: str = "torch"  # what runs it: "torch" or "llama.cpp" (the app names it when the engine dies)


@dataclass(frozen=True)
class LoadFailed(Notice):
    message: str


@dataclass(frozen=True)
class State(Notice):
    state: str  # "idle", "generating" or "paused"


@dataclass(frozen=True)
class BatchMeasured(Notice):
    row: BatchRow


@dataclass(frozen=True)
class ThisMachine(Notice):
    device: str
    dtype: str
    hardware: object  # engine.costs.catalog.Hardware, or None: not measured


@dataclass(frozen=True)
class Connected(Notice):
    info: object  # engine.remote.client.ServerInfo


@dataclass(frozen=True)
class ConnectFailed(Notice):
    message: str


@dataclass(frozen=True)
class Disconnected(Notice):
    pass


@dataclass(frozen=True)
class ServeRequestDone(Notice):
    result: object  # engine.remote.loadlab.RequestResult


@dataclass(frozen=True)
class ServeMetrics(Notice):
    t: float
    metrics: object  # engine.remote.metrics.ServerMetrics


@dataclass(frozen=True)
class ServeLevelDone(Notice):
    figures: dict  # one concurrency level, with `vllm bench serve`'s keys


@dataclass(frozen=True)
class ServeSpans(Notice):
    """Load lab with the server's spans: a level's requests again, each with the span the server exported for it
    (engine.remote.spans.ServerSpan, or None), and one line per trouble the span receiver met."""

    results: tuple  # engine.remote.loadlab.RequestResult
    endpoint: str = ""  # where the receiver listens (what the server's --otlp-traces-endpoint names)
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServeBlocks(Notice):
    """Load lab with the server's KV events: its prefix cache's blocks now (engine.remote.kvevents.BlockSnapshot),
    beside /metrics' KV usage at the same scrape (None: not known)."""

    t: float
    blocks: object  # engine.remote.kvevents.BlockSnapshot
    kv_usage: float | None = None


@dataclass(frozen=True)
class FleetStatus(Notice):
    """The Fleet panel: one scrape of a router's replicas (engine.remote.fleet.ReplicaFigures) and which replica
    served each request whose span reached a replica's receiver ((engine request id, replica name)); `error` is one
    sentence when the fleet could not be watched at all."""

    router: str = ""
    replicas: tuple = ()
    served: tuple = ()
    error: str = ""
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tokenized(Notice):
    """The backend's tokenization of a prompt (and of its chat form); errors are one sentence, "" when none."""

    request_id: int
    text: str
    prompt: object = None  # engine.events.PromptTokenized
    error: str = ""
    chat_prompt: object = None
    chat_error: str = ""


@dataclass(frozen=True)
class PreviewResult(Notice):
    """Next-token candidates for the text being typed (no generation)."""

    request_id: int
    text: str
    n_tokens: int
    n_reused: int  # prompt tokens whose K/V came from the previous run (prefix caching)
    n_computed: int
    seconds: float
    funnel: object  # engine.events.Funnel


@dataclass(frozen=True)
class ExperimentDone(Notice):
    """How an Experiment ended: exactly one of a result (the JSON-ready dict the CLI prints), cancelled, or a failure
    (one sentence; `unsupported` when the runtime cannot run this experiment at all)."""

    request_id: int
    kind: str  # EXPERIMENT_KINDS' names: "heads", "ablate", "patch", "attribute", "compare", "dla", "atp", "gallery"
    params: object  # the Experiment's params
    result: dict | None = None
    cancelled: bool = False
    failure: str = ""
    unsupported: bool = False
    seconds: float = 0.0  # wall time of the experiment in the engine process

    @property
    def ok(self) -> bool:
        return self.result is not None


@dataclass(frozen=True)
class HeldAttention(Notice):
    """Attention captured for the record (Capture.every_layer_below) in layers no panel showed: held in the engine
    process during a generation and sent together, in step and layer order, when the run ends (before its Finished)
    or when a panel asks for one of those layers. What is shown travels with each step; this, once."""

    events: tuple = ()  # engine.events.AttentionCaptured


@dataclass(frozen=True)
class Recomputed(Notice):
    """The answer to a Recompute: the step's AttentionCaptured per layer (and its LensCaptured), or one sentence
    saying why not (the cache holds another run now; the runtime keeps its cache to itself)."""

    request_id: int
    step: int
    attention: tuple = ()  # engine.events.AttentionCaptured, one per layer asked for
    lens: object = None  # engine.events.LensCaptured, when lens_top asked for it
    error: str = ""
    seconds: float = 0.0  # wall time in the engine process
    threads: int = 0  # the thread count it ran at: the one the step ran at (its kernels); 0: it did not run
    reused: bool = False  # answered from the engine's record of the step's last recompute, without running the model

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class SteerReady(Notice):
    """How a SteerVector ended: the vector built or loaded (at scale 1) or saved, or cancelled, or why not (one
    sentence)."""

    request_id: int
    action: str
    steer: Steer | None = None
    norms: tuple[float, ...] = ()  # |direction| of each layer, in the vector's layer order
    error: str = ""
    cancelled: bool = False
    path: str = ""
    seconds: float = 0.0  # wall time in the engine process

    @property
    def ok(self) -> bool:
        return self.steer is not None and not self.error and not self.cancelled


@dataclass(frozen=True)
class LensTuned(Notice):
    """How a TuneLens ended: whether a tuned lens is in use now, its summary (engine.why.tuned_lens.summary: how it
    was fitted, both lenses' mean KL to the output per layer on held-out text), or cancelled, or why not (one
    sentence)."""

    request_id: int
    action: str
    in_use: bool = False
    summary: dict | None = None
    cancelled: bool = False
    error: str = ""
    seconds: float = 0.0  # wall time in the engine process


LabOutcome = Literal["done", "cancelled", "failed", "unsupported"]
LAB_OUTCOMES: tuple[LabOutcome, ...] = get_args(LabOutcome)


@dataclass(frozen=True)
class LabDone(Notice):
    """How a lab (a Lab request) ended, in the shape of ExperimentDone: done; cancelled (Cancel, Stop or Quit);
    failed, with why in one sentence; or unsupported: this runtime cannot run it at all, the sentence says why and
    what to do instead. Panels read the outcome, never the message's words."""

    job: str  # LAB_JOBS' name of the lab: "batch", "spec", "sched" or "serve"
    outcome: LabOutcome = "done"
    message: str = ""  # one sentence when failed or unsupported
    seconds: float = 0.0  # wall time of the lab in the engine process

    def __post_init__(self) -> None:
        if self.job not in LAB_NAMES:
            raise ValueError(f"not a lab: {self.job!r} (choose {', '.join(LAB_NAMES)})")
        if self.outcome not in LAB_OUTCOMES:
            raise ValueError(f"not a lab outcome: {self.outcome!r} (choose {', '.join(LAB_OUTCOMES)})")

    @property
    def ok(self) -> bool:
        return self.outcome == "done"


@dataclass(frozen=True)
class Pong(Notice):
    token: int


@dataclass(frozen=True)
class Stopped(Notice):
    """The engine process is ending (the answer to Quit)."""
