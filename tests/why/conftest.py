"""What the tests of engine/why share: a forward pass written by hand, with a seam at every point the hooks edit.

`by_hand` is tests.tiny_model's reference forward (Hugging Face layout, float64, no cache, no engine code) with its
`edit(site, layer, value)` seam (its docstring lists the sites).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.tiny_model import CFG, reference_logits

Editor = Callable[[str, int, torch.Tensor], torch.Tensor]


def by_hand_logits(w: dict[str, torch.Tensor], ids: list[int], edit: Editor | None = None,
                   cfg: dict = CFG) -> torch.Tensor:
    """Logits (T, V), float64, of a full causal forward with `edit` applied at every site."""
    return reference_logits(w, ids, cfg, edit=edit)


@pytest.fixture(scope="module")
def tiny_session(tiny_lm):
    """A session over the tiny model (tests/conftest.py's tiny_lm), one per module."""
    from engine.run.session import Session

    return Session(tiny_lm)


@pytest.fixture(scope="module")
def tiny_bridge(tiny_dir):
    """TransformerLens's model of the same tiny weights (tests/why/tl_reference.py), one per module."""
    from tests.why.tl_reference import boot

    return boot(tiny_dir.hf_dir)


@pytest.fixture(scope="session")
def by_hand() -> Callable[..., torch.Tensor]:
    return by_hand_logits


def engine_logits(model: torch.nn.Module, ids: list[list[int]] | list[int]) -> torch.Tensor:
    """The engine's logits at every position, (T, V) for one row or (B, T, V) for a batch, from a fresh cache."""
    from engine.model.kv_cache import KVCache

    rows = ids if ids and isinstance(ids[0], list) else [ids]
    cache = KVCache(model.cfg, len(rows), len(rows[0]), model.lm_head.dtype)
    with torch.inference_mode():
        out = model(torch.tensor(rows), cache, all_logits=True)
    return out if rows is ids else out[0]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`python -m engine ARGV` in this process: (exit code, stdout, stderr); argparse's exit counts as the code."""
    from engine.__main__ import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
