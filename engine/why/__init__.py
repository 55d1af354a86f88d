"""Why, not only what: experiments on the running model that say what a part of it caused.

    heads.py      head roles (previous-token, duplicate-token, induction, attention sink), TransformerLens's
                  head_detector definitions, scored on the loaded model
    ablate.py     the next-token distribution before and after an ablation
    patch.py      activation patching between a clean and a corrupted prompt, layer × position
    attribute.py  which prompt tokens drove the next token (gradient × input, integrated gradients, occlusion)
    compare.py    what quantization changed: the same prompt through two files of one model, layer by layer
    dla.py        direct logit attribution: what each head and MLP wrote into the logit difference of two tokens
    atp.py        attribution patching: the patching grid from one forward and one backward pass
    steer.py      steering vectors from contrast pairs, saved as llama.cpp control vectors, added while generating
    tuned_lens.py the tuned lens: one affine map per layer fitted to the model's own output, saved per model file
    gallery.py    canned experiments (induction, an indirect-object name pair, greater-than, factual recall), each
                  set up for the loaded model, with words on what it shows and what to look for

Every read and write of a forward pass goes through the session's seam (engine.model.seam's named points), so the
experiments that only read and write run on either runtime; those that need a backward pass or the weights as torch
tensors ask the session (engine.backend.require) and say so in one sentence where it cannot.

Each module has a function the app's engine process calls (it returns the JSON-ready dict the CLI prints) and an
`add_subcommand(sub)` for `python -m engine …` (engine.why.cli registers them).
"""

from __future__ import annotations

from engine.backend import Progress, ShouldStop, Unsupported, require

__all__ = ["Cancelled", "Progress", "ShouldStop", "Unsupported", "check_stop", "require"]


class Cancelled(Exception):
    """The user stopped an experiment; nothing it measured so far is reported as a result."""


def check_stop(should_stop: ShouldStop | None) -> None:
    """Raise Cancelled when the user asked to stop (called between forward passes)."""
    if should_stop is not None and should_stop():
        raise Cancelled("stopped")
