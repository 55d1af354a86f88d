"""`compare --corpus` (engine.why.compare.compare_corpus): what quantization costs over a text, held to statistics
computed here by hand.

The reference takes each side's logits from a forward pass of its own (tests/tiny_model.py's float64 forward of the
weights, or the engine's plain full forward of a window), computes every statistic in float64 with numpy, and
interpolates percentiles with llama.cpp's formula written out here; the accumulator is never asked.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine.loaders import load
from engine.run.session import Session
from engine.why import Cancelled, Unsupported
from engine.why.compare import compare_corpus, read_corpus
from tests import tiny_model
from tests.requires import default_model, import_required
from tests.tiny_model import random_hf_weights, reference_logits, write_gguf
from tests.why.conftest import engine_logits, run_cli

TEXT = ("the cat sat on the mat and the dog sat on the log; a bird sang in the tree while the sun went down. "
        "then the rain came and the cat ran in, the dog did too, and the bird flew off to a dry nest. ") * 3


def _session(path) -> Session:
    return Session(load(path, device="cpu", dtype="float32", use_cache=False), threads=1)


@pytest.fixture(scope="module")
def perturbed(tiny_dir, tmp_path_factory):
    """The tiny model's weights with noise added: another 'form' of it whose top token differs at some positions."""
    g = torch.Generator().manual_seed(1)
    w = {k: v + 0.08 * v.std() * torch.randn(v.shape, generator=g) for k, v in random_hf_weights(0).items()}
    path = write_gguf(tmp_path_factory.mktemp("perturbed") / "tiny-perturbed.gguf", w)
    return path, tiny_model.gguf_effective_weights(w)


# ---- the reference, by hand ----------------------------------------------------------------------------------------
def _percentile(values: np.ndarray, q: float) -> float:
    """llama.cpp's percentile (perplexity.cpp): linear between the two sorted values around q · (n − 1)."""
    v = sorted(float(x) for x in values)
    f = q / 100 * (len(v) - 1)
    i = int(math.floor(f))
    frac = f - i
    return (1 - frac) * v[i] + frac * v[min(i + 1, len(v) - 1)]


def _by_hand(windows: list[list[int]], logits_a: list[np.ndarray], logits_b: list[np.ndarray]) -> dict:
    """Every statistic of a corpus comparison from each window's full logits (T, V) of both sides."""
    nll_a, nll_b, kl, pa, pb, same = [], [], [], [], [], []
    for w, la, lb in zip(windows, logits_a, logits_b, strict=True):
        la, lb = np.asarray(la, dtype=np.float64), np.asarray(lb, dtype=np.float64)
        for j in range(len(w) // 2, len(w) - 1):  # the scored positions: the second half, but the last
            t = w[j + 1]
            lpa = la[j] - (la[j].max() + np.log(np.exp(la[j] - la[j].max()).sum()))
            lpb = lb[j] - (lb[j].max() + np.log(np.exp(lb[j] - lb[j].max()).sum()))
            p = np.exp(lpa)
            nll_a.append(-lpa[t])
            nll_b.append(-lpb[t])
            kl.append(float(np.sum(p * (lpa - lpb))))
            pa.append(math.exp(lpa[t]))
            pb.append(math.exp(lpb[t]))
            same.append(float(np.argmax(la[j]) == np.argmax(lb[j])))
    nll_a, nll_b, kl, dp = np.array(nll_a), np.array(nll_b), np.array(kl), np.array(pb) - np.array(pa)
    n = len(kl)
    out = {"positions": n, "ppl": [math.exp(nll_a.sum() / n), math.exp(nll_b.sum() / n)],
           "ln_ppl_ratio": float((nll_b - nll_a).sum() / n), "same_top": sum(same) / n}
    mean = kl.sum() / n
    out["kl_stats"] = {"mean": mean, "mean_se": math.sqrt(((kl - mean) ** 2).sum() / (n - 1) / n),
                       "median": _percentile(kl, 50), "p90": _percentile(kl, 90), "p95": _percentile(kl, 95),
                       "p99": _percentile(kl, 99), "p99_9": _percentile(kl, 99.9), "max": max(kl), "min": min(kl)}
    out["delta_p"] = {"mean": dp.sum() / n, "rms": math.sqrt((dp ** 2).sum() / n), "max": max(dp), "min": min(dp),
                      **{"p" + f"{q:g}".replace(".", "_"): _percentile(dp, q)
                         for q in (0.1, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)}}
    return out


def _windows(session, text: str, window: int, max_tokens: int) -> list[list[int]]:
    """The windows by hand: the text's tokens (no special tokens added), whole windows, BOS first where the model
    starts with one."""
    tok = session.tokenizer
    ids = list(tok.encode(text, parse_special=False, add_special=False).ids)
    n = min(len(ids), max_tokens) // window
    out = [ids[k * window:(k + 1) * window] for k in range(n)]
    if tok.add_bos:
        out = [[tok.bos_id, *w[1:]] for w in out]
    return out


def _assert_statistics(got: dict, want: dict, tol: float) -> None:
    assert got["positions"] == want["positions"]
    assert got["same_top"] == pytest.approx(want["same_top"], abs=1e-12)
    assert got["ppl"] == pytest.approx(want["ppl"], rel=tol)
    assert got["ln_ppl_ratio"] == pytest.approx(want["ln_ppl_ratio"], abs=tol)
    for group in ("kl_stats", "delta_p"):
        assert set(got[group]) == set(want[group]), group
        for key, value in want[group].items():
            assert got[group][key] == pytest.approx(value, abs=tol), f"{group} {key}"


# ---- the tiny model ----------------------------------------------------------------------------------------------
def test_a_perturbed_copy_over_a_corpus_equals_the_statistics_by_hand(tiny_dir, perturbed, monkeypatch):
    """Both sides' logits from tests/tiny_model.py's float64 forward of each weight set (no engine code), every
    statistic by hand; and no step of the comparison holds more than a decode product's rows of logits."""
    import engine.why.compare as cmp
    from engine.model.transformer import SPLIT_MAX_ROWS

    rows_seen = []
    scored = cmp._scored

    def counted(la, lb, targets):
        rows_seen.append(la.shape[0])
        return scored(la, lb, targets)

    monkeypatch.setattr(cmp, "_scored", counted)
    path, w_b = perturbed
    a, b = _session(tiny_dir.gguf), _session(path)
    window, cap = 32, 160
    out = compare_corpus(a, b, TEXT, window=window, max_tokens=cap, name="t.txt")
    windows = _windows(a, TEXT, window, cap)
    assert len(windows) == 5 and out["windows"] == 5 and out["tokens"] == 160 and out["window"] == window
    ref_a = [reference_logits(tiny_dir.hf_weights, w).numpy() for w in windows]
    ref_b = [reference_logits(w_b, w).numpy() for w in windows]
    want = _by_hand(windows, ref_a, ref_b)
    assert want["kl_stats"]["mean"] > 1e-3 and want["same_top"] < 1, "the perturbation should show"
    _assert_statistics(out, want, 2e-5)  # the engine runs float32, the reference float64
    assert max(rows_seen) <= SPLIT_MAX_ROWS and sum(rows_seen) == want["positions"]
    assert len(out["kl_quantiles"]) == len(out["delta_p_quantiles"]) == 101
    assert out["kl_quantiles"][0] == out["kl_stats"]["min"] and out["kl_quantiles"][-1] == out["kl_stats"]["max"]


def _lens_by_hand(w: dict, ids: list[int]) -> torch.Tensor:
    """(T, L + 1, V) float64 log-probabilities of the logit lens at every residual point of tests/tiny_model.py's
    forward: the stream entering each layer (and entering the final norm), through the final norm and the head."""
    seen = {}

    def keep(site, layer, value):
        if site == "resid":
            seen[layer] = value.clone()
        return value

    final = reference_logits(w, ids, edit=keep)
    assert len(seen) == tiny_model.CFG["n_layers"] + 1
    g, head = w["model.norm.weight"].double(), w["lm_head.weight"].double()
    x = torch.stack([seen[i] for i in range(len(seen))], dim=1)  # (T, L + 1, d)
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + tiny_model.CFG["norm_eps"]) * g
    lens = torch.log_softmax(normed @ head.T, -1)
    torch.testing.assert_close(lens[:, -1], torch.log_softmax(final, -1))  # the last point's lens is the output
    return lens


def test_the_lens_per_layer_over_a_corpus_equals_the_forward_pass_by_hand(tiny_dir, perturbed):
    """With `lens`, each residual point's KL between the two sides' lens distributions, mean over the last position
    of every step, as tests/tiny_model.py's float64 forward of each weight set gives it; the output's KL at those
    positions too."""
    from engine.model.transformer import SPLIT_MAX_ROWS

    path, w_b = perturbed
    a, b = _session(tiny_dir.gguf), _session(path)
    window, cap = 32, 96
    out = compare_corpus(a, b, TEXT, window=window, max_tokens=cap, lens=True)
    plain = compare_corpus(a, b, TEXT, window=window, max_tokens=cap)
    assert plain["lens"] is None
    assert out["kl_stats"] == plain["kl_stats"] and out["ppl"] == plain["ppl"]  # the capture changes no logit
    kl_sum, n = 0.0, 0
    for w in _windows(a, TEXT, window, cap):
        la, lb = _lens_by_hand(tiny_dir.hf_weights, w), _lens_by_hand(w_b, w)
        last = [min(j + SPLIT_MAX_ROWS, window - 1) - 1 for j in range(window // 2, window - 1, SPLIT_MAX_ROWS)]
        p = la[last].exp()
        kl_sum = kl_sum + (p * (la[last] - lb[last])).sum(-1).sum(0)  # (L + 1,)
        n += len(last)
    want = (kl_sum / n).tolist()
    lens = out["lens"]
    assert lens["positions"] == n == 3 * 4 and lens["every"] == SPLIT_MAX_ROWS
    assert lens["layers"] == ["embedding", "layer 1", "layer 2"]
    assert lens["kl"] == pytest.approx(want, rel=1e-4, abs=1e-9)
    assert lens["kl_output"] == pytest.approx(want[-1], rel=1e-4) and all(k > 1e-4 for k in want)


def test_a_model_against_itself_costs_nothing(tiny_dir):
    out = compare_corpus(_session(tiny_dir.gguf), _session(tiny_dir.gguf), TEXT, window=32, max_tokens=64)
    assert out["kl_stats"]["max"] == 0.0 and out["delta_p"]["rms"] == 0.0 and out["same_top"] == 1.0
    assert out["ppl"][0] == out["ppl"][1] and out["ln_ppl_ratio"] == 0.0


def test_progress_each_window_and_cancel_between_steps(tiny_dir, perturbed):
    """A counted progress: Cancel asked after the first window's report stops the run before the second window
    ends; asked before anything, it stops before the first forward pass."""
    a, b = _session(tiny_dir.gguf), _session(perturbed[0])
    reports = []
    with pytest.raises(Cancelled):
        compare_corpus(a, b, TEXT, window=32, max_tokens=160, progress=lambda f, m: reports.append((f, m)),
                       should_stop=lambda: len(reports) >= 1)
    assert reports == [(pytest.approx(1 / 5), "window 1 of 5: 15 positions compared")]
    asked = []

    def stop() -> bool:
        asked.append(True)
        return True

    with pytest.raises(Cancelled):
        compare_corpus(a, b, TEXT, window=32, max_tokens=160, should_stop=stop)
    assert len(asked) == 1
    reports.clear()
    out = compare_corpus(a, b, TEXT, window=32, max_tokens=160, progress=lambda f, m: reports.append((f, m)),
                         should_stop=lambda: False)
    assert [f for f, _ in reports] == pytest.approx([k / 5 for k in range(1, 6)]) and out["positions"] == 75


def test_the_engine_process_runs_a_corpus_comparison_and_cancels_it(tiny_dir, perturbed, tmp_path):
    from engine.protocol import CompareParams
    from engine.server import run_experiment

    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    params = CompareParams(other=str(perturbed[0]), prompt="", corpus=str(corpus), window=32, max_tokens=96)
    opened = []

    def open_model(path, backend, kernels):
        opened.append((path, backend, kernels))
        return _session(path)

    out = run_experiment(_session(tiny_dir.gguf), params, open_model=open_model)
    assert out["mode"] == "corpus" and out["corpus"] == "c.txt" and out["windows"] == 3
    assert opened == [(str(perturbed[0]), "auto", "exact")]
    with pytest.raises(Cancelled):
        run_experiment(_session(tiny_dir.gguf), params, open_model=open_model, should_stop=lambda: True)
    bad = tmp_path / "empty.txt"
    bad.write_bytes(b"")
    opened.clear()
    with pytest.raises(ValueError, match="empty.txt holds no text"):
        run_experiment(_session(tiny_dir.gguf), CompareParams(other="x", prompt="", corpus=str(bad)),
                       open_model=open_model)
    assert opened == []  # refused before the other model is loaded


def test_llamacpp_runs_the_other_side_of_the_same_file(tiny_dir):
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    lcpp = LlamaCppSession(tiny_dir.gguf, threads=1)
    try:
        out = compare_corpus(_session(tiny_dir.gguf), lcpp, TEXT, window=32, max_tokens=96, lens=True)
    finally:
        lcpp.close()
    assert out["labels"][1] == "tiny.gguf (ALL_F32) on llama.cpp, file kernels"
    assert 0 < out["kl_stats"]["max"] < 1e-4 and out["ppl"][1] == pytest.approx(out["ppl"][0], rel=1e-3)
    assert out["lens"]["positions"] == 12 and 0 < max(out["lens"]["kl"]) < 1e-4  # its float16 KV cache: not zero


# ---- hostile input: one sentence each, in bounded time and memory --------------------------------------------------
def test_bad_corpora_are_refused_in_one_sentence(tmp_path):
    empty, blank, binary, latin = (tmp_path / n for n in ("empty.txt", "blank.txt", "model.bin", "latin.txt"))
    empty.write_bytes(b"")
    blank.write_text(" \n\t\n")
    binary.write_bytes(bytes(range(256)) * 4)
    latin.write_bytes("café au lait".encode("latin-1"))
    for path, words in ((empty, "empty.txt holds no text to compare on (it is empty)"),
                        (blank, "blank.txt holds no text to compare on"),
                        (binary, "model.bin is not text: it holds a NUL byte at offset 0"),
                        (latin, "latin.txt is not UTF-8 text: byte 0xe9 at offset 3"),
                        (tmp_path / "absent.txt", "no corpus file at"),
                        (tmp_path, "is a folder")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            read_corpus(path)


def test_a_large_corpus_is_read_only_as_far_as_the_cap_needs(tmp_path):
    """Bounded: a 4 MiB file with a cap of 8 tokens reads 256 bytes; a cut inside a character is not an error."""
    big = tmp_path / "big.txt"
    big.write_bytes(("é" * 2**21).encode("utf-8"))
    text = read_corpus(big, max_tokens=8)
    assert text == "é" * 128
    big.write_bytes(b"a" + "é".encode() * 2**20)  # the 256th byte is the first half of an é
    assert read_corpus(big, max_tokens=8) == "a" + "é" * 127


def test_a_short_corpus_and_mismatched_models_are_refused(tiny_dir, tmp_path):
    a = _session(tiny_dir.gguf)
    with pytest.raises(ValueError, match="less than one window of 32"):
        compare_corpus(a, _session(tiny_dir.gguf), "the cat", window=32)
    with pytest.raises(ValueError, match="no whole window"):
        compare_corpus(a, _session(tiny_dir.gguf), TEXT, window=64, max_tokens=32)
    with pytest.raises(ValueError, match="two sessions"):
        compare_corpus(a, a, TEXT, window=32)
    import unittest.mock

    with unittest.mock.patch.dict(tiny_model.CFG, {"vocab_size": 320}):
        other = write_gguf(tmp_path / "tiny-320.gguf", random_hf_weights(0))
    with pytest.raises(Unsupported, match="vocab_size 300 vs 320"):
        compare_corpus(a, _session(other), TEXT, window=32)


def test_the_cli_compares_a_corpus_and_refuses_in_one_line(tiny_dir, perturbed, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    base = ["compare", "--model", str(tiny_dir.gguf), "--other", str(perturbed[0]), "--threads", "1"]
    rc, out, _ = run_cli(capsys, *base, "--corpus", str(corpus), "--window", "32", "--max-tokens", "64", "--json")
    r = json.loads(out)
    assert rc == 0 and r["mode"] == "corpus" and r["positions"] == 30
    rc, out, _ = run_cli(capsys, *base, "--corpus", str(corpus), "--window", "32", "--max-tokens", "64", "--lens")
    assert rc == 0 and "Mean KL" in out and "RMS Δp" in out and "Same top p" in out and "PPL(b)" in out
    assert "logit lens, KL(a ‖ b) in nats, mean over 8 positions (the last of each step of 4)" in out
    assert "  layer 2" in out and "  output" in out
    for argv, code, words in (([], 2, "give --prompt"), (["--prompt", "x", "--corpus", str(corpus)], 2, "one of"),
                              (["--corpus", str(tmp_path / "absent.txt")], 1, "no corpus file at"),
                              (["--corpus", str(tiny_dir.gguf)], 1, "is not text"),
                              (["--corpus", str(corpus), "--window", "512"], 1, "less than one window")):
        rc, _, err = run_cli(capsys, *base, *argv)
        assert rc == code and err.count("\n") == 1 and words in err, (argv, err)


# ---- the default model: its Q4_1 file against a Q8_0 file of it ---------------------------------------------------
def _stepped_logits(model, w: list[int]) -> np.ndarray:
    """A window's logits (T, V) from the engine's plain model forward (a KVCache of its own, no runtime, no
    session): the first half in one pass, then the scored positions in passes of a decode product's rows, so each
    product runs the kernel a decode step runs (the kernel mode's); rows that are not scored stay NaN."""
    from engine.model.kv_cache import KVCache
    from engine.model.transformer import SPLIT_MAX_ROWS

    first = len(w) // 2
    out = np.full((len(w), model.cfg.vocab_size), np.nan, dtype=np.float32)
    cache = KVCache(model.cfg, 1, len(w), model.lm_head.dtype)
    with torch.inference_mode():
        model(torch.tensor([w[:first]]), cache)
        for j in range(first, len(w) - 1, SPLIT_MAX_ROWS):
            piece = w[j:min(j + SPLIT_MAX_ROWS, len(w) - 1)]
            out[j:j + len(piece)] = model(torch.tensor([piece]), cache, all_logits=True)[0].float().numpy()
    return out


@pytest.mark.slow
def test_the_default_models_q4_1_against_its_q8_0_equals_the_statistics_by_hand(tmp_path_factory):
    """The issue's check: the default model's Q4_1 file against a Q8_0 file the engine writes of it, both on the
    torch engine in float32 (exact kernels). The reference takes each window's logits from the engine's plain model
    forward of each file, in the decode-sized steps a comparison scores (to 1e-6), and from one pass over the whole
    window (the same numbers but for the order of float32 sums: to 1e-4), and computes every statistic by hand."""
    from pydoc_data.topics import topics

    from engine.formats.requantize import requantize

    src = default_model()
    q8 = requantize(src, tmp_path_factory.mktemp("q8") / "smollm2-Q8_0.gguf", "Q8_0")["path"]
    a, b = (Session(load(p, device="cpu", dtype="float32"), threads=1) for p in (src, q8))
    text = "\n\n".join(topics[k] for k in sorted(topics))
    window, cap = 128, 512
    out = compare_corpus(a, b, text, window=window, max_tokens=cap)
    windows = _windows(a, text, window, cap)
    assert out["windows"] == len(windows) == 4 and out["tokens"] == cap
    want = _by_hand(windows, [_stepped_logits(a.lm.model, w) for w in windows],
                    [_stepped_logits(b.lm.model, w) for w in windows])
    _assert_statistics(out, want, 1e-6)
    assert 0 < want["kl_stats"]["mean"] < 0.5 and want["ppl"][0] < 100 and want["same_top"] < 1
    one_pass = _by_hand(windows, [engine_logits(a.lm.model, w).numpy() for w in windows],
                        [engine_logits(b.lm.model, w).numpy() for w in windows])
    assert abs(one_pass["same_top"] - want["same_top"]) <= 1 / want["positions"]  # a near tie may fall either way
    _assert_statistics(out, {**one_pass, "same_top": out["same_top"]}, 1e-4)
