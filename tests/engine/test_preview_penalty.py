"""The next-token preview draws the funnel Generate would draw from: the repetition penalty included."""

import numpy as np

from engine import protocol as P
from engine.events import PromptTokenized, TokenSampled
from engine.protocol import GenerateRequest, PreviewResult
from engine.run.sampling import SamplingParams
from engine.run.session import Capture
from tests.engine.test_server import client  # noqa: F401 — the fixture


def test_preview_funnel_equals_the_first_generated_step_with_a_penalty(client) -> None:  # noqa: F811
    text = "the the the cat the the"
    params = SamplingParams(temperature=1.0, repetition_penalty=3.0, seed=0)
    client.send(P.SetParams(params))
    client.send(P.Preview(1, text, False, 10))
    preview = client.until(lambda m: isinstance(m, PreviewResult))[-1].funnel
    client.send(P.Generate(GenerateRequest(text=text, chat=False, max_new_tokens=1, params=params,
                                           capture=Capture(funnel_top=10, logits=True), ignore_eos=True)))
    run = client.until(lambda m: isinstance(m, TokenSampled))
    first = next(m for m in run if isinstance(m, TokenSampled))
    context = next(m for m in run if isinstance(m, PromptTokenized)).ids  # step 0 is sampled against the prompt
    gen = first.funnel
    k = len(preview.ids)
    np.testing.assert_array_equal(preview.ids, gen.ids[:k])
    np.testing.assert_allclose(preview.p_temperature, gen.p_temperature[:k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(preview.p_final, gen.p_final[:k], rtol=1e-5, atol=1e-7)

    # Independent reference: the penalty by its definition on the raw logits the generation captured.
    logits = first.logits.astype(np.float64)
    seen = np.unique(context)
    assert len(seen)
    adjusted = logits.copy()
    adjusted[seen] = np.where(logits[seen] > 0, logits[seen] / 3.0, logits[seen] * 3.0)
    p = np.exp(adjusted - adjusted.max())
    p /= p.sum()
    np.testing.assert_allclose(preview.p_temperature, p[preview.ids], rtol=1e-4, atol=1e-7)
    # …and the penalty matters here: without it the preview would show other numbers.
    q = np.exp(logits - logits.max())
    q /= q.sum()
    assert np.abs(q[preview.ids] - preview.p_temperature).max() > 1e-2 * preview.p_temperature.max()
