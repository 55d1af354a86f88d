"""Where greedy speculative output parts from plain greedy decoding, the lab says where, the two tokens, and plain
decoding's top-2 logit margin at that step; where it does not, it says nothing more.

A real difference is forced by hand: one pass's own token is replaced by the model's second choice (as a verify
pass that rounded a near-tie the other way would). The margin is held to an independent path: plain decoding's own
funnel (Session.generate with the two top raw logits captured), not the lab's re-computation.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.__main__ import main
from engine.events import TokenSampled
from engine.labs import speculative as sp
from engine.labs.spec_events import Divergence
from engine.protocol import Capture
from engine.run.session import Session
from tests.engine.test_speculative import GREEDY, REPEATS

N = 12
FLIP_PASS = 2  # the pass whose own token becomes the model's second choice


def flip_one_pass(monkeypatch) -> dict:
    """Make pass FLIP_PASS emit the runner-up of its own token; returns what was flipped (filled when it runs)."""
    real, seen, flipped = sp._accept, {"passes": 0}, {}

    def accept(logits, drafts, q, ids, params, generator):
        n, token, chances, probs = real(logits, drafts, q, ids, params, generator)
        seen["passes"] += 1
        if seen["passes"] == FLIP_PASS:
            runner_up = int(torch.topk(logits[n].float(), 2).indices[1])
            flipped.update(index=len(ids) + n, token=runner_up, plain=token)
            token = runner_up
        return n, token, chances, probs

    monkeypatch.setattr(sp, "_accept", accept)
    return flipped


def plain_margins(lm, prompt) -> list[tuple[int, float]]:
    """(token, top-1 − top-2 raw logit) of each step of plain greedy decoding, from its own funnel."""
    steps = [e for e in Session(lm).generate(prompt, GREEDY, N, Capture(funnel_top=2), ignore_eos=True)
             if isinstance(e, TokenSampled)]
    return [(e.token_id, float(e.funnel.logits[0] - e.funnel.logits[1])) for e in steps]


def test_a_run_that_differs_says_where_with_which_tokens_and_margin(tiny_lm, monkeypatch):
    s = Session(tiny_lm)
    prompt = list(s.tokenize(REPEATS).ids)
    flipped = flip_one_pass(monkeypatch)
    fin = list(sp.speculate(s, prompt, sp.SpecConfig(k=3, ignore_eos=True), GREEDY, N))[-1]
    assert fin.matches_baseline is False
    d = fin.differs
    i = flipped["index"] - len(prompt)  # generated index of the flipped token
    plain = plain_margins(tiny_lm, prompt)
    assert (d.index, d.position) == (i, len(prompt) + i)
    assert (d.spec_token, d.plain_token) == (flipped["token"], flipped["plain"]) == (fin.ids[i], plain[i][0])
    assert d.spec_piece == s.tokenizer.piece(d.spec_token) and d.plain_piece == s.tokenizer.piece(d.plain_token)
    assert d.margin == pytest.approx(plain[i][1], abs=1e-4)
    assert d.dtype == "float32" and not d.near_tie  # a flip nothing rounds to: said to be a fault
    sentence = d.sentence()
    assert f"position {len(prompt) + i}" in sentence and repr(d.spec_piece) in sentence
    assert f"margin {plain[i][1]:.2f}" in sentence and "not a near-tie" in sentence


def test_a_run_that_agrees_reports_no_difference(tiny_lm):
    fin = list(sp.speculate(Session(tiny_lm), REPEATS, sp.SpecConfig(k=3, ignore_eos=True), GREEDY, N))[-1]
    assert fin.matches_baseline is True and fin.differs is None


def test_the_sweep_says_where_a_k_differs(tiny_lm, monkeypatch):
    flip_one_pass(monkeypatch)  # only the first k's run reaches its second pass with the counter there
    points = [e for e in sp.sweep(Session(tiny_lm), REPEATS, sp.SpecConfig(ignore_eos=True), GREEDY, N, ks=(1, 2))
              if isinstance(e, sp.SweepPoint)]
    assert points[0].matches_baseline is False and points[0].differs is not None
    assert points[1].matches_baseline is True and points[1].differs is None


def test_a_near_tie_is_named_as_rounding():
    d = Divergence(index=3, position=17, spec_token=1, spec_piece=" the", plain_token=2, plain_piece=" a",
                   margin=0.03, dtype="bfloat16")
    assert d.near_tie and d.sentence() == (
        "differs from position 17: ' the' vs ' a' (plain), a near-tie (margin 0.03) — a k + 1-position verify pass "
        "rounds differently from a one-position step in bfloat16")
    assert not Divergence(**{**d.__dict__, "dtype": "float32"}).near_tie  # float32 rounds ~1e-5 apart
    ended = Divergence(**{**d.__dict__, "margin": math.nan})
    assert ended.to_dict()["margin"] is None and ended.sentence().endswith("where one run had ended")


def test_the_cli_json_holds_the_difference(tiny_dir, monkeypatch, capsys):
    flipped = flip_one_pass(monkeypatch)
    rc = main(["speculate", "--model", str(tiny_dir.gguf), "--dtype", "float32", "--device", "cpu", "--prompt",
               REPEATS, "--k", "3", "--greedy", "--max-new-tokens", str(N), "--ignore-eos", "--json",
               "--threads", "1"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)["summary"]
    assert d["matches_baseline"] is False and d["differs"]["index"] == d["first_difference"]
    assert d["differs"]["spec_token"] == flipped["token"] and d["differs"]["plain_token"] == flipped["plain"]
    assert d["differs"]["margin"] > 0 and d["differs"]["sentence"].startswith("differs from position")
