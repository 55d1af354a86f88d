"""bfloat16 decode held to float64 and to the float32 model, on every CPU: the product against F.linear in float64 on
the same bf16 inputs, decode logits of the tiny model against its float32 decode, and the real model's greedy
continuations against float32's.

Where the CPU has native bf16 dot products the engine multiplies decode rows by oneDNN's pre-reordered weights
(transformer.pack_for_decode, "packed"); elsewhere it runs F.linear on the plain bf16 weights ("plain", emulated and
slower, but no less exact). Both paths are tested where both exist: "plain" by making the engine believe the CPU has
no native bf16 (transformer._bf16_packing); the packed path exists only where the hardware does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from engine.loaders import load
from engine.model import attention_choice
from engine.model import transformer as model
from engine.model.kv_cache import KVCache
from engine.model.transformer import SPLIT_MAX_ROWS, linear, pack_for_decode

NATIVE_BF16 = model._bf16_packing()
PATHS = ["packed", "plain"] if NATIVE_BF16 else ["plain"]
THIS_CPUS_PATH = "packed" if NATIVE_BF16 else "plain"  # what the engine runs here when asked for bfloat16


@pytest.fixture(params=PATHS)
def bf16_path(request, monkeypatch) -> str:
    """The decode path under test; "plain" is what a CPU without native bf16 dot products gets."""
    if request.param == "plain":
        monkeypatch.setattr(model, "_bf16_packing", lambda: False)
    return request.param


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("rows", "n_in", "n_out"),
                         [(1, 576, 960), (1, 64, 96), (SPLIT_MAX_ROWS, 33, 7), (2, 1536, 576)])
def test_bf16_product_matches_float64(bf16_path, rows, n_in, n_out, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n_in)
    w = torch.randn(n_out, n_in, generator=g).bfloat16()
    x = torch.randn(rows, n_in, generator=g).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if bias else None
    packed = pack_for_decode(w)
    assert (packed is not None) == (bf16_path == "packed")
    y = linear(x, w, b, packed)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())  # the same bf16 inputs, exact sums
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n_out)
    # one bf16 rounding of the output (2^-8 relative) plus float32 accumulation over n_in terms
    assert_close(y.double(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())


def test_nothing_is_packed_where_it_cannot_help():
    assert pack_for_decode(torch.randn(8, 4)) is None  # float32: the row-block split is the fast path
    assert pack_for_decode(torch.randn(8, 4, device="meta").bfloat16()) is None  # not a CPU tensor


def decode_logits(lm, ids: list[int]) -> torch.Tensor:
    """Prefill the first token, then decode the rest one at a time (the decode path): logits of every step."""
    cache = KVCache(lm.cfg, 1, len(ids), lm.dtype)
    out = [lm.model(torch.tensor([ids[:1]]), cache)[0]]
    for t in ids[1:]:
        out.append(lm.model(torch.tensor([[t]]), cache)[0])
    return torch.stack(out)  # (T, V) float32


def test_tiny_model_bf16_decode_stays_within_bf16_tolerance_of_float32(bf16_path, tiny_dir, tiny_lm):
    ids = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]
    bf = load(tiny_dir.gguf, device="cpu", dtype="bfloat16", use_cache=False)
    assert (bf.model.head_packed is not None) == (bf16_path == "packed")  # decode takes the path under test
    lf, lb = decode_logits(tiny_lm, ids), decode_logits(bf, ids)
    assert (lf.argmax(-1) == lb.argmax(-1)).float().mean() > 0.8
    assert_close(lb, lf, atol=0.3, rtol=0.1)  # the same bound the bf16 prefill is held to (test_model.py)
    if bf16_path == "plain":
        return
    plain = load(tiny_dir.gguf, device="cpu", dtype="bfloat16", use_cache=False)
    for m in plain.model.modules():
        if isinstance(m, model.Linear):
            m.packed = None
    plain.model.head_packed = None
    assert_close(lb, decode_logits(plain, ids), atol=0.05, rtol=0.02)  # packing changes the layout, not the math


TEST_PROMPTS = ["Explain what a KV cache is in two sentences.", "What is the capital of France?",
                "Write a haiku about memory bandwidth.", "How do I sort a list in Python?",
                "Tell me a fun fact about octopuses.", "Give three tips for staying focused."]


def test_bf16_head_gives_its_best_candidates_float32_logits(bf16_path, tiny_dir):
    bf = load(tiny_dir.gguf, device="cpu", dtype="bfloat16", use_cache=False)
    x = torch.randn(1, bf.cfg.d_model, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits = bf.model.head(x)[0]  # (V,) float32
    h = bf.model.norm(x)[0].double()
    ref = bf.model.lm_head.double() @ h  # float64 from the same bf16 hidden state and weights
    top = torch.topk(ref, model.HEAD_RESCORE).indices
    assert_close(logits[top].double(), ref[top], rtol=1e-5, atol=1e-4)  # float32 precision, not bf16's 2^-8
    assert logits.argmax() == ref.argmax()


# bfloat16 keeps 8 bits of mantissa: on logits of magnitude 10-30 a product's rounding moves a logit by up to ~0.1-0.2,
# so where float32's top two are closer than this, the emulated path may take the other one (the app loads float32
# there; the margin that parted on the AVX2-only class was well under it).
NEAR_TIE = 0.5


@pytest.mark.slow
def test_real_model_bf16_greedy_continuations_equal_float32(real_lm):
    """On the path this CPU runs (the real model is too slow to run twice): bfloat16 gives float32's greedy tokens up
    to the first step where float32's own top two are a near-tie (the test says which). Where the CPU has native bf16
    dot products (why the app defaults to bfloat16 there: engine.loaders.preferred_dtype), the products alone, with
    the attention in float32 (the `upcast` way), give float32's tokens exactly; the way measured fastest may be
    torch's fused kernel in bf16, whose rounding can take the other side of a near-tie."""
    import numpy as np

    from engine.events import TokenSampled
    from engine.loaders import preferred_dtype
    from engine.model import attention_choice
    from engine.protocol import Capture
    from engine.run.sampling import SamplingParams
    from engine.run.session import Session

    assert preferred_dtype("cpu") == ("bfloat16" if NATIVE_BF16 else "float32")
    bf = load(None, device="cpu", dtype="bfloat16")
    assert (bf.model.head_packed is not None) == (THIS_CPUS_PATH == "packed")

    def greedy(prompt: str) -> list[int]:
        return list(Session(bf).generate(prompt, SamplingParams.greedy_params(), 24, chat=True,
                                         ignore_eos=True))[-1].ids.tolist()

    for prompt in TEST_PROMPTS:
        ref = [e for e in Session(real_lm).generate(prompt, SamplingParams.greedy_params(), 24, Capture(logits=True),
                                                    chat=True, ignore_eos=True) if isinstance(e, TokenSampled)]
        want = [e.token_id for e in ref]
        got = greedy(prompt)
        parted = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if parted is not None:
            logits = np.asarray(ref[parted].logits, dtype=np.float64)
            margin = logits[want[parted]] - logits[got[parted]]
            assert margin < NEAR_TIE, (prompt, parted, margin)
        if NATIVE_BF16:
            with attention_choice.forced("upcast"):
                assert greedy(prompt) == want, prompt


def _attention_f64(q, k, v, group_size, scale, mask):
    """softmax(q·kᵀ·scale + mask)·v in float64 on the same (rounded) inputs, each query head reading its group's KV."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(group_size, 1), v.repeat_interleave(group_size, 1)
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    w = torch.softmax(s, -1)
    return w @ v, w


@pytest.mark.parametrize("S", [8 * 3 - 1, 8 * 3, 8 * 3 + 5, 5])
@pytest.mark.parametrize("window", [0, 9])
def test_key_blocked_attention_matches_float64(S, window):
    """A long bf16 decode query's attention runs its products in bf16 up to a block boundary and in float32 past it
    (so oneDNN sees a new shape once per block, not every step): the output and the weights stay within bf16's
    rounding of float64 on the same inputs, whatever the key count's remainder, with a sliding-window band too."""
    g = torch.Generator().manual_seed(S + window)
    G, KV, hd = 3, 2, 16
    q = torch.randn(1, G * KV, 1, hd, generator=g).bfloat16()
    k = torch.randn(1, KV, S, hd, generator=g).bfloat16()
    v = torch.randn(1, KV, S, hd, generator=g).bfloat16()
    mask = (torch.arange(S) > S - 1 - window)[None] if window else None  # the band of the newest `window` keys
    y, w = model.key_blocked_attention(q, k, v, G, hd ** -0.5, mask, block=8)
    y64, w64 = _attention_f64(q, k, v, G, hd ** -0.5, mask)
    assert y.dtype == w.dtype == torch.bfloat16 and w.shape == (1, G * KV, 1, S)
    assert_close(w.double(), w64, atol=4e-3, rtol=1e-2)
    assert_close(y.double(), y64, atol=2e-2 * float(v.abs().max()), rtol=2e-2)
    if window:
        assert (w[..., : max(0, S - window)] == 0).all()  # no query reads outside its band


def test_tiny_model_bf16_decode_past_the_upcast_limit(monkeypatch, tiny_dir, tiny_lm):
    """With the blocked way forced, the tiny model's bf16 decode runs the key-blocked products
    (blocks smaller than the prompt, so both parts are used) and stays as close to its float32 decode as before."""
    monkeypatch.setattr(model, "KEY_BLOCK", 4)
    monkeypatch.setattr(attention_choice, "_FORCED", ["blocked"])
    called = []
    real = model.key_blocked_attention
    monkeypatch.setattr(model, "key_blocked_attention", lambda *a, **kw: called.append(a[1].shape[2]) or real(*a, **kw))
    ids = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]
    bf = load(tiny_dir.gguf, device="cpu", dtype="bfloat16", use_cache=False)
    lf, lb = decode_logits(tiny_lm, ids), decode_logits(bf, ids)
    assert max(called) > 4 and any(s % 4 for s in called)  # a full block and a remainder were both used
    assert (lf.argmax(-1) == lb.argmax(-1)).float().mean() > 0.8
    assert_close(lb, lf, atol=0.3, rtol=0.1)
