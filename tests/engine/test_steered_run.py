"""A generation with a steering vector on (engine.why.steered): the scale set between two tokens acts from the next
token on and the run says so (Steered events); scale 0 is the unsteered run; a server refuses in one sentence; the
vector crosses the pipe as checked plain data (engine.protocol.Steer) and a session file keeps it, refusing a
hostile one with one sentence."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import Unsupported
from engine.events import PromptTokenized, Steered, TokenSampled
from engine.protocol import Ablated, GenerateRequest, SamplingParams, Steer
from engine.session_file import SavedSession, SessionFileError, load_session, save_session
from engine.why.steered import generate_steered, to_steer, to_vector

N_NEW = 8
SWITCH_AFTER = 3  # the scale changes after this step's token
BIG = 40.0


@pytest.fixture(scope="module")
def local(tiny_lm):
    from engine.backends.local import LocalBackend
    from engine.run.session import Session

    return LocalBackend(Session(tiny_lm))


@pytest.fixture(scope="module")
def vector(local):
    from engine.why.steer import Pair, build

    pairs = [Pair("hello world", "goodbye world"), Pair("I love it", "I hate it")]
    return to_steer(build(local.why_session(), pairs, [1]), "built from 2 pairs", 0.0)


def request(steer: Steer | None) -> GenerateRequest:
    return GenerateRequest("the cat sat", chat=False, max_new_tokens=N_NEW, params=SamplingParams.greedy_params(),
                           ignore_eos=True, steer=steer)


def run(local, steer: Steer, switch: dict[int, float] | None = None) -> tuple[list[int], list[Steered], list]:
    """(token ids, Steered events, all events) of a steered run; `switch`: step → scale set after its token."""
    gen = generate_steered(local, request(steer))
    events, ids = [], []
    for ev in gen:
        events.append(ev)
        if isinstance(ev, TokenSampled):
            ids.append(ev.token_id)
            if switch and ev.step in switch:
                gen.set_scale(switch[ev.step])  # between two tokens, as the engine process does
    return ids, [e for e in events if isinstance(e, Steered)], events


def plain(local) -> list[int]:
    return [e.token_id for e in local.generate(request(None)) if isinstance(e, TokenSampled)]


def test_scale_zero_is_the_unsteered_run_and_the_vector_comes_first(local, vector):
    ids, steered, events = run(local, vector)
    assert ids == plain(local)
    assert len(steered) == 1 and steered[0].step == 0 and steered[0].scale == 0.0
    i = events.index(steered[0])
    assert isinstance(events[i - 1], PromptTokenized)  # right after the prompt: a run's first two events stay put
    np.testing.assert_array_equal(steered[0].directions, vector.directions)
    assert steered[0].layers == (1,) and steered[0].label == "built from 2 pairs at layer 1 × +0"


def test_a_scale_set_between_two_tokens_acts_from_the_next_token(local, vector):
    fixed, _, _ = run(local, vector)
    strong, _, _ = run(local, vector.at(BIG))
    assert strong != fixed  # the vector does move this model's tokens at this scale
    ids, steered, events = run(local, vector, {SWITCH_AFTER: BIG})
    assert ids[:SWITCH_AFTER + 1] == fixed[:SWITCH_AFTER + 1]  # the tokens before the change are the fixed run's
    assert ids[SWITCH_AFTER + 1:] != fixed[SWITCH_AFTER + 1:]  # the next ones are not
    assert [(e.step, e.scale) for e in steered] == [(0, 0.0), (SWITCH_AFTER + 1, BIG)]
    later = steered[1]
    assert later.directions is None and later.label == "× +40"
    # the change is announced before the events of the first token it made
    i = events.index(later)
    assert next(e for e in events[i:] if isinstance(e, TokenSampled)).step == SWITCH_AFTER + 1
    # and the cache is let go: a plain run after it is the unsteered model's
    assert plain(local) == fixed


def test_a_bad_scale_is_refused_in_one_sentence(local, vector):
    gen = generate_steered(local, request(vector))
    it = iter(gen)
    next(it)
    with pytest.raises(ValueError, match="finite"):
        gen.set_scale(float("nan"))
    gen.stop()
    list(it)


def test_a_server_refuses_and_a_run_is_not_both_ablated_and_steered(local, vector):
    from engine.backend import Backend

    class Server:  # what a server backend answers for its forward pass (engine.backend.Backend's own refusal)
        why_session = Backend.why_session

    with pytest.raises(Unsupported, match="a server does not expose: turn steering off, or disconnect"):
        generate_steered(Server(), request(vector))
    with pytest.raises(ValueError, match="either ablated or steered"):
        generate_steered(local, GenerateRequest("x", ablation=Ablated(mlp_layers=(0,)), steer=vector))


def test_a_vector_for_another_model_is_refused(local, vector):
    wide = Steer("other", (1,), np.ones((1, 65), np.float32))
    with pytest.raises(ValueError, match="65 wide"):
        generate_steered(local, request(wide))
    deep = Steer("other", (5,), np.ones((1, 64), np.float32))
    with pytest.raises(ValueError, match="layer 5 cannot be steered"):
        generate_steered(local, request(deep))


@pytest.mark.parametrize("fields, words", [
    (dict(layers=(2, 1)), "increasing order"),
    (dict(layers=(1, 1)), "increasing order"),
    (dict(layers=(-1,)), "block indices"),
    (dict(layers=(True,)), "block indices"),
    (dict(scale=float("inf")), "finite number"),
    (dict(scale=True), "finite number"),
    (dict(directions=np.full((1, 4), np.nan, np.float32)), "not finite"),
    (dict(directions=np.ones((2, 4), np.float32)), r"shape \(2, 4\) for 1 layers"),
    (dict(directions=np.ones(4, np.float32)), "2-D array"),
    (dict(directions=np.ones((1, 4), np.int64)), "2-D array of floats"),
    (dict(name="x" * 201), "name"),
])
def test_steer_is_checked_plain_data(fields, words):
    good = dict(name="v", layers=(1,), directions=np.ones((1, 4), np.float32), scale=2.0)
    with pytest.raises(ValueError, match=words):
        Steer(**{**good, **fields})
    s = Steer(**good)
    assert s.directions.dtype == np.float32 and not s.directions.flags.writeable
    assert to_vector(s).directions[1].shape == (4,) and s.at(-3).scale == -3.0 and s.label == "v at layer 1 × +2"


def test_a_session_keeps_the_vector_and_refuses_a_hostile_one(local, vector, tiny_lm, tmp_path):
    _, _, events = run(local, vector, {SWITCH_AFTER: BIG})
    path = tmp_path / "steered.ilab"
    save_session(path, SavedSession(events=events, info=tiny_lm.info, cfg=tiny_lm.cfg))
    back = [e for e in load_session(path).events if isinstance(e, Steered)]
    assert [(e.step, e.scale, e.name, e.layers) for e in back] == [
        (0, 0.0, vector.name, (1,)), (SWITCH_AFTER + 1, BIG, "", ())]
    np.testing.assert_array_equal(back[0].directions, vector.directions)
    assert back[1].directions is None

    first = next(e for e in events if isinstance(e, Steered))
    for bad, words in ((np.full((1, 64), np.inf, np.float32), "not finite"),
                       (np.ones((3, 64), np.float32), "shape")):
        hostile = [Steered(step=0, scale=1.0, name="x", layers=(1,), directions=bad) if e is first else e
                   for e in events]
        save_session(path, SavedSession(events=hostile, info=tiny_lm.info, cfg=tiny_lm.cfg))
        with pytest.raises(SessionFileError, match=f"a saved Steered is inconsistent: its directions .*{words}"):
            load_session(path)
