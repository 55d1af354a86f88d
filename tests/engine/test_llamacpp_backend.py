"""The llama.cpp backend (engine/backends/llamacpp.py) held to this engine's own float32 Session on the same GGUF.

The two are independent implementations (llama.cpp's C++ graph against this engine's torch model); the file is
F32 but for a Q8_0 embedding, so they differ only by rounding, mostly from llama.cpp's float16 KV cache. For the
same Capture both must yield the same events in the same order, choose the same tokens, and report attention
weights, residual norms, the logit lens and prompt scores that agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.requires import import_required  # noqa: E402

import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")

from engine.backends.llamacpp import LlamaCppSession  # noqa: E402
from engine.costs import formulas as costs  # noqa: E402
from engine.events import (  # noqa: E402
    AttentionCaptured,
    Finished,
    LensCaptured,
    PrefillDone,
    PromptScored,
    ResidualNorms,
    RunStarted,
    TokenSampled,
)
from engine.formats.locate import ModelLoadError  # noqa: E402
from engine.protocol import Capture, SamplingParams  # noqa: E402
from engine.run.session import Session  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog and then it"
GREEDY = SamplingParams.greedy_params()
LOGIT_ATOL = 0.03  # logits of magnitude ~5: float16 keys and values move them by ~0.01
ATTN_ATOL = 5e-3


@pytest.fixture(scope="module")
def shared_lcpp(tiny_dir):
    return LlamaCppSession(tiny_dir.gguf, n_ctx=256)


@pytest.fixture
def lcpp(shared_lcpp):
    """The module's llama.cpp session with an empty cache, like a fresh Session's."""
    shared_lcpp.forget_cache()
    return shared_lcpp


def everything(n_layers: int, **kw) -> Capture:
    return Capture(attention_layers=frozenset(range(n_layers)), residual_norms=True, funnel_top=8, logits=True,
                   lens_top=5, **kw)


def by_type(events, kind) -> list:
    return [e for e in events if isinstance(e, kind)]


def test_same_events_tokens_logits_and_captures_as_the_session(tiny_lm, lcpp):
    cap = everything(tiny_lm.cfg.n_layers, prompt_scores=True)
    ref = list(Session(tiny_lm).generate(PROMPT, GREEDY, 6, cap, ignore_eos=True))
    got = list(lcpp.generate(PROMPT, GREEDY, 6, cap, ignore_eos=True))
    assert [type(e).__name__ for e in got] == [type(e).__name__ for e in ref]
    source = got[0].source
    assert isinstance(got[0], RunStarted) and source.kind == "local" and source.cannot == ()

    ra, ga = by_type(ref, TokenSampled), by_type(got, TokenSampled)
    assert [e.token_id for e in ga] == [e.token_id for e in ra]
    for r, g in zip(ra, ga, strict=True):
        np.testing.assert_allclose(g.logits, r.logits, atol=LOGIT_ATOL)
        assert list(g.funnel.ids) == list(r.funnel.ids)  # the same candidates, in the same order
        np.testing.assert_allclose(g.funnel.p_final, r.funnel.p_final, atol=1e-3)
        assert (g.position, g.phase, g.text) == (r.position, r.phase, r.text)

    for r, g in zip(by_type(ref, AttentionCaptured), by_type(got, AttentionCaptured), strict=True):
        assert (g.step, g.layer, g.query_start, g.rows_skipped, g.group_size) == \
            (r.step, r.layer, r.query_start, r.rows_skipped, r.group_size)
        assert g.weights.shape == r.weights.shape
        np.testing.assert_allclose(g.weights, r.weights, atol=ATTN_ATOL)
        if g.phase == "prefill":
            assert not np.triu(g.weights, k=1).any()  # causal: the upper triangle is exactly zero

    for r, g in zip(by_type(ref, ResidualNorms), by_type(got, ResidualNorms), strict=True):
        np.testing.assert_allclose(g.norms, r.norms, rtol=2e-3)

    for r, g in zip(by_type(ref, LensCaptured), by_type(got, LensCaptured), strict=True):
        assert g.ids.shape == r.ids.shape and list(g.ids[:, 0]) == list(r.ids[:, 0])  # each layer's top token
        np.testing.assert_allclose(g.probs, r.probs, atol=2e-3)
        np.testing.assert_allclose(g.token_probs, r.token_probs, atol=2e-3)

    (rs,), (gs,) = by_type(ref, PromptScored), by_type(got, PromptScored)
    assert gs.first == rs.first and list(gs.ids) == list(rs.ids) and list(gs.top_ids) == list(rs.top_ids)
    np.testing.assert_allclose(gs.probs, rs.probs, atol=2e-3)


def test_a_prefill_in_pieces_keeps_its_last_rows_like_the_session(tiny_lm, tiny_dir):
    """llama.cpp evaluates a long prompt in micro-batches; the rows must come together as the Session's do."""
    chunked = LlamaCppSession(tiny_dir.gguf, n_ctx=256, ubatch=8)
    n = len(tiny_lm.tokenizer.encode(PROMPT).ids)
    H = tiny_lm.cfg.n_heads
    for budget in (H * 5 * n * 4, 1 << 24):  # the last 5 rows only (they span two pieces), then every row
        chunked.forget_cache()
        cap = Capture(attention_layers=frozenset({0, 1}), attention_max_bytes=budget, residual_norms=True)
        ref = by_type(Session(tiny_lm).generate(PROMPT, GREEDY, 2, cap, ignore_eos=True), AttentionCaptured)
        got = by_type(chunked.generate(PROMPT, GREEDY, 2, cap, ignore_eos=True), AttentionCaptured)
        assert [(e.step, e.layer, e.rows_skipped, e.query_start) for e in got] == \
            [(e.step, e.layer, e.rows_skipped, e.query_start) for e in ref]
        assert got[0].rows_skipped == (n - 5 if budget < 1 << 24 else 0)
        for r, g in zip(ref, got, strict=True):
            np.testing.assert_allclose(g.weights, r.weights, atol=ATTN_ATOL)
    chunked.close()


def test_prefix_reuse_and_a_fork_match_the_session(tiny_lm, lcpp):
    ref_s = Session(tiny_lm)
    first = [list(s.generate(PROMPT, GREEDY, 5, Capture(), ignore_eos=True)) for s in (ref_s, lcpp)]
    fins = [by_type(f, Finished)[0] for f in first]
    assert list(fins[1].ids) == list(fins[0].ids)
    # continue from the whole first run plus a few more tokens: the cached positions are reused, not recomputed
    longer = [*fins[0].prompt_ids, *fins[0].ids, 40, 41, 42]
    cap = Capture(attention_layers=frozenset({1}), logits=True)
    ref = list(ref_s.generate(longer, GREEDY, 3, cap, ignore_eos=True))
    got = list(lcpp.generate(longer, GREEDY, 3, cap, ignore_eos=True))
    (rp,), (gp,) = by_type(ref, PrefillDone), by_type(got, PrefillDone)
    assert gp.n_reused == rp.n_reused > 0 and gp.n_tokens == rp.n_tokens
    for r, g in zip(by_type(ref, AttentionCaptured), by_type(got, AttentionCaptured), strict=True):
        assert g.weights.shape == r.weights.shape and g.query_start == r.query_start
        np.testing.assert_allclose(g.weights, r.weights, atol=ATTN_ATOL)
    for r, g in zip(by_type(ref, TokenSampled), by_type(got, TokenSampled), strict=True):
        assert g.token_id == r.token_id
        np.testing.assert_allclose(g.logits, r.logits, atol=LOGIT_ATOL)
    # a fork at step 2 with another token: the forced token is taken, the rest is the model's choice as in Session
    runs = [list(s.fork(fins[0].prompt_ids, fins[0].ids, 2, 77, GREEDY, 4, ignore_eos=True)) for s in (ref_s, lcpp)]
    toks = [[(e.token_id, e.forced) for e in by_type(r, TokenSampled)] for r in runs]
    assert toks[1] == toks[0] and toks[1][0] == (77, True)


def test_seeded_sampling_draws_what_the_session_draws(tiny_lm, lcpp):
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=7)
    runs = [list(s.generate(PROMPT, params, 10, Capture(funnel_top=5), ignore_eos=True))
            for s in (Session(tiny_lm), lcpp)]
    ref, got = (by_type(r, TokenSampled) for r in runs)
    assert [e.token_id for e in got] == [e.token_id for e in ref]
    for r, g in zip(ref, got, strict=True):
        assert (g.funnel.kept_top_k, g.funnel.kept_top_p) == (r.funnel.kept_top_k, r.funnel.kept_top_p)


def test_costs_count_the_files_own_bytes(tiny_lm, lcpp):
    ref = by_type(Session(tiny_lm).generate(PROMPT, GREEDY, 3, Capture(), ignore_eos=True), TokenSampled)
    got = by_type(lcpp.generate(PROMPT, GREEDY, 3, Capture(), ignore_eos=True), TokenSampled)
    info = tiny_lm.info
    for r, g in zip(ref, got, strict=True):
        assert g.cost.flops == r.cost.flops
        # the Q8_0 embedding is streamed at its 1.0625 bytes per value, not the float32 copy's 4
        rows = 1 if g.phase == "decode" else g.position  # a prefill looks up every prompt token
        assert g.cost.weight_bytes == costs.step_weight_bytes_file(
            lcpp.cfg, lcpp.file_bytes, lcpp.embedding_file_bytes, rows=rows)
        assert g.cost.kv_write_bytes == r.cost.kv_write_bytes / 2  # float16 keys and values
    assert g.cost.weight_bytes < r.cost.weight_bytes
    assert lcpp.info.decode_weight_bytes_file == info.decode_weight_bytes_file
    assert lcpp.info.file_bytes_by_type == info.file_bytes_by_type


def test_flash_attention_says_it_cannot_show_attention(tiny_lm, tiny_dir):
    fast = LlamaCppSession(tiny_dir.gguf, n_ctx=256, flash_attn=True)
    events = list(fast.generate(PROMPT, GREEDY, 4, everything(tiny_lm.cfg.n_layers), ignore_eos=True))
    assert events[0].source.cannot == ("attention",) and not events[0].source.can("attention")
    assert not by_type(events, AttentionCaptured) and len(by_type(events, ResidualNorms)) == 4
    ref = by_type(Session(tiny_lm).generate(PROMPT, GREEDY, 4, Capture(), ignore_eos=True), TokenSampled)
    assert [e.token_id for e in by_type(events, TokenSampled)] == [e.token_id for e in ref]
    fast.close()


def test_bad_input_is_one_sentence(tmp_path, lcpp):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError) as e:
        LlamaCppSession(junk)
    assert "junk.gguf" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="empty"):
        lcpp.generate([], GREEDY, 3)
    with pytest.raises(ValueError, match="context holds 256"):
        lcpp.generate([5] * 256, GREEDY, 3)
    with pytest.raises(ValueError, match="outside"):
        lcpp.generate([5, 300], GREEDY, 3)


def test_stop_ends_between_tokens(lcpp):
    gen = lcpp.generate(PROMPT, GREEDY, 50, ignore_eos=True)
    seen = 0
    for e in gen:
        if isinstance(e, TokenSampled):
            seen += 1
            if seen == 3:
                gen.stop()
        if isinstance(e, Finished):
            assert e.reason == "stopped" and len(e.ids) == 3
            return
    pytest.fail("no Finished event")


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_other_families_match_the_session(tmp_path, family):
    """Gemma 3 (sliding window 4, scaled embedding, post-norms) and Qwen3 (q/k norms, NEOX RoPE layout)."""
    import_required("transformers")  # tests.tiny_families writes its checkpoints with it
    from engine.loaders import load
    from tests.tiny_families import write_checkpoint

    path = write_checkpoint(tmp_path, family).gguf
    lm = load(path, device="cpu", dtype="float32", use_cache=False)
    cap = everything(lm.cfg.n_layers)
    ref = list(Session(lm).generate(PROMPT, GREEDY, 5, cap, ignore_eos=True))
    got = list(LlamaCppSession(path, n_ctx=256).generate(PROMPT, GREEDY, 5, cap, ignore_eos=True))
    assert [e.token_id for e in by_type(got, TokenSampled)] == [e.token_id for e in by_type(ref, TokenSampled)]
    for r, g in zip(by_type(ref, ResidualNorms), by_type(got, ResidualNorms), strict=True):
        np.testing.assert_allclose(g.norms, r.norms, rtol=2e-3)
    for r, g in zip(by_type(ref, AttentionCaptured), by_type(got, AttentionCaptured), strict=True):
        s = r.weights.shape[-1]  # a local layer's decode row: the Session shows only the keys its cache still holds
        np.testing.assert_allclose(g.weights[..., -s:], r.weights, atol=ATTN_ATOL)
        assert not g.weights[..., :-s].any()  # llama.cpp's row: keys outside the window weigh exactly zero


def test_the_engine_process_runs_a_model_on_llamacpp_behind_the_backend_seam(tiny_dir, tiny_lm):
    """Load with backend llama.cpp: generations come from llama.cpp (RunStarted says so) with the torch engine's
    greedy tokens; the batching lab measures llama.cpp's batched steps; early-exit drafting, which needs the
    model's own layers, is refused in one sentence."""
    from engine import protocol as P
    from tests.engine.test_server import Client

    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32", backend="llama.cpp"))
        loaded = c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1]
        assert isinstance(loaded, P.Loaded), loaded
        c.send(P.Generate(P.GenerateRequest("the cat sat", chat=False, max_new_tokens=5, ignore_eos=True,
                                            params=SamplingParams.greedy_params())))
        seen = c.until(lambda m: isinstance(m, Finished))
        started = next(m for m in seen if type(m).__name__ == "RunStarted")
        assert started.source.kind == "local" and "llama.cpp" in started.source.name
        ref = [e for e in Session(tiny_lm).generate("the cat sat", SamplingParams.greedy_params(), 5,
                                                     ignore_eos=True)][-1]
        assert seen[-1].ids.tolist() == ref.ids.tolist()
        c.send(P.BatchBench((1, 2), 4, 2))
        msgs = c.until(lambda m: isinstance(m, P.LabDone))
        rows = [m.row for m in msgs if isinstance(m, P.BatchMeasured)]
        assert msgs[-1].job == "batch" and msgs[-1].outcome == "done"
        assert [r.batch for r in rows] == [1, 2] and all(r.tpot_s > 0 for r in rows)
        c.send(P.Speculate("the cat sat", source="early-exit", max_new_tokens=4))
        done = c.until(lambda m: isinstance(m, P.LabDone))[-1]
        assert (done.job, done.outcome) == ("spec", "unsupported")
        assert "early-exit drafting needs a runtime that can stop after some of its layers" in done.message
        assert "\n" not in done.message
    finally:
        c.send(P.Quit())
        c.thread.join(30)


def test_auto_sends_large_gguf_files_to_llamacpp(tiny_dir, monkeypatch):
    import engine.backends as backends
    from engine.formats import runtime_rule  # the threshold lives there

    assert backends.choose(tiny_dir.gguf) == "torch"  # a small model stays on the readable engine
    monkeypatch.setattr(runtime_rule, "LLAMACPP_ABOVE_PARAMS", 1)
    assert backends.choose(tiny_dir.gguf) == "llama.cpp"
    assert backends.choose(tiny_dir.gguf, "torch") == "torch"
    with pytest.raises(ValueError, match="unknown backend"):
        backends.choose(tiny_dir.gguf, "cuda")


def test_the_header_is_read_once_and_kept_by_file(tiny_dir, tmp_path, monkeypatch):
    """A second load reads the header's facts from the cache (the gguf package parses a large vocabulary for tens of
    seconds); they equal the file's own, and a damaged cache entry is read again from the file."""
    import engine.backends.llamacpp as lc
    from engine.loaders import gguf as gg

    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path))
    first = lc.LlamaCppSession._read_header(tiny_dir.gguf)
    assert lc._header_cache(tiny_dir.gguf).is_file()
    opened = []
    real_open = gg.open_reader
    monkeypatch.setattr(gg, "open_reader", lambda path: opened.append(path) or real_open(path))
    assert lc.LlamaCppSession._read_header(tiny_dir.gguf) == first and opened == []  # from the cache
    lc._header_cache(tiny_dir.gguf).write_text("{not json")
    assert lc.LlamaCppSession._read_header(tiny_dir.gguf) == first and len(opened) == 1  # from the file again


def test_the_lens_reads_its_two_tensors_from_their_place_in_the_file(tiny_dir, lcpp, monkeypatch):
    """The lens maps only the output norm and matrix (their places kept with the header): the values are the gguf
    package's own reading of the file (the matrix in float16), and a place that lies beyond the file is refused."""
    import gguf

    from engine.loaders import gguf as gg

    tensors = {t.name: t for t in gg.open_reader(tiny_dir.gguf).tensors}
    out = tensors.get("output.weight") or tensors["token_embd.weight"]
    want = gguf.quants.dequantize(out.data, out.tensor_type).reshape(tuple(int(x) for x in reversed(out.shape)))
    lcpp._lens = None
    head = lcpp.lens_head()
    assert head.output.dtype == torch.float16
    np.testing.assert_allclose(head.output.float().numpy(), want, rtol=1e-3, atol=1e-6)
    norm = tensors["output_norm.weight"]
    np.testing.assert_array_equal(head.norm_weight.numpy(), gguf.quants.dequantize(norm.data, norm.tensor_type))

    places = dict(lcpp._lens_places)
    places["output"] = dict(places["output"], offset=tiny_dir.gguf.stat().st_size - 16)
    monkeypatch.setattr(lcpp, "_lens_places", places)
    lcpp._lens = None
    with pytest.raises(ValueError, match="beyond the end of the file"):
        lcpp.lens_head()
    lcpp._lens = None
