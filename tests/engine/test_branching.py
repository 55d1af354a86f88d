"""Forcing and forking: a fork continues exactly as a fresh generation from the forked prefix (greedy)."""

import json

import pytest

from engine.events import Finished, PrefillDone, TokenSampled
from engine.run.branching import parse_force, tokenization_of
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session
from tests.engine.test_cli import cli

GREEDY = SamplingParams.greedy_params()


def run(gen):
    return list(gen)


def _second_choice(ev: TokenSampled) -> int:
    """The most probable token other than the one chosen, from the step's funnel."""
    order = ev.funnel.ids[ev.funnel.p_raw.argsort()[::-1]].tolist()
    return next(i for i in order if i != ev.token_id)


def _fork_matches_fresh(lm, prompt: str, chat: bool, n: int, k: int, n_fork: int) -> None:
    s = Session(lm)
    events = run(s.generate(prompt, GREEDY, n, Capture(funnel_top=5), chat=chat, ignore_eos=True))
    fin = events[-1]
    assert isinstance(fin, Finished)
    steps = [e for e in events if isinstance(e, TokenSampled)]
    alt = _second_choice(steps[k])
    fork_events = run(s.fork(fin.prompt_ids, fin.ids, k, alt, GREEDY, n_fork, ignore_eos=True))
    pre = next(e for e in fork_events if isinstance(e, PrefillDone))
    prefix = fin.prompt_ids.tolist() + fin.ids[:k].tolist()
    assert pre.n_reused == len(prefix) - 1 and pre.n_tokens == 1  # the cache held the prefix: one token run
    forked = fork_events[-1]
    assert forked.ids[0] == alt and [e.forced for e in fork_events if isinstance(e, TokenSampled)][:2] == [
        True, False]
    # The reference: a new session (empty cache) prefilling the whole forked prefix plus the chosen token.
    fresh = run(Session(lm).generate(prefix + [alt], GREEDY, n_fork - 1, ignore_eos=True))[-1]
    assert forked.ids[1:].tolist() == fresh.ids.tolist()
    assert forked.ids.tolist() != fin.ids[k:k + n_fork].tolist()


def test_fork_continues_like_a_fresh_generation_tiny(tiny_lm):
    _fork_matches_fresh(tiny_lm, "the cat sat on the mat", False, 10, 4, 8)


def test_fork_at_step_zero_tiny(tiny_lm):
    _fork_matches_fresh(tiny_lm, "hello there", False, 4, 0, 5)


@pytest.mark.slow
def test_fork_continues_like_a_fresh_generation_real(real_lm):
    _fork_matches_fresh(real_lm, "The capital of France is", False, 10, 3, 8)


def test_forced_tokens_replace_the_sampled_ones(tiny_lm):
    s = Session(tiny_lm)
    base = run(s.generate("the cat", GREEDY, 6, ignore_eos=True))[-1].ids.tolist()
    want = {1: (base[1] + 1) % tiny_lm.cfg.vocab_size, 4: 7}
    events = run(s.generate("the cat", GREEDY, 6, Capture(funnel_top=3), ignore_eos=True, forced=want))
    toks = [e for e in events if isinstance(e, TokenSampled)]
    assert [t.token_id for t in toks][1] == want[1] and toks[4].token_id == 7
    assert [t.step for t in toks if t.forced] == [1, 4]
    assert toks[0].token_id == base[0]
    assert want[1] in toks[1].funnel.ids.tolist()  # the funnel shows the forced token among the candidates
    # forcing the greedy choice itself changes nothing
    same = run(s.generate("the cat", GREEDY, 6, ignore_eos=True, forced={2: base[2]}))[-1].ids.tolist()
    assert same == base


def test_bad_forcing_is_refused(tiny_lm):
    s = Session(tiny_lm)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.generate("the cat", GREEDY, 4, forced={0: tiny_lm.cfg.vocab_size})
    with pytest.raises(ValueError, match="has steps 0..3"):
        s.generate("the cat", GREEDY, 4, forced={4: 1})
    with pytest.raises(ValueError, match="cannot fork at step 9"):
        s.fork([1, 2, 3], [4, 5], 9, 1)
    assert parse_force(["0:5", "3:17"]) == {0: 5, 3: 17}
    for bad in ("3", "a:1", "1:-2", "1:2:3"):
        with pytest.raises(ValueError, match="--force"):
            parse_force([bad])


def test_tokenization_of_ids_round_trips_the_encoder(tiny_lm):
    tok = tiny_lm.tokenizer
    for text in ("the cat sat", "héllo wörld", ""):
        enc = tok.encode(text)
        back = tokenization_of(tok, enc.ids)
        assert back.text == text and back.ids == enc.ids
        assert back.offsets == enc.offsets and back.byte_offsets == enc.byte_offsets


@pytest.mark.slow
def test_cli_force_json():
    free = cli("generate", "--prompt", "The capital of France is", "--greedy", "--max-new-tokens", "5", "--json")
    assert free.returncode == 0, free.stderr
    base = json.loads(free.stdout)
    assert base["forced"] == []
    r = cli("generate", "--prompt", "The capital of France is", "--greedy", "--max-new-tokens", "5", "--json",
            "--force", "1:13", "--force", "3:28")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["forced"] == [[1, 13], [3, 28]]
    assert d["ids"][0] == base["ids"][0] and d["ids"][1] == 13 and d["ids"][3] == 28
    bad = cli("generate", "--prompt", "hi", "--force", "x")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--force" in bad.stderr
