"""The next-token distribution before and after an ablation: attention heads, a layer's attention or MLP output.

    python -m engine ablate --prompt P --head L:H [--head …] [--layer-attn L] [--layer-mlp L] [--mean]
                            [--positions 0,3] [--tokens A,B] [--chat] [--json]

Zero-ablation replaces a component's output with zeros. Mean-ablation replaces it with the mean of that component's
output over the prompt's positions in the clean (unablated) run of the same prompt: one vector per component, put at
every ablated position. A head's output is its z (TransformerLens's hook_z: the head's attention-weighted values,
before the output projection); a layer's attention or MLP output is what it adds to the residual stream (after
Gemma 3's post norms). engine.model.seam does the editing.

The result: `before` and `after` (the next token's top 5: `ids`, `tokens` (pieces), `probs`), `kl` = KL(before‖after)
= Σ p_before · (ln p_before − ln p_after) in nats, `top1_changed`, and with `tokens` = (A, B) the logit difference
logit(A) − logit(B) before and after (`logit_diff`).

`ablation(session, …)` keeps the ablation on for a `with` block, so a generation run inside it continues from the
intervened model (the app's "continue as a branch").

Importing this module does not import torch (the CLI registers it at start-up).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.backend import Unsupported

if TYPE_CHECKING:
    import torch

    from engine.model.config import ModelConfig
    from engine.model.seam import Edit
    from engine.run.session import Engine

TOP = 5  # candidates shown before and after


@dataclass(frozen=True)
class Ablation:
    """Which components to ablate, how (zero or mean), and where (absolute positions; None = every position)."""

    heads: tuple[tuple[int, int], ...] = ()  # (layer, head)
    attn_layers: tuple[int, ...] = ()
    mlp_layers: tuple[int, ...] = ()
    mean: bool = False
    positions: tuple[int, ...] | None = None

    def check(self, cfg: ModelConfig, n_tokens: int | None = None) -> None:
        """ValueError in one line naming the model's layers and heads when a component is not in it."""
        if not (self.heads or self.attn_layers or self.mlp_layers):
            raise ValueError("nothing to ablate: name at least one head, attention layer or MLP layer")
        last = cfg.n_layers - 1
        for layer, head in self.heads:
            if not 0 <= layer <= last or not 0 <= head < cfg.n_heads:
                raise ValueError(f"head {layer}:{head} is not in this model: it has layers 0 to {last} and heads "
                                 f"0 to {cfg.n_heads - 1} in each")
        for what, layers in (("attention", self.attn_layers), ("MLP", self.mlp_layers)):
            for layer in layers:
                if not 0 <= layer <= last:
                    raise ValueError(f"{what} layer {layer} is not in this model: it has layers 0 to {last}")
        if self.positions is not None and n_tokens is not None:
            outside = [p for p in self.positions if not 0 <= p < n_tokens]
            if outside or not self.positions:
                raise ValueError(f"position {outside[0] if outside else '(none)'} is not in the prompt: it has "
                                 f"positions 0 to {n_tokens - 1}")

    def points(self) -> list:
        from engine.model.seam import Point

        return ([Point.z(layer, head) for layer, head in self.heads] + [Point.attn(i) for i in self.attn_layers]
                + [Point.mlp(i) for i in self.mlp_layers])

    def describe(self) -> dict:
        return {"heads": [list(h) for h in self.heads], "attn_layers": list(self.attn_layers),
                "mlp_layers": list(self.mlp_layers), "mean": self.mean,
                "positions": None if self.positions is None else list(self.positions)}


def edits_for(session: Engine, spec: Ablation, ids: Sequence[int]) -> list[Edit]:
    """The seam's edits for `spec`; mean-ablation first runs the clean prompt `ids` to take each component's mean
    over its positions (all means from the same clean run, none from an already-ablated one)."""
    from engine.model.seam import Edit

    points = spec.points()
    if not spec.mean:
        return [Edit(p, positions=spec.positions) for p in points]
    _, rec = session.run_points([ids], record=points)
    return [Edit(p, rec[p][0].mean(dim=0), positions=spec.positions) for p in points]  # (W,) each


@contextlib.contextmanager
def ablation(session: Engine, spec: Ablation, prompt_ids: Sequence[int]) -> Iterator[list[Edit]]:
    """Run every forward pass of `session` with `spec` ablated inside the block (mean-ablation's means from the clean
    run of `prompt_ids`); generations must be iterated inside it. The KV cache is forgotten on entry and on exit:
    keys and values computed by the intact model must not serve the ablated one, nor the other way round."""
    spec.check(session.cfg, len(prompt_ids))
    edits = edits_for(session, spec, prompt_ids)
    session.forget_cache()
    try:
        with session.intervened(edits):
            yield edits
    finally:
        session.forget_cache()


def _top(logits: torch.Tensor, tokenizer) -> dict:
    import torch

    probs = torch.softmax(logits.double(), dim=-1)
    p, ids = torch.topk(probs, min(TOP, probs.shape[-1]))
    ids = [int(i) for i in ids]
    return {"ids": ids, "tokens": [tokenizer.piece(i) for i in ids], "probs": [float(x) for x in p]}


def ablate(session: Engine, prompt: str, heads: Sequence[tuple[int, int]] = (), attn_layers: Sequence[int] = (),
           mlp_layers: Sequence[int] = (), mean: bool = False, chat: bool = False,
           tokens: tuple[int, int] | None = None, positions: Sequence[int] | None = None) -> dict:
    """The next-token distribution of `prompt` before and after ablating the components (see the module docstring
    for zero- and mean-ablation); returns the JSON the CLI prints. ValueError for a component, position or token
    not in the model or prompt; Unsupported on a runtime whose forward pass cannot be edited."""
    import torch

    spec = Ablation(tuple((int(a), int(b)) for a, b in heads), tuple(attn_layers), tuple(mlp_layers), mean,
                    None if positions is None else tuple(positions))
    s = session
    ids = s.tokenize(prompt, chat).ids
    s.check_prompt(ids)
    spec.check(s.cfg, len(ids))
    if tokens is not None:
        bad = [t for t in tokens if not 0 <= t < s.cfg.vocab_size]
        if bad:
            raise ValueError(f"token {bad[0]} is not in this model's vocabulary (0 to {s.cfg.vocab_size - 1})")
    before, after = before_after(s, spec, ids)
    lp_b, lp_a = torch.log_softmax(before.double(), -1), torch.log_softmax(after.double(), -1)
    kl = float((lp_b.exp() * (lp_b - lp_a)).sum())  # nats
    out = {"prompt_tokens": len(ids), "ablated": spec.describe(), "before": _top(before, s.tokenizer),
           "after": _top(after, s.tokenizer), "kl": kl if math.isfinite(kl) else None,
           "top1_changed": int(before.argmax()) != int(after.argmax())}
    if tokens is not None:
        a, b = tokens
        out["logit_diff"] = {"tokens": [a, b], "pieces": [s.tokenizer.piece(a), s.tokenizer.piece(b)],
                             "before": float(before[a] - before[b]), "after": float(after[a] - after[b])}
    return out


def before_after(session: Engine, spec: Ablation, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits (V,) of the next token without and with the ablation, through the session's seam."""
    before, _ = session.run_points([ids])
    after, _ = session.run_points([ids], edits_for(session, spec, ids))
    return before[0], after[0]


# ---- the command line ------------------------------------------------------------------------------------------
def head_arg(text: str) -> tuple[int, int]:
    """--head L:H, a layer and a head, both counted from 0 (checked against the model once it is loaded)."""
    layer, sep, head = text.strip().partition(":")
    if sep and layer.strip().isdigit() and head.strip().isdigit() and len(text) < 20:
        return int(layer), int(head)
    raise argparse.ArgumentTypeError(f"takes LAYER:HEAD with both counted from 0 (e.g. 3:1), got {text[:40]!r}")


def token_pair(text: str) -> tuple[int, int]:
    """--tokens A,B: two token ids."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 2 and all(p.isdigit() and len(p) < 12 for p in parts):
        return int(parts[0]), int(parts[1])
    raise argparse.ArgumentTypeError(f"takes two token ids A,B (e.g. 7042,2260), got {text[:40]!r}")


def _text(doc: dict) -> str:
    def row(side: dict) -> str:
        return "  ".join(f"{t!r} {p:.4f}" for t, p in zip(side["tokens"], side["probs"], strict=True))

    ab, kl = doc["ablated"], doc["kl"]
    what = ([f"head {h[0]}:{h[1]}" for h in ab["heads"]] + [f"attention of layer {i}" for i in ab["attn_layers"]]
            + [f"MLP of layer {i}" for i in ab["mlp_layers"]])
    lines = [f"{'mean' if ab['mean'] else 'zero'}-ablated: {', '.join(what)}"
             + ("" if ab["positions"] is None else f" at positions {ab['positions']}")
             + f" ({doc['prompt_tokens']} prompt tokens)",
             f"before: {row(doc['before'])}", f"after:  {row(doc['after'])}",
             f"KL(before‖after) = {'undefined' if kl is None else format(kl, '.6f')} nats; "
             f"top-1 {'changed' if doc['top1_changed'] else 'unchanged'}"]
    if "logit_diff" in doc:
        d = doc["logit_diff"]
        lines.append(f"logit({d['pieces'][0]!r}) − logit({d['pieces'][1]!r}): {d['before']:.4f} before, "
                     f"{d['after']:.4f} after")
    return "\n".join(lines)


def cmd_ablate(a: argparse.Namespace) -> int:
    from engine.backends import session_from_args
    from engine.cliargs import one_line, stamped

    s = session_from_args(a)
    with one_line(Unsupported, usage=(ValueError,)):
        doc = ablate(s, a.prompt, a.head, a.layer_attn, a.layer_mlp, a.mean, a.chat, a.tokens, a.positions)
    print(json.dumps(stamped(doc, s.info), ensure_ascii=False) if a.json else _text(doc))
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `ablate` to the engine CLI's subparsers."""
    from engine.cliargs import add_model_args, add_threads_arg, int_in, int_list

    q = sub.add_parser(
        "ablate", help="the next-token distribution before and after ablating heads, attention or MLP layers",
        description="Zero-ablation replaces a component's output with zeros; --mean replaces it with the mean of "
        "that component's output over the prompt's positions in the clean run of the same prompt. A head's output "
        "is its z (before the output projection); a layer's attention or MLP output is what it adds to the residual "
        "stream. Prints the top 5 before and after, KL(before‖after) in nats and whether the top-1 token changed.")
    add_model_args(q)
    q.add_argument("--prompt", required=True)
    q.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template first")
    q.add_argument("--head", type=head_arg, action="append", default=[], metavar="L:H",
                   help="ablate head H of layer L (repeatable; both from 0)")
    q.add_argument("--layer-attn", type=int_in(0), action="append", default=[], metavar="L",
                   help="ablate layer L's attention output (repeatable)")
    q.add_argument("--layer-mlp", type=int_in(0), action="append", default=[], metavar="L",
                   help="ablate layer L's MLP output (repeatable)")
    q.add_argument("--mean", action="store_true",
                   help="mean-ablate: the component's mean output over the prompt's positions instead of zeros")
    q.add_argument("--positions", type=int_list(0, 2**31 - 1), default=None, metavar="P,P",
                   help="ablate only at these prompt positions (from 0; default every position)")
    q.add_argument("--tokens", type=token_pair, default=None, metavar="A,B",
                   help="also report logit(A) − logit(B) before and after (token ids)")
    add_threads_arg(q)
    q.set_defaults(func=cmd_ablate)
