"""Attribution patching (AtP): the whole activation-patching grid of engine.why.patch estimated from one clean
forward, one corrupted forward and one backward pass, beside the exact grid, with where the two part.

    python -m engine atp --clean C --corrupt X --answer A --wrong W [--heads] [--no-exact] [--top K]
        [--ig-steps K] [--json]

Patching an activation a of the corrupted run to its clean value moves the metric
    m = (d − d_corrupt) / (d_clean − d_corrupt),   d = logit[answer] − logit[wrong] at the last position
(engine.why.patch's restored share) by m(a_clean) − m(a_corrupt). Its first-order Taylor estimate around the
corrupted run is
    AtP = (a_clean − a_corrupt) · ∂m/∂a |corrupted run,
the formula of TransformerLens's attribution-patching demo (Neel Nanda). One backward pass gives ∂m/∂a for every
activation at once, so every cell costs a dot product:
    residual grid (L + 1) × T: cell (ℓ, p) sums over d_model at position p of the residual stream entering block ℓ
                               (row 0 the embeddings, row L the last block's output), as patch's `restored`;
    heads grid L × H:          cell (ℓ, h) sums over every position and head h's hd columns of z (hook_z), as
                               patch's `restored_heads` (a head's clean z at every position at once).
The estimate is linear in the change; where the model is not (a softmax that saturates, a norm's scale) it parts
from the exact grid. The result carries both grids, their Pearson correlation (over every cell, and over only the
cells whose clean and corrupted activations differ: the others are 0 in both), and the cells where they part most.

`--ig-steps K` takes ∂m/∂a not at the corrupted run alone but averaged over K runs whose token embeddings lie on
the straight path from the corrupted prompt's to the clean one's (EAP-IG; see atp_grids): K forwards and backwards
more, and an estimate that follows the patch's whole length rather than its start.

Gradients need the torch engine (llama.cpp runs no backward pass). The exact grid is engine.why.patch's own.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.why import Cancelled, Progress, ShouldStop, Unsupported, check_stop, require

if TYPE_CHECKING:
    import torch

TOP = 8  # disagreeing cells listed
MAX_IG_STEPS = 256  # each step is one forward and one backward pass
DEFINITION = ("atp[l][p] = (a_clean − a_corrupt) · ∂m/∂a at the corrupted run, summed over d_model, a the residual "
              "stream entering block l (0 = the embeddings, L = the last block's output) at position p; "
              "m = (d − d_corrupt) / (d_clean − d_corrupt), d = logit[answer] − logit[wrong] at the last position")
HEADS_DEFINITION = "atp_heads[l][h]: the same with a = head h's z in layer l, summed over every position and hd"
IG_DEFINITION = ("; with ig_steps K, ∂m/∂a is averaged over K runs whose token embeddings are e_corrupt + α (e_clean − "
                 "e_corrupt), α = (j + 1/2) / K (EAP-IG)")


def _check(session, clean: str, corrupt: str, answer: str, wrong: str) -> tuple[list[int], list[int], int, int]:
    """The prompts' ids and the two tokens' ids, or ValueError / Unsupported in one sentence (as patch's)."""
    from engine.why.patch import MAX_TOKENS, one_token

    require(session, "gradients", "attribution patching")
    tokenizer = session.tokenizer
    c, x = session.tokenize(clean), session.tokenize(corrupt)
    if len(c.ids) != len(x.ids):
        raise ValueError(f"the clean prompt is {len(c.ids)} tokens and the corrupted one {len(x.ids)}: patching "
                         "needs prompts of equal token length")
    session.check_prompt(c.ids)
    session.check_prompt(x.ids)
    if len(c.ids) > MAX_TOKENS:
        raise ValueError(f"the prompts are {len(c.ids)} tokens; patching takes at most {MAX_TOKENS}")
    a_id, w_id = one_token(tokenizer, answer, "--answer"), one_token(tokenizer, wrong, "--wrong")
    if a_id == w_id:
        raise ValueError(f"--answer and --wrong are the same token {tokenizer.piece(a_id)!r}")
    if session.lm.model.tok_embeddings.weight.is_inference():
        raise Unsupported("this model's weights were loaded under torch.inference_mode, so no gradient can flow "
                          "through them: load it outside inference mode for attribution patching")
    return list(c.ids), list(x.ids), a_id, w_id


def _activations(model: torch.nn.Module, ids: Sequence[int], heads: bool,
                 embeddings: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward of `ids` with autograd on: float32 logits (V,) of the last position, and the tensors in the graph
    for the residual stream entering each block and after the last (L + 1 of (1, T, d)), then (heads) each layer's
    z, the output projection's input (L of (1, T, H·hd)). `embeddings` (1, T, d): the token embeddings' output
    replaced by these (a point on the path between two prompts' embeddings)."""
    import torch

    from engine.model.kv_cache import KVCache

    cfg = model.cfg
    resid: list[torch.Tensor | None] = [None] * (cfg.n_layers + 1)
    zs: list[torch.Tensor | None] = [None] * cfg.n_layers
    handles = [model.tok_embeddings.register_forward_hook(  # a leaf that needs a gradient: the whole graph follows
        lambda _m, _a, out: (out if embeddings is None else embeddings.to(out.dtype)).detach().requires_grad_(True))]

    def keep_input(i: int):
        def hook(_m, args):
            resid[i] = args[0]
        return hook

    def keep_output(i: int):
        def hook(_m, _args, out):
            resid[i + 1] = out
        return hook

    def keep_z(i: int):
        def hook(_m, args):
            zs[i] = args[0]
        return hook

    for i, block in enumerate(model.layers):
        if i == 0:
            handles.append(block.register_forward_pre_hook(keep_input(0)))
        handles.append(block.register_forward_hook(keep_output(i)))
        if heads:
            handles.append(block.attn.wo.register_forward_pre_hook(keep_z(i)))
    device = model.lm_head.device
    try:
        cache = KVCache(cfg, 1, len(ids), model.lm_head.dtype, device)
        logits = model(torch.tensor([list(ids)], device=device), cache)[0].float()  # (V,)
    finally:
        for h in handles:
            h.remove()
    return logits, [t for t in resid] + ([t for t in zs] if heads else [])


def _pearson(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Pearson's r of two equal-length series; None when either is constant."""
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    sa = math.fsum((x - ma) ** 2 for x in a)
    sb = math.fsum((y - mb) ** 2 for y in b)
    if sa == 0 or sb == 0:
        return None
    return math.fsum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / math.sqrt(sa * sb)


def atp_grids(session, clean: str, corrupt: str, answer: str, wrong: str, heads: bool = False,
              ig_steps: int = 0) -> dict:
    """The AtP grids alone (one clean forward, one corrupted forward, one backward): "atp" ((L + 1) × T), with
    heads "atp_heads" (L × H), the prompts' ids and logit differences, and which cells' activations differ.

    `ig_steps` K > 0: the gradient is not taken at the corrupted run alone but averaged over K runs whose token
    embeddings lie on the straight line from the corrupted prompt's to the clean one's, at α = (j + ½) / K (the
    midpoint rule; EAP-IG, Hanna et al. 2024, integrated gradients from the input): K forwards and backwards more,
    and a straight-line guess taken along the whole patch rather than at its start. Along that path the embeddings'
    row adds up to the whole change of the metric (1) as K grows: integrated gradients' completeness."""
    import torch

    from engine.model import kernels
    from engine.why.attribute import _differentiable_products

    c_ids, x_ids, a_id, w_id = _check(session, clean, corrupt, answer, wrong)
    model = session.lm.model
    cfg = model.cfg
    L, T, H, hd = cfg.n_layers, len(c_ids), cfg.n_heads, cfg.head_dim
    if not 0 <= ig_steps <= MAX_IG_STEPS:
        raise ValueError(f"--ig-steps must be 0 to {MAX_IG_STEPS}, got {ig_steps}")
    with torch.inference_mode(False), torch.enable_grad(), _differentiable_products(), kernels.forced("linear"):
        with torch.no_grad():
            clean_logits, clean_acts = _activations(model, c_ids, heads)
        logits, acts = _activations(model, x_ids, heads)
        d_clean = float(clean_logits[a_id] - clean_logits[w_id])
        d = logits[a_id] - logits[w_id]
        d_corrupt = float(d.detach())
        if abs(d_clean - d_corrupt) < 1e-6 * max(1.0, abs(d_clean)):
            raise ValueError(f"both prompts give the same logit difference ({d_clean:.4g}) of "
                             f"{session.tokenizer.piece(a_id)!r} over {session.tokenizer.piece(w_id)!r}: there is "
                             "nothing to restore")
        if ig_steps == 0:
            metric = (d - d_corrupt) / (d_clean - d_corrupt)
            grads = torch.autograd.grad(metric, acts)
        else:
            device = model.lm_head.device
            with torch.no_grad():
                e_clean, e_corrupt = (model.tok_embeddings(torch.tensor([list(ids)], device=device)).float()
                                      for ids in (c_ids, x_ids))
            sums = [torch.zeros_like(a, dtype=torch.float32) for a in acts]
            for j in range(ig_steps):
                alpha = (j + 0.5) / ig_steps
                point = e_corrupt + alpha * (e_clean - e_corrupt)
                lg, on_path = _activations(model, x_ids, heads, embeddings=point)
                metric = (lg[a_id] - lg[w_id] - d_corrupt) / (d_clean - d_corrupt)
                for total, g in zip(sums, torch.autograd.grad(metric, on_path), strict=True):
                    total += g.float() / ig_steps
            grads = tuple(sums)
    with torch.no_grad():
        delta = [(ca.float() - a.float())[0] for ca, a in zip(clean_acts, acts, strict=True)]  # (T, W) each
        cells = [(dl * g.float()[0]) for dl, g in zip(delta, grads, strict=True)]  # (T, W)
        grid = [cells[i].sum(dim=-1).tolist() for i in range(L + 1)]  # (L + 1) × T
        changed = [(delta[i].abs().amax(dim=-1) > 0).tolist() for i in range(L + 1)]
        out = {"ids": {"clean": c_ids, "corrupt": x_ids}, "answer_id": a_id, "wrong_id": w_id,
               "clean_logit_diff": d_clean, "corrupt_logit_diff": d_corrupt, "atp": grid, "changed": changed,
               "ig_steps": ig_steps}
        if heads:
            out["atp_heads"] = [cells[L + 1 + i].view(T, H, hd).sum(dim=(0, 2)).tolist() for i in range(L)]
    return out


def atp(session, clean: str, corrupt: str, answer: str, wrong: str, heads: bool = False, exact: bool = True,
        top: int = TOP, progress: Progress | None = None, should_stop: ShouldStop | None = None,
        ig_steps: int = 0) -> dict:
    """AtP's grids beside engine.why.patch's exact ones (`exact`), their Pearson correlations and the `top` cells
    where they part most; the CLI's JSON document (see the module docstring). ValueError in one sentence for bad
    input; Unsupported on llama.cpp; Cancelled when `should_stop` says so."""
    import time

    check_stop(should_stop)
    t0 = time.perf_counter()
    got = atp_grids(session, clean, corrupt, answer, wrong, heads=heads, ig_steps=ig_steps)
    seconds_atp = time.perf_counter() - t0
    tokenizer = session.tokenizer
    a_id, w_id = got["answer_id"], got["wrong_id"]
    out = {
        "tokens": {"clean": [tokenizer.piece(i) for i in got["ids"]["clean"]],
                   "corrupt": [tokenizer.piece(i) for i in got["ids"]["corrupt"]]},
        "ids": got["ids"],
        "answer": {"id": a_id, "token": tokenizer.piece(a_id)},
        "wrong": {"id": w_id, "token": tokenizer.piece(w_id)},
        "clean_logit_diff": got["clean_logit_diff"], "corrupt_logit_diff": got["corrupt_logit_diff"],
        "atp": got["atp"], "definition": DEFINITION if not ig_steps else DEFINITION + IG_DEFINITION,
        "ig_steps": ig_steps,
        "cost": {"atp": {"forwards": 2 + ig_steps, "backwards": max(1, ig_steps), "seconds": seconds_atp}},
    }
    if heads:
        out["atp_heads"] = got["atp_heads"]
        out["heads_definition"] = HEADS_DEFINITION
    if not exact:
        return out
    from engine.why.patch import patch

    t0 = time.perf_counter()
    ex = patch(session, clean, corrupt, answer, wrong, heads=heads, progress=progress, should_stop=should_stop)
    out["cost"]["exact"] = {"forwards": ex["forwards"], "seconds": time.perf_counter() - t0}
    out["restored"] = ex["restored"]
    pieces = out["tokens"]["clean"]
    flat = [(layer, p) for layer in range(len(got["atp"])) for p in range(len(pieces))]
    a = [got["atp"][i][p] for i, p in flat]
    e = [ex["restored"][i][p] for i, p in flat]
    moved = [k for k, (i, p) in enumerate(flat) if got["changed"][i][p]]
    out["pearson"] = _pearson(a, e)
    out["pearson_changed"] = _pearson([a[k] for k in moved], [e[k] for k in moved]) if len(moved) > 1 else None
    out["changed_cells"] = len(moved)
    order = sorted(range(len(flat)), key=lambda k: -abs(a[k] - e[k]))[:top]
    out["disagree"] = [{"layer": flat[k][0], "position": flat[k][1], "token": pieces[flat[k][1]],
                        "atp": a[k], "exact": e[k], "difference": a[k] - e[k]} for k in order]
    if heads:
        out["restored_heads"] = ex["restored_heads"]
        cells = [(i, h) for i in range(len(got["atp_heads"])) for h in range(len(got["atp_heads"][0]))]
        ah = [got["atp_heads"][i][h] for i, h in cells]
        eh = [ex["restored_heads"][i][h] for i, h in cells]
        out["pearson_heads"] = _pearson(ah, eh)
        order = sorted(range(len(cells)), key=lambda k: -abs(ah[k] - eh[k]))[:top]
        out["disagree_heads"] = [{"layer": cells[k][0], "head": cells[k][1], "atp": ah[k], "exact": eh[k],
                                  "difference": ah[k] - eh[k]} for k in order]
    return out


# ---- the command line --------------------------------------------------------------------------------------------
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `atp` to the engine's CLI."""
    from engine.cliargs import add_model_args, add_threads_arg, int_in

    q = sub.add_parser("atp", help="attribution patching: the patching grid from one forward of each prompt and "
                                   "one backward pass, beside the exact grid, and where the two part")
    add_model_args(q)
    add_threads_arg(q)
    q.add_argument("--clean", required=True, help="the prompt whose answer is right")
    q.add_argument("--corrupt", required=True, help="a prompt of the same token length that changes the answer")
    q.add_argument("--answer", required=True, help="the clean answer, one token (with its leading space: ' Paris')")
    q.add_argument("--wrong", required=True, help="the corrupted prompt's answer, one token (' Rome')")
    q.add_argument("--heads", action="store_true", help="also each head's output (z), layer × head")
    q.add_argument("--no-exact", dest="exact", action="store_false",
                   help="AtP alone: skip the exact grid (its (L + 1) × T patched forwards)")
    q.add_argument("--top", type=int_in(1, 1000), default=TOP, help=f"disagreeing cells listed (default {TOP})")
    q.add_argument("--ig-steps", type=int_in(0, MAX_IG_STEPS), default=0, metavar="K",
                   help="average the gradient over K points on the path between the prompts' embeddings "
                        "(EAP-IG; K forwards and backwards more); 0 (default): AtP at the corrupted run")
    q.set_defaults(func=_cmd, local_only="runs a backward pass through the model, which a server does not let us do")


def _cmd(a: argparse.Namespace) -> int:
    from engine.backends import session_from_args
    from engine.cliargs import EXACT_PRODUCTS, one_line, stamped
    from engine.why.patch import grid

    s = session_from_args(a)
    with one_line(Unsupported, Cancelled, RuntimeError, usage=(ValueError,)):
        out = atp(s, a.clean, a.corrupt, a.answer, a.wrong, heads=a.heads, exact=a.exact, top=a.top,
                  ig_steps=a.ig_steps)
    if a.json:
        print(json.dumps(stamped(out, s.info, EXACT_PRODUCTS), ensure_ascii=False))
        return 0
    pieces = out["tokens"]["clean"]
    print(f"logit difference {out['answer']['token']!r} - {out['wrong']['token']!r}: clean "
          f"{out['clean_logit_diff']:.3f}, corrupted {out['corrupt_logit_diff']:.3f}")
    print("attribution patching (AtP): estimated share restored by the clean residual stream after each layer (rows) "
          "at each position (columns)")
    grid(out["atp"], pieces, "emb")
    if "restored" in out:
        print("exact patching: the share restored")
        grid(out["restored"], pieces, "emb")
        r = out["pearson"]
        rc = out["pearson_changed"]
        print(f"Pearson r over the grid: {'n/a' if r is None else f'{r:.3f}'}; over the "
              f"{out['changed_cells']} cells whose activations differ: {'n/a' if rc is None else f'{rc:.3f}'}")
        print("where they part most (layer, position, token: AtP, exact):")
        for d in out["disagree"]:
            print(f"  {d['layer']:>3} {d['position']:>4} {d['token']!r:>12}: {d['atp']:>7.3f} {d['exact']:>7.3f}")
    if "atp_heads" in out:
        print("AtP per head's output at every position (rows: layers, columns: heads)")
        grid(out["atp_heads"])
        if "restored_heads" in out:
            r = out["pearson_heads"]
            print(f"exact per head; Pearson r {'n/a' if r is None else f'{r:.3f}'}")
            grid(out["restored_heads"])
    return 0
