"""Steering (engine.why.steer) held to independent references on the same weights: steering-vectors'
train_steering_vector and repeng's pca_diff for building, forward hooks written here on transformers' model (and
repeng's own ControlModel) for applying, llama.cpp's own control-vector adapter (`llama_set_adapter_cvec`) for the
layer a direction lands on, and the forward pass by hand (tests/why/conftest.py) for generation.

Models: the tiny random Llama checkpoint (2 blocks, so block 1 is the only one a control vector can steer, and also
the last) and a 4-block random Llama written here (tests/tiny_families.py, plain RoPE), so that a layer has a block
on either side for the off-by-one test and a middle block for repeng (see test_pca_equals_repeng_pca_diff).

Tokens: neither the engine's tokenizer nor transformers' adds a BOS for these tokenizers (the tiny one and
SmolLM2's); each test that hands the same text to both asserts that the ids are equal, so a BOS added on one side
only would fail there instead of comparing different sequences.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from engine.events import TokenSampled
from engine.formats.control_vector import ControlVector, as_llama_buffer
from engine.protocol import SamplingParams
from engine.why.steer import Pair, build, load_for, next_token_logits, steering
from tests.requires import import_required

PAIRS = [  # five, an odd number: repeng's and the engine's sign rule (most positives above) never ties
    Pair("I love this", "I hate this"), Pair("the tea is nice", "the tea is bad"),
    Pair("a happy day", "a sad day"), Pair("we went there together", "we went there alone"),
    Pair("the weather is good", "the weather is awful"),
]
PROMPT = "the cat sat on the"
LLAMA_TOL = dict(atol=3e-2, rtol=0)  # llama.cpp's float16 K/V cache: its logits differ from float32 by ~5e-3


# ---- fixtures -----------------------------------------------------------------------------------------------------
def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return import_required("transformers")


def _tokenizer(hf_dir):
    tok = _transformers().AutoTokenizer.from_pretrained(str(hf_dir))
    tok.pad_token = tok.eos_token  # steering-vectors and repeng pad their batches
    return tok


def _llama_session(path):
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    return LlamaCppSession(path, threads=1)


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    """transformers' model of the tiny checkpoint's weights (float32) and its tokenizer."""
    model = _transformers().LlamaForCausalLM.from_pretrained(str(tiny_dir.hf_dir), dtype=torch.float32).eval()
    return model, _tokenizer(tiny_dir.hf_dir)


@pytest.fixture(scope="module")
def tiny_llama(tiny_dir):
    s = _llama_session(tiny_dir.gguf)
    yield s
    s.close()


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 4-block random Llama (float32 GGUF + transformers folder): transformers' model is the reference."""
    _transformers()
    from tests.tiny_families import write_checkpoint

    ck = write_checkpoint(tmp_path_factory.mktemp("deep"), "llama3", num_hidden_layers=4, rope_scaling=None)
    return ck, _tokenizer(ck.hf_dir)


@pytest.fixture(scope="module")
def deep_session(deep):
    from engine.loaders import load
    from engine.run.session import Session

    return Session(load(deep[0].gguf, device="cpu", dtype="float32", use_cache=False), threads=1)


@pytest.fixture(scope="module")
def deep_llama(deep):
    s = _llama_session(deep[0].gguf)
    yield s
    s.close()


# ---- references ---------------------------------------------------------------------------------------------------
def hf_logits(model, ids: list[int], adds: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """transformers' float32 logits (V,) of the last position, with adds[k] added to the output of decoder layer k
    at every position (a forward hook on model.model.layers[k], written here)."""
    def hook(v):
        def add(_module, _args, out):
            return (out[0] + v, *out[1:]) if isinstance(out, tuple) else out + v
        return add

    handles = [model.model.layers[k].register_forward_hook(hook(v)) for k, v in (adds or {}).items()]
    try:
        with torch.no_grad():
            return model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def cvec_adapter(session, vector: ControlVector, scale: float):
    """llama.cpp's own control-vector adapter on the session's context (direction.N added at the end of block N,
    llama.cpp's build_cvec), cleared after the block; the cache is forgotten on entry and exit."""
    L, cfg = session.llama, session.cfg
    buf = as_llama_buffer(vector, cfg.n_layers, cfg.d_model, scale)
    rc = L.llama_set_adapter_cvec(session._ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), buf.size,
                                  cfg.d_model, 1, cfg.n_layers - 1)
    assert rc == 0
    session.forget_cache()
    try:
        yield
    finally:
        L.llama_set_adapter_cvec(session._ctx, None, 0, cfg.d_model, -1, -1)
        session.forget_cache()


def adapter_logits(session, ids: list[int], vector: ControlVector, scale: float) -> torch.Tensor:
    with cvec_adapter(session, vector, scale):
        return session.next_token_logits(ids)[0]


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def same_ids(session, tok, texts) -> None:
    for text in texts:
        assert session.tokenize(text).ids == tok(text)["input_ids"], text  # the same sequence on both sides


def greedy(session, ids: list[int], n: int) -> list[int]:
    run = session.generate(ids, SamplingParams(temperature=0.0), n, ignore_eos=True)
    return [e.token_id for e in run if isinstance(e, TokenSampled)]


# ---- 1. building: the mean difference equals steering-vectors' --------------------------------------------------
@pytest.mark.parametrize("runtime", ["torch", "llama.cpp"])
@pytest.mark.parametrize("model", ["tiny", "deep"])
def test_mean_equals_steering_vectors(model, runtime, request):
    """build(…, "mean") read through the seam (resid_post.L at the last token) equals train_steering_vector on
    transformers' model of the same weights (a decoder block's output hook, read_token_index=-1), at each layer:
    block 1 of the tiny model (its last), blocks 1, 2 and 3 (the last) of the 4-block one."""
    from tests.requires import steering_vectors

    sv = steering_vectors()
    if model == "tiny":
        hf, tok = request.getfixturevalue("tiny_hf")
        session = request.getfixturevalue("tiny_session" if runtime == "torch" else "tiny_llama")
        layers = [1]
    else:
        ck, tok = request.getfixturevalue("deep")
        hf = ck.model
        session = request.getfixturevalue("deep_session" if runtime == "torch" else "deep_llama")
        layers = [1, 2, 3]
    same_ids(session, tok, [t for p in PAIRS for t in (p.positive, p.negative)])
    ref = sv.train_steering_vector(hf, tok, [(p.positive, p.negative) for p in PAIRS], layers=layers,
                                   read_token_index=-1)
    got = build(session, PAIRS, layers, "mean")
    assert got.layers == tuple(layers)
    for L in layers:
        want = ref.layer_activations[L].double().numpy()
        assert np.linalg.norm(want) > 0.1  # the pairs differ at this layer
        assert cosine(got.directions[L], want) >= 0.999
        tol = 1e-4 if runtime == "torch" else 2e-2  # llama.cpp's float16 K/V cache
        assert np.linalg.norm(got.directions[L] - want) <= tol * np.linalg.norm(want)


# ---- 2. building: the principal component equals repeng's pca_diff ----------------------------------------------
def test_pca_equals_repeng_pca_diff(deep, deep_session):
    """build(…, "pca") equals repeng's read_representations(method="pca_diff") at blocks 1 and 2 of the 4-block
    model. Sign: both orient the component so that most pairs' positives project above their negatives (with five
    pairs there is no tie), so the cosine is compared without abs. Length: both are unit vectors.

    Block 3, the last, is left out on purpose: repeng reads layer N from hidden_states[N + 1], and transformers'
    hidden_states[n_layers] is the last block's output after the final norm, while the engine (and steering-vectors,
    and llama.cpp's adapter, where the vector is added) take the block's output itself."""
    from tests.requires import repeng

    rp = repeng()
    ck, tok = deep
    same_ids(deep_session, tok, [t for p in PAIRS for t in (p.positive, p.negative)])
    dataset = [rp.DatasetEntry(p.positive, p.negative) for p in PAIRS]
    with torch.inference_mode():
        ref = rp.extract.read_representations(ck.model, tok, dataset, hidden_layers=[1, 2], method="pca_diff")
    got = build(deep_session, PAIRS, [1, 2], "pca")
    for L in (1, 2):
        assert np.linalg.norm(got.directions[L]) == pytest.approx(1, abs=1e-5)
        assert cosine(got.directions[L], ref[L]) >= 0.999
    # and not the mean difference: the two methods give different directions on these pairs
    mean = build(deep_session, PAIRS, [1, 2], "mean")
    assert cosine(mean.directions[1], got.directions[1]) < 0.99


# ---- 3. the layer a direction lands on: block L's output, not L - 1's or L + 1's ----------------------------------
def test_layer_index_on_torch_and_on_llamacpp(deep, deep_session, deep_llama):
    """A direction at layer L moves the logits exactly as adding it to decoder layer L's output by hand does on
    transformers' model, and not as adding it at L − 1 or L + 1 would; llama.cpp's adapter with direction.L gives
    what the seam's edit at resid_post.L gives on the same file, not what resid_post.L ± 1 give."""
    ck, _ = deep
    n = ck.model.config.num_hidden_layers
    ids = deep_session.tokenize(PROMPT).ids
    g = torch.Generator().manual_seed(1)
    v = torch.randn(deep_session.cfg.d_model, generator=g)
    scale = 3.0
    for L in range(1, n):
        vec = ControlVector({L: v.numpy()})
        near = [k for k in (L - 1, L + 1) if 0 <= k < n]
        ref = {k: hf_logits(ck.model, ids, {k: scale * v}) for k in [L, *near]}
        got = next_token_logits(deep_session, ids, vec, scale)
        assert_close(got, ref[L], atol=1e-4, rtol=0)
        for k in near:
            assert (got - ref[k]).abs().max() > 0.3, (L, k)  # the neighbours move the logits elsewhere
        seam = {k: next_token_logits(deep_llama, ids, ControlVector({k: v.numpy()}), scale) for k in [L, *near]}
        cvec = adapter_logits(deep_llama, ids, vec, scale)
        assert_close(cvec, seam[L], atol=1e-4, rtol=0)  # one addition at one node: the same float32 sums
        assert_close(cvec, ref[L], **LLAMA_TOL)
        for k in near:
            assert (cvec - seam[k]).abs().max() > 0.3, (L, k)
    plain = deep_llama.next_token_logits(ids)[0]  # the adapter was cleared after each use
    assert_close(plain, hf_logits(ck.model, ids), **LLAMA_TOL)


# ---- 4. the same flips on both runtimes ---------------------------------------------------------------------------
SWEEP = (-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.5, 2.5, 3.5)  # on the tiny model, "I think that": top-1 margins ≥ 0.1


def test_top1_flips_at_the_same_multipliers(tiny_hf, tiny_session, tiny_llama):
    """One vector (the pairs' mean difference at block 1), a sweep of multipliers: the top-1 next token at each is
    the same on torch (the seam), on llama.cpp (the seam) and on llama.cpp (its adapter), and is transformers' top-1
    with the vector added to decoder layer 1's output by hand; and it changes across the sweep. (The default model's
    sweep is test_default_model_flips.)"""
    hf, tok = tiny_hf
    ids = tiny_session.tokenize("I think that").ids
    same_ids(tiny_session, tok, ["I think that"])
    vec = build(tiny_session, PAIRS, [1])
    v = torch.from_numpy(vec.directions[1].copy())
    tops = {"reference": [], "torch": [], "llama.cpp seam": [], "llama.cpp adapter": []}
    for m in SWEEP:
        ref = hf_logits(hf, ids, {1: m * v})
        top2 = torch.topk(ref, 2).values
        assert top2[0] - top2[1] > 0.1, m  # no near-tie the runtimes' rounding (~5e-3) could break
        tops["reference"].append(int(ref.argmax()))
        tops["torch"].append(int(next_token_logits(tiny_session, ids, vec, m).argmax()))
        tops["llama.cpp seam"].append(int(next_token_logits(tiny_llama, ids, vec, m).argmax()))
        tops["llama.cpp adapter"].append(int(adapter_logits(tiny_llama, ids, vec, m).argmax()))
    for name, got in tops.items():
        assert got == tops["reference"], name
    assert len(set(tops["reference"])) >= 3  # the sweep flips the top-1 more than once


# ---- 5. a control vector written by repeng ------------------------------------------------------------------------
def test_repeng_file_acts_as_repeng_applies_it(deep, deep_session, deep_llama, tmp_path):
    """repeng trains a vector (pca_diff, blocks 1 and 2) and writes it with export_gguf; the engine loads the file
    (load_for) to the same directions, applies it as it applies the same directions built in memory (exactly),
    and as repeng's own ControlModel applies it on transformers' model; llama.cpp's adapter fed the file's data,
    and the seam on llama.cpp, give the same logits."""
    from engine.formats.control_vector import load
    from tests.requires import repeng

    rp = repeng()
    ck, tok = deep
    ids = deep_session.tokenize(PROMPT).ids
    same_ids(deep_session, tok, [PROMPT])
    trained = rp.ControlVector.train(ck.model, tok, [rp.DatasetEntry(p.positive, p.negative) for p in PAIRS],
                                     hidden_layers=[1, 2], method="pca_diff")
    path = tmp_path / "repeng.gguf"
    rp.ControlVector(model_type="llama", directions=trained.directions).export_gguf(str(path))

    loaded = load_for(deep_session, str(path))
    assert loaded.layers == (1, 2) and loaded.model_hint == "llama"
    for L in (1, 2):
        np.testing.assert_array_equal(loaded.directions[L], trained.directions[L])
    scale = 4.0
    in_memory = ControlVector({L: np.array(d) for L, d in trained.directions.items()})
    got = next_token_logits(deep_session, ids, loaded, scale)
    assert torch.equal(got, next_token_logits(deep_session, ids, in_memory, scale))

    control = rp.ControlModel(ck.model, [1, 2])  # repeng wraps the blocks in place: unwrapped below
    try:
        control.set_control(trained, coeff=scale)
        with torch.no_grad():
            ref = control(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    finally:
        control.unwrap()
    plain = hf_logits(ck.model, ids)
    assert (ref - plain).abs().max() > 0.3  # the vector moves the logits far more than the runtimes differ
    assert_close(got, ref, atol=1e-4, rtol=0)

    from_file = load(path)  # as llama.cpp's own loader would hand it to the adapter
    cvec = adapter_logits(deep_llama, ids, from_file, scale)
    assert_close(cvec, ref, **LLAMA_TOL)
    assert_close(cvec, next_token_logits(deep_llama, ids, loaded, scale), atol=1e-4, rtol=0)


# ---- 6. generation --------------------------------------------------------------------------------------------------
def _greedy_by_hand(by_hand, w, ids, n, scale_at) -> list[int]:
    """Greedy tokens of the forward pass by hand with v × scale_at(position) added to the residual stream entering
    the final norm (block 1's output, the tiny model's last block) at each position."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(by_hand(w, ids, scale_at)[-1].argmax()))
    return ids[-n:]


def _adder(v: torch.Tensor, scale_of):
    def edit(site, layer, x):
        if (site, layer) != ("resid", 2):
            return x
        s = torch.tensor([scale_of(t) for t in range(x.shape[0])], dtype=x.dtype)[:, None]  # (T, 1)
        return x + s * v.double()
    return edit


@pytest.mark.parametrize("runtime", ["torch", "llama.cpp"])
def test_generation_under_steering(runtime, request, tiny_dir, tiny_session, by_hand):
    """Greedy tokens under steering(…) are the forward pass by hand's with the vector added at block 1's output at
    every position; they differ from the unsteered run; after the block the session is unsteered again; and a
    scale changed between two tokens acts from the next forward pass on (the positions before keep their K/V)."""
    session = request.getfixturevalue("tiny_session" if runtime == "torch" else "tiny_llama")
    w, ids, n, scale = tiny_dir.hf_weights, tiny_session.tokenize(PROMPT).ids, 8, 2.0
    vec = build(tiny_session, PAIRS, [1])
    v = torch.from_numpy(vec.directions[1].copy())
    plain = _greedy_by_hand(by_hand, w, ids, n, None)
    want = _greedy_by_hand(by_hand, w, ids, n, _adder(v, lambda t: scale))
    assert want != plain
    with steering(session, vec, scale):
        got = greedy(session, ids, n)
    assert got == want
    assert greedy(session, ids, n) == plain  # unsteered again after the block

    # the slider moved once the k-th new token is out: that token sits at position P + k − 1, which the next step
    # runs with the new scale; the positions before keep −scale (their K/V were computed with it)
    P, k = len(ids), 3
    live = _greedy_by_hand(by_hand, w, ids, n, _adder(v, lambda t: -scale if t < P + k - 1 else scale))
    assert live != _greedy_by_hand(by_hand, w, ids, n, _adder(v, lambda t: -scale))
    got = []
    with steering(session, vec, -scale) as handle:
        for e in session.generate(ids, SamplingParams(temperature=0.0), n, ignore_eos=True):
            if isinstance(e, TokenSampled):
                got.append(e.token_id)
                if len(got) == k:
                    handle.set_scale(scale)
    assert got == live


# ---- the default model (SmolLM2-135M, Q4_1) -------------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_mean_equals_steering_vectors(real_lm, tmp_path):
    """On SmolLM2 exported to a Hugging Face folder (the GGUF's dequantized float32 values), at blocks 3, 15 and 29
    (the last): build(…, "mean") on the torch engine equals train_steering_vector."""
    from engine.run.session import Session
    from tests.requires import steering_vectors
    from tests.why.tl_reference import export_default

    sv = steering_vectors()
    hf_dir = export_default(tmp_path / "smollm2")
    tok = _tokenizer(hf_dir)
    hf = _transformers().LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    session = Session(real_lm, threads="auto")
    same_ids(session, tok, [t for p in PAIRS for t in (p.positive, p.negative)])
    layers = [3, 15, 29]
    ref = sv.train_steering_vector(hf, tok, [(p.positive, p.negative) for p in PAIRS], layers=layers,
                                   read_token_index=-1)
    got = build(session, PAIRS, layers, "mean")
    for L in layers:
        want = ref.layer_activations[L].double().numpy()
        assert cosine(got.directions[L], want) >= 0.999
        assert np.linalg.norm(got.directions[L] - want) <= 1e-4 * np.linalg.norm(want)


@pytest.mark.slow
def test_default_model_flips(real_lm):
    """One vector (the pairs' mean difference at blocks 6, 9 and 12, built on torch), multipliers −1.5 … 1.5: on
    llama.cpp the adapter and the seam give the same logits at every multiplier; torch's top-1 is llama.cpp's
    wherever torch's top-1 leads by more than 1 nat. Nearer a flip the two may differ: llama.cpp multiplies the
    Q4_1 weights with activations quantized to 8 bits, torch the dequantized weights in float32, and their intact
    log-probs already differ by up to ~0.4 nats (test_ablate's default-model test)."""
    from engine.run.session import Session
    from tests.requires import default_model

    session = Session(real_lm, threads="auto")
    llama = _llama_session(default_model())
    try:
        vec = build(session, PAIRS, [6, 9, 12])
        ids = session.tokenize("Today I feel").ids
        firm, changed = [], set()
        for m in np.arange(-1.5, 1.51, 0.25):
            lp = torch.log_softmax(next_token_logits(session, ids, vec, m).double(), -1)
            seam = next_token_logits(llama, ids, vec, m)
            cvec = adapter_logits(llama, ids, vec, m)
            assert_close(cvec, seam, atol=1e-3, rtol=0)
            top2 = torch.topk(lp, 2)
            changed.add(int(top2.indices[0]))
            if top2.values[0] - top2.values[1] > 1.0:
                firm.append((m, int(top2.indices[0]), int(seam.argmax())))
        assert len(changed) >= 3  # the sweep flips the top-1
        assert len(firm) >= 5 and len({t for _, t, _ in firm}) >= 3, firm
        assert all(t == lt for _, t, lt in firm), firm
    finally:
        llama.close()


def test_generate_steer_on_the_command_line_names_the_vector_and_changes_the_tokens(tiny_dir, tmp_path, capsys):
    """`engine steer --out` writes a control vector; `generate --steer FILE:SCALE` runs with it: at scale 0 the
    tokens are the plain run's, at a large scale they are not, and the JSON and the summary line name the vector,
    its layers and the scale."""
    import json

    from engine.__main__ import main

    model = ["--model", str(tiny_dir.gguf), "--backend", "torch", "--threads", "1"]
    vec = tmp_path / "mood.gguf"
    assert main(["steer", *model, "--pair", "I love this", "I hate this", "--layers", "1", "--out", str(vec)]) == 0
    capsys.readouterr()

    def run(*extra: str) -> dict:
        assert main(["generate", *model, "--prompt", "the cat", "--greedy", "--max-new-tokens", "6",
                     "--ignore-eos", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    plain, zero, strong = run(), run("--steer", f"{vec}:0"), run("--steer", f"{vec}:40")
    assert "steered" not in plain
    assert zero["ids"] == plain["ids"]
    assert strong["ids"] != plain["ids"]
    assert strong["steered"] == {"vector": "mood.gguf", "layers": [1], "scale": 40.0}
    assert main(["generate", *model, "--prompt", "the cat", "--greedy", "--max-new-tokens", "2",
                 "--steer", f"{vec}:-2.5"]) == 0
    assert "[steered by mood.gguf at layers [1] × -2.5]" in capsys.readouterr().err
