"""Activation patching: which activations of a clean prompt carry its answer, found by copying them one at a time into
the run of a corrupted prompt of the same token length ("The Eiffel Tower is in" / "The Colosseum is in").

The measure is the logit difference of the answer over a wrong token at the last position,
    d = logit[answer] − logit[wrong],
and a patch's share of it restored:
    restored = (d_patched − d_corrupt) / (d_clean − d_corrupt),
0 when the patch changes nothing, 1 when it brings the clean answer's whole margin back (it can go past either).

Residual grid, (layers + 1) × positions: row ℓ patches the clean residual stream after layer ℓ (row 0: the
embeddings, as the first block receives them; TransformerLens's blocks.ℓ.hook_resid_pre, and the last row the last
block's output) at one position into the corrupted run. Heads grid, layers × heads: the clean output z of one head
(its attention-weighted values before the output projection, TransformerLens's hook_z) at every position at once.

Cost: one forward of each prompt, then for each of the L + 1 residual rows one forward whose batch rows are the
positions (row p patches position p; the rows are independent), split into forwards of at most MAX_ROWS rows; heads
add L forwards of H rows. So a 12-token pair on a 30-layer model is 2 + 31 forwards of 12 × 12 tokens.
Only the torch engine lets us write into the forward pass (engine.model.seam).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from engine.why import Cancelled, Progress, ShouldStop, Unsupported, check_stop

MAX_TOKENS = 128  # the grid costs (L + 1) × T rows of T tokens: 31 × 128 rows of 128 tokens is minutes already
MAX_ROWS = 32  # batch rows per patched forward (memory: rows × T positions of every activation)
DEFINITION = ("restored = (d_patched - d_corrupt) / (d_clean - d_corrupt), d = logit[answer] - logit[wrong] at the "
              "last position; restored[l][p] patches the clean residual stream after layer l (0 = the embeddings) "
              "at position p into the corrupted run")
HEADS_DEFINITION = "restored_heads[l][h] patches the clean output z of head h of layer l at every position"


def one_token(tokenizer, text: str, flag: str) -> int:
    """The id of `text` as one token (ValueError naming its pieces otherwise)."""
    tok = tokenizer.encode(text, add_special=False)
    if len(tok.ids) != 1:
        pieces = ", ".join(repr(p) for p in tok.pieces) or "none"
        raise ValueError(f"{flag} {text!r} is {len(tok.ids)} tokens ({pieces}); it must be one token (a leading "
                         "space is part of a token: ' Paris' and 'Paris' differ)")
    return tok.ids[0]


def _diff(logits, answer: int, wrong: int):
    return logits[..., answer] - logits[..., wrong]  # float32 logits (…, V) → (…)


def patch(session, clean: str, corrupt: str, answer: str, wrong: str, heads: bool = False,
          progress: Progress | None = None, should_stop: ShouldStop | None = None) -> dict:
    """The patching grids for a clean and a corrupted prompt (see the module docstring); the CLI's JSON document.

    ValueError in one sentence for bad input (unequal token lengths, an answer that is not one token, prompts the
    model already answers alike); Unsupported where the runtime cannot reach a point (a head's output under
    llama.cpp's flash attention).
    """
    import torch

    from engine.model.seam import Edit, Point

    cfg, tokenizer = session.cfg, session.tokenizer
    c, x = session.tokenize(clean), session.tokenize(corrupt)
    if len(c.ids) != len(x.ids):
        raise ValueError(f"the clean prompt is {len(c.ids)} tokens and the corrupted one {len(x.ids)}: patching "
                         "needs prompts of equal token length")
    session.check_prompt(c.ids)
    session.check_prompt(x.ids)
    T = len(c.ids)
    if T > MAX_TOKENS:
        raise ValueError(f"the prompts are {T} tokens; patching takes at most {MAX_TOKENS} (its grid costs "
                         f"{cfg.n_layers + 1} × T forwards of T tokens)")
    a_id, w_id = one_token(tokenizer, answer, "--answer"), one_token(tokenizer, wrong, "--wrong")
    if a_id == w_id:
        raise ValueError(f"--answer and --wrong are the same token {tokenizer.piece(a_id)!r}")
    L, H, hd = cfg.n_layers, cfg.n_heads, cfg.head_dim
    n_forwards = 2 + (L + 1) * -(-T // MAX_ROWS) + (L * -(-H // MAX_ROWS) if heads else 0)
    done = 0

    def forward(ids: Sequence[int], rows: int, edits=(), record=()):
        nonlocal done
        check_stop(should_stop)
        if progress is not None:
            progress(done / n_forwards, f"forward {done + 1} of {n_forwards}")
        logits, rec = session.run_points([list(ids)] * rows, edits, record)  # (B, V) float32, the last position
        done += 1
        return logits, rec

    with torch.inference_mode():
        points = [Point.resid(i) for i in range(L + 1)] + ([Point.z(i) for i in range(L)] if heads else [])
        logits, clean_rec = forward(c.ids, 1, record=points)
        d_clean = float(_diff(logits[0], a_id, w_id))
        d_corrupt = float(_diff(forward(x.ids, 1)[0][0], a_id, w_id))
        if abs(d_clean - d_corrupt) < 1e-6 * max(1.0, abs(d_clean)):
            raise ValueError(f"both prompts give the same logit difference ({d_clean:.4g}) of "
                             f"{tokenizer.piece(a_id)!r} over {tokenizer.piece(w_id)!r}: there is nothing to restore")

        def restored(d: torch.Tensor) -> list[float]:
            return ((d - d_corrupt) / (d_clean - d_corrupt)).tolist()

        grid = []
        for layer in range(L + 1):
            clean_stream = clean_rec[Point.resid(layer)][0]  # (T, d)
            row: list[float] = []
            for lo in range(0, T, MAX_ROWS):
                positions = range(lo, min(T, lo + MAX_ROWS))  # batch row b patches position lo + b
                edits = [Edit(Point.resid(layer), clean_stream[p], positions=(p,), rows=(b,))
                         for b, p in enumerate(positions)]
                row += restored(_diff(forward(x.ids, len(positions), edits)[0], a_id, w_id))
            grid.append(row)
        out = {
            "tokens": {"clean": list(c.pieces), "corrupt": list(x.pieces)},
            "ids": {"clean": list(c.ids), "corrupt": list(x.ids)},
            "answer": {"id": a_id, "token": tokenizer.piece(a_id)},
            "wrong": {"id": w_id, "token": tokenizer.piece(w_id)},
            "clean_logit_diff": d_clean, "corrupt_logit_diff": d_corrupt,
            "restored": grid, "definition": DEFINITION,
        }
        if heads:
            head_grid = []
            for layer in range(L):
                clean_z = clean_rec[Point.z(layer)][0]  # (T, H·hd), head-major
                row = []
                for lo in range(0, H, MAX_ROWS):
                    which = range(lo, min(H, lo + MAX_ROWS))  # batch row b patches head lo + b
                    edits = [Edit(Point.z(layer, h), clean_z[:, h * hd:(h + 1) * hd], rows=(b,))
                             for b, h in enumerate(which)]
                    row += restored(_diff(forward(x.ids, len(which), edits)[0], a_id, w_id))
                head_grid.append(row)
            out["restored_heads"] = head_grid
            out["heads_definition"] = HEADS_DEFINITION
    if progress is not None:
        progress(1.0, f"{n_forwards} forwards")
    out["forwards"] = n_forwards
    return out


# ---- the command line --------------------------------------------------------------------------------------------
def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add `patch` to the engine's CLI."""
    from engine.cliargs import add_model_args, add_threads_arg

    q = sub.add_parser("patch", help="activation patching: the share of the clean answer's logit difference each "
                                     "layer × position of the clean residual stream restores in the corrupted run")
    add_model_args(q)
    add_threads_arg(q)
    q.add_argument("--clean", required=True, help="the prompt whose answer is right")
    q.add_argument("--corrupt", required=True, help="a prompt of the same token length that changes the answer")
    q.add_argument("--answer", required=True, help="the clean answer, one token (with its leading space: ' Paris')")
    q.add_argument("--wrong", required=True, help="the corrupted prompt's answer, one token (' Rome')")
    q.add_argument("--heads", action="store_true", help="also patch each head's output (z), layer × head")
    q.set_defaults(func=_cmd, local_only="edits the forward pass, which a server does not let us do")


def _cmd(a: argparse.Namespace) -> int:
    from engine.backends import session_from_args
    from engine.cliargs import EXACT_PRODUCTS, one_line, stamped

    s = session_from_args(a)
    with one_line(Unsupported, Cancelled, RuntimeError, usage=(ValueError,)):
        out = patch(s, a.clean, a.corrupt, a.answer, a.wrong, heads=a.heads)
    if a.json:
        print(json.dumps(stamped(out, s.info, EXACT_PRODUCTS), ensure_ascii=False))
        return 0
    print(f"logit difference {out['answer']['token']!r} - {out['wrong']['token']!r}: clean "
          f"{out['clean_logit_diff']:.3f}, corrupted {out['corrupt_logit_diff']:.3f}; share restored by patching "
          "the clean residual stream after each layer (rows) at each position (columns)")
    grid(out["restored"], out["tokens"]["clean"], "emb")
    if "restored_heads" in out:
        print("share restored by patching each head's output at every position (rows: layers, columns: heads)")
        grid(out["restored_heads"])
    return 0


def grid(rows: list[list[float]], labels: Sequence[str] = (), first: str = "") -> None:
    """A grid as the CLI prints it: the labels (tokens) over the columns, the rows numbered (the first `first`)."""
    width = max([6, *(min(len(p), 10) for p in labels)])
    if labels:
        print(f"{'':>6}" + "".join(f"{p[:10]:>{width + 1}}" for p in labels))
    for i, row in enumerate(rows):
        print(f"{first if i == 0 and first else i:>6}" + "".join(f"{v:>{width + 1}.2f}" for v in row))
