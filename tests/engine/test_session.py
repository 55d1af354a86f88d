"""The generation loop: event order, stepping, stopping, knobs between tokens, prefix caching, the real model."""

import numpy as np
import pytest
import torch

from engine.events import (
    AttentionCaptured,
    Failed,
    Finished,
    KVCacheGrew,
    PrefillDone,
    PromptTokenized,
    ResidualNorms,
    TokenSampled,
)
from engine.model.kv_cache import KVCache
from engine.run.refunnel import refunnel
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session

GREEDY = SamplingParams.greedy_params()


@pytest.fixture
def session(tiny_lm):
    return Session(tiny_lm)


def run(gen):
    return list(gen)


def test_event_order_and_counts(session):
    cap = Capture(attention_layers=frozenset({0, 1}), residual_norms=True, funnel_top=5, logits=True)
    events = run(session.generate("the cat sat on the mat", GREEDY, 6, cap, ignore_eos=True))
    kinds = [type(e).__name__ for e in events]
    assert kinds[:2] == ["RunStarted", "PromptTokenized"] and kinds[-1] == "Finished"
    assert events[0].source.kind == "local" and events[0].source.cannot == ()
    tokens = [e for e in events if isinstance(e, TokenSampled)]
    assert [t.step for t in tokens] == list(range(6))
    assert [t.phase for t in tokens] == ["prefill"] + ["decode"] * 5
    assert sum(isinstance(e, PrefillDone) for e in events) == 1
    prompt = events[1]  # after RunStarted
    assert isinstance(prompt, PromptTokenized)
    n = len(prompt.ids)
    # KV cache: the prefill holds the whole prompt at once, then one more position per decode step
    kv = [e.n_tokens for e in events if isinstance(e, KVCacheGrew)]
    assert kv == [n + i for i in range(6)]
    att = [e for e in events if isinstance(e, AttentionCaptured)]
    assert len(att) == 2 * 6
    first = [a for a in att if a.step == 0 and a.layer == 1][0]
    assert first.weights.shape == (session.cfg.n_heads, n, n)
    later = [a for a in att if a.step == 3 and a.layer == 0][0]
    assert later.weights.shape == (session.cfg.n_heads, 1, n + 3)
    assert np.allclose(later.weights.sum(-1), 1, atol=1e-5)
    norms = [e for e in events if isinstance(e, ResidualNorms)]
    assert len(norms) == 6 and norms[0].norms.shape == (session.cfg.n_layers + 1,)
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.reason == "length" and len(fin.ids) == 6
    assert fin.ttft_s > 0 and fin.tpot_s > 0 and len(fin.step_seconds) == 5
    assert fin.ttft_s + 5 * fin.tpot_s <= fin.total_s * 1.0001
    assert [t.token_id for t in tokens] == fin.ids.tolist()
    assert tokens[2].funnel.ids.shape[0] >= 5 and tokens[2].funnel.p_final.sum() <= 1.0001


def test_costs_ride_on_events(session):
    events = run(session.generate("hello there", GREEDY, 3, ignore_eos=True))
    pre = next(e for e in events if isinstance(e, PrefillDone))
    dec = [e for e in events if isinstance(e, TokenSampled) and e.phase == "decode"]
    assert pre.cost.flops > dec[0].cost.flops > 0
    assert pre.cost.intensity > dec[0].cost.intensity  # prefill does more arithmetic per byte moved
    assert dec[1].cost.kv_read_bytes > dec[0].cost.kv_read_bytes  # the cache read grows each step


def test_greedy_generation_matches_a_plain_loop(session, tiny_lm):
    """Tokens from the session equal argmax decoding with a fresh full forward each step (no cache reuse)."""
    gen_ids = run(session.generate("the cat", GREEDY, 5, ignore_eos=True))[-1].ids.tolist()
    ids = session.tokenize("the cat").ids
    expect = []
    for _ in range(5):
        cache = KVCache(tiny_lm.cfg, 1, 64, torch.float32)
        nxt = int(tiny_lm.model(torch.tensor([ids + expect]), cache)[0].argmax())
        expect.append(nxt)
    assert gen_ids == expect


def test_step_by_step_stop_and_change_settings(session):
    gen = session.generate("the cat", SamplingParams(temperature=1.0, seed=3), 50, Capture(funnel_top=5),
                           ignore_eos=True)
    seen = []
    for ev in gen:
        if isinstance(ev, TokenSampled):
            seen.append(ev)
            if ev.step == 1:
                gen.params = SamplingParams(temperature=1.0, top_k=1)  # from the next token on: greedy in effect
            if ev.step == 4:
                gen.stop()
    fin = ev
    assert isinstance(fin, Finished) and fin.reason == "stopped" and len(fin.ids) == 5
    assert all(s.funnel.kept_final == 1 for s in seen[2:]) and seen[0].funnel.kept_final > 1


def test_seeded_runs_repeat(session):
    p = SamplingParams(temperature=1.2, top_p=0.95, seed=11)
    a = run(session.generate("hello", p, 8, ignore_eos=True))[-1].ids.tolist()
    b = run(session.generate("hello", p, 8, ignore_eos=True))[-1].ids.tolist()
    assert a == b


def test_prefix_caching_reuses_the_shared_prompt(session):
    first = run(session.generate("the cat sat on the mat", GREEDY, 2, ignore_eos=True))[-1]
    events = run(session.generate("the cat sat on the mat and then", GREEDY, 2, ignore_eos=True))
    pre = next(e for e in events if isinstance(e, PrefillDone))
    old, new = session.tokenize("the cat sat on the mat").ids, list(events[1].ids)
    assert new[: len(old)] == old  # the new prompt extends the old one, token for token
    # the cache holds what the first run fed through the model: its prompt and every generated token but the last
    cached = old + first.ids.tolist()[:-1]
    shared = next((i for i, (a, b) in enumerate(zip(cached, new, strict=False)) if a != b), min(len(cached), len(new)))
    assert pre.n_reused == min(shared, len(new) - 1) >= len(old)
    assert pre.n_tokens == len(new) - pre.n_reused
    # and the answer is the same as without any reuse
    session.forget_cache()
    again = run(session.generate("the cat sat on the mat and then", GREEDY, 2, ignore_eos=True))
    assert again[-1].ids.tolist() == events[-1].ids.tolist()


def test_preview_logits_reuse_cache(session):
    ids = session.tokenize("the cat sat on the").ids
    a, reused_a, _ = session.next_token_logits(ids)
    b, reused_b, _ = session.next_token_logits(ids + session.tokenize(" mat").ids)
    assert reused_a == 0 and reused_b == len(ids)
    session.forget_cache()
    c, _, _ = session.next_token_logits(ids + session.tokenize(" mat").ids)
    torch.testing.assert_close(b, c, atol=2e-5, rtol=1e-5)


def test_refunnel_redraws_a_step_with_new_settings(session):
    events = run(session.generate("the cat", SamplingParams(temperature=1.0), 2, Capture(funnel_top=10, logits=True),
                                  ignore_eos=True))
    tok = next(e for e in events if isinstance(e, TokenSampled))
    wide = refunnel(tok, SamplingParams(temperature=1.0), session.tokenizer)
    narrow = refunnel(tok, SamplingParams(temperature=1.0, top_k=3), session.tokenizer)
    assert wide.kept_final == session.cfg.vocab_size and narrow.kept_final == 3
    assert tok.token_id in narrow.ids.tolist()


def test_bad_prompts_raise_clear_errors(session):
    with pytest.raises(ValueError, match="empty"):
        session.generate("", GREEDY, 3)
    with pytest.raises(ValueError, match="context"):
        session.generate("word " * 400, GREEDY, 3)
    with pytest.raises(ValueError, match="at least 1"):
        session.generate("hi", GREEDY, 0)
    # ids the embedding has no row for (a tokenizer larger than the model) are refused before any forward pass
    vocab = session.cfg.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab}, outside this model's vocabulary"):
        session.check_prompt([5, vocab, 6])
    with pytest.raises(ValueError, match="token id -1"):
        session.next_token_logits([5, -1])


def test_context_limit_ends_generation(session):
    ids = session.tokenize("the cat " * 40).ids
    n_free = session.cfg.context_length - len(ids)
    fin = run(session.generate("the cat " * 40, GREEDY, n_free + 50, ignore_eos=True))[-1]
    # tokens at positions len(ids)…context_length - 1 fit; max new tokens is 50 further away
    assert fin.reason == "context" and len(fin.ids) == n_free


@pytest.mark.slow
def test_real_model_greedy_chat_is_deterministic_english(real_lm):
    s = Session(real_lm, threads=1)  # "auto" may move between thread counts, each with its own measured kernels
    prompt = "Explain what a KV cache is in two sentences."
    assert len(s.tokenize(prompt, chat=True).ids) == 41
    a = run(s.generate(prompt, GREEDY, 24, chat=True))[-1]
    b = run(s.generate(prompt, GREEDY, 24, chat=True))[-1]
    assert a.ids.tolist() == b.ids.tolist()
    words = a.text.split()
    assert len(words) >= 12 and sum(w.strip(".,").isalpha() for w in words) / len(words) > 0.8


@pytest.mark.slow
def test_real_model_greedy_tokens_match_transformers(real_lm, hf_from_gguf):
    """The first greedy tokens equal those of Hugging Face transformers' own model on the same GGUF weights."""
    from engine.loaders import default_model_path
    from engine.model import kernels

    s = Session(real_lm)
    prompt = s.tokenize("Explain what a KV cache is in two sentences.", chat=True).ids
    with kernels.forced("linear"):  # the float products: a quantized decode form is held to its own tolerance
        ours = run(s.generate(prompt, GREEDY, 8, ignore_eos=True))[-1].ids.tolist()
    path = default_model_path()
    hf = hf_from_gguf(path)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert ours == out[0, len(prompt):].tolist()


def test_warm_up_leaves_no_trace(session):
    before = run(session.generate("the cat", GREEDY, 4, ignore_eos=True))[-1].ids.tolist()
    assert session.warm_up() > 0
    assert session.cache is None and session.cached_ids == []
    assert run(session.generate("the cat", GREEDY, 4, ignore_eos=True))[-1].ids.tolist() == before


def test_non_finite_logits_end_the_generation_with_one_clear_message(tiny_lm):
    """Weights that make NaN (here the final norm, past the loader's own check) fail the step by name, in both
    the sampled and the greedy path (argmax would otherwise pick a token from NaN), and leave no cache behind."""
    import dataclasses

    from engine.model.transformer import build_model

    sd = {k: v.clone() for k, v in tiny_lm.model.state_dict().items()}
    sd["norm.weight"][0] = float("nan")
    s = Session(dataclasses.replace(tiny_lm, model=build_model(tiny_lm.cfg, sd)))
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=0)):
        last = run(s.generate("the cat", params, 3, ignore_eos=True))[-1]
        assert isinstance(last, Failed) and "NaN or infinite logits at position" in last.message
        assert s.cache is None
    with pytest.raises(ValueError, match="NaN or infinite logits"):
        s.next_token_logits(s.tokenize("the cat").ids)
