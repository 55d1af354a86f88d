"""engine.why.ablate held to a forward pass by hand (tests/why/conftest.py) and to TransformerLens's hook_z on the
same weights (a tiny random Llama checkpoint, and the default model exported to a Hugging Face folder)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.testing import assert_close

from engine.__main__ import main
from engine.events import TokenSampled
from engine.model.seam import edited
from engine.protocol import SamplingParams
from engine.run.session import Session
from engine.why.ablate import Ablation, ablate, ablation, edits_for
from tests.why.conftest import engine_logits

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def session(tiny_lm):
    return Session(tiny_lm, threads=1)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def _z_means(by_hand, w, ids, heads):
    """Each head's output averaged over the prompt's positions, in the clean run (by hand)."""
    means = {}

    def keep(site, layer, v):
        for la, h in heads:
            if (site, layer) == ("z", la):
                means[la, h] = v[:, h].mean(dim=0)
        return v

    by_hand(w, ids, keep)
    return means


def test_mean_ablation_of_heads_equals_a_reimplementation_by_hand(tiny_dir, session, by_hand):
    heads = [(0, 1), (1, 2)]
    ids = session.tokenize(PROMPT).ids
    means = _z_means(by_hand, tiny_dir.hf_weights, ids, heads)

    def put_means(site, layer, v):
        v = v.clone()
        for (la, h), m in means.items():
            if (site, layer) == ("z", la):
                v[:, h] = m  # every position gets the clean run's mean
        return v

    clean = by_hand(tiny_dir.hf_weights, ids)[-1]
    ref = by_hand(tiny_dir.hf_weights, ids, put_means)[-1]
    doc = ablate(session, PROMPT, heads=heads, mean=True, tokens=(5, 251))
    ref_p = torch.softmax(ref, -1)
    assert doc["after"]["ids"] == torch.topk(ref_p, 5).indices.tolist()
    got_p = torch.tensor(doc["after"]["probs"], dtype=torch.float64)
    assert_close(got_p, ref_p[doc["after"]["ids"]], atol=1e-5, rtol=1e-4)
    assert doc["kl"] == pytest.approx(_kl(clean, ref), rel=1e-3, abs=1e-6)
    assert doc["kl"] > 1e-3  # the ablation does something the comparison can miss
    assert doc["top1_changed"] == (int(clean.argmax()) != int(ref.argmax()))
    assert doc["logit_diff"]["before"] == pytest.approx(float(clean[5] - clean[251]), abs=2e-4)
    assert doc["logit_diff"]["after"] == pytest.approx(float(ref[5] - ref[251]), abs=2e-4)
    # zero-ablation is a different result (the mean is not zero)
    zero = ablate(session, PROMPT, heads=heads)
    assert abs(zero["kl"] - doc["kl"]) > 1e-4


def test_zero_ablation_of_layers_at_positions_equals_the_forward_by_hand(tiny_dir, session, by_hand):
    ids = session.tokenize(PROMPT).ids

    def zero(site, layer, v):
        v = v.clone()
        if (site, layer) in (("attn", 1), ("mlp", 0)):
            v[[0, 4]] = 0
        return v

    clean = by_hand(tiny_dir.hf_weights, ids)[-1]
    ref = by_hand(tiny_dir.hf_weights, ids, zero)[-1]
    doc = ablate(session, PROMPT, attn_layers=[1], mlp_layers=[0], positions=[0, 4])
    assert doc["after"]["ids"] == torch.topk(ref, 5).indices.tolist()
    assert doc["kl"] == pytest.approx(_kl(clean, ref), rel=1e-3, abs=1e-6)
    assert doc["before"]["probs"] == pytest.approx(torch.softmax(clean, -1)[doc["before"]["ids"]].tolist(), abs=1e-5)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(heads=[(2, 0)]), "layers 0 to 1 and heads 0 to 3"), (dict(heads=[(0, 4)]), "heads 0 to 3"),
    (dict(mlp_layers=[2]), "MLP layer 2 .*layers 0 to 1"), (dict(attn_layers=[5]), "attention layer 5"),
    (dict(), "nothing to ablate"), (dict(heads=[(0, 0)], positions=[99]), "position 99 .*0 to 10"),
    (dict(heads=[(0, 0)], tokens=(1, 300)), "token 300 .*0 to 299"),
])
def test_bad_components_are_refused_in_one_line(session, kw, message):
    with pytest.raises(ValueError, match=message):
        ablate(session, PROMPT, **kw)


def _greedy(session, ids, n):
    run = session.generate(ids, SamplingParams(temperature=0.0), n, ignore_eos=True)
    return [e.token_id for e in run if isinstance(e, TokenSampled)]


def _greedy_by_hand(by_hand, w, ids, n, edit=None):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(by_hand(w, ids, edit)[-1].argmax()))
    return ids[-n:]


def test_generation_continues_from_the_ablated_model(tiny_dir, session, by_hand):
    """Inside `ablation` a generation runs the ablated model at every position, prompt and new tokens alike, and
    the cache of an earlier intact run is not reused (nor the ablated one after)."""
    w, ids, n = tiny_dir.hf_weights, session.tokenize(PROMPT).ids, 6

    def zero(site, layer, v):
        if (site, layer) == ("z", 1):
            v = v.clone()
            v[:, 0] = 0
            v[:, 2] = 0
        return v

    intact = _greedy_by_hand(by_hand, w, ids, n)
    ablated = _greedy_by_hand(by_hand, w, ids, n, zero)
    assert intact != ablated  # the check below can tell them apart
    assert _greedy(session, ids, n) == intact  # fills the session's cache with the intact model's K/V
    with ablation(session, Ablation(heads=((1, 0), (1, 2))), ids):
        assert _greedy(session, ids, n) == ablated
    assert _greedy(session, ids, n) == intact


# ---- TransformerLens -------------------------------------------------------------------------------------------
def _tl_bridge(hf_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to ask the hub for
    from tests.requires import import_required

    import_required("transformer_lens", "references", dist="transformer-lens")
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(hf_dir), device="cpu")
    return bridge.eval()


def _tl_ablated_logprobs(bridge, ids, heads, mean=False):
    """TransformerLens's next-token log-probs with `heads` zero- (or mean-) ablated through blocks.L.attn.hook_z."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        _, cache = bridge.run_with_cache(tokens, names_filter=lambda name: name.endswith("attn.hook_z"))
        by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            by_layer.setdefault(layer, []).append(head)

        def ablate_z(z, hook, layer):  # z (B, T, H, hd)
            z = z.clone()
            for h in by_layer[layer]:
                z[:, :, h] = cache[f"blocks.{layer}.attn.hook_z"][:, :, h].mean(dim=1, keepdim=True) if mean else 0
            return z

        hooks = [(f"blocks.{layer}.attn.hook_z", lambda z, hook, layer=layer: ablate_z(z, hook, layer))
                 for layer in by_layer]
        logits = bridge.run_with_hooks(tokens, fwd_hooks=hooks)
        clean = bridge(tokens)
    return torch.log_softmax(clean[0, -1].double(), -1), torch.log_softmax(logits[0, -1].double(), -1)


def _engine_logprobs(session, ids, spec):
    model = session.lm.model
    with edited(model, edits_for(session, spec, ids)):
        logits = engine_logits(model, ids)[-1]
    return torch.log_softmax(logits.double(), -1)


def test_head_ablation_matches_transformerlens_on_the_tiny_model(tiny_dir, session):
    bridge = _tl_bridge(tiny_dir.hf_dir)
    ids = session.tokenize(PROMPT).ids
    heads = [(0, 3), (1, 1), (1, 2)]
    for mean in (False, True):
        tl_clean, tl = _tl_ablated_logprobs(bridge, ids, heads, mean)
        assert (tl - tl_clean).abs().max() > 1e-2  # the heads matter
        got = _engine_logprobs(session, ids, Ablation(heads=tuple(heads), mean=mean))
        assert_close(got, tl, atol=1e-4, rtol=1e-4)
        doc = ablate(session, PROMPT, heads=heads, mean=mean)
        assert doc["kl"] == pytest.approx(float((tl_clean.exp() * (tl_clean - tl)).sum()), rel=1e-3, abs=1e-6)


@pytest.mark.slow
def test_head_ablation_matches_transformerlens_on_the_default_model(real_lm, tmp_path):
    from engine.cli.export_hf import export
    from tests.requires import default_model

    bridge = _tl_bridge(export(default_model(), tmp_path / "smollm2-hf"))  # the GGUF's float32 values exactly
    session = Session(real_lm, threads="auto")
    ids = session.tokenize("The Eiffel Tower is in the city of").ids
    heads = [(0, 4), (3, 1), (14, 5), (29, 8)]
    for mean in (False, True):
        tl_clean, tl = _tl_ablated_logprobs(bridge, ids, heads, mean)
        assert (tl - tl_clean).abs().max() > 1e-3
        got = _engine_logprobs(session, ids, Ablation(heads=tuple(heads), mean=mean))
        top = torch.topk(tl, 50).indices  # the candidates that carry the probability; the tail is float noise
        assert_close(got[top], tl[top], atol=2e-3, rtol=0)


# ---- the command line ------------------------------------------------------------------------------------------
def _cli(capsys, *args):
    code = main(["ablate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json(tiny_dir, capsys):
    code, out, _ = _cli(capsys, "--model", str(tiny_dir.gguf), "--backend", "torch", "--prompt", PROMPT,
                        "--head", "1:2", "--head", "0:1", "--layer-mlp", "0", "--mean", "--tokens", "5,251",
                        "--threads", "1", "--json")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {"prompt_tokens", "ablated", "before", "after", "kl", "top1_changed", "logit_diff", "kernels",
                        "dtype"}
    assert (doc["kernels"], doc["dtype"]) == ("exact", "float32")  # what computed it
    assert set(doc["before"]) == set(doc["after"]) == {"ids", "tokens", "probs"}
    assert doc["ablated"]["heads"] == [[1, 2], [0, 1]] and doc["ablated"]["mean"] is True
    assert doc["kl"] > 0 and len(doc["after"]["ids"]) == 5
    code, out, _ = _cli(capsys, "--model", str(tiny_dir.gguf), "--backend", "torch", "--prompt", PROMPT,
                        "--layer-attn", "1", "--threads", "1")
    assert code == 0 and "nats" in out and "attention of layer 1" in out


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--head", "3"], 2, "LAYER:HEAD"), (["--head", "a:1"], 2, "LAYER:HEAD"), (["--layer-mlp", "-1"], 2, "from 0"),
    (["--tokens", "1"], 2, "two token ids"), (["--head", "7:0"], 2, "layers 0 to 1 and heads 0 to 3"),
    (["--head", "0:9"], 2, "heads 0 to 3"), ([], 2, "nothing to ablate"), (["--layer-mlp", "3"], 2, "layers 0 to 1"),
    (["--head", "0:0", "--tokens", "1,999"], 2, "vocabulary"),
])
def test_cli_bad_input_is_one_line(tiny_dir, capsys, args, code, says):
    try:
        got, out, err = _cli(capsys, "--model", str(tiny_dir.gguf), "--backend", "torch", "--prompt", PROMPT,
                             "--threads", "1", *args)
    except SystemExit as e:  # the parser's refusal
        got, err = e.code, capsys.readouterr().err
        out = ""
    assert got == code
    assert out == "" and len(err.strip().splitlines()) == 1 and says in err


# ---- llama.cpp: its graph callback writes the ablation into the node --------------------------------------------
LLAMA_TOL = dict(atol=3e-2, rtol=0)  # llama.cpp's float16 K/V cache: its intact logits differ from ours by ~5e-3


@pytest.fixture(scope="module")
def llama_session(tiny_dir):
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    s = LlamaCppSession(tiny_dir.gguf, threads=1)
    yield s
    s.close()


@pytest.mark.parametrize("spec", [
    Ablation(heads=((1, 2),)), Ablation(heads=((0, 1), (1, 3)), mean=True),
    Ablation(attn_layers=(0,), mlp_layers=(1,), positions=(2, 10)), Ablation(mlp_layers=(0,), mean=True),
], ids=["zero-head", "mean-heads", "layers-at-positions", "mean-mlp"])
def test_llamacpp_ablation_changes_the_logits_as_the_engine_does(session, llama_session, spec):
    from engine.why.ablate import before_after

    ids = session.tokenize(PROMPT).ids
    before, after = before_after(llama_session, spec, ids)
    model = session.lm.model
    with edited(model, edits_for(session, spec, ids)):
        want = engine_logits(model, ids)[-1]
    clean = engine_logits(model, ids)[-1]
    assert (want - clean).abs().max() > 0.3  # the ablation moves the logits far more than the runtimes differ
    assert_close(before, clean, **LLAMA_TOL)
    assert_close(after, want, **LLAMA_TOL)


def test_llamacpp_ablate_result_and_cli(tiny_dir, session, llama_session, capsys):
    doc = ablate(llama_session, PROMPT, heads=[(1, 2)], tokens=(5, 251))
    ref = ablate(session, PROMPT, heads=[(1, 2)], tokens=(5, 251))
    assert doc["after"]["ids"][:2] == ref["after"]["ids"][:2]
    assert doc["kl"] == pytest.approx(ref["kl"], rel=0.1)
    code, out, _ = _cli(capsys, "--model", str(tiny_dir.gguf), "--backend", "llama.cpp", "--prompt", PROMPT,
                        "--head", "1:2", "--threads", "1", "--json")
    assert code == 0 and json.loads(out)["top1_changed"] == ref["top1_changed"]
    # continuing as a branch: llama.cpp's own context keeps the seam's edits on, step after step
    ids, spec = session.tokenize(PROMPT).ids, Ablation(heads=((1, 0), (1, 2)))
    with ablation(session, spec, ids):
        want = _greedy(session, ids, 6)
    with ablation(llama_session, spec, ids):
        got = _greedy(llama_session, ids, 6)
    assert got == want
    assert _greedy(llama_session, ids, 6) == _greedy(session, ids, 6) != want  # and off again after the block


def test_llamacpp_gemma3_post_norm_nodes(tmp_path):
    """Gemma 3's attention and MLP outputs are edited after their post norms (attn_post_norm-L, ffn_post_norm-L),
    as the engine's hooks edit them; Qwen3's graph names no attention-output node and says so in one line."""
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    import_required("transformers")
    from engine.backend import Unsupported
    from engine.backends.llamacpp import LlamaCppSession
    from engine.loaders import load
    from engine.why.ablate import before_after
    from tests.tiny_families import write_checkpoint

    ck = write_checkpoint(tmp_path, "gemma3")
    lm, s = load(ck.gguf, device="cpu", dtype="float32", use_cache=False), LlamaCppSession(ck.gguf, threads=1)
    lm_session = Session(lm, threads=1)
    ids = [5, 77, 140, 3, 250, 99, 12]
    try:
        for spec in (Ablation(attn_layers=(5,), mean=True), Ablation(mlp_layers=(2,), mean=True),
                     Ablation(heads=((6, 1),))):
            _, after = before_after(s, spec, ids)
            with edited(lm.model, edits_for(lm_session, spec, ids)):
                want = engine_logits(lm.model, ids)[-1]
            assert (want - engine_logits(lm.model, ids)[-1]).abs().max() > 0.1
            assert_close(after, want, **LLAMA_TOL)
    finally:
        s.close()
    ck = write_checkpoint(tmp_path, "qwen3")
    s = LlamaCppSession(ck.gguf, threads=1)
    try:
        with pytest.raises(Unsupported, match="forms no node attn_out-1"):
            before_after(s, Ablation(attn_layers=(1,)), ids)
    finally:
        s.close()


@pytest.mark.slow
def test_llamacpp_ablation_on_the_default_model_moves_what_the_engine_moves(real_lm):
    """On the Q4_1 file llama.cpp also quantizes activations, so its intact log-probs differ from the engine's by up to
    ~0.4 nats among the top 20: what is compared is the ablation's effect on the intact top 20 (after − before log-
    probs), which must agree in pattern (correlation) though not to float precision."""
    from tests.requires import default_model, import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession
    from engine.why.ablate import before_after

    session = Session(real_lm, threads="auto")
    llama = LlamaCppSession(default_model(), threads=2)
    ids = session.tokenize("The Eiffel Tower is in the city of").ids
    try:
        for spec in (Ablation(heads=((3, 1), (14, 5), (0, 4))), Ablation(mlp_layers=(0,))):
            lb, la = (torch.log_softmax(x.double(), -1) for x in before_after(llama, spec, ids))
            model = session.lm.model
            tb = torch.log_softmax(engine_logits(model, ids)[-1].double(), -1)
            with edited(model, edits_for(session, spec, ids)):
                ta = torch.log_softmax(engine_logits(model, ids)[-1].double(), -1)
            top = torch.topk(tb, 20).indices
            effect_torch, effect_llama = (ta - tb)[top], (la - lb)[top]
            assert effect_torch.abs().max() > 1.0
            assert torch.corrcoef(torch.stack([effect_torch, effect_llama]))[0, 1] > 0.85
    finally:
        llama.close()
