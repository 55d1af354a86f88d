"""Logit lens: every layer's row against an independent float64 reference; the last row is the model's output."""

import json

import numpy as np
import pytest
import torch

from engine.events import LensCaptured, TokenSampled
from engine.run.lens import entropy_bits, entropy_bits_of_logits
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session
from tests.engine.test_cli import cli
from tests.tiny_model import CFG, reference_logits

GREEDY = SamplingParams.greedy_params()
IDS = [5, 77, 140, 3, 250, 99, 12, 200, 41, 7, 66]


def _lens_run(lm, prompt, n):
    events = list(Session(lm).generate(prompt, GREEDY, n, Capture(lens_top=8, logits=True), ignore_eos=True))
    return [e for e in events if isinstance(e, LensCaptured)], [e for e in events if isinstance(e, TokenSampled)]


def test_each_layer_row_matches_a_truncated_reference(tiny_dir, tiny_lm):
    lens, toks = _lens_run(tiny_lm, IDS, 3)
    assert [e.step for e in lens] == [0, 1, 2] and lens[0].ids.shape == (CFG["n_layers"] + 2, 8)
    for ev in lens:
        context = IDS + [t.token_id for t in toks[: ev.step]]
        assert ev.position == len(context) - 1
        for layer in range(CFG["n_layers"] + 1):
            # the reference cut after `layer` blocks, then its own final norm and head: the lens by definition
            ref = torch.softmax(reference_logits(tiny_dir.hf_weights, context, dict(CFG, n_layers=layer))[-1], -1)
            np.testing.assert_allclose(ev.probs[layer], ref[ev.ids[layer]].numpy(), atol=2e-5, rtol=1e-4)
            assert ev.entropy_bits[layer] == pytest.approx(float(-(ref * ref.log2()).sum()), abs=1e-3)


def test_last_row_is_the_models_own_distribution(tiny_lm):
    lens, toks = _lens_run(tiny_lm, "the cat sat on the mat", 4)
    for ev, tok in zip(lens, toks, strict=True):
        p = torch.softmax(torch.from_numpy(tok.logits), -1)
        vals, idx = torch.topk(p, 8)
        assert np.array_equal(ev.ids[-1], idx.numpy()) and np.array_equal(ev.probs[-1], vals.numpy())
        assert ev.ids[-1][0] == tok.token_id  # greedy: the output row's top token is the one chosen
        assert ev.entropy_bits[-1] == pytest.approx(entropy_bits(p).item(), abs=1e-5)  # log p two ways
        np.testing.assert_allclose(ev.probs[-2], ev.probs[-1], atol=1e-5)  # the last layer through the head
        assert ev.token_id == tok.token_id and ev.token_probs[-1] == p[tok.token_id].item()
        for row in range(ev.ids.shape[0]):  # where the chosen token is among a row's top, the two agree
            hit = np.flatnonzero(ev.ids[row] == tok.token_id)
            if hit.size:
                assert ev.token_probs[row] == pytest.approx(float(ev.probs[row, hit[0]]), abs=1e-6)


def test_entropy_bits_of_known_distributions():
    assert entropy_bits(torch.full((8,), 1 / 8)).item() == pytest.approx(3.0)
    assert entropy_bits(torch.tensor([1.0, 0.0, 0.0])).item() == 0.0


def test_entropy_from_logits_matches_a_float64_reference():
    """The lens's float32 entropy (log p from logsumexp) against float64 −Σ p·log₂ p, on a vocabulary of Gemma's
    size with logits of a real model's spread, a peaked row and a row with a −inf entry."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 262144, generator=g) * 4
    z[1, 7] = 60.0  # nearly all the mass on one token
    z[2, 11] = float("-inf")
    p = torch.softmax(z, -1)
    z64 = z.double()
    p64 = torch.softmax(z64, -1)
    want = -(torch.where(p64 > 0, p64 * torch.log2(p64), 0.0)).sum(-1)
    got = entropy_bits_of_logits(z, p)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-3)
    np.testing.assert_allclose(entropy_bits(p).numpy(), want.numpy(), atol=1e-3)


@pytest.mark.slow
def test_cli_lens_json_real_model():
    # One fixed thread count in both runs: `auto` may run each at another count, whose kernels the machine chose
    # apart (engine.model.kernels; the int8 kernel at one count, float products at the other), and their
    # probabilities then differ by more than this comparison allows.
    r = cli("lens", "--prompt", "The capital of France is", "--top", "3", "--greedy", "--json", "--threads", "1")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    rows = d["layers"]
    assert [row["layer"] for row in rows] == list(range(32)) and rows[-1]["name"] == "output"
    assert rows[-1]["top"][0]["token"] == " Paris" == d["sampled"]["token"]
    assert rows[0]["top"][0]["token"] == " is"  # tied embeddings: the embedding row points at the input token
    logits = json.loads(cli("logits", "--prompt", "The capital of France is", "--top", "3", "--json",
                            "--threads", "1").stdout)
    for got, want in zip(rows[-1]["top"], logits["candidates"], strict=True):
        assert got["id"] == want["id"] and got["prob"] == pytest.approx(want["prob_raw"], abs=1e-6)
    r2 = cli("lens", "--prompt", "The capital of France is", "--top", "3", "--greedy", "--step", "2", "--json")
    assert json.loads(r2.stdout)["position"] == d["position"] + 2
    bad = cli("lens", "--prompt", "hi", "--top", "0")
    assert bad.returncode != 0 and "--top" in bad.stderr


def test_prompt_scores_match_the_reference_at_every_position(tiny_dir, tiny_lm):
    from engine.events import PromptScored

    events = list(Session(tiny_lm).generate(IDS, GREEDY, 2, Capture(prompt_scores=True), ignore_eos=True))
    sc = next(e for e in events if isinstance(e, PromptScored))
    ref = torch.softmax(reference_logits(tiny_dir.hf_weights, IDS), -1)  # (T, V) float64, no cache
    assert sc.first == 1 and sc.ids.tolist() == IDS[1:]
    want = ref[torch.arange(len(IDS) - 1), torch.tensor(IDS[1:])].numpy()
    np.testing.assert_allclose(sc.probs, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sc.surprise_bits, -np.log2(want), rtol=1e-3, atol=1e-4)
    assert sc.top_ids.tolist() == ref[:-1].argmax(-1).tolist()
    ent = -(ref[:-1] * ref[:-1].log2()).sum(-1).numpy()
    np.testing.assert_allclose(sc.entropy_bits, ent, rtol=1e-4, atol=1e-4)
    # the prefill's own next token is unchanged by keeping every position's logits
    plain = list(Session(tiny_lm).generate(IDS, GREEDY, 2, ignore_eos=True))[-1]
    assert plain.ids.tolist() == events[-1].ids.tolist()
