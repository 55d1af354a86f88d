"""Direct logit attribution: how much of the margin of one token over another each head, each MLP and the
embeddings wrote straight into the residual stream, read off a single forward pass.

    python -m engine dla --prompt P --answer TOKEN --wrong TOKEN [--step N] [--chat] [--top K] [--json]

The residual stream the final norm reads at position t is a sum of what each part wrote into it:
    x = e + Σ_ℓ Σ_h o_ℓh + Σ_ℓ m_ℓ
e the embeddings (× Gemma's embedding scale), o_ℓh = z_ℓh · W_O[ℓ][:, h] head h's output (its attention-weighted
values z, TransformerLens's hook_z, times its slice of the output projection), m_ℓ the MLP's output. The logit
difference of `answer` over `wrong` is
    Δ = RMSNorm(x) · (W_U[answer] − W_U[wrong]) = (x / s) · (g ⊙ (W_U[answer] − W_U[wrong])),
s = √(mean(x²) + ε) the final norm's scale and g its weight. The norm is not linear in x; freezing s at the value
this run had (TransformerLens's apply_ln_to_stack with the cached hook_scale) makes it so, and each component's
contribution is its own vector through the same map:
    c = (v / s) · u,   u = g ⊙ (W_U[answer] − W_U[wrong]).
The contributions add up to Δ: with an RMSNorm (no centring) and s taken from this very x the sum is exact in exact
arithmetic, so `frozen_norm_error` = Δ (the model's own logits) − Σ c is the arithmetic's rounding (float32 logits
against a float64 sum; more in a bfloat16 run), reported so that a gap is seen rather than assumed away.

Where attention's output is normalised before it joins the stream (Gemma 3's post-attention norm), a head's vector
goes through that norm with its scale likewise frozen at the layer's summed output: o_ℓh · g_post / s_ℓ.

`step` N: the prediction of generation step N; step 0 is the prompt's last position (the prefill chooses the first
token), step N > 0 first appends N greedy tokens and reads the position that chooses token N + 1.

Torch engine only: a head's output needs its z and its slice of W_O from inside the forward pass (engine.model.seam
records z at the output projection's input). Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from engine.why import Unsupported, require

if TYPE_CHECKING:
    import torch

    from engine.run.session import Engine

TOP = 10  # components listed by the size of their contribution
MAX_STEP = 256
DEFINITION = ("contribution = (v / s) · (g ⊙ (W_U[answer] − W_U[wrong])): v a component's output written into the "
              "residual stream at the position, s the final RMSNorm's scale frozen at this run's final residual, g "
              "its weight; heads[l][h] is head h of layer l (z_h · W_O slice), mlp[l] layer l's MLP, embeddings the "
              "token embedding")


def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """`ids` and n greedy tokens after them (the float products, as the recorded pass runs)."""
    import torch

    from engine.model import kernels
    from engine.model.kv_cache import KVCache

    device = model.lm_head.device
    out = list(ids)
    cache = KVCache(model.cfg, 1, len(ids) + n, model.lm_head.dtype, device)
    feed = out
    with torch.inference_mode(), kernels.forced("linear"):
        for _ in range(n):
            logits = model(torch.tensor([feed], device=device), cache)[0]
            out.append(int(logits.argmax()))
            feed = out[-1:]
    return out


def components(model: torch.nn.Module, ids: list[int], answer: int, wrong: int, position: int = -1) -> dict:
    """The direct logit attribution of `answer` over `wrong` at `position` of one forward pass over `ids`.

    Returns float tensors (float64): "heads" (L, H), "mlp" (L,), "embeddings" (), "attn" (L,) (the sum of each
    layer's heads), "logit_diff" (the model's own float32 logits' difference), "scale" (the frozen final-norm scale).
    """
    import torch

    from engine.model import kernels
    from engine.model.kv_cache import KVCache
    from engine.model.seam import Point, edited

    cfg = model.cfg
    L, H, hd = cfg.n_layers, cfg.n_heads, cfg.head_dim
    device = model.lm_head.device
    points = [Point.resid(0), Point.resid(L)] + [Point.z(i) for i in range(L)] + [Point.mlp(i) for i in range(L)]
    cache = KVCache(cfg, 1, len(ids), model.lm_head.dtype, device)
    with torch.inference_mode(), edited(model, (), points) as rec, kernels.forced("linear"):
        logits = model(torch.tensor([ids], device=device), cache, None, all_logits=True)[0, position]  # (V,)
        f64 = torch.float64
        x = rec[Point.resid(L)][0, position].to(f64)  # (d,) what the final norm reads
        scale = torch.sqrt(x.pow(2).mean() + model.norm.eps)
        u = model.norm.weight.to(f64) * (model.lm_head[answer].to(f64) - model.lm_head[wrong].to(f64))  # (d,)
        direction = u / scale
        heads = torch.zeros(L, H, dtype=f64)
        mlp = torch.zeros(L, dtype=f64)
        for i, block in enumerate(model.layers):
            z = rec[Point.z(i)][0, position].to(f64).view(H, hd)  # (H, hd)
            w_o = block.attn.wo.weight.to(f64).view(cfg.d_model, H, hd)  # (d, H, hd)
            per_head = torch.einsum("hk,dhk->hd", z, w_o)  # (H, d): each head's output, before any post norm
            if block.post_attn_norm is not None:  # Gemma 3: its scale frozen at the layer's summed output
                a = per_head.sum(dim=0)
                s = torch.sqrt(a.pow(2).mean() + block.post_attn_norm.eps)
                per_head = per_head * block.post_attn_norm.weight.to(f64) / s
            heads[i] = (per_head @ direction).cpu()
            mlp[i] = float(rec[Point.mlp(i)][0, position].to(f64) @ direction)
        embeddings = rec[Point.resid(0)][0, position].to(f64) @ direction
    return {"heads": heads, "mlp": mlp, "attn": heads.sum(dim=1), "embeddings": embeddings.cpu(),
            "logit_diff": float(logits[answer] - logits[wrong]), "scale": float(scale)}


def dla(session: Engine, prompt: str, answer: str, wrong: str, step: int = 0, chat: bool = False,
        top: int = TOP) -> dict:
    """Direct logit attribution of `answer` over `wrong` at generation step `step` (see the module docstring); the
    CLI's JSON document. ValueError in one sentence for bad input; Unsupported on llama.cpp."""
    from engine.why.patch import one_token

    require(session, "gradients", "direct logit attribution (each head's z times its slice of the output "
            "projection)")
    lm = session.lm
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"--step must be 0 to {MAX_STEP}, got {step}")
    tokenizer = session.tokenizer
    tok = session.tokenize(prompt, chat=chat)
    session.check_prompt(tok.ids, max_new_tokens=step + 1)
    a_id, w_id = one_token(tokenizer, answer, "--answer"), one_token(tokenizer, wrong, "--wrong")
    if a_id == w_id:
        raise ValueError(f"--answer and --wrong are the same token {tokenizer.piece(a_id)!r}")
    model = lm.model
    ids = _greedy(model, list(tok.ids), step) if step else list(tok.ids)
    c = components(model, ids, a_id, w_id)
    L, H = c["heads"].shape
    total = float(c["heads"].sum() + c["mlp"].sum() + c["embeddings"])
    named = ([(f"L{i}H{h}", float(c["heads"][i, h])) for i in range(L) for h in range(H)]
             + [(f"MLP{i}", float(c["mlp"][i])) for i in range(L)] + [("embeddings", float(c["embeddings"]))])
    named.sort(key=lambda kv: -abs(kv[1]))
    return {
        "tokens": [tokenizer.piece(i) for i in ids], "ids": ids, "step": step, "position": len(ids) - 1,
        "generated": [tokenizer.piece(i) for i in ids[len(tok.ids):]],
        "answer": {"id": a_id, "token": tokenizer.piece(a_id)},
        "wrong": {"id": w_id, "token": tokenizer.piece(w_id)},
        "heads": c["heads"].tolist(), "attn": c["attn"].tolist(), "mlp": c["mlp"].tolist(),
        "embeddings": float(c["embeddings"]),
        "sum": total, "logit_diff": c["logit_diff"], "frozen_norm_error": c["logit_diff"] - total,
        "final_norm_scale": c["scale"],
        "top": [{"component": k, "contribution": v} for k, v in named[:top]],
        "definition": DEFINITION,
    }


# ---- the command line --------------------------------------------------------------------------------------------
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `dla` to the engine's CLI."""
    from engine.cliargs import add_model_args, add_threads_arg, int_in

    q = sub.add_parser("dla", help="direct logit attribution: what each head, MLP and the embeddings wrote into the "
                                   "logit difference of two tokens, read off one forward pass")
    add_model_args(q)
    add_threads_arg(q)
    q.add_argument("--prompt", required=True)
    q.add_argument("--answer", required=True, help="the token whose logit is credited, one token (' Paris')")
    q.add_argument("--wrong", required=True, help="the token it is measured against, one token (' Rome')")
    q.add_argument("--step", type=int_in(0, MAX_STEP), default=0,
                   help="generation step: 0 (default) the prompt's last position; N after N greedy tokens")
    q.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    q.add_argument("--top", type=int_in(1, 1000), default=TOP, help=f"components listed (default {TOP})")
    q.set_defaults(func=_cmd, local_only="reads each head's output inside the forward pass, which a server does not "
                                         "give")


def _cmd(a: argparse.Namespace) -> int:
    from engine.backends import session_from_args
    from engine.cliargs import EXACT_PRODUCTS, one_line, stamped

    s = session_from_args(a)
    with one_line(Unsupported, RuntimeError, usage=(ValueError,)):
        out = dla(s, a.prompt, a.answer, a.wrong, step=a.step, chat=a.chat, top=a.top)
    if a.json:
        print(json.dumps(stamped(out, s.info, EXACT_PRODUCTS), ensure_ascii=False))
        return 0
    at = f"step {out['step']}" + (f" (after {''.join(out['generated'])!r})" if out["generated"] else "")
    print(f"logit difference {out['answer']['token']!r} - {out['wrong']['token']!r} at {at}: "
          f"{out['logit_diff']:.4f}; sum of the components {out['sum']:.4f} (frozen-norm error "
          f"{out['frozen_norm_error']:.2e}); embeddings {out['embeddings']:.3f}")
    print("top components:")
    for c in out["top"]:
        print(f"  {c['component']:>10} {c['contribution']:>9.3f}")
    H = len(out["heads"][0])
    print("per head (rows: layers; columns: heads), then the layer's attention total and its MLP")
    print(f"{'':>4}" + "".join(f"{'H' + str(h):>7}" for h in range(H)) + f"{'attn':>8}{'mlp':>8}")
    for i, row in enumerate(out["heads"]):
        print(f"{i:>4}" + "".join(f"{v:>7.2f}" for v in row) + f"{out['attn'][i]:>8.2f}{out['mlp'][i]:>8.2f}")
    return 0
