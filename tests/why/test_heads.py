"""Head roles (engine.why.heads) held to TransformerLens's head_detector, run by TransformerLens on the same weights:
the tiny random Llama checkpoint, and SmolLM2 exported to a Hugging Face folder (slow)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from engine.run.session import Session
from engine.why.heads import SCORES, ablation_loss, confirm_induction, head_roles, random_repeated, top_heads
from tests.requires import import_required, missing
from tests.why.conftest import run_cli
from tests.why.tl_reference import boot, export_default

TL_NAMES = {"previous_token": "previous_token_head", "duplicate_token": "duplicate_token_head",
            "induction": "induction_head"}
TOL = 1e-5  # scores are means of float32 attention weights; two float32 forwards differ by ~1e-7 here


def transformer_lens_scores(bridge, tokens: list[int]) -> dict[str, np.ndarray]:
    """TransformerLens's detect_head on its own attention for `tokens` (all defaults), and the sink score as the same
    formula with a first-column detection pattern."""
    hd = import_required("transformer_lens.head_detector", "references", dist="transformer-lens")
    ids = torch.tensor([tokens])
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids, remove_batch_dim=True)

    class SameTokens:  # detect_head tokenizes a text; the random ids are given to it as they are
        cfg = bridge.cfg

        def to_tokens(self, _seq):
            return ids

    out = {name: hd.detect_head(SameTokens(), "", tl, cache=cache).numpy() for name, tl in TL_NAMES.items()}
    T = len(tokens)
    sink = torch.zeros(T, T)
    sink[:, 0] = 1
    out["sink"] = hd.detect_head(SameTokens(), "", sink, cache=cache).numpy()
    return out


@pytest.fixture(scope="module")
def tiny_bridge(tiny_dir):
    return boot(tiny_dir.hf_dir)


@pytest.fixture(scope="module")
def tiny_session(tiny_lm):
    return Session(tiny_lm)


def test_scores_equal_transformer_lens_on_the_tiny_model(tiny_session, tiny_bridge):
    got = head_roles(tiny_session, repeat=10, seed=3)
    ref = transformer_lens_scores(tiny_bridge, got["tokens"])
    for name in SCORES:
        a = np.asarray(got["scores"][name])
        assert a.shape == (2, 4)
        np.testing.assert_allclose(a, ref[name], atol=TOL, rtol=0, err_msg=name)
        assert np.ptp(a) > 1e-3  # heads differ, so a wrong pattern or normalisation shows


def test_the_sequence_is_distinct_non_special_ids_repeated_once(tiny_lm):
    tok = tiny_lm.tokenizer
    ids = random_repeated(tok, tiny_lm.cfg.vocab_size, 40, seed=7)
    assert len(ids) == 80 and ids[:40] == ids[40:] and len(set(ids)) == 40
    assert not any(tok.is_special(i) for i in ids)
    assert ids == random_repeated(tok, tiny_lm.cfg.vocab_size, 40, seed=7) != random_repeated(
        tok, tiny_lm.cfg.vocab_size, 40, seed=8)
    with_bos = copy.copy(tok)
    with_bos.add_bos = True
    ids = random_repeated(with_bos, tiny_lm.cfg.vocab_size, 5, seed=7)
    assert ids[0] == tok.bos_id and ids[1:6] == ids[6:] and len(ids) == 11


def test_a_perfect_previous_token_head_scores_t_minus_1_over_t():
    from engine.why.heads import pattern_scores

    T = 8
    a = np.zeros((1, 2, T, T))
    a[0, 0, 0, 0] = 1
    a[0, 0, np.arange(1, T), np.arange(T - 1)] = 1  # head 0: every row on t − 1 (row 0 can only see itself)
    a[0, 1, :, 0] = 1  # head 1: a sink
    s = pattern_scores(a, [5, 6, 7, 8, 5, 6, 7, 8])
    assert s["previous_token"][0].tolist() == pytest.approx([(T - 1) / T, 1 / T])
    assert s["sink"][0].tolist() == pytest.approx([2 / T, 1.0])  # rows 0 and 1 read key 0
    assert s["induction"][0, 0] == pytest.approx(0)  # t − 1 is never the token after an earlier copy here


def test_ablation_loss_equals_transformer_lens_zeroing_hook_z(tiny_session, tiny_bridge):
    """Zeroing heads' z and the second copy's loss, against TransformerLens's forward with hook_z zeroed."""
    tokens = random_repeated(tiny_session.tokenizer, tiny_session.cfg.vocab_size, 12, seed=1)
    heads = [(0, 1), (1, 3)]

    def zero(layer: int):
        def hook(z, hook):  # z (B, T, H, hd); the bridge names this point blocks.L.attn.o.hook_in
            z = z.clone()
            z[:, :, [h for la, h in heads if la == layer]] = 0
            return z
        return hook

    hooks = [(f"blocks.{layer}.attn.hook_z", zero(layer)) for layer in {layer for layer, _ in heads}]
    with torch.no_grad():
        logits = tiny_bridge.run_with_hooks(torch.tensor([tokens]), fwd_hooks=hooks)[0]  # (T, V)
        plain = tiny_bridge(torch.tensor([tokens]))[0]
    targets = torch.tensor(tokens[-11:])
    ref = float(torch.nn.functional.cross_entropy(logits[-12:-1], targets))
    assert abs(ref - float(torch.nn.functional.cross_entropy(plain[-12:-1], targets))) > 1e-3
    assert ablation_loss(tiny_session, tokens, 12, heads) == pytest.approx(ref, abs=1e-4)


def test_cli_json(tiny_dir, capsys):
    code, out, err = run_cli(capsys, "heads", "--model", str(tiny_dir.gguf), "--backend", "torch", "--repeat", "6",
                          "--seed", "2", "--threads", "1", "--json", "--ablate-top", "2")
    assert code == 0, err
    d = json.loads(out)
    assert {"tokens", "scores", "definitions", "repeat", "seed", "ablation"} <= d.keys()
    assert d["repeat"] == 6 and d["seed"] == 2 and len(d["tokens"]) == 12
    assert all(np.asarray(d["scores"][k]).shape == (2, 4) for k in SCORES) and d["definitions"].keys() == set(SCORES)
    assert [(h["layer"], h["head"]) for h in d["ablation"]["heads"]] == [
        (la, h) for la, h, _ in top_heads(d["scores"]["induction"], 2)]


@pytest.mark.parametrize("argv, needle", [
    (["--repeat", "0"], "--repeat: takes an integer from 1 to 256"),
    (["--repeat", "257"], "--repeat: takes an integer from 1 to 256"),
    (["--seed", "-1"], "--seed: takes an integer"),
    (["--url", "http://127.0.0.1:9"], "drop --url"),
    (["--ablate-top", "9"], "more than this model's 8 heads"),
])
def test_cli_refuses_bad_input_in_one_line(tiny_dir, capsys, argv, needle):
    code, _, err = run_cli(capsys, "heads", "--model", str(tiny_dir.gguf), "--backend", "torch", *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_llama_cpp_scores_equal_the_torch_engine(tiny_dir, tiny_session):
    """The llama.cpp runtime's captured attention gives the same scores (its graph callback, not the torch Reads)."""
    try:
        from engine.backends.llamacpp import LlamaCppSession
    except ImportError:
        missing("llamacpp", "llama_cpp does not import")
    from engine.backends import llamacpp_available

    if not llamacpp_available():
        missing("llamacpp", "llama-cpp-python is not installed")
    s = LlamaCppSession(tiny_dir.gguf, threads=1)
    try:
        got = head_roles(s, repeat=10, seed=3)
    finally:
        s.close()
    ref = head_roles(tiny_session, repeat=10, seed=3)
    assert got["tokens"] == ref["tokens"]
    for name in SCORES:  # llama.cpp keeps K and V in float16: scores move by ~1e-4
        np.testing.assert_allclose(got["scores"][name], ref["scores"][name], atol=1e-3, rtol=0, err_msg=name)


# ---- the default model ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_bridge(tmp_path_factory):
    return boot(export_default(tmp_path_factory.mktemp("smollm2") / "hf"))


@pytest.mark.slow
def test_scores_equal_transformer_lens_on_smollm2(real_lm, default_bridge):
    s = Session(real_lm)
    got = head_roles(s, repeat=24, seed=0)
    ref = transformer_lens_scores(default_bridge, got["tokens"])
    for name in SCORES:
        np.testing.assert_allclose(got["scores"][name], ref[name], atol=TOL, rtol=0, err_msg=name)
    assert max(v for _, _, v in top_heads(got["scores"]["induction"], 1)) > 0.3  # SmolLM2 has induction heads
    ab = confirm_induction(s, got, 3)
    rise, control = ab["loss_ablated"] - ab["loss"], ab["loss_control"] - ab["loss"]
    assert rise > 1.0 and rise > 4 * control  # the 3 induction heads carry the copy; 3 other heads hardly
