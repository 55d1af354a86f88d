"""engine.run.refunnel (numpy, GUI process) gives engine.run.sampling's funnel (torch, what Generate samples from)."""

import itertools

import numpy as np
import pytest
import torch

from engine.protocol import SamplingParams
from engine.run.refunnel import funnel_stages
from engine.run.sampling import funnel

SETTINGS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r, logit_bias=b)
    for t, k, p, m, r, b in itertools.product(
        (0.0, 0.3, 1.0, 2.5), (0, 1, 5, 40), (1.0, 0.9, 0.3), (0.0, 0.05), (1.0, 1.7), ((), ((3, -4.0), (7, 2.5))))
]


@pytest.mark.parametrize("seed,tie", [(0, False), (1, False), (2, True)])
def test_numpy_funnel_equals_the_torch_funnel(seed: int, tie: bool) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(300) * 3).astype(np.float32)
    if tie:
        logits[[10, 11]] = logits.max() + 1.0  # two tokens exactly tied at the top
    context = rng.integers(0, 300, 40)
    for params in SETTINGS:
        ref = funnel(torch.from_numpy(logits), params, torch.from_numpy(context))
        got = funnel_stages(logits, params, context)
        for name in ("p_raw", "p_temperature", "p_top_k", "p_top_p", "p_final"):
            want, have = getattr(ref, name).numpy(), got[name]
            if tie:  # top-p among exactly tied tokens keeps whichever its sort puts first: compare as multisets
                want, have = np.sort(want), np.sort(have)
            np.testing.assert_allclose(have, want, rtol=2e-5, atol=1e-7, err_msg=f"{name} {params}")
        assert (got["kept_top_k"], got["kept_top_p"], got["kept_final"]) == (
            ref.kept_top_k, ref.kept_top_p, ref.kept_final), params


def test_bad_logit_bias_is_refused_as_in_the_engine() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        funnel_stages(np.zeros(5, np.float32), SamplingParams(logit_bias=((9, 1.0),)))
