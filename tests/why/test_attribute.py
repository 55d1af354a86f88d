"""Token attribution (engine.why.attribute) held to Captum run on Hugging Face transformers' model of the same weights.

Captum's forward here is an independent path: transformers' LlamaForCausalLM reads the weights from a Hugging Face
folder and is fed `inputs_embeds`; nothing of engine/ runs in it. Same input, same baseline (the end-of-text
token's embedding at every position), same rule (Gauss–Legendre, the same step count).
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.why import Cancelled, Unsupported
from engine.why.attribute import attribute
from tests.requires import import_required

PROMPT = "the cat sat on the mat and then"


@pytest.fixture(scope="module")
def tiny_session(tiny_lm):
    from engine.run.session import Session

    return Session(tiny_lm)


def hf_model(folder):
    transformers = import_required("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()


def log_prob_of(hf, target: int):
    """f(embeds) = log p(target | embeds) of the last position, on the HF model: Captum's forward function."""

    def f(embeds: torch.Tensor) -> torch.Tensor:
        logits = hf(inputs_embeds=embeds).logits[:, -1].float()  # (B, V)
        return torch.log_softmax(logits, dim=-1)[:, target]

    return f


def captum_scores(hf, ids: list[int], baseline_id: int, target: int, method: str, steps: int = 32,
                  special: list[bool] | None = None) -> torch.Tensor:
    """Captum's attribution per token (summed over the embedding dimension), (T,); `special` tokens stay as they are
    in the baseline and are not occluded (score 0)."""
    attr = import_required("captum", "references").attr
    special = special or [False] * len(ids)
    table = hf.get_input_embeddings().weight.detach()
    x = table[torch.tensor([ids])]  # (1, T, d)
    x0 = table[torch.tensor([[i if k else baseline_id for i, k in zip(ids, special, strict=True)]])]  # (1, T, d)
    f = log_prob_of(hf, target)
    if method == "ig":
        a = attr.IntegratedGradients(f).attribute(x, baselines=x0, n_steps=steps, method="gausslegendre",
                                                  internal_batch_size=steps)
    elif method == "grad-input":
        a = attr.InputXGradient(f).attribute(x.clone().requires_grad_(True))
    else:  # each token's row replaced by the baseline's: the whole attribution of that window is the drop
        a = attr.Occlusion(f).attribute(x, sliding_window_shapes=(1, x.shape[-1]), strides=(1, x.shape[-1]),
                                        baselines=x0)
        return a[0, :, 0].detach()  # a special token's window changes nothing: 0
    return a[0].sum(dim=-1).detach()


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
@pytest.mark.parametrize("method", ["ig", "grad-input", "occlusion"])
def test_tiny_model_matches_captum_on_transformers(tiny_session, tiny_dir, method, chat):
    hf = hf_model(tiny_dir.hf_dir)
    got = attribute(tiny_session, PROMPT, method=method, steps=32, chat=chat)
    ids, special = got["tokens"]["ids"], got["tokens"]["special"]
    assert ids == tiny_session.tokenize(PROMPT, chat=chat).ids and any(special) == chat
    assert len(ids) >= 5 and got["tokens"]["pieces"][0]
    with torch.no_grad():
        greedy = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
    assert got["target"]["id"] == greedy and got["target"]["chosen"] == "greedy"
    eot = tiny_session.tokenizer.eos_ids[0]  # the baseline and occluder: the first end-of-text token
    assert method == "grad-input" or got["baseline"]["id"] == eot
    want = captum_scores(hf, ids, eot, greedy, method, special=None if method == "grad-input" else special)
    if chat and method != "grad-input":  # the template's markers are kept, never scored
        assert all(got["scores"][i] == 0.0 for i, k in enumerate(special) if k)
    torch.testing.assert_close(torch.tensor(got["scores"]), want, rtol=1e-4, atol=1e-4)
    assert want.abs().max() > 1e-2  # a comparison of scores that are all ~0 would prove nothing


def test_ig_completeness_is_reported_against_the_model(tiny_session, tiny_dir):
    """Σ scores ≈ log p(x) − log p(x₀), both sides computed here on transformers; the gap shrinks with steps."""
    hf = hf_model(tiny_dir.hf_dir)
    coarse = attribute(tiny_session, PROMPT, method="ig", steps=4)
    fine = attribute(tiny_session, PROMPT, method="ig", steps=256)
    ids, target = fine["tokens"]["ids"], fine["target"]["id"]
    f = log_prob_of(hf, target)
    table = hf.get_input_embeddings().weight.detach()
    with torch.no_grad():
        lp_x = float(f(table[torch.tensor([ids])]))
        lp_0 = float(f(table[torch.tensor([[tiny_session.tokenizer.eos_ids[0]] * len(ids)])]))
    c = fine["completeness"]
    assert c["logprob_input"] == pytest.approx(lp_x, abs=1e-4)
    assert c["logprob_baseline"] == pytest.approx(lp_0, abs=1e-4)
    assert c["sum_of_scores"] == pytest.approx(sum(fine["scores"]), abs=1e-4)
    assert abs(c["gap"]) < 0.01 * max(1.0, abs(lp_x - lp_0))
    assert abs(coarse["completeness"]["gap"]) > abs(c["gap"])
    assert fine["cost"]["forward_passes"] == fine["cost"]["backward_passes"]
    assert fine["cost"]["rows"] == 256 + 2 and fine["cost"]["seconds"] > 0


def test_a_given_target_is_explained_instead_of_the_greedy_one(tiny_session, tiny_dir):
    hf = hf_model(tiny_dir.hf_dir)
    got = attribute(tiny_session, PROMPT, method="grad-input", target=42)
    assert got["target"] == {**got["target"], "id": 42, "chosen": "given"}
    want = captum_scores(hf, got["tokens"]["ids"], 0, 42, "grad-input")  # (no baseline)
    torch.testing.assert_close(torch.tensor(got["scores"]), want, rtol=1e-4, atol=1e-4)


def test_progress_and_stop_between_passes(tiny_session):
    seen = []
    attribute(tiny_session, PROMPT, method="ig", steps=40, progress=lambda f, m: seen.append(f))
    assert seen and seen[-1] == 1.0 and seen == sorted(seen)
    calls = []

    def stop_after_one() -> bool:
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(Cancelled):
        attribute(tiny_session, PROMPT, method="occlusion", should_stop=stop_after_one)
    assert len(calls) == 2


@pytest.mark.parametrize("kwargs, words", [
    ({"method": "shap"}, "unknown attribution method"),
    ({"method": "ig", "steps": 0}, "1 to"),
    ({"method": "ig", "steps": -1}, "1 to"),
    ({"method": "occlusion", "target": 10**6}, "outside this model's vocabulary"),
])
def test_bad_arguments_are_one_sentence(tiny_session, kwargs, words):
    with pytest.raises(ValueError, match=words):
        attribute(tiny_session, PROMPT, **kwargs)


def test_empty_prompt_is_refused(tiny_session):
    with pytest.raises(ValueError, match="empty"):
        attribute(tiny_session, "", method="occlusion")
    with pytest.raises(ValueError, match="only special tokens"):
        attribute(tiny_session, "<|im_start|><|im_end|>", method="ig")


@pytest.mark.parametrize("argv, words", [
    (["--prompt", "", "--method", "ig"], "prompt is empty"),
    (["--prompt", "hi", "--method", "lime"], "invalid choice"),
    (["--prompt", "hi", "--steps", "0"], "takes an integer from 1"),
    (["--prompt", "hi", "--target-id", "-3"], "takes an integer from 0"),
])
def test_cli_bad_input_is_one_line_exit_2(capsys, argv, words):
    from engine.__main__ import main

    try:
        code = main(["attribute", "--model", "/nonexistent.gguf", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and "\n" not in err


def test_cli_json_on_the_tiny_model(capsys, tiny_dir):
    from engine.__main__ import main

    assert main(["attribute", "--model", str(tiny_dir.gguf), "--backend", "torch", "--prompt", PROMPT,
                 "--method", "occlusion", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "occlusion" and len(out["scores"]) == len(out["tokens"]["ids"])
    assert out["cost"]["forward_passes"] == len(out["scores"]) + 1
    assert main(["attribute", "--model", str(tiny_dir.gguf), "--prompt", PROMPT, "--target-id", "300"]) == 2
    assert "past this model's vocabulary" in capsys.readouterr().err


# ---- llama.cpp: occlusion only -----------------------------------------------------------------------------------
def llamacpp_session(path):
    import_required("llama_cpp", "llamacpp", dist="llama_cpp_python")
    from engine.backends.llamacpp import LlamaCppSession

    return LlamaCppSession(path, threads=1)


def test_llamacpp_refuses_gradients_in_one_sentence_and_occludes(tiny_dir, tiny_session):
    s = llamacpp_session(tiny_dir.gguf)
    try:
        for method in ("ig", "grad-input"):
            with pytest.raises(Unsupported, match="needs gradients") as e:
                attribute(s, PROMPT, method=method)
            assert "\n" not in str(e.value) and "occlusion" in str(e.value)
        got = attribute(s, PROMPT, method="occlusion")
    finally:
        s.close()
    ref = attribute(tiny_session, PROMPT, method="occlusion")
    assert got["backend"] == "llama.cpp" and got["target"]["id"] == ref["target"]["id"]
    # the tiny file is float32 but for a Q8_0 embedding, which both runtimes read: llama.cpp's own kernels differ
    # from torch's only by rounding (its f32 products convert activations to f16 for some kernels)
    torch.testing.assert_close(torch.tensor(got["scores"]), torch.tensor(ref["scores"]), rtol=0, atol=2e-2)
    n = len(got["scores"])
    assert got["cost"]["forward_passes"] == n + 1
    assert got["cost"]["tokens_run"] == n + n * (n + 1) // 2  # pass i re-runs from the occluded token on


# ---- the default model (slow) -------------------------------------------------------------------------------------
REAL_PROMPT = "The Eiffel Tower is in Paris and the Colosseum is in"  # 14 tokens; greedy next: " Rome"


@pytest.fixture(scope="module")
def real_session(real_lm):
    from engine.run.session import Session

    return Session(real_lm)


@pytest.fixture(scope="module")
def real_hf(tmp_path_factory):
    from engine.cli.export_hf import export
    from tests.requires import default_model

    out = export(default_model(), tmp_path_factory.mktemp("smollm2") / "hf")
    return hf_model(out)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ig", "grad-input"])
def test_default_model_matches_captum_on_transformers(real_session, real_hf, method):
    got = attribute(real_session, REAL_PROMPT, method=method, steps=32)
    ids, target = got["tokens"]["ids"], got["target"]["id"]
    assert got["target"]["piece"] == " Rome"
    want = captum_scores(real_hf, ids, real_session.tokenizer.eos_ids[0], target, method)
    torch.testing.assert_close(torch.tensor(got["scores"]), want, rtol=1e-3, atol=2e-3)


@pytest.mark.slow
def test_default_model_occlusion_on_llamacpp_matches_the_float_reference(real_session):
    from tests.requires import default_model

    s = llamacpp_session(default_model())
    try:
        got = attribute(s, REAL_PROMPT, method="occlusion")
    finally:
        s.close()
    ref = attribute(real_session, REAL_PROMPT, method="occlusion")
    assert got["target"]["id"] == ref["target"]["id"] == real_session.tokenizer.encode(" Rome").ids[0]
    g, r = torch.tensor(got["scores"]), torch.tensor(ref["scores"])
    assert set(g.topk(3).indices.tolist()) == set(r.topk(3).indices.tolist()) and int(g.argmax()) == int(r.argmax())
    # The same Q4_1 weights on both sides, dequantized to float32 for torch; llama.cpp multiplies them by the
    # activations rounded to 8 bits (Q8_1), which moves an unlikely target's log-probability by a few tenths of a
    # nat (measured: at most 0.52 nats, on the score of 5.8 of " in" before " Rome"; the largest score is ~20).
    torch.testing.assert_close(g, r, rtol=0.1, atol=0.3)
    assert got["cost"]["forward_passes"] == len(g) + 1 and got["cost"]["seconds"] > 0
