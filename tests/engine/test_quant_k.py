"""K-quant files on the quantized decode path (engine.model.quant): a Q4_K tensor's own blocks as torch's int4 form,
other quantized types (Q5_0, Q8_0, Q6_K) with the int8 requantization only, held to the gguf package's
dequantization of the same bytes and to the float path's logits and greedy tokens, on Q4_K blocks written here by
hand from ggml's block_q4_K layout and on the real Gemma 3 270M Q4_K_M file.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch.testing import assert_close

from engine.loaders import gguf as gg
from engine.loaders import load
from engine.model import kernel_cache, kernels, quant
from engine.model.transformer import HEAD_RESCORE, Linear
from tests.engine.test_bf16_decode import NEAR_TIE, decode_logits
from tests.engine.test_quant_path import LOGIT_TOLERANCE, assert_int8_form_is, kernel_weight, token_table

Q = gguf.GGMLQuantizationType
BF16_FORM = 2 ** -7  # the int4 form with bf16 scale, zero and output, as a share of the tensor's largest |w|


def q4_k_bytes(w: np.ndarray) -> np.ndarray:
    """ggml's block_q4_K bytes (rows, in/256 · 144) of w (rows, in), written by hand (not llama.cpp's search for the
    best scales: a plain min/max grid per 32 values, which is all these tests need)."""
    rows, n = w.shape
    g = w.reshape(rows, n // 256, 8, 32).astype(np.float64)
    lo, hi = np.minimum(g.min(-1), 0.0), g.max(-1)  # (rows, nsb, 8)
    step, offset = np.maximum(hi - lo, 1e-6) / 15, -lo
    d = (step.max(-1) / 63).astype(np.float16)  # (rows, nsb)
    dmin = np.maximum(offset.max(-1) / 63, 1e-6).astype(np.float16)
    sc = np.clip(np.round(step / d[..., None].astype(np.float64)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / dmin[..., None].astype(np.float64)), 0, 63).astype(np.uint8)
    scale, shift = d[..., None].astype(np.float64) * sc, dmin[..., None].astype(np.float64) * mn  # (rows, nsb, 8)
    q = np.clip(np.round((g + shift[..., None]) / scale[..., None]), 0, 15)
    q = q.astype(np.uint8)  # (rows, nsb, 8, 32)
    scales = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                             (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], axis=-1)  # (rows, nsb, 12)
    qs = (q[:, :, 0::2] | q[:, :, 1::2] << 4).reshape(rows, n // 256, 128)  # run j: groups 2j (low), 2j+1 (high)
    halves = [x[..., None].view(np.uint8) for x in (d, dmin)]  # (rows, nsb, 2) each
    return np.concatenate([*halves, scales, qs], axis=-1).reshape(rows, -1)


def random_q4_k(rows: int, n: int, seed: int) -> np.ndarray:
    """Random block_q4_K bytes: every scale, min and nibble bit pattern, d and dmin in [1e-3, 2e-3] (float16)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, n // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        raw[..., at:at + 2] = rng.uniform(1e-3, 2e-3, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def ggufs(raw: np.ndarray, kind: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, kind), np.float32).reshape(shape))


def as_blocks(raw: np.ndarray) -> np.ndarray:
    """(rows, bytes per row) -> the loader's (rows, in/32, 18)."""
    return raw.reshape(raw.shape[0], -1, quant.BLOCK_BYTES["q4_k"])


@pytest.mark.parametrize("source", ["random bytes", "by-hand quantizer"])
def test_q4_k_blocks_unpack_to_ggufs_dequantization_bit_for_bit(source):
    rows, n = 48, 512
    if source == "random bytes":
        raw = random_q4_k(rows, n, seed=1)
    else:
        w = np.random.default_rng(2).normal(0, 0.3, (rows, n)).astype(np.float32)
        w[:, :32] += 0.5  # a group of positive values: its min mn is 0
        raw = q4_k_bytes(w)
        assert float((ggufs(raw, Q.Q4_K, (rows, n)) - torch.from_numpy(w)).abs().max()) < 0.1  # a real quantization
    ref = ggufs(raw, Q.Q4_K, (rows, n))
    q, d, m = quant.split_q4_blocks(as_blocks(raw), "q4_k")
    scale, zero = quant.int4_scale_zero(d, m)
    assert bool((zero.double() == 8 * d.double() + m.double()).all())  # zero exact in float32 (d, dmin alike)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    assert_close(quant.dequantize_int4(q, scale, zero), ref, rtol=0, atol=0)  # (q − 8)·scale + zero == gguf's
    exact = quant.int4_from_blocks(as_blocks(raw), "q4_k", torch.float32)  # the kernel with float32 scales
    assert_close(kernel_weight(exact, n, "int4"), ref, rtol=0, atol=2 ** -22 * float(ref.abs().max()))
    fast = quant.int4_from_blocks(as_blocks(raw), "q4_k")  # the candidate's bf16 scales and output
    assert_close(kernel_weight(fast, n, "int4"), ref, rtol=0, atol=BF16_FORM * float(ref.abs().max()))


def test_the_int4_candidate_multiplies_by_the_q4_k_weight():
    raw = random_q4_k(64, 768, seed=3)
    ref = ggufs(raw, Q.Q4_K, (64, 768))
    forms = quant.q4_forms(torch.from_numpy(as_blocks(raw)), "q4_k", ref, quant.FAST)
    assert forms.int4 is not None and forms.int8 is not None
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(4))
    want = x.double() @ ref.double().T
    # bf16 x (2⁻⁹ relative) and the form's bf16 weight (BF16_FORM of max|w|) in every term, bf16 output
    bound = (x.abs().double() @ ref.abs().double().T + x.abs().sum(1, keepdim=True).double() * ref.abs().max())
    got = kernels.int4(x, ref, None, None, forms).double()
    assert bool(((got - want).abs() <= BF16_FORM * bound).all())
    assert float((got - want).abs().max()) > 0  # a bf16 product, not the float one in disguise


def test_other_quantized_types_get_the_int8_form_only_and_shapes_keep_one_set_of_forms():
    q4k = torch.from_numpy(as_blocks(random_q4_k(32, 256, seed=5)))
    marker = quant.requant_marker
    sd = {
        "layers.0.attn.wq.weight.requant": marker(32, 256), "layers.0.attn.wk.weight.requant": marker(16, 256),
        "layers.0.attn.wv.weight.requant": marker(16, 256),  # Q5_0, Q5_0 and Q8_0 in the file: one marker
        "layers.1.attn.wq.weight.q4_k": q4k, "layers.1.attn.wk.weight.q4_k": q4k[:16],
        "layers.1.attn.wv.weight.requant": marker(16, 256),  # Q4_K parts beside a Q8_0 part: int8 only
        "layers.0.mlp.w_down.weight.q4_k": q4k, "layers.1.mlp.w_down.weight.requant": marker(32, 256),  # one shape
        "layers.0.mlp.w_gate.weight.q4_k": q4k,  # its w_up is float in the file: the fused weight has no forms
        "layers.0.attn.wq.weight": torch.zeros(32, 256),
    }
    blocks = quant.take_blocks(sd)
    assert list(sd) == ["layers.0.attn.wq.weight"]  # every block entry taken, the weights left
    assert {n: (tuple(b.shape), k) for n, (b, k) in blocks.items()} == {
        "layers.0.attn.wqkv.weight": ((64, 8, 0), quant.REQUANT),
        "layers.1.attn.wqkv.weight": ((64, 8, 0), quant.REQUANT),
        "layers.0.mlp.w_down.weight": ((32, 8, 18), "q4_k"),  # layer 1's Q6_K-like down projection runs float
    }
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    forms = quant.q4_forms(*blocks["layers.0.attn.wqkv.weight"], w, quant.FAST)
    assert forms.int4 is None and forms.int8 is not None
    assert_close(forms.int8[0].float() * forms.int8[1].float()[:, None], w, rtol=0,
                 atol=quant.INT8_STEP_ERROR * float(forms.int8[1].float().max()) * (1 + 2 ** -7))


# ---- a tiny Gemma 3 written as a mixed K-quant file, as llama.cpp's Q4_K_M mixes types --------------------------
def _mix(name: str) -> gguf.GGMLQuantizationType | None:
    """The type each tensor of the tiny mixed file is written in (None: as the reference writer does, F32)."""
    if not name.startswith("blk.") or "norm" in name:
        return Q.Q8_0 if name == "token_embd.weight" else None
    layer, part = int(name.split(".")[1]), name.split(".")[2]
    return {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0 if layer % 2 == 0 else Q.Q5_0,
            "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K,
            "ffn_down": Q.Q4_K if layer % 3 else Q.Q8_0}[part]


def write_mixed(directory, family: str):
    """The tiny `family` checkpoint (d_model 256, so that Q4_K's 256-value super-blocks fit) written with each
    tensor at its _mix type: Q4_K by q4_k_bytes, the others by gguf's own quantizer."""
    from tests.tiny_families import write_checkpoint

    real = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kwargs):
        kind = _mix(name)
        if kind is None:
            return real(self, name, tensor, *args, **kwargs)
        raw = q4_k_bytes(tensor) if kind == Q.Q4_K else gguf.quants.quantize(tensor, kind)
        return real(self, name, raw, raw_dtype=kind)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
        path = write_checkpoint(directory, family, hidden_size=256, intermediate_size=256).gguf
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.ffn_down.weight"] == Q.Q4_K and types["blk.0.ffn_down.weight"] == Q.Q8_0
    return path


@pytest.fixture(scope="module")
def k_file(tmp_path_factory):
    return write_mixed(tmp_path_factory.mktemp("kquant"), "gemma3")


@pytest.fixture(scope="module")
def k_lm(k_file):
    with kernels.keeping_forms():
        return load(k_file, device="cpu", dtype="float32", use_cache=False, kernels="fast")


def test_the_loader_keeps_q4_k_blocks_that_are_the_files_weights(k_file):
    reader = gg.open_reader(k_file)
    sd = gg.read_weights(reader, gg.read_config(reader, "tiny"))
    kinds = {n.rsplit(".", 1)[1] for n in sd if n.endswith(quant.KINDS)}
    assert kinds == {"q4_k", "q4_0", quant.REQUANT}
    for name in [n for n in sd if n.endswith(".q4_k")]:
        q, d, m = quant.split_q4_blocks(sd[name], "q4_k")
        assert_close(quant.dequantize_int4(q, *quant.int4_scale_zero(d, m)), sd[name.removesuffix(".q4_k")],
                     rtol=0, atol=0, msg=name)  # the float weight is gguf's dequantization of the same bytes
    assert sd["layers.0.attn.wq.weight.requant"].shape == (64, 8, 0)  # a Q5_0 projection: its marker, no bytes
    assert sd["tok_embeddings.weight.requant"].shape == (300, 8, 0)  # the Q8_0 table is the tied head: its marker


def test_each_projection_gets_the_forms_of_its_type(k_lm):
    for i, layer in enumerate(k_lm.model.layers):
        parts = {"wqkv": layer.attn.wqkv, "wo": layer.attn.wo, "w_gate_up": layer.mlp.w_gate_up,
                 "w_down": layer.mlp.w_down}
        int4 = {"wqkv": False, "wo": True, "w_gate_up": True, "w_down": i % 3 != 0}
        for name, m in parts.items():
            assert isinstance(m, Linear)
            if name == "w_down" and i % 3 == 0:  # Q8_0 in a shape whose other weights are Q4_K: float only
                assert m.quant is None, (i, name)
                continue
            assert m.quant is not None and m.quant.int8 is not None, (i, name)
            assert (m.quant.int4 is not None) == int4[name], (i, name)
            if m.quant.int4 is not None:
                assert_close(kernel_weight(m.quant.int4, m.weight.shape[1], "int4"), m.weight, rtol=0,
                             atol=BF16_FORM * float(m.weight.abs().max()), msg=(i, name))


@pytest.mark.parametrize("name", kernels.QUANTIZED)
def test_forced_quantized_decode_of_a_k_quant_file_stays_near_the_float_path(k_lm, name):
    ids = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]
    with kernels.forced("linear"):
        ref = decode_logits(k_lm, ids)
    with kernels.forced(name):
        got = decode_logits(k_lm, ids)
    assert_close(got, ref, rtol=0, atol=LOGIT_TOLERANCE[name] * float(ref.abs().max()))
    assert float((got - ref).abs().max()) > 0  # the quantized kernels ran


def test_the_tied_head_gets_the_int8_form_of_its_q8_0_table(k_file, k_lm):
    model = k_lm.model
    raw, kind = token_table(k_file)
    assert kind == Q.Q8_0 and model.output is None
    ref = ggufs(raw, kind, tuple(model.lm_head.shape))
    forms = model.head_quant
    assert forms is not None and forms.int4 is None  # Q8_0: no exact int4 form
    assert_int8_form_is(forms, ref)
    assert_close(model.tok_embeddings.weight, ref, rtol=0, atol=0)  # the lookup gathers the float table
    assert model.decode_products()[(*ref.shape, kernel_cache.Q4)][0][3] is forms  # the head: a quantized product


def test_the_quantized_head_runs_its_form_and_rescores_its_best_candidates_in_float32(k_lm, monkeypatch):
    """Forced int8, the head multiplies by its int8 form; the HEAD_RESCORE best are then recomputed from the float
    table, so they (and the argmax) are float64's to float32 rounding, the rest the form's approximation."""
    model = k_lm.model
    h = torch.randn(1, model.cfg.d_model, generator=torch.Generator().manual_seed(7))
    exact = (model.norm(h).double() @ model.lm_head.double().T)[0]  # (V,) the float table in float64
    heads = []
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm",
                        lambda x, q, s: heads.append(q is model.head_quant.int8[0]) or real(x, q, s))
    with kernels.forced("int8"):
        got = model.head(h)[0].double()
    assert heads == [True]
    top = got.topk(HEAD_RESCORE).indices
    assert_close(got[top], exact[top], rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    assert int(got.argmax()) == int(exact.argmax())
    rest = torch.ones_like(got, dtype=torch.bool).index_fill(0, top, False)
    assert float((got - exact)[rest].abs().max()) > 1e-5 * float(exact.abs().max())  # the int8 product ran
    assert_close(got, exact, rtol=0, atol=LOGIT_TOLERANCE["int8"] * float(exact.abs().max()))


def test_a_decode_step_reads_the_tied_heads_form_not_its_float_table(k_lm, monkeypatch):
    """Forced int8: the head is priced at its int8 bytes (V·d + 2·V), by hand from the shape; were the head left
    float (no forms), the step would read 4·V·d for it."""
    model = k_lm.model
    V, d = model.lm_head.shape
    with kernels.forced("int8"):
        with_form = model.decode_weight_bytes_read()
        monkeypatch.setattr(model, "tied_head_quant", None)
        without = model.decode_weight_bytes_read()
    assert without - with_form == 4 * V * d - (V * d + 2 * V)


def test_the_tuner_measures_the_tied_heads_forms_and_drops_them_where_float_wins(k_file, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_FORCED", [])
    monkeypatch.setattr(kernel_cache, "cache_path",  # each kind of measurement its own file, as the real path
                        lambda kind=kernel_cache.Entry: tmp_path / ("k.json" if kind is kernel_cache.Entry
                                                                    else kind.FILE))
    with kernels.keeping_forms():
        lm = load(k_file, device="cpu", dtype="float32", use_cache=False, kernels="fast")
    head = tuple(lm.model.lm_head.shape)
    for int8_cost, want in ((1.0, "int8"), (9.0, "linear")):
        costs = {"linear": 3.0, "split": 4.0, "onednn": 5.0, "packed": 5.0, "int4": 2.0, "int8": int8_cost}
        entries = kernels.tune(lm.model.decode_products(), counts=[1], remeasure=True,
                               time_once=lambda products, name, c=costs: c[name])
        e = next(e for e in entries if e.shape == head)
        assert e.weights == kernel_cache.Q4 and e.key.endswith("|q4")  # keyed apart from the float head's
        assert "int8" in e.seconds and "int4" not in e.seconds and e.choice == want
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    lm.model.tune_kernels()  # reads the last choice (float): the head's int8 form goes
    forms = lm.model.head_quant
    assert forms.int8 is None and forms.dropped and not kernels.runs_form(lm.model.lm_head, forms)
    with kernels.forced("int8"):  # nothing left to run for the head: it reads its float table
        kept = lm.model.decode_weight_bytes_read()
        monkeypatch.setattr(lm.model, "tied_head_quant", None)
        assert lm.model.decode_weight_bytes_read() == kept


def test_export_leaves_the_blocks_and_markers_out(tmp_path):
    from safetensors import safe_open

    from engine.cli.export_hf import export

    out = export(write_mixed(tmp_path, "llama3"), tmp_path / "hf")  # gemma3 is not exportable
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not [n for n in names if n.endswith(quant.KINDS) or ".weight." in n]


# ---- the real Gemma 3 270M Q4_K_M file ---------------------------------------------------------------------------
@pytest.mark.slow
def test_gemma3_q4_k_tensors_are_the_int4_form_bit_for_bit():
    """Every Q4_K tensor of the real file: the int4 form's float32 formula is gguf's dequantization exactly, and
    the bf16 form the candidate runs within BF16_FORM (measured: 0.52 % of a tensor's largest |w| at most; read off
    the kernel for the first tensor of each shape, minutes for all of them on a 2-core machine)."""
    from tests.requires import gemma3

    reader = gg.open_reader(gemma3())
    tensors = [t for t in reader.tensors if t.tensor_type == Q.Q4_K]
    assert len(tensors) == 27  # every attn_output and half the ffn_down
    seen: set[tuple[int, ...]] = set()
    for t in tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        raw = np.array(t.data)  # off the read-only file map
        ref = ggufs(raw, Q.Q4_K, shape)
        q, d, m = quant.split_q4_blocks(as_blocks(raw), "q4_k")
        assert_close(quant.dequantize_int4(q, *quant.int4_scale_zero(d, m)), ref, rtol=0, atol=0, msg=t.name)
        if shape in seen:
            continue
        seen.add(shape)
        fast = quant.int4_from_blocks(as_blocks(raw), "q4_k")
        assert_close(kernel_weight(fast, shape[1], "int4"), ref, rtol=0,
                     atol=BF16_FORM * float(ref.abs().max()), msg=t.name)


@pytest.mark.slow
def test_gemma3_quantized_path_logits_and_greedy_tokens_as_the_float_path():
    """Gemma 3 270M through the tuner's choice, and forced through int4 (Q4_K blocks; other projections float) and
    int8 (every quantized projection but the Q6_K ones): logits within LOGIT_TOLERANCE of the float path, greedy
    tokens equal up to a step where the float path's own top two are a near-tie (margin under NEAR_TIE)."""
    from engine.events import TokenSampled
    from engine.protocol import Capture
    from engine.run.sampling import SamplingParams
    from engine.run.session import Session
    from tests.requires import gemma3

    with kernels.keeping_forms():
        lm = load(gemma3(), device="cpu", dtype="float32", use_cache=False, kernels="fast")
    layers = lm.model.layers
    assert all(x.attn.wo.quant.int4 is not None for x in layers)  # Q4_K everywhere
    assert sum(x.mlp.w_down.quant is not None and x.mlp.w_down.quant.int4 is not None for x in layers) == 9
    assert sum(x.mlp.w_down.quant is None for x in layers) == 9  # the Q6_K ones: float
    assert all(x.attn.wqkv.quant.int4 is None and x.attn.wqkv.quant.int8 is not None for x in layers)  # Q5_0/Q8_0
    assert all(x.mlp.w_gate_up.quant.int4 is None and x.mlp.w_gate_up.quant.int8 is not None for x in layers)
    raw, kind = token_table(gemma3())  # the tied head: its table's type gives it the int8 form only
    assert kind == Q.Q8_0 and lm.model.output is None
    assert lm.model.head_quant.int4 is None and lm.model.head_quant.int8 is not None
    assert_int8_form_is(lm.model.head_quant, ggufs(raw, kind, tuple(lm.model.lm_head.shape)), rows=4096)
    ids = lm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is").ids[:16]
    with kernels.forced("linear"):
        ref = decode_logits(lm, ids)
    scale = float(ref.abs().max())
    tuned = decode_logits(lm, ids)  # whatever this machine's tuner chose (the largest error either kernel gives)
    assert_close(tuned, ref, rtol=0, atol=max(LOGIT_TOLERANCE.values()) * scale)
    for name in kernels.QUANTIZED:
        with kernels.forced(name):
            assert_close(decode_logits(lm, ids), ref, rtol=0, atol=LOGIT_TOLERANCE[name] * scale)
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about memory bandwidth.",
               "How do I sort a list in Python?"]
    for prompt in prompts:
        with kernels.forced("linear"):
            want_ev = [e for e in Session(lm, threads=1).generate(
                prompt, SamplingParams.greedy_params(), 24, Capture(logits=True), ignore_eos=True)
                if isinstance(e, TokenSampled)]
        want = [e.token_id for e in want_ev]
        for name in kernels.QUANTIZED:
            with kernels.forced(name):
                got = list(Session(lm, threads=1).generate(prompt, SamplingParams.greedy_params(), 24,
                                                           ignore_eos=True))[-1].ids.tolist()
            parted = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
            if parted is not None:
                logits = np.asarray(want_ev[parted].logits, dtype=np.float64)
                margin = logits[want[parted]] - logits[got[parted]]
                assert margin < NEAR_TIE, (name, prompt, parted, margin)


def test_a_quantized_files_weight_cache_is_read_back(k_file):
    first = load(k_file, device="cpu", dtype="float32", kernels="fast")
    again = load(k_file, device="cpu", dtype="float32", kernels="fast")
    assert not first.info.from_cache and again.info.from_cache
    blocks = [m.quant for m in again.model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(blocks) == len([m for m in first.model.modules() if isinstance(m, Linear) and m.quant is not None])
