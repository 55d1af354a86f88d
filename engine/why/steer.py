"""Steering: a direction in the residual stream, read off contrast pairs, added back during generation.

    python -m engine steer --pair "I love this" "I hate this" [--pair …] --layers 6,7,8 [--method mean|pca]
                           --out happy.gguf [--prompt P --scales -8,0,8]
    python -m engine generate --steer happy.gguf:4 --prompt "I think that"

Building: each pair is a positive and a negative text; both run through the model and the residual stream after
block L (the seam's resid_post.L) is read at one position of each (the last, by default). With `mean` the layer's
vector is the mean over the pairs of (positive − negative), as steering-vectors' train_steering_vector computes it;
with `pca` it is the first principal component of those differences (centred), unit length, signed so that most
positives project above their negatives, as repeng's pca_diff does.

Applying: v_L × scale is added to resid_post.L at every position a forward pass runs, through the session's seam on
either runtime (engine.model.seam, engine.backends.llamacpp_seam), so a scale changed between two tokens acts from the
next token on (the K/V already cached keep the scale they were computed with).

The file is llama.cpp's control-vector GGUF (engine.formats.control_vector): direction.L is added to block L's output,
which is what llama.cpp's own adapter and repeng do with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from engine.backend import Progress, ShouldStop
    from engine.formats.control_vector import ControlVector
    from engine.run.session import Engine

METHODS = ("mean", "pca")
MAX_PAIRS = 512
MAX_PAIR_TOKENS = 512


@dataclass(frozen=True)
class Pair:
    positive: str
    negative: str


def _last_resid(session: Engine, text: str, layers: Sequence[int], position: int) -> np.ndarray:
    """(len(layers), d): resid_post.L of `text` at `position` (negative: from the end), each layer in `layers`."""
    from engine.model.seam import Point

    ids = session.tokenize(text).ids
    session.check_prompt(ids)
    if len(ids) > MAX_PAIR_TOKENS:
        raise ValueError(f"a pair's text is {len(ids)} tokens; steering reads at most {MAX_PAIR_TOKENS}")
    if not -len(ids) <= position < len(ids):
        raise ValueError(f"position {position} is outside {text[:40]!r}, which is {len(ids)} tokens")
    points = [Point.resid(L + 1) for L in layers]
    _, rec = session.run_points([ids], record=points)
    return np.stack([rec[p][0, position].double().numpy() for p in points])


def check_layers(layers: Sequence[int], n_layers: int) -> list[int]:
    """The layers, sorted and unique; ValueError naming the range a control vector holds: blocks 1…n_layers − 1
    (llama.cpp's format has no place for block 0's output)."""
    out = sorted(set(int(x) for x in layers))
    if not out:
        raise ValueError("name at least one layer to steer")
    bad = [x for x in out if not 1 <= x < n_layers]
    if bad:
        raise ValueError(f"layer {bad[0]} cannot be steered: a control vector holds the outputs of blocks 1 to "
                         f"{n_layers - 1}")
    return out


def build(session: Engine, pairs: Sequence[Pair], layers: Sequence[int], method: str = "mean",
          position: int = -1, progress: Progress | None = None, should_stop: ShouldStop | None = None
          ) -> ControlVector:
    """The steering vector of `pairs` at each of `layers` (see the module docstring); `progress` after each pair,
    engine.why.Cancelled between forward passes once `should_stop()`."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose {' or '.join(METHODS)}")
    if not pairs or len(pairs) > MAX_PAIRS:
        raise ValueError(f"steering needs 1 to {MAX_PAIRS} contrast pairs, got {len(pairs)}")
    if method == "pca" and len(pairs) < 2:
        raise ValueError("a principal component needs at least two pairs")
    layers = check_layers(layers, session.cfg.n_layers)
    from engine.why import check_stop

    rows = []  # (positive, negative) of each pair: (layers, d) each
    for i, p in enumerate(pairs):
        check_stop(should_stop)
        rows.append([_last_resid(session, text, layers, position) for text in (p.positive, p.negative)])
        if progress is not None:
            progress((i + 1) / len(pairs), f"pair {i + 1} of {len(pairs)}")
    pos = np.stack([r[0] for r in rows])  # (N, layers, d)
    neg = np.stack([r[1] for r in rows])
    from engine.formats.control_vector import ControlVector

    diffs = pos - neg
    directions = {}
    for i, layer in enumerate(layers):
        if method == "mean":
            v = diffs[:, i].mean(axis=0)
        else:
            d = diffs[:, i] - diffs[:, i].mean(axis=0)  # sklearn's PCA centres its data
            v = np.linalg.svd(d, full_matrices=False)[2][0]  # (d,), unit length
            above = np.mean(pos[:, i] @ v > neg[:, i] @ v)
            v = v if above >= 0.5 else -v
        directions[layer] = v.astype(np.float32)
    return ControlVector(directions=directions, model_hint=session.cfg.architecture)


class Steering:
    """A vector on for a session's forward passes, its scale changeable between two tokens (`set_scale`)."""

    def __init__(self, vector: ControlVector, scale: float, dtype=None) -> None:
        import torch

        self.vector = vector
        self.layers = sorted(vector.directions)
        self._base = {L: torch.tensor(np.asarray(vector.directions[L], dtype=np.float32)) for L in self.layers}
        self._live = {L: v.clone() for L, v in self._base.items()}  # what the seam's edits read, in place
        self.scale = 0.0
        self.set_scale(scale)

    def set_scale(self, scale: float) -> None:
        scale = float(scale)
        if not np.isfinite(scale) or abs(scale) > 1e4:
            raise ValueError(f"a steering scale must be a finite number within ±10000, got {scale}")
        for L, v in self._base.items():
            self._live[L].copy_(v * scale)
        self.scale = scale

    def edits(self) -> list:
        from engine.model.seam import Edit, Point

        return [Edit(Point.resid(L + 1), self._live[L], add=True) for L in self.layers]


def check_vector(vector: ControlVector, cfg) -> None:
    """ValueError when the vector's layers or width do not fit the loaded model."""
    check_layers(list(vector.directions), cfg.n_layers)
    widths = {int(np.asarray(v).shape[-1]) for v in vector.directions.values()}
    if widths != {cfg.d_model}:
        raise ValueError(f"the steering vector is {sorted(widths)[0]} wide; this model's residual stream is "
                         f"{cfg.d_model}")


@contextlib.contextmanager
def steering(session: Engine, vector: ControlVector, scale: float) -> Iterator[Steering]:
    """The vector × scale added to resid_post.L of every forward pass the session runs inside the block; the KV
    cache is forgotten on entry and on exit (keys and values of the unsteered model must not serve the steered one)."""
    check_vector(vector, session.cfg)
    handle = Steering(vector, scale)
    session.forget_cache()
    try:
        with session.intervened(handle.edits()):
            yield handle
    finally:
        session.forget_cache()


def next_token_logits(session: Engine, ids: Sequence[int], vector: ControlVector | None, scale: float
                      ) -> torch.Tensor:
    """Float32 logits (V,) of the token after `ids` with the vector × scale added (or none), from an empty cache."""
    edits = [] if vector is None else Steering(vector, scale).edits()
    logits, _ = session.run_points([list(ids)], edits)
    return logits[0]


# ---- the command line --------------------------------------------------------------------------------------------
def scales_arg(text: str) -> list[float]:
    """--scales S,S,…: finite numbers within ±10000."""
    try:
        out = [float(x) for x in text.split(",")]
        if out and len(out) <= 64 and all(np.isfinite(x) and abs(x) <= 1e4 for x in out):
            return out
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"takes up to 64 finite scales within ±10000, e.g. -4,0,4; got {text[:60]!r}")


def steer_arg(text: str) -> tuple[str, float]:
    """--steer FILE:SCALE (the scale after the last colon)."""
    path, sep, scale = text.rpartition(":")
    try:
        if sep and path:
            return path, float(scale)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"takes FILE:SCALE (e.g. happy.gguf:4), got {text[:60]!r}")


def load_for(session: Engine, path: str) -> ControlVector:
    """A control-vector file, checked against the loaded model (ValueError in one sentence)."""
    from engine.formats.control_vector import load

    vector = load(path, n_layers=session.cfg.n_layers, d_model=session.cfg.d_model)
    check_vector(vector, session.cfg)
    return vector


def _pairs_from(a: argparse.Namespace) -> list[Pair]:
    pairs = [Pair(p, n) for p, n in a.pair]
    if a.pairs:
        try:
            with open(a.pairs, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the pairs file {a.pairs}: {e}") from None
        if not isinstance(doc, list) or not all(isinstance(x, dict) and isinstance(x.get("positive"), str)
                                                and isinstance(x.get("negative"), str) for x in doc):
            raise ValueError(f"{a.pairs}: the pairs file must be a JSON list of {{\"positive\": …, \"negative\": …}}")
        pairs += [Pair(x["positive"], x["negative"]) for x in doc[:MAX_PAIRS + 1]]
    return pairs


def cmd_steer(a: argparse.Namespace) -> int:
    from engine.backends import session_from_args
    from engine.cliargs import CliError, one_line, stamped
    from engine.formats.control_vector import save
    from engine.why import Unsupported

    with one_line(usage=(ValueError,)):
        pairs = _pairs_from(a)
    s = session_from_args(a)
    with one_line(Unsupported, RuntimeError, usage=(ValueError,)):
        if a.vector:
            vector = load_for(s, a.vector)
        else:
            if not pairs:
                raise ValueError("give contrast pairs (--pair POSITIVE NEGATIVE, --pairs FILE) or --vector FILE")
            vector = build(s, pairs, a.layers or [], a.method, a.position)
        doc: dict = {"layers": sorted(vector.directions), "method": None if a.vector else a.method,
                     "pairs": len(pairs), "norms": {str(L): float(np.linalg.norm(v))
                                                    for L, v in sorted(vector.directions.items())}}
        if a.out:
            try:
                save(vector, a.out)
            except OSError as e:
                raise CliError(f"cannot write {a.out}: {e.strerror or e}") from None
            doc["out"] = a.out
        if a.prompt:
            import torch

            ids = s.tokenize(a.prompt, a.chat).ids
            s.check_prompt(ids)
            rows = []
            for scale in a.scales:
                logits = next_token_logits(s, ids, vector, scale)
                probs = torch.softmax(logits.double(), -1)
                p, top = torch.topk(probs, 5)
                rows.append({"scale": scale, "ids": top.tolist(), "tokens": [s.tokenizer.piece(int(i)) for i in top],
                             "probs": [float(x) for x in p]})
            doc["prompt"], doc["next_token"] = a.prompt, rows
    if a.json:
        print(json.dumps(stamped(doc, s.info), ensure_ascii=False))
        return 0
    print(f"steering vector at layers {doc['layers']} ({doc['method'] or 'loaded'}; {doc['pairs']} pairs); norms "
          + ", ".join(f"{k}: {v:.3f}" for k, v in doc["norms"].items()) + (f"; written to {a.out}" if a.out else ""))
    for row in doc.get("next_token", []):
        print(f"scale {row['scale']:+g}: " + "  ".join(f"{t!r} {p:.3f}" for t, p in zip(row["tokens"], row["probs"],
                                                                                        strict=True)))
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `steer` to the engine's CLI."""
    from engine.cliargs import add_model_args, add_threads_arg, int_list

    q = sub.add_parser("steer", help="build a steering vector from contrast pairs (or load one), save it as a "
                                     "llama.cpp control vector, and show what it does to the next token",
                       description=__doc__.split("\n\n")[2])
    add_model_args(q)
    add_threads_arg(q)
    q.add_argument("--pair", nargs=2, action="append", default=[], metavar=("POSITIVE", "NEGATIVE"),
                   help="a contrast pair (repeatable)")
    q.add_argument("--pairs", metavar="FILE.json", help='a JSON list of {"positive": …, "negative": …}')
    q.add_argument("--layers", type=int_list(0, 4096), metavar="L,L", help="the blocks whose output is read and "
                   "steered (from 0)")
    q.add_argument("--method", choices=METHODS, default="mean")
    q.add_argument("--position", type=int, default=-1, help="the token read in each text (default -1: the last)")
    q.add_argument("--vector", metavar="FILE.gguf", help="load this control vector instead of building one")
    q.add_argument("--out", metavar="FILE.gguf", help="write the vector as a llama.cpp control vector")
    q.add_argument("--prompt", help="show the next token of this prompt at each --scales")
    q.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template first")
    q.add_argument("--scales", type=scales_arg, default=[-4.0, 0.0, 4.0], metavar="S,S")
    q.set_defaults(func=cmd_steer, local_only="edits the forward pass, which a server does not let us do")
