"""Attribution patching with the gradient integrated along the path between the two prompts' embeddings
(engine.why.atp's `ig_steps`, EAP-IG): its embeddings row equals Captum's integrated gradients on Hugging Face
transformers' model of the same weights with the same quadrature, adds up to the whole change of the metric
(completeness), and every deeper cell is the path-averaged derivative that central differences through the seam
give, without autograd."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.why.atp import atp, atp_grids
from tests.requires import import_required
from tests.why.conftest import run_cli
from tests.why.test_atp import ANSWER, CLEAN, CORRUPT, WRONG


def test_the_embeddings_row_equals_captums_integrated_gradients_on_transformers(tiny_session, tiny_dir):
    attr = import_required("captum", "references").attr
    transformers = import_required("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir.hf_dir), dtype=torch.float32).eval()
    k = 8
    got = atp_grids(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, ig_steps=k)
    a, w = got["answer_id"], got["wrong_id"]
    table = hf.get_input_embeddings().weight.detach()
    e_clean, e_corrupt = (table[torch.tensor([got["ids"][s]])] for s in ("clean", "corrupt"))
    with torch.no_grad():
        d_clean, d_corrupt = (float(hf(inputs_embeds=e).logits[0, -1, a] - hf(inputs_embeds=e).logits[0, -1, w])
                              for e in (e_clean, e_corrupt))

    def metric(embeds: torch.Tensor) -> torch.Tensor:
        logits = hf(inputs_embeds=embeds).logits[:, -1].float()
        return (logits[:, a] - logits[:, w] - d_corrupt) / (d_clean - d_corrupt)

    want = attr.IntegratedGradients(metric).attribute(e_clean, baselines=e_corrupt, n_steps=k,
                                                      method="riemann_middle", internal_batch_size=k)
    want = want[0].sum(dim=-1).detach().numpy()  # (T,)
    assert np.ptp(want) > 0.1  # not flat: the comparison means something
    np.testing.assert_allclose(got["atp"][0], want, atol=1e-4, rtol=0)


def test_the_embeddings_row_adds_up_to_the_whole_change(tiny_session):
    """Integrated gradients' completeness: along the straight path of the embeddings the row sums to m(clean) −
    m(corrupt) = 1, within the midpoint rule's O(1/K²); AtP's single gradient at the corrupted run does not."""
    plain = atp_grids(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG)
    assert plain["ig_steps"] == 0 and abs(sum(plain["atp"][0]) - 1) > 0.5
    fine = atp_grids(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, ig_steps=64)
    assert sum(fine["atp"][0]) == pytest.approx(1.0, abs=1e-3)


def test_each_cell_is_the_path_averaged_derivative_by_central_differences(tiny_session):
    """Cell (ℓ, p) with K steps is the mean over α = (j + ½) / K of the derivative of the metric along
    a_clean − a_corrupt at (ℓ, p), in the run whose embeddings are e_corrupt + α (e_clean − e_corrupt): here taken by
    central differences (±3e-3) of forward passes through the session's seam, which write the embeddings and the
    nudged cell. A whole token's change is a long step: the metric curves along it, and the differences' own error
    (∝ eps² · the third derivative) grows with the slope, so the tolerance does too."""
    from engine.model.seam import Edit, Point

    k = 2
    got = atp_grids(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True, ig_steps=k)
    a, w = got["answer_id"], got["wrong_id"]
    d_clean, d_corrupt = got["clean_logit_diff"], got["corrupt_logit_diff"]
    points = [Point.resid(i) for i in range(3)]

    def run(ids, edits=(), record=()):
        with torch.inference_mode():
            logits, rec = tiny_session.run_points([ids], edits, record)
        return (float(logits[0, a] - logits[0, w]) - d_corrupt) / (d_clean - d_corrupt), rec

    _, clean = run(got["ids"]["clean"], record=points)
    _, corrupt = run(got["ids"]["corrupt"], record=points)
    e_c, e_x = clean[Point.resid(0)][0], corrupt[Point.resid(0)][0]  # (T, d): the embeddings block 0 reads
    eps = 3e-3
    checked = 0
    for layer, p in [(0, 7), (1, 7), (1, 9), (2, 8), (2, 9)]:
        step = clean[Point.resid(layer)][0, p] - corrupt[Point.resid(layer)][0, p]
        slopes = []
        for j in range(k):
            alpha = (j + 0.5) / k
            on_path = Edit(Point.resid(0), e_x + alpha * (e_c - e_x))
            _, rec = run(got["ids"]["corrupt"], [on_path], record=[Point.resid(layer)])
            here = rec[Point.resid(layer)][0, p]
            nudged = [run(got["ids"]["corrupt"], [on_path, Edit(Point.resid(layer), here + s * eps * step,
                                                                  positions=(p,))])[0] for s in (1, -1)]
            slopes.append((nudged[0] - nudged[1]) / (2 * eps))
        tolerance = 2e-3 + 1e-3 * float(np.mean(np.abs(slopes)))
        assert float(np.mean(slopes)) == pytest.approx(got["atp"][layer][p], abs=tolerance), (layer, p, slopes)
        checked += abs(got["atp"][layer][p]) > 0.01
    assert checked >= 3


def test_beside_the_exact_grid_and_on_the_command_line(tiny_session, tiny_dir, capsys):
    got = atp(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, ig_steps=4)
    assert got["ig_steps"] == 4 and got["cost"]["atp"]["forwards"] == 6 and got["cost"]["atp"]["backwards"] == 4
    assert "EAP-IG" in got["definition"] and got["pearson"] is not None
    with pytest.raises(ValueError, match="--ig-steps must be 0 to 256"):
        atp_grids(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, ig_steps=257)
    code, out, err = run_cli(capsys, "atp", "--model", str(tiny_dir.gguf), "--backend", "torch", "--threads", "1",
                             "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", ANSWER, "--wrong", WRONG,
                             "--ig-steps", "4", "--no-exact", "--json")
    assert code == 0, err
    d = json.loads(out)
    np.testing.assert_allclose(d["atp"], got["atp"], atol=1e-5, rtol=0)  # another process: float32's rounding
    assert d["ig_steps"] == 4


@pytest.mark.slow
def test_eiffel_colosseum_along_the_path_on_smollm2(real_lm):
    """On the default model plain AtP's Pearson with the exact grid is 0.547 (test_atp.py's strict xfail); the
    gradient integrated along the embeddings' path brings it to about 0.9 (measured 0.897 at K = 8 and 16, BENCHMARKS),
    and the embeddings row adds up to the whole change."""
    from engine.run.session import Session
    from engine.why.patch import patch
    from tests.why.test_atp import EIFFEL

    s = Session(real_lm)
    exact = np.asarray(patch(s, *EIFFEL)["restored"]).ravel()
    plain = np.asarray(atp_grids(s, *EIFFEL)["atp"])
    path = np.asarray(atp_grids(s, *EIFFEL, ig_steps=8)["atp"])
    r_plain, r_path = (float(np.corrcoef(g.ravel(), exact)[0, 1]) for g in (plain, path))
    print(f"\nEiffel/Colosseum on SmolLM2: Pearson AtP {r_plain:.3f}, along the path (K = 8) {r_path:.3f}; "
          f"embeddings row sums {plain[0].sum():.3f} and {path[0].sum():.3f}")
    assert r_plain < 0.6 and r_path > 0.85
    assert abs(path[0].sum() - 1) < 0.05 < abs(plain[0].sum() - 1)
