"""Sampling stages on hand-built logits: what survives each stage, and the draw."""

import math

import pytest
import torch

from engine.run.sampling import (
    SamplingParams,
    choose,
    draw,
    funnel,
    make_generator,
    sample,
    top_k_mask,
    top_p_mask,
)


def probs(*p):
    return torch.tensor(p, dtype=torch.float32)


def test_temperature_zero_is_argmax_and_keeps_one():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    token, st = sample(logits, SamplingParams(temperature=0.0))
    assert token == 1
    assert st.kept_final == 1 and st.p_final.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    cold = funnel(logits, SamplingParams(temperature=0.5)).p_temperature
    hot = funnel(logits, SamplingParams(temperature=2.0)).p_temperature
    raw = torch.softmax(logits, -1)
    assert cold[0] > raw[0] > hot[0]
    assert math.isclose(float(cold[0]), math.exp(4) / (math.exp(4) + math.exp(2) + 1), rel_tol=1e-6)


def test_top_k_keeps_ties_at_the_boundary():
    p = probs(0.4, 0.2, 0.2, 0.1, 0.1)
    assert top_k_mask(p, 2).tolist() == [True, True, True, False, False]  # the 2nd value is tied with the 3rd
    assert top_k_mask(p, 1).tolist() == [True, False, False, False, False]
    assert top_k_mask(p, 0).all()


def test_top_p_boundary():
    p = probs(0.5, 0.3, 0.15, 0.05)
    assert top_p_mask(p, 0.5).tolist() == [True, False, False, False]  # 0.5 alone reaches 0.5
    assert top_p_mask(p, 0.51).tolist() == [True, True, False, False]
    assert top_p_mask(p, 0.8).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8 exactly
    assert top_p_mask(p, 0.81).tolist() == [True, True, True, False]
    assert top_p_mask(p, 0.01).tolist() == [True, False, False, False]  # never empty


def test_top_p_on_a_flat_distribution_widens_the_search():
    p = torch.full((4096,), 1 / 4096)  # powers of two: the cumulative sums are exact
    assert int(top_p_mask(p, 0.5).sum()) == 2048


def test_funnel_counts_and_renormalises():
    logits = torch.log(probs(0.5, 0.3, 0.15, 0.05))
    st = funnel(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert (st.kept_top_k, st.kept_top_p, st.kept_final) == (3, 2, 2)
    # after top-k the three survivors are renormalised: 0.5/0.95, …; top-p then needs 0.526 + 0.316 ≥ 0.8
    assert torch.allclose(st.p_top_k, probs(0.5, 0.3, 0.15, 0) / 0.95)
    assert torch.allclose(st.p_final, probs(0.625, 0.375, 0, 0))
    assert math.isclose(float(st.p_final.sum()), 1.0, rel_tol=1e-6)


def test_min_p():
    logits = torch.log(probs(0.6, 0.25, 0.1, 0.05))
    st = funnel(logits, SamplingParams(temperature=1.0, min_p=0.2))  # threshold 0.12
    assert st.kept_final == 2


def test_repetition_penalty_and_bias():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    st = funnel(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0, logit_bias=((3, 5.0),)),
                context_ids=torch.tensor([0, 1, 1]))
    assert st.adjusted.tolist() == [1.0, -2.0, 0.5, 5.0]
    assert st.logits.tolist() == logits.tolist()  # the raw logits are untouched


def test_seeded_draws_repeat_and_follow_the_distribution():
    logits = torch.log(probs(0.7, 0.2, 0.1))
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, params, g)[0] for g in [make_generator(7)] for _ in range(200)]
    g = make_generator(7)
    b = [sample(logits, params, g)[0] for _ in range(200)]
    assert a == b
    g = make_generator(1)
    draws = [sample(logits, params, g)[0] for _ in range(2000)]
    assert abs(draws.count(0) / 2000 - 0.7) < 0.05


def test_a_draw_follows_the_distribution_as_torch_multinomial_does():
    """Inverse-CDF draws against torch.multinomial's on the same distribution (zeros, a tiny tail, unnormalized):
    the frequencies agree with each other and with p, and a token of zero mass is never drawn."""
    p = torch.tensor([0.30, 0.0, 0.05, 0.0, 0.40, 0.2499, 0.0001, 0.0]) * 7.0
    n = 40_000
    g1, g2 = make_generator(3), make_generator(4)
    ours = torch.bincount(torch.tensor([draw(p, g1) for _ in range(n)]), minlength=len(p)).double() / n
    ref = torch.bincount(torch.multinomial(p, n, replacement=True, generator=g2), minlength=len(p)).double() / n
    want = (p / p.sum()).double()
    assert (ours[want == 0] == 0).all()
    assert torch.allclose(ours, want, atol=0.01) and torch.allclose(ours, ref, atol=0.012)
    assert draw(torch.tensor([0.0, 0.0, 1.0, 0.0])) == 2  # one token with all the mass
    assert draw(torch.tensor([1e-30, 0.0, 0.0])) == 0  # whatever the scale
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan")])):
        with pytest.raises(ValueError, match="cannot draw a token"):
            draw(bad)


def test_sampling_never_picks_a_removed_token():
    g = make_generator(0)
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=1.5, top_k=20, top_p=0.7)
    allowed = set(torch.nonzero(funnel(logits, params).p_final).flatten().tolist())
    assert all(sample(logits, params, g)[0] in allowed for _ in range(300))


@pytest.mark.parametrize("kw, msg", [
    ({"temperature": -0.1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"min_p": 1.0}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_out_of_range_knobs_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_logit_bias_outside_vocab_raises():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        funnel(torch.zeros(4), SamplingParams(logit_bias=((9, 1.0),)))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, logit_bias=((3, 2.0),)),
])
def test_choose_picks_what_sample_picks(params):
    """The decode loop's funnel-free path draws exactly the token the full funnel would."""
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(5)) * 2
    ctx = torch.tensor([3, 9, 9, 400])
    g1, g2 = make_generator(42), make_generator(42)
    a = [sample(logits, params, g1, ctx)[0] for _ in range(50)]
    b = [choose(logits, params, g2, ctx) for _ in range(50)]
    assert a == b
