"""Attribution patching (engine.why.atp) held to TransformerLens's attribution-patching demo formula run by
TransformerLens on the same weights ((a_clean − a_corrupt) · ∂metric/∂a at the corrupted run, from its forward and
backward hooks), to the derivative of exact patching taken by finite differences through engine.model.seam, and set
beside engine.why.patch's exact grid; the Eiffel Tower / Colosseum pair on SmolLM2 (slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.run.session import Session
from engine.why.atp import atp, atp_grids
from engine.why.patch import patch
from tests.why.conftest import run_cli
from tests.why.tl_reference import boot, export_default

CLEAN, CORRUPT, ANSWER, WRONG = "zq vx kj wy", "zq vx kb wy", "k", "j"  # 10 tokens each on the tiny vocabulary
EIFFEL = ("The Eiffel Tower is in the city of", "The Colosseum is in the city of", " Paris", " Rome")


def transformer_lens_atp(bridge, clean: list[int], corrupt: list[int], answer: int,
                         wrong: int) -> tuple[np.ndarray, np.ndarray]:
    """The demo's formula with TransformerLens's own hooks: clean and corrupted activations from forward hooks, the
    normalised logit difference's gradient at the corrupted run from backward hooks; the residual grid ((L + 1) × T,
    summed over d_model) and the heads grid (L × H, hook_z summed over positions and d_head)."""
    L = bridge.cfg.n_layers
    names = ([f"blocks.{i}.hook_resid_pre" for i in range(L)] + [f"blocks.{L - 1}.hook_resid_post"]
             + [f"blocks.{i}.attn.hook_z" for i in range(L)])
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    bridge.reset_hooks()
    for n in names:  # keyed by the name given here (the bridge resolves aliases to its own hook names)
        bridge.add_hook(n, lambda act, hook, n=n: acts.__setitem__(n, act.detach().clone()), "fwd")
        bridge.add_hook(n, lambda grad, hook, n=n: grads.__setitem__(n, grad.detach().clone()), "bwd")
    try:
        with torch.no_grad():
            logits = bridge(torch.tensor([clean]))
        d_clean = float(logits[0, -1, answer] - logits[0, -1, wrong])
        clean_acts = dict(acts)
        logits = bridge(torch.tensor([corrupt]))
        d = logits[0, -1, answer] - logits[0, -1, wrong]
        d_corrupt = float(d.detach())
        ((d - d_corrupt) / (d_clean - d_corrupt)).backward()
    finally:
        bridge.reset_hooks()
        bridge.zero_grad(set_to_none=True)
    cell = {n: (clean_acts[n] - acts[n])[0] * grads[n][0] for n in names}
    resid = np.array([cell[n].sum(dim=-1).numpy() for n in names[:L + 1]])  # (L + 1, T)
    heads = np.array([cell[n].sum(dim=(0, 2)).numpy() for n in names[L + 1:]])  # (T, H, hd) → (H,)
    return resid, heads


def test_atp_equals_transformer_lens_demo_formula_on_the_tiny_model(tiny_session, tiny_bridge):
    got = atp_grids(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    resid, heads = transformer_lens_atp(tiny_bridge, got["ids"]["clean"], got["ids"]["corrupt"], got["answer_id"],
                                        got["wrong_id"])
    grid, head_grid = np.asarray(got["atp"]), np.asarray(got["atp_heads"])
    assert grid.shape == (3, 10) and head_grid.shape == (2, 4)
    assert np.ptp(grid) > 0.1 and np.ptp(head_grid) > 0.01  # not flat: the comparison means something
    np.testing.assert_allclose(grid, resid, atol=1e-4, rtol=0)
    np.testing.assert_allclose(head_grid, heads, atol=1e-4, rtol=0)


def test_atp_is_the_derivative_of_exact_patching(tiny_session, tiny_lm):
    """Patching a cell part of the way, a_corrupt + α (a_clean − a_corrupt), moves the metric by α · AtP to first
    order: the central difference at α = ±1e-2 through the engine's own hooks (no autograd) gives the estimate."""
    from engine.model.kv_cache import KVCache
    from engine.model.seam import Edit, Point, edited

    got = atp_grids(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    model, a, w = tiny_lm.model, got["answer_id"], got["wrong_id"]
    d_clean, d_corrupt = got["clean_logit_diff"], got["corrupt_logit_diff"]

    def metric(ids, edits=(), record=()):
        with torch.inference_mode(), edited(model, edits, record) as rec:
            logits = model(torch.tensor([ids]), KVCache(model.cfg, 1, len(ids), torch.float32))[0].double()
        return (float(logits[a] - logits[w]) - d_corrupt) / (d_clean - d_corrupt), rec

    points = [Point.resid(i) for i in range(3)] + [Point.z(i) for i in range(2)]
    _, clean = metric(got["ids"]["clean"], record=points)
    _, corrupt = metric(got["ids"]["corrupt"], record=points)
    eps = 1e-2  # central: the error is O(eps²), and float32 noise over 2·eps stays small
    hd = model.cfg.head_dim
    checked = 0
    for layer, p in [(0, 7), (1, 7), (1, 8), (1, 9), (2, 9)]:
        c, x = clean[Point.resid(layer)][0, p], corrupt[Point.resid(layer)][0, p]
        up, _ = metric(got["ids"]["corrupt"], [Edit(Point.resid(layer), x + eps * (c - x), positions=(p,))])
        down, _ = metric(got["ids"]["corrupt"], [Edit(Point.resid(layer), x - eps * (c - x), positions=(p,))])
        assert (up - down) / (2 * eps) == pytest.approx(got["atp"][layer][p], abs=2e-3)
        checked += abs(got["atp"][layer][p]) > 0.01
    for layer, h in [(0, 1), (1, 2), (1, 3)]:
        cols = slice(h * hd, (h + 1) * hd)
        c, x = clean[Point.z(layer)][0][:, cols], corrupt[Point.z(layer)][0][:, cols]  # (T, hd)
        up, _ = metric(got["ids"]["corrupt"], [Edit(Point.z(layer, h), x + eps * (c - x))])
        down, _ = metric(got["ids"]["corrupt"], [Edit(Point.z(layer, h), x - eps * (c - x))])
        assert (up - down) / (2 * eps) == pytest.approx(got["atp_heads"][layer][h], abs=2e-3)
    assert checked >= 3  # most of the cells checked are not zero


def test_beside_the_exact_grid(tiny_session):
    got = atp(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True, top=5)
    exact = patch(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    np.testing.assert_allclose(got["restored"], exact["restored"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(got["restored_heads"], exact["restored_heads"], atol=1e-6, rtol=0)
    a, e = np.asarray(got["atp"]).ravel(), np.asarray(got["restored"]).ravel()
    assert got["pearson"] == pytest.approx(np.corrcoef(a, e)[0, 1], abs=1e-9)
    assert got["pearson_heads"] == pytest.approx(
        np.corrcoef(np.ravel(got["atp_heads"]), np.ravel(got["restored_heads"]))[0, 1], abs=1e-9)
    gap = np.abs(a - e)
    assert [abs(d["difference"]) for d in got["disagree"]] == pytest.approx(sorted(gap, reverse=True)[:5])
    first = got["disagree"][0]
    assert first["token"] == got["tokens"]["clean"][first["position"]]
    # positions before the first token that differs (7) carry the same activations in both runs: 0 in both grids
    assert got["changed_cells"] == 1 + 2 * 3 and np.abs(np.asarray(got["atp"])[:, :7]).max() == 0
    assert got["cost"]["atp"] == {"forwards": 2, "backwards": 1, "seconds": got["cost"]["atp"]["seconds"]}
    alone = atp(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, exact=False)
    assert alone["atp"] == got["atp"] and "restored" not in alone and "pearson" not in alone


def test_cli(tiny_dir, capsys):
    argv = ["atp", "--model", str(tiny_dir.gguf), "--backend", "torch", "--threads", "1", "--clean", CLEAN,
            "--corrupt", CORRUPT, "--answer", ANSWER, "--wrong", WRONG]
    code, out, err = run_cli(capsys, *argv, "--heads", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert np.asarray(d["atp"]).shape == (3, 10) and np.asarray(d["restored"]).shape == (3, 10)
    assert np.asarray(d["atp_heads"]).shape == (2, 4) and d["kernels"] == "exact" and d["dtype"] == "float32"
    assert {"pearson", "pearson_changed", "disagree", "disagree_heads", "definition"} <= d.keys()
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "Pearson r over the grid" in out and "where they part most" in out, err
    code, out, err = run_cli(capsys, *argv, "--no-exact")
    assert code == 0 and "Pearson" not in out and "attribution patching (AtP)" in out, err


@pytest.mark.parametrize("argv, code, needle", [
    (["--corrupt", "zq vx kb wyy"], 2, "the clean prompt is 10 tokens and the corrupted one 11"),
    (["--wrong", "k"], 2, "--answer and --wrong are the same token"),
    (["--url", "http://127.0.0.1:9"], 2, "drop --url"),
    (["--backend", "llama.cpp"], 1, "needs gradients"),
])
def test_cli_refuses_in_one_line(tiny_dir, capsys, argv, code, needle):
    args = {"--clean": CLEAN, "--corrupt": CORRUPT, "--answer": ANSWER, "--wrong": WRONG, "--backend": "torch"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        args[flag] = value
    got, _, err = run_cli(capsys, "atp", "--model", str(tiny_dir.gguf), *[s for kv in args.items() for s in kv])
    assert got == code and needle in err and len(err.strip().splitlines()) == 1, err


# ---- the default model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eiffel(real_lm):
    return atp(Session(real_lm), *EIFFEL)


@pytest.mark.slow
def test_eiffel_colosseum_on_smollm2(eiffel, tmp_path_factory):
    """AtP on the default model equals TransformerLens's demo formula on its exported weights, beside the exact
    grid; the figures are printed (pytest -s) for BENCHMARKS."""
    got = eiffel
    bridge = boot(export_default(tmp_path_factory.mktemp("smollm2") / "hf"))
    resid, _ = transformer_lens_atp(bridge, got["ids"]["clean"], got["ids"]["corrupt"], got["answer"]["id"],
                                    got["wrong"]["id"])
    assert got["clean_logit_diff"] > 0 > got["corrupt_logit_diff"]
    np.testing.assert_allclose(got["atp"], resid, atol=1e-3, rtol=0)
    grid = np.asarray(got["atp"])
    assert grid.shape == np.asarray(got["restored"]).shape == (31, 9)
    print(f"\nAtP against TransformerLens's formula: max |Δ| {np.abs(grid - resid).max():.2e}")
    print(f"Eiffel/Colosseum on SmolLM2: Pearson {got['pearson']:.3f} over the residual grid, "
          f"{got['pearson_changed']:.3f} over its {got['changed_cells']} changed cells; most apart:",
          [(d["layer"], d["token"], round(d["atp"], 3), round(d["exact"], 3)) for d in got["disagree"]])
    assert got["pearson"] is not None and -1 <= got["pearson"] <= 1
    assert {d["token"] for d in got["disagree"][:4]} <= {"iffel", " Tower"}  # the subject's tokens, early layers


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="measured Pearson 0.547 on SmolLM2 (float32): the metric is far from linear "
                   "along the patch at the subject's tokens in the early layers (AtP's known failure); issue 47")
def test_eiffel_colosseum_pearson_reaches_0_9(eiffel):
    assert eiffel["pearson"] >= 0.9
