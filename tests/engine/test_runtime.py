"""The runtime seam (engine.runtime): a batch of sequences at their own positions gives each sequence what it gets
alone, and the KV verbs (remove, copy, keep) leave a sequence holding exactly the positions they say.

The torch runtime's reference is the model's single-sequence path (engine.model.kv_cache.KVCache, one start for
the batch), which tests/engine/test_model.py holds to independent references. The llama.cpp runtime, on the real
default model, is held to llama.cpp's own single-sequence generation (LlamaCppSession.generate, one context and
one sequence): batching several sequences into one llama_batch must not change any of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from engine.events import Finished, TokenSampled
from engine.labs import speculative as sp
from engine.labs.batching import generate_batch
from engine.model.kv_cache import KVCache
from engine.protocol import Capture, SamplingParams
from engine.run.session import Session
from engine.runtime import Row
from engine.runtime.torch import TorchRuntime

GREEDY = SamplingParams.greedy_params()


def reference_logits(lm, ids: list[int]) -> torch.Tensor:
    """Logits (V,) after `ids` on the single-sequence path."""
    cache = KVCache(lm.cfg, 1, len(ids), lm.dtype)
    with torch.inference_mode():
        return lm.model(torch.tensor([ids]), cache)[0]


def test_rows_at_different_positions_equal_each_sequence_alone(tiny_lm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny_lm.cfg.vocab_size, size=n).tolist() for n in (3, 7, 7, 12)]
    rt = TorchRuntime(tiny_lm, n_seq=4, capacity=16, page_size=4)
    first = rt.forward([Row(i, p) for i, p in enumerate(prompts)])  # three passes: 3, 7 and 12 tokens
    for p, got in zip(prompts, first, strict=True):
        assert_close(got, reference_logits(tiny_lm, p), rtol=1e-4, atol=1e-4)
    nxt = [int(x.argmax()) for x in first]
    step = rt.forward([Row(i, [t]) for i, t in enumerate(nxt)])  # one pass, four positions
    for p, t, got in zip(prompts, nxt, step, strict=True):
        assert_close(got, reference_logits(tiny_lm, [*p, t]), rtol=1e-4, atol=1e-4)
    assert [rt.length(i) for i in range(4)] == [len(p) + 1 for p in prompts]


def test_all_logits_gives_every_row_of_a_verify_pass(tiny_lm):
    ids = [5, 77, 140, 3, 250, 99]
    rt = TorchRuntime(tiny_lm, capacity=12)
    rt.forward([Row(0, ids[:2])])
    every = rt.forward([Row(0, ids[2:], all_logits=True)])[0]  # (4, V)
    assert every.shape == (4, tiny_lm.cfg.vocab_size)
    for i in range(4):
        assert_close(every[i], reference_logits(tiny_lm, ids[:3 + i]), rtol=1e-4, atol=1e-4)


def test_remove_copy_and_keep(tiny_lm):
    ids = [5, 77, 140, 3, 250, 99, 12, 200, 41]
    rt = TorchRuntime(tiny_lm, n_seq=3, capacity=16, page_size=4)
    rt.forward([Row(0, ids)])
    rt.copy(0, 1, 5)  # sequence 1 forks after ids[:5]
    assert rt.length(1) == 5
    got = rt.forward([Row(1, [7])])[0]
    assert_close(got, reference_logits(tiny_lm, [*ids[:5], 7]), rtol=1e-4, atol=1e-4)
    rt.remove(0, 3)  # sequence 0 keeps ids[:3]; its later pages go back to the pool
    assert rt.length(0) == 3 and rt.cache.pages_of(0) == 1
    got = rt.forward([Row(0, [9, 8])])[0]
    assert_close(got, reference_logits(tiny_lm, [*ids[:3], 9, 8]), rtol=1e-4, atol=1e-4)
    assert_close(rt.forward([Row(1, [1])])[0], reference_logits(tiny_lm, [*ids[:5], 7, 1]), rtol=1e-4, atol=1e-4)
    rt.keep(1)
    assert rt.length(0) == 0 and rt.length(1) == 7 and rt.cache.pages_in_use() == 2


def test_a_row_past_its_capacity_is_refused(tiny_lm):
    rt = TorchRuntime(tiny_lm, n_seq=2, capacity=4)
    with pytest.raises(ValueError, match="holds 4"):
        rt.forward([Row(0, [1, 2, 3, 4, 5])])
    with pytest.raises(ValueError, match="not one of"):
        rt.forward([Row(2, [1])])


def test_torch_batched_decode_equals_single_sequence_decode(tiny_lm):
    rng = np.random.default_rng(4)
    prompts = rng.integers(3, tiny_lm.cfg.vocab_size, size=(5, 6)).tolist()
    batched, _, _ = generate_batch(Session(tiny_lm), prompts, 8)
    alone = [generate_batch(Session(tiny_lm), [p], 8)[0][0].tolist() for p in prompts]
    assert batched.tolist() == alone


# ---- llama.cpp on the real default model -----------------------------------------------------------------------
PROMPTS = (
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5, 6,",
    "The quick brown fox",
    "Water boils at a temperature of",
)
REPEATS = "the cat sat on the mat . the cat sat on the mat . the cat sat on"


@pytest.fixture(scope="module")
def lcpp():
    from tests.requires import default_model, import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    s = LlamaCppSession(default_model(), n_ctx=512)
    yield s
    s.close()


def plain(s, prompt, n: int) -> list[int]:
    s.forget_cache()
    fin = list(s.generate(prompt, GREEDY, n, ignore_eos=True))[-1]
    assert isinstance(fin, Finished), fin
    return fin.ids.tolist()


# How far llama.cpp's logits of a sequence may move when other sequences' rows share its decode step in one unified
# cache (the scheduling lab's pooled cells): its attention then runs as one product over several queries, another
# kernel than a lone query's, and on some CPU classes it rounds otherwise (BENCHMARKS.md, "llama.cpp's unified
# pool"; separate streams, as generate_batch runs, stay exact).
POOLED_BATCH_NOISE = 1.0


def greedy_within_noise(s, prompt: list[int], tokens: list[int]) -> None:
    """Each of `tokens` is the greedy choice of llama.cpp's own one-sequence generation fed the same tokens before
    it, up to POOLED_BATCH_NOISE: its logit there is within the noise of the largest (a token from another sequence's
    context, or from a wrong position, is many logits below)."""
    s.forget_cache()
    gen = s.generate(prompt, GREEDY, len(tokens), capture=Capture(logits=True), ignore_eos=True,
                     forced=dict(enumerate(tokens)))
    steps = [e for e in gen if isinstance(e, TokenSampled)]
    assert [e.token_id for e in steps] == tokens
    for e in steps:
        gap = float(e.logits.max() - e.logits[e.token_id])
        assert gap <= POOLED_BATCH_NOISE, f"step {e.step}: token {e.token_id} is {gap:.2f} below the greedy choice"


@pytest.mark.slow
def test_llamacpp_batched_decode_equals_each_sequence_alone(lcpp):
    """B different prompts (of different lengths) decoded in one llama_batch per step give each the tokens of
    llama.cpp's own single-sequence generation. Both compute in float32 over the same quantized weights; a batch
    only changes which rows share a matrix product, so no near-tie is expected to flip (the test would say where)."""
    prompts = [lcpp.tokenize(p).ids for p in PROMPTS]
    batched, _, _ = generate_batch(lcpp, prompts, 12)
    for text, row in zip(PROMPTS, batched.tolist(), strict=True):
        assert row == plain(lcpp, text, 12), text


@pytest.mark.slow
def test_llamacpp_kv_verbs(lcpp):
    from engine.runtime.llamacpp import LlamaCppRuntime

    ids = lcpp.tokenize(PROMPTS[2]).ids
    with LlamaCppRuntime(lcpp, n_seq=2, capacity=64) as rt:
        full = rt.forward([Row(0, ids, all_logits=True)])[0]  # (T, V)
        rt.copy(0, 1, 5)
        fork = rt.forward([Row(1, ids[5:8], all_logits=True)])[0]
        assert rt.length(1) == 8
        assert_close(fork, full[5:8], rtol=0, atol=0.05)  # float16 cache cells copied, not recomputed
        rt.remove(0, 4)
        again = rt.forward([Row(0, ids[4:])])[0]
        assert_close(again, full[-1], rtol=0, atol=0.05)
        rt.keep(1)
        assert rt.length(0) == 0 and rt.length(1) == 8


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [REPEATS, PROMPTS[1], PROMPTS[3]])
@pytest.mark.parametrize("k", [1, 4])
def test_llamacpp_speculative_greedy_equals_plain_greedy(lcpp, prompt, k):
    cfg = sp.SpecConfig(k=k, source="lookup", baseline=False, ignore_eos=True)
    events = list(sp.speculate(lcpp, prompt, cfg, GREEDY, 24))
    fin = events[-1]
    assert isinstance(fin, sp.SpecFinished), fin
    assert fin.ids.tolist() == plain(lcpp, prompt, 24)
    if prompt == REPEATS:  # text that repeats itself: lookup's guesses are taken, fewer passes than tokens
        assert fin.n_passes < 23 and fin.accepted_by_position[0] > 0


@pytest.mark.slow
def test_llamacpp_draft_model_is_another_gguf(lcpp):
    """The draft model on llama.cpp too (here the same file: every guess is the model's own argmax)."""
    from engine.backends.llamacpp import LlamaCppSession

    draft = LlamaCppSession(lcpp.path, n_ctx=256)
    try:
        cfg = sp.SpecConfig(k=3, source="draft-model", draft=draft, baseline=False, ignore_eos=True)
        fin = list(sp.speculate(lcpp, PROMPTS[0], cfg, GREEDY, 16))[-1]
        assert isinstance(fin, sp.SpecFinished), fin
        assert fin.ids.tolist() == plain(lcpp, PROMPTS[0], 16)
        assert fin.acceptance_rate > 0.8
    finally:
        draft.close()


def test_llamacpp_refuses_early_exit_in_one_sentence(lcpp):
    from engine.backend import Unsupported

    with pytest.raises(Unsupported, match="early-exit drafting needs a runtime that can stop after some of its layers"):
        sp.speculate(lcpp, "hello", sp.SpecConfig(source="early-exit"), GREEDY, 4)


def test_llamacpp_model_info_names_the_files_sha256(lcpp):
    from engine.formats.locate import file_sha256

    assert lcpp.info.sha256 == file_sha256(lcpp.path)


@pytest.mark.slow
def test_llamacpp_scheduling_lab(lcpp):
    """Static against continuous batching on llama.cpp's own cache: the same tokens under both policies, each
    request's the greedy continuation of its prompt alone (within POOLED_BATCH_NOISE); continuous batching's first
    tokens come sooner; the cache holds cells of the positions in use, under a contiguous reservation."""
    import math

    from engine.labs.schedule_events import SchedConfig
    from engine.labs.scheduler import SchedPlan, SchedRequestDone, SchedStep, SchedSummary, schedule

    cfg = SchedConfig(n_requests=6, rate=math.inf, prompt_len=8, output_len=6, range_ratio=0.5, max_batch=3, seed=1)
    events = list(schedule(lcpp, cfg))
    plan = events[0]
    assert isinstance(plan, SchedPlan)
    assert plan.page_size == 1 != cfg.page_size  # llama.cpp's cells, whatever page size was asked for
    done = {p: {e.request_id: e.tokens for e in events if isinstance(e, SchedRequestDone) and e.policy == p}
            for p in plan.policies}
    assert done["static"] == done["continuous"] and len(done["static"]) == 6
    rng = np.random.default_rng(cfg.seed + 1)
    prompts = [rng.integers(100, lcpp.cfg.vocab_size, size=r.prompt_len).tolist() for r in plan.requests]
    for rid in (0, 5):
        greedy_within_noise(lcpp, prompts[rid], list(done["continuous"][rid]))
    steps = [e for e in events if isinstance(e, SchedStep)]
    assert all(s.used_bytes == s.paged_bytes <= s.contiguous_bytes for s in steps)  # a page is one cell
    # Continuous batching's first tokens come sooner. Counted in forward steps waited, not seconds: the steps are
    # timed on a shared machine, and a busy neighbour can stretch one policy's steps more than the other's.
    waited = {p: sorted(sum(1 for s in steps if s.policy == p and s.start_s < d.first_token_s)
                        for d in events if isinstance(d, SchedRequestDone) and d.policy == p)
              for p in plan.policies}
    assert np.median(waited["continuous"]) < np.median(waited["static"])
    summary = {e.policy: e for e in events if isinstance(e, SchedSummary)}
    assert summary["continuous"].decode_steps < summary["static"].decode_steps


@pytest.mark.slow
def test_llamacpp_speculative_greedy_equals_plain_greedy_on_gemma3():
    """Gemma 3's own GGUF (Q4_K_M, sliding-window layers) on llama.cpp: prompt-lookup drafting gives the tokens of
    plain greedy decoding, and the same file as its own draft model too."""
    from engine.backends.llamacpp import LlamaCppSession
    from tests.requires import gemma3, import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    target, draft = LlamaCppSession(gemma3(), n_ctx=256), LlamaCppSession(gemma3(), n_ctx=256)
    try:
        want = plain(target, REPEATS, 20)
        lookup = sp.SpecConfig(k=4, source="lookup", baseline=False, ignore_eos=True)
        fin = list(sp.speculate(target, REPEATS, lookup, GREEDY, 20))[-1]
        assert isinstance(fin, sp.SpecFinished), fin
        assert fin.ids.tolist() == want and fin.n_passes < 20  # the repeating text's guesses were taken
        model = sp.SpecConfig(k=3, source="draft-model", draft=draft, baseline=False, ignore_eos=True)
        fin = list(sp.speculate(target, REPEATS, model, GREEDY, 20))[-1]
        assert isinstance(fin, sp.SpecFinished), fin
        assert fin.ids.tolist() == want
    finally:
        target.close()
        draft.close()


@pytest.mark.slow
def test_llamacpp_sampled_tokens_follow_the_models_exact_distribution(tiny_dir, tmp_path):
    """The acceptance rule on llama.cpp keeps the target's distribution: 1,000 sampled runs of the tiny GGUF drafted
    by another GGUF (its weights plus noise: guesses accepted sometimes, rejected sometimes) against the float64
    reference's exact joint distribution of the first three tokens (the torch lab's test,
    tests/engine/test_speculative.py)."""
    from engine.backends.llamacpp import LlamaCppSession
    from tests.engine.test_speculative import RUNS, chi_square_p, exact_joint, sampled_runs
    from tests.requires import import_required
    from tests.tiny_model import random_hf_weights, write_gguf

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) for k, v in random_hf_weights(0).items()}
    prompt = [5, 77, 140, 5, 77, 140, 5, 77]
    s = LlamaCppSession(tiny_dir.gguf, n_ctx=64)
    draft = LlamaCppSession(write_gguf(tmp_path / "draft.gguf", noisy), n_ctx=64)
    cfg = sp.SpecConfig(k=2, source="draft-model", draft=draft, baseline=False, ignore_eos=True)
    try:
        counts, judged, accepted = sampled_runs(s, prompt, cfg)
    finally:
        s.close()
        draft.close()
    assert 0.05 * judged < accepted < 0.95 * judged, (accepted, judged)  # both branches of the rule were taken
    expected = exact_joint(tiny_dir.hf_weights, prompt, 3, threshold=5 / RUNS)
    assert len(expected) >= 20 and sum(expected.values()) > 0.95
    assert chi_square_p(counts, expected, RUNS) > 1e-3
