"""The tuned lens, fitted on this machine: one affine map per layer that makes the layer's lens match the output.

The logit lens (engine.run.lens) reads residual row ℓ through the model's final norm and head as if the model
stopped there; below the last third of the stack that guess is far from what the model ends up saying. The tuned
lens (Belrose et al. 2023; the `tuned-lens` package) reads x + A_ℓ x + b_ℓ instead, with A_ℓ, b_ℓ fitted to minimise
KL(output ‖ lens_ℓ) over text, the output being the model's own distribution at the same position. Pre-fitted maps
exist for a few hub models only; here they are fitted for whatever model is loaded, on text every Python ships
(`pydoc_data.topics`, the help text of the language's keywords and statements) or a text file the user names:

1. the corpus is tokenized; its first `tokens` tokens train, the last HELD_OUT_TOKENS (never trained on) judge;
2. every residual point of the training text is read in one pass per few sequences through the session's seam
   (position 0 of each sequence, the attention sink whose residual is unlike any later position's, is left out);
3. each map starts from the least-squares affine map of row ℓ onto row L (ridge-regularised, closed form): cheap,
   and already most of the way, since the head reads row L;
4. then `steps` Adam steps on the KL itself, BATCH random positions a step, every layer at once, stopped by the step
   count, the time bound or Cancel, whichever comes first;
5. both lenses' KL to the output is measured on the held-out text, layer by layer, and kept with the maps.

Fitting needs gradients through the final norm and the head, so the torch runtime (engine.backend.require); the maps
then read any runtime's residual rows, llama.cpp's included, for the same model file. They are saved per model in
the engine's cache, keyed by the model file's SHA-256, as safetensors (plain float32 arrays and string facts, never a
pickle), and loaded again.

`python -m engine lens --tuned` uses them (fitting first when none is saved); the app's Logit lens panel fits, loads
and switches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.run.lens import LN2, TunedLens, use_tuned
from engine.why import Cancelled, Progress, ShouldStop, check_stop, require

if TYPE_CHECKING:
    import torch

    from engine.run.session import Engine

DEFAULT_TOKENS = 4096  # training tokens: d + 1 = 577 unknowns per output of each least-squares map, several per token
HELD_OUT_TOKENS = 512  # judged on, never trained on
SEQ_TOKENS = 256  # tokens per sequence the residuals are read from
PASS_SEQUENCES = 4  # sequences per forward pass while reading residuals
DEFAULT_STEPS = 20  # KL steps after the least-squares start
MAX_STEPS = 10_000
BATCH = 32  # positions per KL step (each through every layer's map and the head, forward and backward)
LEARNING_RATE = 1e-4  # Adam's: a larger one moved the last layers, already near the output, away from it
RIDGE = 1e-2  # the least-squares start's ridge, as a share of the centred rows' mean square per dimension
DEFAULT_SECONDS = 300.0  # the KL steps stop here (the least-squares start and the judging are not counted)
EVAL_POSITIONS = 256  # held-out positions the KL is averaged over (each costs 2 (L + 1) products with the head)
EVAL_CHUNK = 32  # held-out positions judged at once
MAX_CORPUS_BYTES = 32 << 20  # a corpus file is read up to here; more text than a fit uses is not needed
MAX_ROW_BYTES = 1 << 30  # the training text's residual rows, (L + 1) · d float32 values a token, held at once
FILE_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class Corpus:
    """Token sequences of SEQ_TOKENS: `train` fitted on, `held` (from the text's end) judged on."""

    name: str
    train: list[list[int]]
    held: list[list[int]]


def corpus_text(path: str | None = None) -> tuple[str, str]:
    """(name, text) of the corpus: the file at `path` (UTF-8, up to MAX_CORPUS_BYTES), or Python's own help text
    (pydoc_data.topics, in the order of its topic names). ValueError in one sentence when the file cannot serve."""
    if not path:
        from pydoc_data import topics

        return "Python's help topics (pydoc_data.topics)", "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_CORPUS_BYTES)
    except OSError as e:
        raise ValueError(f"cannot read the corpus {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8", errors="strict" if len(data) < MAX_CORPUS_BYTES else "ignore")
    except UnicodeDecodeError as e:
        raise ValueError(f"the corpus {path} is not UTF-8 text (byte {e.start} is not)") from None
    if "\x00" in text:
        raise ValueError(f"the corpus {path} holds NUL bytes: it is not text")
    return p.name, text


def make_corpus(session: Engine, path: str | None = None, tokens: int = DEFAULT_TOKENS,
                held_out: int = HELD_OUT_TOKENS, seq: int = SEQ_TOKENS) -> Corpus:
    """The corpus tokenized and cut into sequences: `tokens` from its start to fit on, `held_out` from its end to
    judge on. ValueError (one sentence) when the text is too short for both."""
    if tokens < seq or held_out < seq:
        raise ValueError(f"a tuned lens needs at least {seq} training and {seq} held-out tokens, got {tokens} and "
                         f"{held_out}")
    seq = min(seq, session.cfg.context_length)
    name, text = corpus_text(path)
    need = tokens + held_out
    # The text is tokenized only as far as the fit reads it: a 32 MiB file would take long, and held-out text from
    # its end is as unseen as any.
    chars = min(len(text), need * 16)
    ids = list(session.tokenizer.encode(text[:chars]).ids)
    if len(ids) < need and chars < len(text):
        ids = list(session.tokenizer.encode(text).ids)
    if len(ids) < need:
        raise ValueError(f"the corpus {name} has {len(ids):,} tokens; fitting on {tokens:,} and judging on "
                         f"{held_out:,} needs {need:,}")
    train = [ids[i:i + seq] for i in range(0, tokens - seq + 1, seq)]
    rest = ids[tokens:]
    held = [rest[len(rest) - held_out + i:len(rest) - held_out + i + seq] for i in range(0, held_out - seq + 1, seq)]
    return Corpus(name, train, held)


def residual_rows(session: Engine, seqs: list[list[int]], progress: Progress | None = None,
                  should_stop: ShouldStop | None = None, span: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """Every residual point (L + 1 rows: resid_pre.0 … resid_post.L−1) at every position of `seqs` but each one's
    first, read through the session's seam: (L + 1, N, d) float32, N = Σ (len − 1)."""
    import torch

    from engine.model.seam import Point

    L = session.cfg.n_layers
    points = [Point.resid(i) for i in range(L + 1)]
    parts = []
    for i in range(0, len(seqs), PASS_SEQUENCES):
        check_stop(should_stop)
        group = seqs[i:i + PASS_SEQUENCES]
        _, rec = session.run_points(group, record=points)
        rows = torch.stack([rec[p].float() for p in points])  # (L + 1, B, T, d)
        parts.append(rows[:, :, 1:].reshape(L + 1, -1, rows.shape[-1]))
        if progress is not None:
            done = min(1.0, (i + len(group)) / len(seqs))
            progress(span[0] + (span[1] - span[0]) * done, f"reading residuals: {i + len(group)}/{len(seqs)} "
                     "sequences")
    return torch.cat(parts, dim=1)


def least_squares(rows: torch.Tensor, ridge: float = RIDGE) -> TunedLens:
    """The affine maps x ↦ x + A x + b nearest in the mean square to row L from each row ℓ < L (rows (L + 1, N, d)):
    A, b minimise Σ_n |x_n + A x_n + b − y_n|² + λ |A|², with λ = ridge × the centred x's mean square per dimension,
    solved in float64 in closed form."""
    import torch

    L, _, d = rows.shape[0] - 1, rows.shape[1], rows.shape[2]
    y = rows[L].double()
    weight = np.zeros((L, d, d), np.float32)
    bias = np.zeros((L, d), np.float32)
    for ell in range(L):
        x = rows[ell].double()
        xm, r = x.mean(0), y - x
        rm = r.mean(0)
        xc, rc = x - xm, r - rm
        lam = ridge * float(xc.pow(2).sum()) / d
        gram = xc.T @ xc + lam * torch.eye(d, dtype=torch.float64)  # (d, d)
        a = torch.linalg.solve(gram, xc.T @ rc).T  # (d_out, d_in)
        weight[ell] = a.float().numpy()
        bias[ell] = (rm - a @ xm).float().numpy()
    return TunedLens(weight, bias)


class _Head:
    """The final norm and the head as float32 tensors outside inference mode, so that a gradient flows through them
    to the maps (the weights' own gradients are never taken)."""

    def __init__(self, session: Engine) -> None:
        import torch

        model = session.lm.model  # the torch runtime (require "gradients"): its weights as tensors
        with torch.inference_mode(False):
            self.norm = model.norm.weight.detach().float().clone()
            self.eps = float(model.norm.eps)
            self.weight = model.lm_head.detach().float().clone()  # (V, d)

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        h = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        return torch.log_softmax(h @ self.weight.T, dim=-1)  # (…, V)


def _kl_steps(head: _Head, rows: torch.Tensor, start: TunedLens, steps: int, seconds: float,
              progress: Progress | None, should_stop: ShouldStop | None, clock: Callable[[], float],
              span: tuple[float, float], seed: int = 0) -> tuple[TunedLens, int, list[float]]:
    """Adam on Σ_ℓ mean KL(output ‖ lens_ℓ) over BATCH random positions a step, from `start`: the maps, the steps
    taken and each step's mean KL per layer in nats."""
    import torch

    L = rows.shape[0] - 1
    losses: list[float] = []
    with torch.inference_mode(False), torch.enable_grad():
        a = torch.tensor(start.weight).requires_grad_(True)  # (L, d, d)
        b = torch.tensor(start.bias).requires_grad_(True)  # (L, d)
        opt = torch.optim.Adam([a, b], lr=LEARNING_RATE)
        gen = torch.Generator().manual_seed(seed)
        t0, taken = clock(), 0
        while taken < steps and clock() - t0 < seconds:
            check_stop(should_stop)
            x = rows[:, torch.randint(0, rows.shape[1], (BATCH,), generator=gen)].clone()  # (L + 1, n, d)
            with torch.no_grad():
                target = head.log_probs(x[L])  # (n, V)
            moved = x[:L] + torch.einsum("lnd,led->lne", x[:L], a) + b[:, None]  # (L, n, d)
            lp = head.log_probs(moved)  # (L, n, V)
            loss = (target.exp() * (target - lp)).sum(-1).mean(-1).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            taken += 1
            losses.append(float(loss.detach()) / L)
            if progress is not None:
                frac = max(taken / steps, min(1.0, (clock() - t0) / seconds))
                progress(span[0] + (span[1] - span[0]) * frac,
                         f"KL step {taken}/{steps}: {losses[-1] / LN2:.3f} bits a layer")
    return TunedLens(a.detach().numpy().copy(), b.detach().numpy().copy()), taken, losses


def held_out_kl(session: Engine, rows: torch.Tensor, tuned: TunedLens | None,
                positions: int = EVAL_POSITIONS) -> tuple[np.ndarray, np.ndarray | None]:
    """The mean KL(output ‖ lens_ℓ) in bits of rows ℓ = 0…L (rows (L + 1, N, d), the first `positions` of them), of
    the logit lens and of `tuned` (None: not asked), each through the session's own lens head, whatever runs it."""
    import torch

    head = lens_head(session)
    L = rows.shape[0] - 1
    x = rows[:, :positions]
    w = next(head.parameters())

    def log_probs(v: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(head.head(v.to(w.dtype)).double(), -1)

    logit_kl, tuned_kl = np.zeros(L + 1), None if tuned is None else np.zeros(L + 1)
    n = x.shape[1]
    with torch.inference_mode():
        for i in range(0, n, EVAL_CHUNK):  # float64 (chunk, V) arrays: a few of them at once, whatever the vocabulary
            c = x[:, i:i + EVAL_CHUNK]
            target = log_probs(c[L])  # (c, V)
            p = target.exp()
            moved = None if tuned is None else tuned.translate(c.transpose(0, 1)).transpose(0, 1)  # (L + 1, c, d)
            for ell in range(L + 1):
                logit_kl[ell] += float((p * (target - log_probs(c[ell]))).sum()) / n
                if moved is not None:
                    tuned_kl[ell] += float((p * (target - log_probs(moved[ell]))).sum()) / n
    return logit_kl / LN2, None if tuned_kl is None else tuned_kl / LN2


def lens_head(session: Engine) -> torch.nn.Module:
    """The head a session's lens reads through (its generation runtime's: the same object every later lens uses)."""
    return session.runtime(1).lens_head()


def model_key(session: Engine) -> str:
    """The loaded model file's SHA-256, which a tuned lens is saved under."""
    from engine.formats.locate import cache_root, file_sha256

    info = session.info
    sha = info.sha256 or (file_sha256(info.path, memo=cache_root() / "sha256") if info.path else "")
    if not sha:
        raise ValueError("a tuned lens is saved under the model file's SHA-256, and this model has no file to hash")
    return sha


def saved_path(session: Engine) -> Path:
    """Where the tuned lens of the loaded model is kept: the engine's cache, tuned-lens/<SHA-256>.safetensors."""
    from engine.formats.locate import cache_root

    return cache_root() / "tuned-lens" / (model_key(session) + FILE_SUFFIX)


def save(tuned: TunedLens, path: str | Path) -> Path:
    """Write `tuned` as safetensors: its two float32 arrays and its facts (strings) as the header's metadata."""
    from safetensors.numpy import save_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".part")
    save_file({"weight": np.ascontiguousarray(tuned.weight, np.float32),
               "bias": np.ascontiguousarray(tuned.bias, np.float32)}, str(tmp),
              metadata={str(k): str(v) for k, v in tuned.facts.items()})
    tmp.replace(p)  # a reader never sees half a file
    return p


def load(path: str | Path, n_layers: int, d_model: int) -> TunedLens:
    """The tuned lens in a file `save` wrote, for a model of n_layers layers of width d_model. ValueError in one
    sentence when the file is missing, damaged or for another shape of model; its size is checked before reading."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    want = 4 * (n_layers * d_model * d_model + n_layers * d_model)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise ValueError(f"cannot read the tuned lens {p}: {e.strerror or e}") from None
    if size > want + (1 << 20):
        raise ValueError(f"{p.name} is {size:,} bytes, more than a tuned lens of this model ({want:,} bytes of maps)")
    try:
        with safe_open(str(p), framework="numpy") as f:
            names = set(f.keys())
            if names != {"weight", "bias"}:
                raise ValueError(f"{p.name} is not a tuned lens: it holds {sorted(names)}, not weight and bias")
            tuned = TunedLens(f.get_tensor("weight"), f.get_tensor("bias"), dict(f.metadata() or {}))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{p.name} is not a readable safetensors file: {e}") from None
    problem = tuned.problem(n_layers, d_model)
    if problem:
        raise ValueError(f"{p.name}: {problem}")
    return tuned


def load_for(session: Engine) -> TunedLens | None:
    """The saved tuned lens of the loaded model, or None when none is saved (ValueError when it is damaged)."""
    p = saved_path(session)
    if not p.is_file():
        return None
    return load(p, session.cfg.n_layers, session.cfg.d_model)


def use(session: Engine, tuned: TunedLens | None) -> None:
    """Every later lens of this session (its generations', its recomputed steps') also reads through `tuned`
    (None: the logit lens alone)."""
    use_tuned(lens_head(session), tuned)


def fit(session: Engine, corpus: str | None = None, tokens: int = DEFAULT_TOKENS, steps: int = DEFAULT_STEPS,
        seconds: float = DEFAULT_SECONDS, held_out: int = HELD_OUT_TOKENS, progress: Progress | None = None,
        should_stop: ShouldStop | None = None, clock: Callable[[], float] = time.perf_counter,
        judged: int = EVAL_POSITIONS) -> TunedLens:
    """Fit the tuned lens of the loaded model (the module docstring's five stages) and return it, its facts saying
    how it was fitted and what it achieved on held-out text, averaged over `judged` of its positions (not saved:
    see `save`, `saved_path`).

    Unsupported (one sentence) on a runtime without gradients; ValueError on a corpus too short or bad settings;
    engine.why.Cancelled when should_stop() turns true."""
    require(session, "gradients", "fitting a tuned lens",
            "load the model with --backend torch to fit it; the fitted lens then reads llama.cpp's residuals too")
    if not 0 <= steps <= MAX_STEPS:
        raise ValueError(f"a tuned lens takes 0 to {MAX_STEPS:,} KL steps, got {steps}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"the time bound must be a positive number of seconds, got {seconds}")
    if judged < 1:
        raise ValueError(f"a fit is judged on at least one held-out position, got {judged}")
    per_token = 4 * (session.cfg.n_layers + 1) * session.cfg.d_model
    if tokens * per_token > MAX_ROW_BYTES:
        raise ValueError(f"{tokens:,} training tokens would hold {tokens * per_token / 2**30:.1f} GiB of residuals; "
                         f"this model takes at most {MAX_ROW_BYTES // per_token:,}")
    t0 = clock()
    say = progress or (lambda f, m: None)
    say(0.0, "tokenizing the corpus")
    data = make_corpus(session, corpus, tokens, held_out)
    rows = residual_rows(session, data.train, say, should_stop, (0.0, 0.35))
    check_stop(should_stop)
    say(0.35, f"least-squares start: {session.cfg.n_layers} maps")
    start = least_squares(rows)
    head = _Head(session)
    tuned, taken, losses = _kl_steps(head, rows, start, steps, seconds, say, should_stop, clock, (0.4, 0.85))
    del rows
    held = residual_rows(session, data.held, None, should_stop)
    check_stop(should_stop)
    say(0.9, "judging both lenses on the held-out text")
    logit_kl, tuned_kl = held_out_kl(session, held, tuned, judged)
    check_stop(should_stop)
    n_train = sum(len(s) - 1 for s in data.train)
    facts = {
        "kind": "tuned lens (x + A x + b per layer, KL to the output)",
        "model": session.info.name, "sha256": model_key(session), "corpus": data.name,
        "train_tokens": str(n_train), "held_out_tokens": str(min(judged, held.shape[1])),
        "kl_steps": str(taken), "batch": str(BATCH), "learning_rate": str(LEARNING_RATE), "ridge": str(RIDGE),
        "seconds": f"{clock() - t0:.1f}",
        "train_kl_bits_first_last": "" if not losses else f"{losses[0] / LN2:.4f} {losses[-1] / LN2:.4f}",
        "held_out_logit_kl_bits": " ".join(f"{v:.4f}" for v in logit_kl),
        "held_out_tuned_kl_bits": " ".join(f"{v:.4f}" for v in tuned_kl),
    }
    say(1.0, "fitted")
    return TunedLens(tuned.weight, tuned.bias, facts)


def summary(tuned: TunedLens) -> dict:
    """The JSON-ready account of a fitted lens: its facts, the held-out KL per layer as numbers."""
    out: dict = {k: v for k, v in tuned.facts.items() if not k.startswith("held_out_") or not k.endswith("_bits")}
    for kind in ("logit", "tuned"):
        text = tuned.facts.get(f"held_out_{kind}_kl_bits", "")
        try:
            out[f"held_out_{kind}_kl_bits"] = [float(v) for v in text.split()]
        except ValueError:
            out[f"held_out_{kind}_kl_bits"] = []
    return out


__all__ = ["Cancelled", "Corpus", "TunedLens", "corpus_text", "fit", "held_out_kl", "lens_head", "least_squares",
           "load", "load_for", "make_corpus", "model_key", "residual_rows", "save", "saved_path", "summary", "use"]
