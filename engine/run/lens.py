"""The logit lens: what the model would say if it stopped after layer ℓ.

The residual stream of the newest position after the embedding (ℓ = 0) and after every layer (ℓ = 1…L) goes
through the model's own final norm and LM head: p_ℓ = softmax(head(norm(x_ℓ))). Row L is the model's output
computed the same way; the last row is the output the forward pass itself returned (for these models the two agree;
a model whose output adds anything after the head, such as logit soft-capping, would show the difference).
Where in the stack the answer's token first rises to the top is where the model "decided".
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.events import LensCaptured

LN2 = math.log(2.0)


def entropy_bits(p: torch.Tensor) -> torch.Tensor:
    """H(p) = −Σ p·log₂ p over the last axis, in bits (0·log 0 = 0), in float32."""
    p = p.float()
    return torch.where(p > 0, p * p.log(), 0.0).sum(-1).neg_().div_(LN2)


def entropy_bits_of_logits(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """H of p = softmax(logits) in bits over the last axis, in float32, with no logarithm or exponential per entry.

    With z = logits − max(logits), log p = z + log p_max (p_max = 1 / Σ e^z), so H = −log p_max − Σ p·z / Σ p: one
    dot product per row. Elementwise −Σ p·log p takes a logarithm of every entry, which on Gemma 3's lens rows of
    262,144 tokens cost over ten times this (`python -m benchmarks.recompute --model gemma3-270m`; in BENCHMARKS.md's
    history, `git log -p BENCHMARKS.md`, commit 69fab4e, "Long runs (issue 26)"). Dividing by Σ p removes float32
    softmax's error in the total (a few 1e-5 over such a vocabulary), which would otherwise be multiplied by the
    logits' spread. A row with −inf logits (p = 0 there, so 0·(−inf)) takes the elementwise path.
    """
    z = logits - logits.amax(-1, keepdim=True)
    log_pmax = p.amax(-1).log()
    h = -log_pmax - torch.linalg.vecdot(p, z) / p.sum(-1)
    bad = torch.isnan(h)
    if bad.any():
        i = bad.nonzero().flatten()
        pi, log_p = p[i], z[i] + log_pmax[i].unsqueeze(-1)
        h[i] = -torch.where(pi > 0, pi * log_p, 0.0).sum(-1)
    return h.div_(LN2)


def lens_logits(model: torch.nn.Module, stream: torch.Tensor, final_logits: torch.Tensor) -> torch.Tensor:
    """stream (L + 1, d) residual vectors, final_logits (V,) → (L + 2, V) float32 logits, the model's own last: one
    product of every layer's row with the head."""
    w = next(model.parameters())
    x = stream.to(device=w.device, dtype=w.dtype)
    return torch.cat([model.head(x).float(), final_logits.float().reshape(1, -1).to(w.device)], dim=0)


def lens_probs(model: torch.nn.Module, stream: torch.Tensor, final_logits: torch.Tensor) -> torch.Tensor:
    """stream (L + 1, d) residual vectors, final_logits (V,) → (L + 2, V) probabilities, the model's own last."""
    return torch.softmax(lens_logits(model, stream, final_logits), dim=-1)


def lens_event(
    model: torch.nn.Module, tokenizer, step: int, position: int, stream: np.ndarray | torch.Tensor,
    final_logits: torch.Tensor, top: int, token: int | None = None,
) -> LensCaptured:
    """The LensCaptured event for one step from the captured residual stream (L + 1, d) and the step's logits.

    `token` (the token the step chose) gets its probability in every row, wherever it ranks.
    """
    logits = lens_logits(model, torch.as_tensor(stream), final_logits)
    p = torch.softmax(logits, dim=-1)
    vals, idx = torch.topk(p, min(top, p.shape[-1]), dim=-1)  # (L + 2, N)
    ids = idx.cpu().numpy().astype(np.int64)
    return LensCaptured(
        step=step, position=position, ids=ids, probs=vals.cpu().numpy().astype(np.float32),
        entropy_bits=entropy_bits_of_logits(logits, p).cpu().numpy(),
        pieces=tuple(tuple(tokenizer.piece(int(i)) for i in row) for row in ids),
        token_id=-1 if token is None else int(token),
        token_probs=None if token is None else p[:, int(token)].cpu().numpy().astype(np.float32),
    )


def lens_rows(ev: LensCaptured) -> list[dict]:
    """The JSON shape of `python -m engine lens`: one dict per row, layer 0 … L, then the model's output."""
    n = ev.ids.shape[0]
    rows = []
    for r in range(n):
        name = "embedding" if r == 0 else ("output" if r == n - 1 else f"layer {r}")
        rows.append({
            "layer": r, "name": name, "entropy_bits": float(ev.entropy_bits[r]),
            "top": [{"id": int(i), "token": ev.pieces[r][j] if ev.pieces else "", "prob": float(ev.probs[r, j])}
                    for j, i in enumerate(ev.ids[r])],
        })
    return rows
