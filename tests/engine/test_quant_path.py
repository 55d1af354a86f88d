"""The quantized decode path (engine.model.quant; the int4 and int8 candidates of engine.model.kernels), held to
independent references: torch's own kernels multiplying the identity (what they really compute), the gguf
package's dequantization of the same Q4_0/Q4_1 blocks, and the float path's logits and greedy tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch.testing import assert_close

from engine.formats.requantize import requantize
from engine.loaders import gguf as gg
from engine.loaders import load
from engine.model import kernel_cache, kernels, quant
from engine.model.transformer import Linear
from tests.engine.test_bf16_decode import NEAR_TIE, TEST_PROMPTS, decode_logits

KINDS = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}
# Logits through a forced quantized path against the float path, as a share of the largest |logit|: bf16
# activations and scales (2^-9 relative each) in every product, plus for int8 the per-row requantization (each
# weight within half a step of max|w_row| / 127). Measured on the tiny random model: int4 ≤ 1.6 %, int8 ≤ 5.6 %.
LOGIT_TOLERANCE = {"int4": 0.03, "int8": 0.08}
IDS = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]


def kernel_weight(form: tuple[torch.Tensor, torch.Tensor], in_f: int, name: str) -> torch.Tensor:
    """The weight (out, in) a quantized kernel multiplies by, read off by multiplying the identity."""
    eye = torch.eye(in_f, dtype=form[1].dtype)
    if name == "int4":
        return torch._weight_int4pack_mm_for_cpu(eye, form[0], quant.GROUP, form[1]).float().T
    return torch._weight_int8pack_mm(eye, form[0], form[1]).float().T


def token_table(path) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The file's token_embd bytes and type (a tied model's LM head), off gguf's own reader."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    return np.array(t.data), t.tensor_type


def dequantized(raw: np.ndarray, kind: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, kind), np.float32).reshape(shape))


def assert_int8_form_is(forms: quant.QuantForms, ref: torch.Tensor, rows: int | None = None) -> None:
    """forms' int8 weight q·scale within half a step of `ref` (gguf's dequantization), the step no coarser than
    the row needs; and the kernel multiplying by q·scale (read off it, on the first `rows` rows; None: all), to its
    bf16 output rounding."""
    q, scale = forms.int8
    step = scale.float()[:, None]
    assert bool(((q.float() * step - ref).abs() <= quant.INT8_STEP_ERROR * step * (1 + 2 ** -7)).all())
    assert bool((step[:, 0] <= ref.abs().amax(1) / 127 * (1 + 2 ** -7)).all())
    n = rows or q.shape[0]
    got = kernel_weight((q[:n], scale[:n]), ref.shape[1], "int8")
    assert_close(got, q[:n].float() * step[:n], rtol=2 ** -8, atol=0)


def test_torchs_int4_kernel_computes_q_minus_8_times_scale_plus_zero():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (48, 96), generator=g, dtype=torch.int32)
    scale, zero = torch.rand(48, 3, generator=g) + 0.01, torch.randn(48, 3, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, quant.INT4_INNER_K_TILES)
    w = kernel_weight((packed, torch.stack([scale.t(), zero.t()], -1).contiguous()), 96, "int4")
    by_hand = (q.double() - 8) * scale.double().repeat_interleave(32, 1) + zero.double().repeat_interleave(32, 1)
    assert_close(w.double(), by_hand, rtol=1e-6, atol=1e-6)
    assert_close(quant.dequantize_int4(q, scale, zero).double(), by_hand, rtol=1e-6, atol=1e-6)


def _blocks(kind: str, out_f: int = 96, in_f: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """gguf's own quantization of a random matrix: blocks (out, in/32, bytes) and its dequantization (out, in)."""
    w = np.random.default_rng(seed).normal(0, 0.3, (out_f, in_f)).astype(np.float32)
    w[:, :32] += 0.5  # a block whose values are all positive: Q4_1's m ≠ −8·d
    raw = gguf.quants.quantize(w, KINDS[kind])  # (out, in/32 · bytes)
    ref = np.asarray(gguf.quants.dequantize(raw, KINDS[kind]), np.float32).reshape(out_f, in_f)
    return raw.reshape(out_f, in_f // 32, quant.BLOCK_BYTES[kind]), ref


@pytest.mark.parametrize("kind", KINDS)
def test_the_int4_form_of_a_files_blocks_is_ggufs_dequantization(kind):
    blocks, ref = _blocks(kind)
    ref = torch.from_numpy(ref)
    q, d, m = quant.split_q4_blocks(blocks, kind)
    scale, zero = quant.int4_scale_zero(d, m)
    # Q4_0: d·(q − 8) exactly; Q4_1: m + 8·d is rounded once more in float32 (one ulp of the block's magnitude)
    atol = 0.0 if kind == "q4_0" else 2 ** -22 * float(zero.abs().max())
    assert_close(quant.dequantize_int4(q, scale, zero), ref, rtol=0, atol=atol)
    exact = quant.int4_from_blocks(blocks, kind, torch.float32)  # float32 scales: the kernel's own product
    assert_close(kernel_weight(exact, 128, "int4"), ref, rtol=0, atol=atol + 2 ** -22 * float(ref.abs().max()))
    fast = quant.int4_from_blocks(blocks, kind)  # what the candidate runs: bfloat16 scales and output
    assert fast[1].dtype == torch.bfloat16
    assert_close(kernel_weight(fast, 128, "int4"), ref, rtol=0, atol=2 ** -7 * float(ref.abs().max()))


def test_int8_requantization_moves_each_weight_by_at_most_half_a_step():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 3, 64)[:, None]
    q, scale = quant.int8_from_float(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and int(q.abs().max()) <= 127
    s = scale.float()[:, None]
    assert bool(((w - q.float() * s).abs() <= quant.INT8_STEP_ERROR * s * (1 + 1e-6)).all())
    assert bool((s[:, 0] <= w.abs().amax(1) / 127 * (1 + 2 ** -7)).all())  # a step no coarser than needed
    assert_close(kernel_weight((q, scale), 96, "int8"), q.float() * s, rtol=2 ** -8, atol=0)


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1"])
def q4_file(request, tiny_dir, tmp_path_factory):
    """The tiny model written with every matrix as Q4_0 or Q4_1 blocks (by gguf's own quantizer)."""
    path = tmp_path_factory.mktemp("q4") / f"tiny-{request.param}.gguf"
    requantize(tiny_dir.gguf, path, request.param)
    return path


@pytest.fixture(scope="module")
def q4_lm(q4_file):
    with kernels.keeping_forms():  # every form, whatever this machine's tuner chose
        return load(q4_file, device="cpu", dtype="float32", use_cache=False, kernels="fast")


def test_the_loader_keeps_each_projections_blocks_and_they_are_its_weights(q4_file):
    reader = gg.open_reader(q4_file)
    sd = gg.read_weights(reader, gg.read_config(reader, "tiny"))
    kind = q4_file.stem.split("-")[1].lower()
    blocks = {n: t for n, t in sd.items() if n.endswith("." + kind)}
    assert sorted(blocks) == sorted(f"{n}.{kind}" for n in sd if n.endswith(".weight") and sd[n].dim() == 2
                                    and n != "tok_embeddings.weight")  # every projection, not the embedding
    for name, b in blocks.items():
        weight = sd[name.removesuffix("." + kind)]  # gguf's dequantization of the same tensor
        q, d, m = quant.split_q4_blocks(b, kind)
        assert_close(quant.dequantize_int4(q, *quant.int4_scale_zero(d, m)), weight, rtol=0,
                     atol=2 ** -22 * float(weight.abs().max() + 8 * d.abs().max()), msg=name)


def test_every_projection_gets_forms_that_multiply_by_its_weight(q4_lm):
    linears = {n: m for n, m in q4_lm.model.named_modules() if isinstance(m, Linear)}
    assert len(linears) == 4 * q4_lm.cfg.n_layers + 1
    for name, m in linears.items():
        assert m.quant is not None and m.quant.int8 is not None, name
        out_f, in_f = m.weight.shape
        assert (m.quant.int4 is not None) == (out_f % quant.INT4_ROWS == 0), name  # the 300-row head has none
        tol = 2 ** -7 * float(m.weight.abs().max())
        if m.quant.int4 is not None:  # fused wqkv and w_gate_up: the parts' blocks in the model's row order
            assert_close(kernel_weight(m.quant.int4, in_f, "int4"), m.weight, rtol=0, atol=tol, msg=name)
        step = m.quant.int8[1].float()[:, None]
        assert bool(((kernel_weight(m.quant.int8, in_f, "int8") - m.weight).abs()
                     <= quant.INT8_STEP_ERROR * step + tol).all()), name


def test_a_float_file_gets_no_forms(tiny_lm):
    assert all(m.quant is None for m in tiny_lm.model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("name", kernels.QUANTIZED)
def test_forced_quantized_decode_stays_near_the_float_path(q4_lm, name):
    with kernels.forced("linear"):
        ref = decode_logits(q4_lm, IDS)
    calls = []
    op = "_weight_int4pack_mm_for_cpu" if name == "int4" else "_weight_int8pack_mm"
    real = getattr(torch, op)
    with kernels.forced(name), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, op, lambda *a: calls.append(1) or real(*a))
        got = decode_logits(q4_lm, IDS)
    # every step (one-token rows, the first a one-token prefill) ran each projection with a form through the kernel
    per_step = sum(getattr(m.quant, name) is not None for m in q4_lm.model.modules()
                   if isinstance(m, Linear) and m.quant is not None)
    assert len(calls) == per_step * len(IDS)
    scale = float(ref.abs().max())
    assert_close(got, ref, rtol=0, atol=LOGIT_TOLERANCE[name] * scale)
    margin = ref.topk(2, dim=-1).values.diff(dim=-1).abs()[:, 0]  # float path's top-1 minus top-2
    clear = margin > 2 * LOGIT_TOLERANCE[name] * scale
    assert bool((got.argmax(-1) == ref.argmax(-1))[clear].all())  # greedy equal wherever not a near-tie


def test_the_tuner_measures_the_quantized_candidates_only_for_weights_with_forms(q4_file, tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_FORCED", [])
    monkeypatch.setattr(kernel_cache, "cache_path",  # each kind of measurement its own file, as the real path
                        lambda kind=kernel_cache.Entry: tmp_path / ("k.json" if kind is kernel_cache.Entry
                                                                    else kind.FILE))
    measured: dict[tuple, list[str]] = {}
    costs = {"linear": 3.0, "split": 4.0, "onednn": 5.0, "packed": 5.0, "int4": 1.0, "int8": 2.0}

    def time_once(products, name):
        measured.setdefault((*products[0][0].shape, products[0][3] is not None), []).append(name)
        return costs[name]

    with kernels.keeping_forms():
        q4_lm = load(q4_file, device="cpu", dtype="float32", use_cache=False, kernels="fast")  # its own: forms freed
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    groups = q4_lm.model.decode_products()
    assert all(q == kernel_cache.Q4 for *_, q in groups)  # every matrix of the file is Q4, the untied head too
    entries = kernels.tune(groups, counts=[1], time_once=time_once, remeasure=True)
    for e in entries:
        quantized = e.weights == kernel_cache.Q4
        assert quantized == any(q == kernel_cache.Q4 for (o, i, q) in groups if (o, i) == e.shape)
        int4 = quantized and e.shape[0] % quant.INT4_ROWS == 0
        assert ("int4" in e.seconds) == int4 and ("int8" in e.seconds) == quantized, e
        assert e.choice == ("int4" if int4 else "int8" if quantized else "linear")
        assert e.key.endswith("|q4") == quantized
    # the model reads those choices: int4 where chosen, int8 dropped there; decode runs int4
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    q4_lm.model.tune_kernels()
    wqkv = q4_lm.model.layers[0].attn.wqkv
    assert kernels.chosen(tuple(wqkv.weight.shape), torch.float32, 1, kernel_cache.Q4) == "int4"
    assert wqkv.quant.int4 is not None and wqkv.quant.int8 is None


@pytest.mark.slow
def test_real_model_forced_quantized_greedy_continuations_equal_float(real_lm):
    """SmolLM2's Q4_1 projections through int4 (its own blocks) and int8: greedy tokens as the float path's, up to
    a step where float's own top two are a near-tie (the test says which), and logits within the tolerance."""
    from engine.events import TokenSampled
    from engine.protocol import Capture
    from engine.run.sampling import SamplingParams
    from engine.run.session import Session
    from tests.requires import default_model

    with kernels.keeping_forms():
        lm = load(None, device="cpu", dtype="float32", kernels="fast")
    forms = [m.quant for m in lm.model.modules() if isinstance(m, Linear)]
    assert sum(f is not None and f.int4 is not None for f in forms) == len(forms) == 4 * lm.cfg.n_layers  # tied head
    raw, kind = token_table(default_model())  # the tied head: a Q8_0 table, so the int8 form only
    assert kind == gguf.GGMLQuantizationType.Q8_0 and lm.model.output is None
    assert lm.model.head_quant.int4 is None
    assert_int8_form_is(lm.model.head_quant, dequantized(raw, kind, tuple(lm.model.lm_head.shape)), rows=4096)
    V, d = lm.model.lm_head.shape
    with kernels.forced("int8"):  # the head is priced at its int8 form's bytes, not its float table's
        assert lm.model.decode_bytes_saved() == sum(4 * w.numel() - w.numel() - 2 * w.shape[0] for ps in
                                                    lm.model.decode_products().values() for w, *_ in ps)
    ids = lm.tokenizer.encode(TEST_PROMPTS[0]).ids[:16]
    with kernels.forced("linear"):
        ref = decode_logits(lm, ids)
    for name in kernels.QUANTIZED:
        with kernels.forced(name):
            assert_close(decode_logits(lm, ids), ref, rtol=0, atol=LOGIT_TOLERANCE[name] * float(ref.abs().max()))
    for name in kernels.QUANTIZED:
        for prompt in TEST_PROMPTS:
            with kernels.forced("linear"):
                want_ev = [e for e in Session(lm).generate(prompt, SamplingParams.greedy_params(), 24,
                                                           Capture(logits=True), chat=True, ignore_eos=True)
                           if isinstance(e, TokenSampled)]
            with kernels.forced(name):
                got = list(Session(lm).generate(prompt, SamplingParams.greedy_params(), 24, chat=True,
                                                ignore_eos=True))[-1].ids.tolist()
            want = [e.token_id for e in want_ev]
            parted = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
            if parted is not None:
                logits = np.asarray(want_ev[parted].logits, dtype=np.float64)
                margin = logits[want[parted]] - logits[got[parted]]
                assert margin < NEAR_TIE, (name, prompt, parted, margin)


def test_a_decode_step_reads_the_chosen_forms_bytes(q4_lm):
    """What the roofline should count: int4 0.5 byte per value + a bf16 scale and zero per 32; int8 1 byte per value
    + a bf16 scale per row; float32 4 bytes per value (by hand from the shapes, not from the tensors)."""
    linears = [m for m in q4_lm.model.modules() if isinstance(m, Linear)]
    float32 = sum(4 * m.weight.numel() for m in linears)
    int4 = sum(m.weight.numel() // 2 + 2 * 2 * m.weight.numel() // 32 if m.weight.shape[0] % 16 == 0
               else 4 * m.weight.numel() for m in linears)
    int8 = sum(m.weight.numel() + 2 * m.weight.shape[0] for m in linears)
    for name, want in (("linear", float32), ("int4", int4), ("int8", int8)):
        with kernels.forced(name):
            assert q4_lm.model.decode_weight_bytes_read() == want, name


def test_a_decode_steps_cost_counts_the_bytes_its_kernels_read(q4_lm):
    """The roofline's bytes: a generation's decode steps are priced at the int4 form's bytes when it runs."""
    from engine.costs import formulas as costs
    from engine.events import TokenSampled
    from engine.run.session import Capture, SamplingParams, Session

    linears = [m for m in q4_lm.model.modules() if isinstance(m, Linear)]
    float32 = sum(4 * m.weight.numel() for m in linears)
    int4 = sum(m.weight.numel() // 2 + 2 * 2 * m.weight.numel() // 32 if m.weight.shape[0] % 16 == 0
               else 4 * m.weight.numel() for m in linears)
    formula = costs.step_weight_bytes(q4_lm.cfg, "float32", rows=1)
    s = Session(q4_lm, threads=1)
    for name, want in (("linear", formula), ("int4", formula - float32 + int4)):
        with kernels.forced(name):
            steps = [e for e in s.generate([5, 6, 7], SamplingParams(temperature=0.0), 3, Capture(), ignore_eos=True)
                     if isinstance(e, TokenSampled)]
        assert [e.cost.weight_bytes for e in steps[1:]] == [want, want], name  # the two decode steps


def test_forms_the_tuner_did_not_choose_are_freed_and_a_later_measurement_is_not_cached(q4_file, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernel_cache, "cache_path",  # each kind of measurement its own file, as the real path
                        lambda kind=kernel_cache.Entry: tmp_path / ("k.json" if kind is kernel_cache.Entry
                                                                    else kind.FILE))
    lm = load(q4_file, device="cpu", dtype="float32", use_cache=False, kernels="fast")  # measures, frees the losers
    before = kernel_cache.read(tmp_path / "k.json")
    assert any(e.weights == kernel_cache.Q4 and "int4" in e.seconds for e in before.values())
    for m in lm.model.modules():
        if isinstance(m, Linear):
            for name in kernels.QUANTIZED:  # a form is kept only where some thread count chose it
                chose = any(e.shape == tuple(m.weight.shape) and e.choice == name and e.weights == kernel_cache.Q4
                            for e in before.values())
                assert (getattr(m.quant, name) is not None) == chose or (name == "int4" and m.weight.shape[0] == 300)
    lm.model.tune_kernels(remeasure=True)  # without the freed forms: used now, but the file keeps the full entries
    after = kernel_cache.read(tmp_path / "k.json")
    assert {k: e.seconds.keys() for k, e in after.items() if e.weights == kernel_cache.Q4} == {
        k: e.seconds.keys() for k, e in before.items() if e.weights == kernel_cache.Q4}


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3"])
def test_blocks_follow_their_weights_rows_in_other_layouts(family, tmp_path):
    """qwen3 and gemma3 files keep q/k rows in rotate-halves order (the loader reorders them, blocks too); phi3
    fuses q/k/v and gate/up in the file (the loader splits them, blocks too): each form still multiplies by its
    projection's own weight."""
    from tests.tiny_families import write_checkpoint

    src = write_checkpoint(tmp_path, family).gguf
    requantize(src, tmp_path / "q4.gguf", "Q4_0")
    with kernels.keeping_forms():
        lm = load(tmp_path / "q4.gguf", device="cpu", dtype="float32", use_cache=False, kernels="fast")
    linears = {n: m for n, m in lm.model.named_modules() if isinstance(m, Linear) and n != "output"}
    assert len(linears) == 4 * lm.cfg.n_layers
    for name, m in linears.items():
        assert m.quant is not None and m.quant.int4 is not None, name
        assert_close(kernel_weight(m.quant.int4, m.weight.shape[1], "int4"), m.weight, rtol=0,
                     atol=2 ** -7 * float(m.weight.abs().max()), msg=name)


def test_a_tied_heads_q4_0_table_gives_the_head_its_int4_form(tmp_path):
    """A tied model's Q4_0 token table (320 rows: a multiple of the int4 packing's 16) is its head's int4 form,
    as gguf dequantizes it; the lookup keeps the float table; forced through either form, every decode step's head
    multiplies by it and the logits stay within the tolerance."""
    from tests.tiny_families import write_checkpoint

    src = write_checkpoint(tmp_path, "gemma3", vocab_size=320).gguf
    requantize(src, tmp_path / "q4.gguf", "Q4_0")
    with kernels.keeping_forms():
        lm = load(tmp_path / "q4.gguf", device="cpu", dtype="float32", use_cache=False, kernels="fast")
    raw, kind = token_table(tmp_path / "q4.gguf")
    ref = dequantized(raw, kind, (320, lm.cfg.d_model))
    forms = lm.model.head_quant
    assert kind == gguf.GGMLQuantizationType.Q4_0 and lm.model.output is None and lm.cfg.vocab_size == 320
    assert forms.int4 is not None and forms.int8 is not None
    assert_close(kernel_weight(forms.int4, lm.cfg.d_model, "int4"), ref, rtol=0, atol=2 ** -7 * float(ref.abs().max()))
    assert_int8_form_is(forms, ref)
    assert_close(lm.model.tok_embeddings.weight, ref, rtol=0, atol=0)
    ids = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 33, 200]
    with kernels.forced("linear"):
        want = decode_logits(lm, ids)
    for name, op in (("int4", "_weight_int4pack_mm_for_cpu"), ("int8", "_weight_int8pack_mm")):
        heads: list[bool] = []
        form, real = getattr(forms, name)[0], getattr(torch, op)

        def counted(x, w, *a, form=form, real=real, seen=heads):
            seen.append(w is form)
            return real(x, w, *a)

        with kernels.forced(name), pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, op, counted)
            got = decode_logits(lm, ids)
        assert sum(heads) == len(ids), name  # the head ran its form at every step
        assert_close(got, want, rtol=0, atol=LOGIT_TOLERANCE[name] * float(want.abs().max()), msg=name)
        margin = want.topk(2, dim=-1).values.diff(dim=-1).abs()[:, 0]
        clear = margin > 2 * LOGIT_TOLERANCE[name] * float(want.abs().max())
        assert bool((got.argmax(-1) == want.argmax(-1))[clear].all()), name  # greedy equal but at near-ties


def _fake_clock_int8_fastest(products, name):
    return {"linear": 3.0, "split": 4.0, "onednn": 5.0, "packed": 5.0, "int4": 2.0, "int8": 1.0}[name]


def test_the_default_kernel_mode_computes_the_files_weights_exactly(q4_file, monkeypatch, tmp_path):
    """Exact (the default): no projection has a quantized form, so whatever this machine's tuner measured, every
    decode product multiplies the file's dequantized weights in float32; a decode step's logits equal the float
    path forced through F.linear to float32 rounding, and the model says so."""
    lm = load(q4_file, device="cpu", dtype="float32", use_cache=False)
    assert lm.info.kernels == "exact" and lm.model.kernel_mode == "exact"
    assert all(q is None for ps in lm.model.decode_products().values() for *_, q in ps)
    assert {w for *_, w in lm.model.decode_products()} == {kernel_cache.FLOAT}
    assert lm.model.decode_bytes_saved() == 0  # every product streams its float32 weight
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    entries = kernels.tune(lm.model.decode_products(), counts=[1], time_once=_fake_clock_int8_fastest,
                           remeasure=True, path=tmp_path / "k.json", chain_path=tmp_path / "chain.json")
    assert entries and all(e.weights == kernel_cache.FLOAT and not set(e.seconds) & set(kernels.QUANTIZED)
                           for e in entries)  # a quantized kernel is never a candidate, however fast
    got = decode_logits(lm, IDS)
    with kernels.forced("linear"):
        ref = decode_logits(lm, IDS)
    assert_close(got, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_the_file_mode_runs_the_files_own_int4_blocks_and_never_a_requantization(q4_file, monkeypatch, tmp_path):
    """File: each projection's int4 form is its own blocks (gguf's dequantization), there is no int8 form to run
    even where it would be fastest, and its measurements are keyed apart from the fast mode's."""
    with kernels.keeping_forms():
        lm = load(q4_file, device="cpu", dtype="float32", use_cache=False, kernels="file")
    assert lm.info.kernels == "file"
    forms = [q for ps in lm.model.decode_products().values() for *_, q in ps if q is not None]
    assert forms and all(q.int4 is not None and q.int8 is None and q.mode == "file" for q in forms)
    monkeypatch.setattr(kernels, "_CHOSEN", {})
    monkeypatch.setattr(kernels, "_MEASURED_AT", {})  # (other tests' measurements of the fast mode's forms)
    entries = kernels.tune(lm.model.decode_products(), counts=[1], time_once=_fake_clock_int8_fastest,
                           remeasure=True, path=tmp_path / "k.json", chain_path=tmp_path / "chain.json")
    quantized = [e for e in entries if e.weights != kernel_cache.FLOAT]
    assert quantized and all(e.weights == kernel_cache.Q4_FILE and "int8" not in e.seconds and e.choice == "int4"
                             and e.key.endswith("|q4-file") for e in quantized)
    wqkv = lm.model.layers[0].attn.wqkv.weight
    assert kernels.chosen(tuple(wqkv.shape), torch.float32, 1, kernel_cache.Q4_FILE) == "int4"
    assert kernels.chosen(tuple(wqkv.shape), torch.float32, 1, kernel_cache.Q4) is None  # fast's: not measured


def test_an_unknown_kernel_mode_is_refused_in_one_sentence(q4_file):
    from engine.formats.locate import ModelLoadError

    with pytest.raises(ModelLoadError, match="unknown kernel mode 'turbo'"):
        load(q4_file, device="cpu", dtype="float32", kernels="turbo")


def test_a_mode_that_finds_no_quantized_weight_says_exact(tiny_dir):
    """The mode recorded is the one that runs: a float file in fast mode builds no form, so it computes (and says)
    exact; so does the file mode on weights without an int4 form."""
    lm = load(tiny_dir.gguf, device="cpu", dtype="float32", use_cache=False, kernels="fast")
    assert all(q is None for ps in lm.model.decode_products().values() for *_, q in ps)
    assert lm.info.kernels == lm.model.kernel_mode == "exact"
