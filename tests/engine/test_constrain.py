"""Constrained decoding: whatever the model prefers, the output matches the regex or the schema."""

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.events import Finished, TokenSampled
from engine.run.constrain import Constraint
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session
from tests.engine.test_cli import cli


def constraint_for(s: Session, **kw) -> Constraint:
    eos = [*s.tokenizer.eos_ids, *sorted(set(s.stop_ids) - set(s.tokenizer.eos_ids))]
    return Constraint.build(s.tokenizer, s.cfg.vocab_size, eos, **kw)


# Simple patterns: literals, bounded classes and repeats, alternations, optional parts (all finite, so a generation
# of 48 tokens always has room to finish them). No \d: the grammar's \d is every Unicode decimal digit of a newer
# Unicode than Python 3.11's `re` knows (it emitted U+1CCF9, OUTLINED DIGIT NINE, Unicode 16), so `re` cannot be
# the reference for it; [0-9] is.
_piece = st.one_of(
    st.text(alphabet="abcxyz ", min_size=1, max_size=3).map(re.escape),
    st.sampled_from(["[a-c]", "[0-9]", "[xyz]", "[a-z]"]).flatmap(
        lambda c: st.sampled_from([c, c + "{1,3}", c + "{2}", c + "?"])),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=2), min_size=2, max_size=3).map(
        lambda alts: "(" + "|".join(map(re.escape, alts)) + ")"),
)
patterns = st.lists(_piece, min_size=1, max_size=4).map("".join)


@pytest.fixture(scope="module")
def tiny_session(tiny_lm):
    return Session(tiny_lm)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=patterns, seed=st.integers(0, 2**16), temperature=st.sampled_from([0.0, 0.7, 1.5]))
def test_the_output_always_matches_the_regex(tiny_session, pattern, seed, temperature):
    s = tiny_session
    params = SamplingParams(temperature=temperature, seed=seed)
    gen = s.generate("the cat", params, 48, constraint=constraint_for(s, regex=pattern), ignore_eos=True)
    fin = list(gen)[-1]
    assert isinstance(fin, Finished) and fin.reason == "eos", fin
    assert re.fullmatch(pattern, fin.text), (pattern, fin.text)


def test_the_funnel_shows_the_grammar_as_the_first_stage(tiny_session):
    s = tiny_session
    c = constraint_for(s, regex="[0-9]{3}")
    events = list(s.generate("the cat", SamplingParams(temperature=1.0, seed=1), 8, Capture(funnel_top=300),
                             constraint=c, ignore_eos=True))
    toks = [e for e in events if isinstance(e, TokenSampled)]
    digits = {s.tokenizer.token_id(d) for d in "0123456789"} - {None}
    for t in toks[:3]:
        f = t.funnel
        allowed = np.isin(f.ids, list(digits))
        assert f.kept_grammar == len(digits)
        assert np.all(f.p_temperature[~allowed] == 0) and f.p_temperature[allowed].sum() == pytest.approx(1.0)
        assert f.p_raw[~allowed].sum() > 0  # the model itself wanted other tokens: the grammar removed them
        assert f.kept_final <= f.kept_grammar
    assert "".join(t.text for t in toks) == events[-1].text and re.fullmatch("[0-9]{3}", events[-1].text)


def test_bad_grammars_are_one_sentence(tiny_session):
    with pytest.raises(ValueError, match="regular expression cannot be used"):
        constraint_for(tiny_session, regex="(unclosed")
    with pytest.raises(ValueError, match="JSON schema cannot be used"):
        constraint_for(tiny_session, json_schema="[1, 2")
    with pytest.raises(ValueError, match="either"):
        constraint_for(tiny_session)


@pytest.mark.slow
def test_json_schema_on_the_real_model(real_lm):
    s = Session(real_lm)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fin = list(s.generate("Describe a person as JSON:", SamplingParams(temperature=0.8, seed=3), 60,
                          constraint=constraint_for(s, json_schema=schema)))[-1]
    assert fin.reason == "eos"
    d = json.loads(fin.text)
    assert set(d) == {"name", "age"} and isinstance(d["name"], str) and isinstance(d["age"], int)
    assert len(d["name"]) <= 12


@pytest.mark.slow
def test_cli_regex_and_schema(tmp_path):
    r = cli("generate", "--prompt", "The Eiffel tower was built in", "--greedy", "--max-new-tokens", "12",
            "--regex", " [0-9]{4}\\.", "--json")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(" [0-9]{4}\\.", json.loads(r.stdout)["text"])
    bad = cli("generate", "--prompt", "hi", "--json-schema", str(tmp_path / "none.json"))
    assert bad.returncode == 1 and "cannot read the JSON schema" in bad.stderr
