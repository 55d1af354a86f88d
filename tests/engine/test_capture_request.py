"""Capture is an explicit request: a layer asked for during a generation is captured from the next token on."""

from engine import protocol as P
from engine.events import AttentionCaptured, Finished, TokenSampled
from engine.protocol import GenerateRequest
from engine.run.sampling import SamplingParams
from engine.run.session import Capture
from tests.engine.test_server import client  # noqa: F401 — the fixture


def test_attention_layer_asked_mid_generation_is_captured_from_the_next_token(client) -> None:  # noqa: F811
    req = GenerateRequest(text="the cat sat on the mat", chat=False, max_new_tokens=4,
                          params=SamplingParams.greedy_params(), capture=Capture(attention_layers=frozenset({1})),
                          ignore_eos=True, start_paused=True)
    client.send(P.Generate(req))
    first = client.until(lambda m: isinstance(m, TokenSampled))
    assert {(m.step, m.layer) for m in first if isinstance(m, AttentionCaptured)} == {(0, 1)}
    client.send(P.CaptureAttention(frozenset({0})))
    client.send(P.Step())
    second = client.until(lambda m: isinstance(m, TokenSampled))
    assert {(m.step, m.layer) for m in second if isinstance(m, AttentionCaptured)} == {(1, 0), (1, 1)}
    row = next(m for m in second if isinstance(m, AttentionCaptured) and m.layer == 0)
    assert row.weights.shape[1] == 1 and abs(float(row.weights[0, 0].sum()) - 1.0) < 1e-5  # one softmax row
    client.send(P.Resume())
    rest = client.until(lambda m: isinstance(m, Finished))
    assert {m.layer for m in rest if isinstance(m, AttentionCaptured)} == {0, 1}


def test_attention_layers_outside_a_generation_changes_nothing(client) -> None:  # noqa: F811
    client.send(P.CaptureAttention(frozenset({0})))
    client.send(P.Generate(GenerateRequest(text="the cat", chat=False, max_new_tokens=2, ignore_eos=True,
                                           params=SamplingParams.greedy_params())))
    events = client.until(lambda m: isinstance(m, Finished))
    assert not [m for m in events if isinstance(m, AttentionCaptured)]  # the request's capture decides
