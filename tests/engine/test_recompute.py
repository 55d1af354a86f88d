"""A step's attention and lens recomputed from the live run's KV cache (engine.run.recompute) equal what a capture at
that step gave, and an independent reference (tests/tiny_model.py's float64 forward; transformers' Gemma 3); the
cache is left exactly as it was; a cache that no longer holds the run, and llama.cpp, say so in one sentence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.backend import Unsupported
from engine.events import AttentionCaptured, LensCaptured, TokenSampled
from engine.protocol import Capture, Recompute, SamplingParams
from engine.run.recompute import CacheGone, answer, recompute
from engine.run.session import Session
from tests.tiny_model import reference_logits

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [int(i) for i in np.random.default_rng(7).integers(3, 300, size=11)]


def generate_everything(lm, prompt, n: int, lens_top: int = 5, threads: int = 1) -> tuple[Session, list, list[int]]:
    """A generation capturing every layer's attention and the lens; (session, events, tokens at positions 0…).

    At a fixed thread count: each count may run its own decode kernels (engine.model.kernels), and "auto" switches
    counts between steps, so a step and its recompute run the same kernels only at a fixed count."""
    s = Session(lm, threads=threads)
    cap = Capture(attention_layers=frozenset(range(lm.cfg.n_layers)), lens_top=lens_top)
    events = list(s.generate(prompt, GREEDY, n, cap, ignore_eos=True))
    out = [e.token_id for e in events if isinstance(e, TokenSampled)]
    return s, events, list(prompt) + out


def captured(events, step: int) -> tuple[dict[int, AttentionCaptured], LensCaptured]:
    att = {e.layer: e for e in events if isinstance(e, AttentionCaptured) and e.step == step}
    lens = next(e for e in events if isinstance(e, LensCaptured) and e.step == step)
    return att, lens


def context(ids: list[int], n_prompt: int, step: int) -> list[int]:
    """The tokens at positions 0…p of decode step `step`, whose query is the token fed at p = n_prompt + step − 1."""
    return ids[:n_prompt + step]


def snapshot(s: Session) -> tuple:
    c = s.cache
    return c.pos, list(c.base), list(s.cached_ids), [k.clone() for k in c.k], [v.clone() for v in c.v]


def assert_unchanged(s: Session, before: tuple) -> None:
    pos, base, ids, ks, vs = before
    c = s.cache
    assert (c.pos, c.base, s.cached_ids) == (pos, base, ids)
    assert all(torch.equal(a[:, :, :pos], b[:, :, :pos]) for a, b in zip(ks, c.k, strict=True))
    assert all(torch.equal(a[:, :, :pos], b[:, :, :pos]) for a, b in zip(vs, c.v, strict=True))


def test_every_layer_of_old_and_new_steps_equals_its_capture_and_the_reference(tiny_lm, tiny_dir, threads):
    n = 10
    s, events, ids = generate_everything(tiny_lm, PROMPT, n, threads=threads)
    ref: dict = {}
    reference_logits(tiny_dir.hf_weights, ids[:-1], attention=ref)  # every position the run fed, float64
    before = snapshot(s)
    L, P = tiny_lm.cfg.n_layers, len(PROMPT)
    for step in (1, 4, n - 1):
        p = P + step - 1
        att, lens = recompute(s, context(ids, P, step), step, range(L), lens_top=5, token=ids[p + 1])
        cap_att, cap_lens = captured(events, step)
        for ev in att:
            want = cap_att[ev.layer]
            assert (ev.step, ev.phase, ev.query_start, ev.weights.shape) == (step, "decode", p, want.weights.shape)
            np.testing.assert_allclose(ev.weights, want.weights, atol=1e-5, rtol=0)
            np.testing.assert_allclose(ev.weights[:, 0], ref[ev.layer][:, p, :p + 1].numpy(), atol=2e-5, rtol=0)
        for layer in range(L):  # one layer, without the lens: only the layers up to it run
            s.recomputed = None  # (else the record of the pass above answers)
            alone, no_lens = recompute(s, context(ids, P, step), step, [layer])
            assert no_lens is None and [e.layer for e in alone] == [layer]
            np.testing.assert_allclose(alone[0].weights, cap_att[layer].weights, atol=1e-5, rtol=0)
        assert lens.position == cap_lens.position == p and lens.token_id == cap_lens.token_id
        np.testing.assert_array_equal(lens.ids, cap_lens.ids)
        np.testing.assert_allclose(lens.probs, cap_lens.probs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(lens.token_probs, cap_lens.token_probs, atol=1e-5, rtol=0)
    assert_unchanged(s, before)
    # the run goes on from the cache as if nothing had happened: the same tokens as an untouched session
    more = [e.token_id for e in s.generate(ids, GREEDY, 3, ignore_eos=True) if isinstance(e, TokenSampled)]
    fresh = [e.token_id for e in Session(tiny_lm).generate(ids, GREEDY, 3, ignore_eos=True)
             if isinstance(e, TokenSampled)]
    assert more == fresh


def test_another_layer_of_the_same_step_comes_from_the_last_pass_until_the_cache_changes(tiny_lm, monkeypatch):
    """A switch to another layer of the step just recomputed, or its logit lens after a pass through the last layer,
    is answered from what that pass ran, without running the model; once the cache is truncated (a new run, even of
    the same tokens) the model runs again."""
    import engine.run.recompute as rc

    s, events, ids = generate_everything(tiny_lm, PROMPT, 6)
    L, step = tiny_lm.cfg.n_layers, 4
    ctx = tuple(context(ids, len(PROMPT), step))
    cap_att, cap_lens = captured(events, step)
    passes = []  # the query position of each pass through the model (each reads the cache through one of these)
    real = rc.ReadOnlyCache
    monkeypatch.setattr(rc, "ReadOnlyCache", lambda cache, p: passes.append(p) or real(cache, p))
    p = len(ctx) - 1

    def ask(i: int, layers) -> object:
        reply = answer(s, Recompute(i, step, ctx, frozenset(layers)))
        assert reply.ok and reply.threads == 1
        for ev in reply.attention:
            np.testing.assert_allclose(ev.weights, cap_att[ev.layer].weights, atol=1e-5, rtol=0)
        return reply

    first = ask(1, [L - 1])
    assert (first.reused, passes) == (False, [p])
    # the pass through the last layer went on through the LM head: the lens of the step comes from it too
    lens = answer(s, Recompute(9, step, ctx, frozenset(), 5, ids[len(ctx)]))
    assert lens.reused and lens.attention == () and lens.lens.position == cap_lens.position == p
    np.testing.assert_array_equal(lens.lens.ids, cap_lens.ids)
    np.testing.assert_allclose(lens.lens.probs, cap_lens.probs, atol=1e-5, rtol=0)
    np.testing.assert_allclose(lens.lens.token_probs, cap_lens.token_probs, atol=1e-5, rtol=0)
    for i, layer in enumerate(range(L - 1), start=2):
        again = ask(i, [layer])
        assert again.reused and [e.layer for e in again.attention] == [layer]
    assert passes == [p]
    other = ask(20, [L - 1])
    assert other.reused
    assert not answer(s, Recompute(21, step - 1, ctx[:-1], frozenset({0}))).reused  # another step: its own pass
    assert passes == [p, p - 1]
    assert not ask(22, [0]).reused and passes[-1] == p  # back to this step: its pass, kept again
    assert ask(23, [0]).reused and len(passes) == 3
    list(s.generate(ids[:len(PROMPT) + step], GREEDY, 1, ignore_eos=True))  # the same tokens, written again
    assert not ask(24, [0]).reused and len(passes) == 4


def test_a_cache_that_holds_another_run_says_so(tiny_lm):
    s, _, ids = generate_everything(tiny_lm, PROMPT, 6, lens_top=0)
    ctx = context(ids, len(PROMPT), 3)
    assert recompute(s, ctx, 3, [0])[0]  # held
    list(s.generate([5, 6, 7, 8], GREEDY, 2, ignore_eos=True))  # another run replaces the cache
    with pytest.raises(CacheGone, match="no longer holds this run"):
        recompute(s, ctx, 3, [0])
    s.forget_cache()  # an experiment forgets it
    reply = answer(s, Recompute(1, 3, tuple(ctx), frozenset({0})))
    assert not reply.ok and "no longer holds this run" in reply.error and reply.attention == ()
    list(s.generate(PROMPT, GREEDY, 2, ignore_eos=True))
    with pytest.raises(ValueError, match="layer 9 is not in this model"):
        recompute(s, PROMPT, 0, [9])


def test_a_preview_of_the_prompt_after_the_run_leaves_its_cache_whole(tiny_lm, tiny_dir):
    """Typing or moving a sampling control after a run previews the prompt's next token: it reads the run's cache
    (the same logits as a fresh forward) and writes nothing, so the run's steps can still be recomputed and the next
    Generate still reuses every position."""
    s, _, ids = generate_everything(tiny_lm, PROMPT, 6, lens_top=0)
    before = snapshot(s)
    logits, reused, _ = s.next_token_logits(PROMPT)
    want = reference_logits(tiny_dir.hf_weights, PROMPT)[-1]
    np.testing.assert_allclose(logits.double().numpy(), want.numpy(), atol=2e-4, rtol=0)
    assert reused == len(PROMPT) - 1
    assert_unchanged(s, before)
    assert recompute(s, context(ids, len(PROMPT), 5), 5, [0])[0]  # still the live run's cache
    other = [9, 8, 7, 6]  # a prompt the cache does not hold is previewed as before: the cache follows it
    np.testing.assert_allclose(s.next_token_logits(other)[0].double().numpy(),
                               reference_logits(tiny_dir.hf_weights, other)[-1].numpy(), atol=2e-4, rtol=0)
    assert s.cached_ids == other


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from tests.requires import import_required

    import_required("transformers")
    from engine.loaders import load
    from tests.tiny_families import write_checkpoint

    ck = write_checkpoint(tmp_path_factory.mktemp("gemma"), "gemma3")
    return ck, load(ck.hf_dir, device="cpu", dtype="float32", use_cache=False)


@pytest.mark.parametrize("keep_all", [True, False], ids=["every position kept", "ring"])
def test_sliding_window_layers_read_their_window_and_old_steps_are_recomputed_or_refused(gemma, keep_all,
                                                                                         monkeypatch):
    """Tiny Gemma 3, window 4. A generation's local layers keep every position when that fits the runtime's budget
    (engine.runtime.torch.KEEP_ALL_WINDOW_BYTES), and then an old step is recomputed as it was captured; with no
    budget they keep at most 8 positions and, just after they move their newest to the front, only the last 4
    (engine.model.kv_cache), and a step whose band they have let go is refused. Either way the newest step reads
    its band exactly as the capture and transformers' eager attention do."""
    import engine.runtime.torch as rt

    if not keep_all:
        monkeypatch.setattr(rt, "KEEP_ALL_WINDOW_BYTES", 0)
    ck, lm = gemma
    cfg = lm.cfg
    prompt = PROMPT[:6]
    n = 14
    s, events, ids = generate_everything(lm, prompt, n)
    assert s.cache.local_slots == (s.cache.capacity if keep_all else 2 * cfg.sliding_window)
    with torch.no_grad():
        out = ck.model(torch.tensor([ids[:-1]]), use_cache=False, output_attentions=True)
    before = snapshot(s)
    step = n - 1
    p = len(prompt) + step - 1
    att, lens = recompute(s, context(ids, len(prompt), step), step, range(cfg.n_layers), lens_top=5,
                          token=ids[p + 1])
    cap_att, cap_lens = captured(events, step)
    for ev in att:
        keys = cfg.sliding_window if cfg.is_local(ev.layer) else p + 1
        assert ev.weights.shape == cap_att[ev.layer].weights.shape == (cfg.n_heads, 1, keys)
        np.testing.assert_allclose(ev.weights, cap_att[ev.layer].weights, atol=1e-5, rtol=0)
        hf = out.attentions[ev.layer][0, :, p, p + 1 - keys:p + 1].numpy()
        np.testing.assert_allclose(ev.weights[:, 0], hf, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lens.probs, cap_lens.probs, atol=1e-5, rtol=0)
    for layer in range(cfg.n_layers):  # each alone: the embedding's √d scale and the windows up to it
        alone = recompute(s, context(ids, len(prompt), step), step, [layer])[0][0]
        np.testing.assert_allclose(alone.weights, cap_att[layer].weights, atol=1e-5, rtol=0)
    assert_unchanged(s, before)
    glob = cfg.layer_types.index("global")  # a global layer reads the local ones' output
    if not keep_all:
        with pytest.raises(CacheGone, match="sliding-window layers"):
            recompute(s, context(ids, len(prompt), 2), 2, [glob])
        return
    old_att = {ev.layer: ev for ev in recompute(s, context(ids, len(prompt), 2), 2, range(cfg.n_layers))[0]}
    for layer, ev in captured(events, 2)[0].items():
        np.testing.assert_allclose(old_att[layer].weights, ev.weights, atol=1e-5, rtol=0)
    p2 = len(prompt) + 1
    hf = out.attentions[glob][0, :, p2, :p2 + 1].numpy()
    np.testing.assert_allclose(old_att[glob].weights[:, 0], hf, atol=2e-5, rtol=0)
    assert_unchanged(s, before)


@pytest.mark.slow
@pytest.mark.parametrize("n_threads", [1, 2])
def test_smollm2_every_layer_equals_its_capture(real_lm, n_threads):
    """SmolLM2's Q4_1 weights run int4 decode kernels at one thread and int8 at two here: each matches itself."""
    n = 24
    prompt = real_lm.tokenizer.encode("The KV cache keeps the keys and values of every past position, so").ids
    s, events, ids = generate_everything(real_lm, prompt, n, threads=n_threads)
    before = snapshot(s)
    for step in (1, 11, n - 1):
        p = len(prompt) + step - 1
        att, lens = recompute(s, context(ids, len(prompt), step), step, range(real_lm.cfg.n_layers), lens_top=5,
                              token=ids[p + 1])
        cap_att, cap_lens = captured(events, step)
        assert len(att) == real_lm.cfg.n_layers
        for ev in att:
            np.testing.assert_allclose(ev.weights, cap_att[ev.layer].weights, atol=1e-5, rtol=0)
        middle = real_lm.cfg.n_layers // 2  # alone: the layers after it and the LM head are not run
        s.recomputed = None  # (else the record of the pass above answers)
        alone = recompute(s, context(ids, len(prompt), step), step, [middle])[0][0]
        np.testing.assert_allclose(alone.weights, cap_att[middle].weights, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(lens.ids[:, 0], cap_lens.ids[:, 0])
        np.testing.assert_allclose(lens.probs, cap_lens.probs, atol=1e-5, rtol=0)
    assert_unchanged(s, before)


@pytest.mark.slow
def test_smollm2_steps_run_at_another_thread_count_are_recomputed_at_theirs(real_lm):
    """A run whose thread count changed midway (threads "auto" switches between steps): each step is recomputed at
    the count it ran at, so with the kernels it ran (int4 at one thread and int8 at two, here), and equals its
    capture; at the run's last count the early steps would differ by the two kernels' rounding."""
    from engine.model.threads import AdaptiveThreads

    prompt = real_lm.tokenizer.encode("Attention reads every key of the cache, and the cache grows by").ids
    s, first, ids = generate_everything(real_lm, prompt, 8, threads=1)
    s.threads = AdaptiveThreads(2)
    cap = Capture(attention_layers=frozenset(range(real_lm.cfg.n_layers)), lens_top=0)
    later = list(s.generate(ids, GREEDY, 6, cap, ignore_eos=True))  # continues from the cache, at two threads
    later_ids = ids + [e.token_id for e in later if isinstance(e, TokenSampled)]
    for events, n_prompt, step, all_ids, want_threads in ((first, len(prompt), 3, ids, 1),
                                                         (later, len(ids), 4, later_ids, 2)):
        cap_att = {e.layer: e for e in events if isinstance(e, AttentionCaptured) and e.step == step}
        reply = answer(s, Recompute(1, step, tuple(context(all_ids, n_prompt, step)), frozenset(cap_att)))
        assert reply.ok and reply.threads == want_threads
        for ev in reply.attention:
            np.testing.assert_allclose(ev.weights, cap_att[ev.layer].weights, atol=1e-5, rtol=0)


def test_llama_cpp_refuses_in_one_sentence(tiny_dir):
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    s = LlamaCppSession(tiny_dir.gguf, n_ctx=64)
    list(s.generate(PROMPT, GREEDY, 3, ignore_eos=True))
    with pytest.raises(Unsupported, match="kept steps only on llama.cpp"):
        recompute(s, PROMPT, 0, [0])
    reply = answer(s, Recompute(2, 0, tuple(PROMPT), frozenset({0})))
    assert reply.error.startswith("kept steps only on llama.cpp") and "\n" not in reply.error


def test_the_engine_process_answers_between_tokens_and_the_run_goes_on_unchanged(tiny_dir, tiny_lm):
    from engine import protocol as P
    from engine.protocol import GenerateRequest, Recomputed
    from tests.engine.test_server import Client

    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32"))
        assert isinstance(c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1], P.Loaded)
        req = GenerateRequest("", chat=False, max_new_tokens=12, params=GREEDY, ignore_eos=True, start_paused=True,
                              prompt_ids=tuple(PROMPT), capture=Capture(attention_layers=frozenset({1})))
        c.send(P.Generate(req))
        for _ in range(5):  # paused after the prefill: five more steps, one at a time
            c.until(lambda m: isinstance(m, TokenSampled))
            c.send(P.Step())
        c.until(lambda m: isinstance(m, TokenSampled))
        ids = list(PROMPT) + [m.token_id for m in c.seen if isinstance(m, TokenSampled)]
        ctx, chosen = tuple(ids[:len(PROMPT) + 3]), ids[len(PROMPT) + 3]  # step 3: its query, its token
        c.send(P.Recompute(7, 3, ctx, frozenset({0, 1}), lens_top=3, token=chosen))
        reply = c.until(lambda m: isinstance(m, Recomputed))[-1]
        assert reply.ok and reply.request_id == 7 and [e.layer for e in reply.attention] == [0, 1]
        captured_3 = next(m for m in c.seen if isinstance(m, AttentionCaptured) and m.step == 3)
        np.testing.assert_allclose(reply.attention[1].weights, captured_3.weights, atol=1e-5, rtol=0)
        assert reply.lens is not None and reply.lens.position == len(PROMPT) + 2
        c.send(P.Resume())
        fin = c.until(lambda m: isinstance(m, P.State) and m.state == "idle")
        out = [m.token_id for m in c.seen if isinstance(m, TokenSampled)]
        fresh = [e.token_id for e in Session(tiny_lm).generate(PROMPT, GREEDY, 12, ignore_eos=True)
                 if isinstance(e, TokenSampled)]
        assert out == fresh and fin
        c.send(P.Preview(1, "something else entirely", False, 3))  # a preview takes the cache over
        c.until(lambda m: isinstance(m, P.PreviewResult))
        c.send(P.Recompute(8, 3, ctx, frozenset({0})))
        gone = c.until(lambda m: isinstance(m, Recomputed))[-1]
        assert not gone.ok and "no longer holds this run" in gone.error
    finally:
        c.send(P.Quit())
        c.thread.join(10)


def test_a_layer_switch_that_comes_during_a_lens_is_answered_before_the_lens(tiny_dir, monkeypatch):
    """The Logit lens panel's request runs a pass through every layer and then the lens's products over the whole
    vocabulary; a request for another layer's attention of the same step that comes meanwhile is answered from that
    pass as soon as it is done, before the lens, instead of waiting for it (Gemma 3: most of the lens's time)."""
    import time

    import engine.run.recompute as rc
    from engine import protocol as P
    from engine.protocol import GenerateRequest, Recomputed
    from tests.engine.test_server import Client

    real = rc.run_pass

    def slow_pass(*a, **k):  # time for the layer switch to reach the engine while the pass runs
        out = real(*a, **k)
        time.sleep(0.5)
        return out

    monkeypatch.setattr(rc, "run_pass", slow_pass)
    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32"))
        assert isinstance(c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1], P.Loaded)
        c.send(P.SetThreads(1))
        req = GenerateRequest("", chat=False, max_new_tokens=6, params=GREEDY, ignore_eos=True,
                              prompt_ids=tuple(PROMPT))
        c.send(P.Generate(req))
        c.until(lambda m: isinstance(m, P.State) and m.state == "idle")
        ids = list(PROMPT) + [m.token_id for m in c.seen if isinstance(m, TokenSampled)]
        ctx = tuple(ids[:len(PROMPT) + 3])  # step 3
        c.send(P.Recompute(1, 3, ctx, frozenset(), lens_top=3, token=ids[len(PROMPT) + 3]))  # the lens panel's
        c.send(P.Recompute(2, 3, ctx, frozenset({1})))  # the attention panel's, right after
        c.send(P.Recompute(3, 2, ctx[:-1], frozenset({1})))  # another step's: not from that pass, keeps its place
        replies = [m for m in c.until(lambda m: isinstance(m, Recomputed) and m.request_id == 3)
                   if isinstance(m, Recomputed)]
        assert [r.request_id for r in replies] == [2, 1, 3]
        assert all(r.ok for r in replies)
        assert replies[0].reused and [e.layer for e in replies[0].attention] == [1] and replies[0].lens is None
        assert replies[1].lens is not None and replies[1].lens.position == len(ctx) - 1
        assert not replies[2].reused and replies[2].attention[0].query_start == len(ctx) - 2
    finally:
        c.send(P.Quit())
        c.thread.join(10)
