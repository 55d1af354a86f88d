"""engine.why.compare (what quantization changed) and engine.formats.requantize, held to references by hand.

The divergences against plain-Python loops on small arrays; a whole comparison against tests/tiny_model.py's
float64 forward pass of the two weight sets (its logits for the output KL and the flipped steps, its attention for
the Jensen–Shannon distance); a requantized file against that forward pass on weights rounded through the type by
hand. On the default model (slow): quantizing the float reference to fewer bits moves its computation further.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine.__main__ import main
from engine.formats.requantize import requantize
from engine.loaders import load
from engine.model.kv_cache import KVCache
from engine.run.session import Session
from engine.why import Unsupported
from engine.why.compare import compare, js_distance_bits, kl_nats
from tests import tiny_model
from tests.requires import default_model, import_required
from tests.tiny_model import gguf_effective_weights, random_hf_weights, reference_logits, write_gguf

PROMPT = "the cat sat on the mat"


def _session(path) -> Session:
    return Session(load(path, device="cpu", dtype="float32", use_cache=False), threads=1)


# ---- the two divergences against loops by hand --------------------------------------------------------------------
def _kl_by_hand(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def _js_by_hand(p: list[float], q: list[float]) -> float:
    m = [(pi + qi) / 2 for pi, qi in zip(p, q, strict=True)]
    jsd = (_kl_by_hand(p, m) + _kl_by_hand(q, m)) / 2
    return math.sqrt(jsd / math.log(2))


def test_kl_and_js_distance_match_loops_by_hand():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 7)) * 2
    other = logits + rng.standard_normal((3, 7))
    lp, lq = torch.log_softmax(torch.from_numpy(logits), -1), torch.log_softmax(torch.from_numpy(other), -1)
    got = kl_nats(lp, lq)
    for r in range(3):
        p, q = lp[r].exp().tolist(), lq[r].exp().tolist()
        assert got[r].item() == pytest.approx(_kl_by_hand(p, q), rel=1e-12)
        assert js_distance_bits(lp[r].exp(), lq[r].exp()).item() == pytest.approx(_js_by_hand(p, q), rel=1e-12)
    # attention rows with masked (zero) keys, rows that share no key, and a row against itself
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.75, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    got = js_distance_bits(p, q)
    assert got[0].item() == pytest.approx(_js_by_hand(p[0].tolist(), q[0].tolist()), rel=1e-12)
    assert got[1].item() == pytest.approx(1.0, rel=1e-12)  # disjoint: one bit, the distance's maximum
    assert got[2].item() == 0.0
    assert torch.isfinite(got).all()


# ---- whole comparisons on the tiny model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def perturbed(tiny_dir, tmp_path_factory):
    """The tiny model's weights with noise added: another 'form' of it whose top-1 differs at some steps."""
    g = torch.Generator().manual_seed(1)
    w = {k: v + 0.08 * v.std() * torch.randn(v.shape, generator=g) for k, v in random_hf_weights(0).items()}
    path = write_gguf(tmp_path_factory.mktemp("perturbed") / "tiny-perturbed.gguf", w)
    return path, gguf_effective_weights(w)


def test_a_model_against_itself_changes_nothing(tiny_dir):
    a, b = _session(tiny_dir.gguf), _session(tiny_dir.gguf)
    out = compare(a, b, PROMPT, steps=6)
    n_layers = tiny_model.CFG["n_layers"]
    assert out["layers"] == ["embedding", *(f"layer {i}" for i in range(1, n_layers + 1))]
    assert out["kl"] == [0.0] * (n_layers + 1) and out["kl_output"] == 0.0
    assert out["attention_js"] == [0.0] * n_layers
    assert out["top1_flips"] == [] and len(out["tokens"]) == 6
    assert out["bytes_per_token"][0] == out["bytes_per_token"][1] > 0
    assert all(t > 0 for t in out["tpot_s"])


@pytest.mark.parametrize("lens_steps", [None, 5], ids=["lens-at-once", "lens-5-steps-at-a-time"])
def test_a_perturbed_copy_diverges_where_the_forward_pass_by_hand_says(tiny_dir, perturbed, lens_steps, monkeypatch):
    import engine.why.compare as cmp

    path, w_b = perturbed
    w_a = tiny_dir.hf_weights
    steps = 12
    if lens_steps:  # the lens in chunks of steps (12 = 5 + 5 + 2), as a large vocabulary has it
        c = tiny_model.CFG
        monkeypatch.setattr(cmp, "LENS_BYTES", lens_steps * (c["n_layers"] + 2) * c["vocab_size"] * 8)
    out = compare(_session(tiny_dir.gguf), _session(path), PROMPT, steps=steps)
    ids, tokens = out["prompt_ids"], out["tokens"]
    seq = ids + tokens[:-1]  # what both sides were fed: step s predicts at position len(ids) - 1 + s
    att_a, att_b = {}, {}
    ref_a, ref_b = reference_logits(w_a, seq, attention=att_a), reference_logits(w_b, seq, attention=att_b)
    at = slice(len(ids) - 1, len(seq))
    assert ref_a[at].argmax(-1).tolist() == tokens  # a's greedy continuation, by hand
    flips = [s for s in range(steps) if int(ref_b[len(ids) - 1 + s].argmax()) != tokens[s]]
    assert flips, "the perturbation should change some greedy token (else this test proves nothing)"
    assert [f["step"] for f in out["top1_flips"]] == flips
    assert [f["b"] for f in out["top1_flips"]] == [int(ref_b[len(ids) - 1 + s].argmax()) for s in flips]
    kl = kl_nats(torch.log_softmax(ref_a[at], -1), torch.log_softmax(ref_b[at], -1))  # (steps,)
    got = torch.tensor(out["kl_by_step"], dtype=torch.float64)[:, -1]
    torch.testing.assert_close(got, kl, rtol=1e-3, atol=1e-7)
    assert out["kl_output"] == pytest.approx(float(kl.mean()), rel=1e-3)
    assert out["kl"][-1] == pytest.approx(out["kl_output"], rel=1e-4)  # the last layer's lens is the output
    assert all(k > 0 for k in out["kl"])
    # every row of the causal attention over what was fed: the prefill's prompt rows, then one row per decode step
    js = [float(js_distance_bits(att_a[i], att_b[i]).mean()) for i in range(tiny_model.CFG["n_layers"])]
    assert out["attention_js"] == pytest.approx(js, rel=1e-3)
    assert all(j > 0 for j in js)


def test_a_long_prefill_keeps_only_its_last_attention_rows(tiny_dir, perturbed, monkeypatch):
    """The attention held per layer is bounded: the prefill keeps its last rows that fit, and the distance is the
    mean over those rows and the decode steps' (by hand, from the full attention of the same sequence)."""
    import engine.why.compare as cmp

    path, w_b = perturbed
    a, b = _session(tiny_dir.gguf), _session(path)
    n = len(a.tokenize(PROMPT).ids)
    monkeypatch.setattr(cmp, "ATTENTION_BYTES", tiny_model.CFG["n_heads"] * n * 4 * 2)  # two prompt rows
    out = compare(a, b, PROMPT, steps=4)
    seq = out["prompt_ids"] + out["tokens"][:-1]
    att_a, att_b = {}, {}
    reference_logits(tiny_dir.hf_weights, seq, attention=att_a)
    reference_logits(w_b, seq, attention=att_b)
    kept = slice(n - 2, len(seq))  # the prefill's last two rows, then one row per decode step
    js = [float(js_distance_bits(att_a[i][:, kept], att_b[i][:, kept]).mean())
          for i in range(tiny_model.CFG["n_layers"])]
    assert out["attention_js"] == pytest.approx(js, rel=1e-3)


def test_the_llamacpp_runtime_of_the_same_file_differs_only_by_rounding(tiny_dir):
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    lcpp = LlamaCppSession(tiny_dir.gguf, threads=1)
    try:
        out = compare(_session(tiny_dir.gguf), lcpp, PROMPT, steps=6)
    finally:
        lcpp.close()
    assert out["labels"] == ["tiny.gguf (ALL_F32) on torch float32, exact kernels",
                             "tiny.gguf (ALL_F32) on llama.cpp, file kernels"]
    assert out["top1_flips"] == []
    assert 0 < max(out["kl"]) < 1e-4 and 0 < max(out["attention_js"]) < 1e-2  # float16 KV cache, not zero


def test_different_models_are_refused_in_one_line(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(tiny_model.CFG, "vocab_size", 320)
    other = write_gguf(tmp_path / "tiny-320.gguf", random_hf_weights(0))
    monkeypatch.undo()
    with pytest.raises(Unsupported, match="vocab_size 300 vs 320"):
        compare(_session(tiny_dir.gguf), _session(other), PROMPT, steps=2)
    same = _session(tiny_dir.gguf)
    with pytest.raises(ValueError, match="two sessions"):
        compare(same, same, PROMPT, steps=2)
    rc = main(["compare", "--model", str(tiny_dir.gguf), "--other", str(other), "--prompt", PROMPT, "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "vocab_size 300 vs 320" in err


def test_the_cli_prints_one_json_object(tiny_dir, perturbed, capsys):
    rc = main(["compare", "--model", str(tiny_dir.gguf), "--other", str(perturbed[0]), "--prompt", PROMPT,
               "--steps", "3", "--threads", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["steps"] == 3 and len(out["kl"]) == tiny_model.CFG["n_layers"] + 1
    with pytest.raises(SystemExit) as e:
        main(["compare", "--model", str(tiny_dir.gguf), "--prompt", PROMPT, "--steps", "0"])
    assert e.value.code == 2
    capsys.readouterr()
    context = tiny_model.CFG["context_length"]
    assert main(["compare", "--model", str(tiny_dir.gguf), "--prompt", PROMPT, "--steps", str(context)]) == 2
    assert "past the context" in capsys.readouterr().err


# ---- requantized files -------------------------------------------------------------------------------------------
def _rounded(weights: dict[str, torch.Tensor], qtype: str) -> dict[str, torch.Tensor]:
    """The HF weights with every matrix rounded through `qtype` by hand (row-wise blocks, as the file stores them)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    out = {}
    for k, v in weights.items():
        a = v.numpy().astype(np.float32)
        out[k] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, t), t)) if a.ndim == 2 else v
    return out


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_a_requantized_file_holds_the_weights_rounded_through_its_type(tiny_dir, tmp_path, qtype):
    import gguf

    out = requantize(tiny_dir.gguf, tmp_path / f"tiny-{qtype}.gguf", qtype)
    r = gguf.GGUFReader(out["path"])
    assert {t.tensor_type.name for t in r.tensors if len(t.shape) == 2} == {qtype}
    assert {t.tensor_type.name for t in r.tensors if len(t.shape) == 1} == {"F32"}
    assert r.get_field("general.file_type").contents() == gguf.LlamaFileType[f"MOSTLY_{qtype}"]
    assert not (tmp_path / f"tiny-{qtype}.gguf.partial").exists()
    s = _session(out["path"])
    ids = s.tokenize(PROMPT).ids
    cache = KVCache(s.cfg, 1, len(ids), torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        got = s.lm.model(torch.tensor([ids]), cache, None, all_logits=True)[0]  # (T, V)
    want = reference_logits(_rounded(tiny_dir.hf_weights, qtype), ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want, reference_logits(tiny_dir.hf_weights, ids), rtol=1e-4, atol=1e-4)


def test_requantize_refuses_in_one_sentence(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="cannot write tensor type 'Q4_K'"):
        requantize(tiny_dir.gguf, tmp_path / "x.gguf", "Q4_K")
    with pytest.raises(ValueError, match="is the file being read"):
        requantize(tiny_dir.gguf, tiny_dir.gguf, "Q8_0")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="cannot read junk.gguf as GGUF"):
        requantize(junk, tmp_path / "y.gguf", "Q8_0")
    assert not (tmp_path / "y.gguf").exists() and not (tmp_path / "y.gguf.partial").exists()


def test_the_requantize_command_writes_a_file_and_refuses_in_one_line(tiny_dir, tmp_path):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "engine.formats.requantize", *args], capture_output=True,
                              text=True, timeout=120)

    ok = run(str(tiny_dir.gguf), str(tmp_path / "q8.gguf"), "--type", "Q8_0")
    assert ok.returncode == 0 and "Q8_0" in ok.stdout and (tmp_path / "q8.gguf").stat().st_size > 0
    bad = run(str(tiny_dir.gguf), str(tmp_path / "x.gguf"), "--type", "Q3_K")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    missing = run(str(tmp_path / "absent.gguf"), str(tmp_path / "x.gguf"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1


# ---- the default model (slow) ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fewer_bits_move_the_default_models_computation_further(tmp_path_factory):
    """The float reference (the default model's weights in float32, torch) against its Q8_0 and its Q4_0 file on
    llama.cpp: 8 bits per weight stay closer to it than 4, at every layer's lens and at the output."""
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    src = default_model()
    folder = tmp_path_factory.mktemp("requantized")
    reference = Session(load(src, device="cpu", dtype="float32"), threads=1)
    kl = {}
    for qtype in ("Q8_0", "Q4_0"):
        lcpp = LlamaCppSession(requantize(src, folder / f"smollm2-{qtype}.gguf", qtype)["path"], threads=1)
        try:
            kl[qtype] = compare(reference, lcpp, "The capital of France is", steps=8)
        finally:
            lcpp.close()
    q8, q4 = kl["Q8_0"], kl["Q4_0"]
    assert q8["kl_output"] < q4["kl_output"]
    assert sum(q8["kl"][1:]) < sum(q4["kl"][1:])
    assert np.mean(q8["attention_js"]) < np.mean(q4["attention_js"])
    assert q8["bytes_per_token"][1] > q4["bytes_per_token"][1]
