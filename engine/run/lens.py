"""The logit lens: what the model would say if it stopped after layer ℓ.

The residual stream of the newest position after the embedding (ℓ = 0) and after every layer (ℓ = 1…L) goes
through the model's own final norm and LM head: p_ℓ = softmax(head(norm(x_ℓ))). Row L is the model's output
computed the same way; the last row is the output the forward pass itself returned (for these models the two agree;
a model whose output adds anything after the head, such as logit soft-capping, would show the difference).
Where in the stack the answer's token first rises to the top is where the model "decided".

The tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with the Tuned Lens"; the
`tuned-lens` package's translator) first moves each residual row ℓ < L by its own affine map, x ↦ x + A_ℓ x + b_ℓ,
fitted so that the row's distribution matches the model's output (engine.why.tuned_lens fits and saves it): with
A = 0 and b = 0 it is the logit lens exactly. Row L is what the final norm reads, so it keeps no map. A TunedLens in
use is attached to the head it reads through (use_tuned), so that every LensCaptured of that model (a generation's,
a recomputed step's, on either runtime) also carries the tuned lens's rows.

Each row's distance from the output is KL(output ‖ row) = Σ_v p_out,v · log₂(p_out,v / p_row,v), in bits: what the
row's guess costs, per token, when the model's own output is the truth.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

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


def kl_bits_of_logits(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(p_out ‖ p_r) in bits for every row r of p = softmax(logits) (R, V), p_out its last row, in float32.

    As in entropy_bits_of_logits, log p_r = z_r + log max p_r with z_r = logits_r − max logits_r, so
    KL = Σ_v p_out,v (log p_out,v − log p_r,v) = (p_out · z_out + log max p_out) − (p_out · z_r + log max p_r): one
    product of the output row with every row's z, no logarithm per entry. Where a logit is −∞ (0·(−∞)) the row is
    summed entry by entry. Float32 rounding leaves a few 1e-6 bits where the two rows are equal; the result is
    clamped at 0, below which no KL lies.
    """
    z = logits - logits.amax(-1, keepdim=True)
    log_pmax = p.amax(-1).log()
    q = p[-1] / p[-1].sum()
    kl = (q @ z[-1] + log_pmax[-1]) - (z @ q + log_pmax)
    bad = ~torch.isfinite(kl)
    if bad.any():
        log_q = torch.log_softmax(logits[-1].double(), -1)
        log_r = torch.log_softmax(logits[bad.nonzero().flatten()].double(), -1)
        kl[bad] = torch.where(q > 0, q * (log_q - log_r), 0.0).sum(-1).float()
    return kl.clamp_(min=0.0).div_(LN2)


@dataclasses.dataclass(frozen=True, eq=False)
class TunedLens:
    """A fitted tuned lens: residual row ℓ (0 ≤ ℓ < L) is read as x + A_ℓ x + b_ℓ before the final norm and head.

    weight (L, d, d) float32: A_ℓ as nn.Linear holds it (out × in, so A_ℓ x = weight[ℓ] @ x); bias (L, d) float32.
    `facts` are plain strings said about the fit (the model's SHA-256, the corpus, its tokens, steps and seconds, the
    held-out KL of both lenses), saved beside the arrays.
    """

    weight: np.ndarray
    bias: np.ndarray
    facts: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def identity(cls, n_layers: int, d_model: int) -> TunedLens:
        """The maps of the logit lens (A = 0, b = 0): the tuned-lens package's initial translator."""
        return cls(np.zeros((n_layers, d_model, d_model), np.float32), np.zeros((n_layers, d_model), np.float32))

    @property
    def n_layers(self) -> int:
        return int(self.weight.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.weight.shape[-1])

    def problem(self, n_layers: int, d_model: int) -> str | None:
        """Why these maps cannot read a model of n_layers layers of width d_model, in one sentence, or None."""
        w, b = self.weight, self.bias
        if not (isinstance(w, np.ndarray) and isinstance(b, np.ndarray) and w.ndim == 3 and b.ndim == 2):
            return "a tuned lens holds one d × d matrix and one d-vector per layer"
        if w.shape != (n_layers, d_model, d_model) or b.shape != (n_layers, d_model):
            return (f"the tuned lens has {w.shape[0]} maps of width {w.shape[-1]}; this model has {n_layers} layers "
                    f"of width {d_model}")
        if w.dtype.kind != "f" or b.dtype.kind != "f" or not (np.isfinite(w).all() and np.isfinite(b).all()):
            return "the tuned lens holds values that are not finite numbers"
        return None

    def translate(self, stream: torch.Tensor) -> torch.Tensor:
        """stream (…, L + 1, d) → (…, L + 1, d) float32: rows 0…L − 1 through their maps, row L as it is."""
        x = stream.float()
        w = torch.from_numpy(np.ascontiguousarray(self.weight, np.float32)).to(x.device)  # (L, d, d)
        b = torch.from_numpy(np.ascontiguousarray(self.bias, np.float32)).to(x.device)  # (L, d)
        low = x[..., :-1, :]  # (…, L, d)
        moved = low + torch.einsum("...ld,led->...le", low, w) + b  # x + A x + b per row
        return torch.cat([moved, x[..., -1:, :]], dim=-2)


# The tuned lens each head reads through, when one is in use: a generation's lens, a recomputed step's and the CLI's
# all reach the head through the runtime (Runtime.lens_head), so the maps ride with it; the head going away drops
# them.
_TUNED: weakref.WeakKeyDictionary[torch.nn.Module, TunedLens] = weakref.WeakKeyDictionary()


def use_tuned(head: torch.nn.Module, tuned: TunedLens | None) -> None:
    """Read every later lens through `head` with `tuned` too (None: the logit lens alone again)."""
    if tuned is None:
        _TUNED.pop(head, None)
    else:
        _TUNED[head] = tuned


def tuned_for(head: torch.nn.Module) -> TunedLens | None:
    """The tuned lens in use with `head`, or None."""
    return _TUNED.get(head)


def lens_logits(model: torch.nn.Module, stream: torch.Tensor, final_logits: torch.Tensor,
                tuned: TunedLens | None = None) -> torch.Tensor:
    """stream (L + 1, d) residual vectors, final_logits (V,) → (L + 2, V) float32 logits, the model's own last: one
    product of every layer's row with the head (each row first through its map when `tuned` is given)."""
    w = next(model.parameters())
    if tuned is not None:
        stream = tuned.translate(torch.as_tensor(stream))
    x = stream.to(device=w.device, dtype=w.dtype)
    return torch.cat([model.head(x).float(), final_logits.float().reshape(1, -1).to(w.device)], dim=0)


def lens_probs(model: torch.nn.Module, stream: torch.Tensor, final_logits: torch.Tensor,
               tuned: TunedLens | None = None) -> torch.Tensor:
    """stream (L + 1, d) residual vectors, final_logits (V,) → (L + 2, V) probabilities, the model's own last."""
    return torch.softmax(lens_logits(model, stream, final_logits, tuned), dim=-1)


def lens_event(
    model: torch.nn.Module, tokenizer, step: int, position: int, stream: np.ndarray | torch.Tensor,
    final_logits: torch.Tensor, top: int, token: int | None = None,
) -> LensCaptured:
    """The LensCaptured event for one step from the captured residual stream (L + 1, d) and the step's logits.

    `token` (the token the step chose) gets its probability in every row, wherever it ranks. Every row's KL to the
    output comes along; where a tuned lens is in use with `model` (use_tuned), the event's `tuned` holds its rows.
    """
    stream = torch.as_tensor(stream)
    tuned = tuned_for(model)
    logit = _lens_rows(model, tokenizer, step, position, stream, final_logits, top, token, None)
    if tuned is None:
        return logit
    return dataclasses.replace(
        logit, tuned=_lens_rows(model, tokenizer, step, position, stream, final_logits, top, token, tuned))


def _lens_rows(model: torch.nn.Module, tokenizer, step: int, position: int, stream: torch.Tensor,
               final_logits: torch.Tensor, top: int, token: int | None, tuned: TunedLens | None) -> LensCaptured:
    logits = lens_logits(model, stream, final_logits, tuned)
    p = torch.softmax(logits, dim=-1)
    vals, idx = torch.topk(p, min(top, p.shape[-1]), dim=-1)  # (L + 2, N)
    ids = idx.cpu().numpy().astype(np.int64)
    return LensCaptured(
        step=step, position=position, ids=ids, probs=vals.cpu().numpy().astype(np.float32),
        entropy_bits=entropy_bits_of_logits(logits, p).cpu().numpy(),
        pieces=tuple(tuple(tokenizer.piece(int(i)) for i in row) for row in ids),
        token_id=-1 if token is None else int(token),
        token_probs=None if token is None else p[:, int(token)].cpu().numpy().astype(np.float32),
        kl_bits=kl_bits_of_logits(logits, p).cpu().numpy(),
    )


def lens_rows(ev: LensCaptured) -> list[dict]:
    """The JSON shape of `python -m engine lens`: one dict per row, layer 0 … L, then the model's output (with its KL
    to the output in bits, and the tuned lens's reading of the row under "tuned" when one was in use)."""
    n = ev.ids.shape[0]
    rows = []
    for r in range(n):
        name = "embedding" if r == 0 else ("output" if r == n - 1 else f"layer {r}")
        row = {
            "layer": r, "name": name, "entropy_bits": float(ev.entropy_bits[r]),
            "top": [{"id": int(i), "token": ev.pieces[r][j] if ev.pieces else "", "prob": float(ev.probs[r, j])}
                    for j, i in enumerate(ev.ids[r])],
        }
        if ev.kl_bits is not None:
            row["kl_bits"] = float(ev.kl_bits[r])
        if ev.tuned is not None:  # the tuned lens's reading of the same row
            row["tuned"] = {k: v for k, v in lens_rows(ev.tuned)[r].items() if k not in ("layer", "name")}
        rows.append(row)
    return rows
