"""Direct logit attribution (engine.why.dla) held to TransformerLens on the same weights (the tiny random Llama):
per head `stack_head_results(apply_ln=True)` and per MLP / embeddings `decompose_resid(apply_ln=True)`, each times
the unembedding direction. TransformerLens 4's bridge keeps the final norm's weight g out of W_U (HookedTransformer
folded it in), so its direction is g ⊙ (W_U[:, answer] − W_U[:, wrong]), as the engine's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.run.session import Session
from engine.why.dla import components, dla
from tests.why.conftest import engine_logits, run_cli

PROMPT, ANSWER, WRONG = "zq vx kj wy", "k", "j"


def transformer_lens_dla(bridge, ids: list[int], answer: int, wrong: int) -> dict[str, np.ndarray]:
    """TransformerLens's per-head, per-MLP and embedding contributions at the last position, and its logit diff."""
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(torch.tensor([ids]))
        g = dict(bridge.ln_final.named_parameters())["_original_component.weight"]
        u = g * (bridge.W_U[:, answer] - bridge.W_U[:, wrong])  # (d,)
        heads = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)  # (L·H, 1, d)
        parts, labels = cache.decompose_resid(layer=-1, pos_slice=-1, apply_ln=True, return_labels=True)
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    by = dict(zip(labels, (parts[:, 0] @ u).numpy(), strict=True))
    return {"heads": (heads[:, 0] @ u).numpy().reshape(L, H), "mlp": np.array([by[f"{i}_mlp_out"] for i in range(L)]),
            "attn": np.array([by[f"{i}_attn_out"] for i in range(L)]), "embeddings": by["embed"],
            "logit_diff": float(logits[0, -1, answer] - logits[0, -1, wrong])}


def test_dla_equals_transformer_lens_on_the_tiny_model(tiny_session, tiny_bridge):
    got = dla(tiny_session, PROMPT, ANSWER, WRONG)
    ref = transformer_lens_dla(tiny_bridge, got["ids"], got["answer"]["id"], got["wrong"]["id"])
    heads = np.asarray(got["heads"])
    assert heads.shape == (2, 4) and np.ptp(heads) > 0.1  # not flat: the comparison means something
    np.testing.assert_allclose(heads, ref["heads"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["mlp"], ref["mlp"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["attn"], ref["attn"], atol=1e-4, rtol=0)
    assert got["embeddings"] == pytest.approx(ref["embeddings"], abs=1e-4)
    assert got["logit_diff"] == pytest.approx(ref["logit_diff"], abs=1e-4)
    # the components add up to the model's own logit difference, up to the reported frozen-norm error
    assert got["sum"] == pytest.approx(heads.sum() + sum(got["mlp"]) + got["embeddings"], abs=1e-9)
    assert got["logit_diff"] - got["sum"] == got["frozen_norm_error"]
    assert abs(got["frozen_norm_error"]) < 1e-4
    top = got["top"]
    assert [abs(c["contribution"]) for c in top] == sorted((abs(c["contribution"]) for c in top), reverse=True)
    assert len(top) == 10 and {c["component"] for c in top} <= {f"L{i}H{h}" for i in range(2) for h in range(4)} | {
        "MLP0", "MLP1", "embeddings"}


def test_a_later_step_reads_the_greedy_continuation(tiny_session, tiny_lm):
    got = dla(tiny_session, PROMPT, ANSWER, WRONG, step=3)
    n = len(tiny_session.tokenize(PROMPT).ids)
    ids = got["ids"]
    assert len(ids) == n + 3 and got["position"] == n + 2 and len(got["generated"]) == 3
    logits = engine_logits(tiny_lm.model, ids)  # (T, V)
    for k in range(3):  # each appended token is the argmax of the position before it
        assert ids[n + k] == int(logits[n - 1 + k].argmax())
    diff = float(logits[-1, got["answer"]["id"]] - logits[-1, got["wrong"]["id"]])
    assert got["logit_diff"] == pytest.approx(diff, abs=1e-4)
    assert abs(got["frozen_norm_error"]) < 1e-4


def test_post_norms_gemma3_components_sum_to_the_logit_difference(tmp_path):
    """Gemma 3 normalises attention's and the MLP's outputs before they join the stream: the heads go through the
    post-attention norm with its scale frozen at the layer's output, so they still add up to the layer's attention
    output (the engine's own recording) and everything to the logit difference."""
    from engine.loaders import load
    from engine.model.kv_cache import KVCache
    from engine.model.seam import Point, edited
    from tests.tiny_families import write_checkpoint

    ck = write_checkpoint(tmp_path, "gemma3")
    lm = load(ck.hf_dir, device="cpu", dtype="float32", use_cache=False)
    ids = [5, 70, 9, 33, 101, 4, 8, 200]
    c = components(lm.model, ids, 11, 29)
    total = float(c["heads"].sum() + c["mlp"].sum() + c["embeddings"])
    assert abs(c["logit_diff"]) > 0.1 and c["logit_diff"] == pytest.approx(total, abs=1e-4)
    L, model = lm.cfg.n_layers, lm.model
    with torch.inference_mode(), edited(model, (), [Point.attn(i) for i in range(L)]) as rec:
        model(torch.tensor([ids]), KVCache(lm.cfg, 1, len(ids), torch.float32))
    scale = c["scale"]
    u = (model.norm.weight * (model.lm_head[11] - model.lm_head[29])).double() / scale
    attn = torch.stack([rec[Point.attn(i)][0, -1].double() @ u for i in range(L)])
    np.testing.assert_allclose(c["attn"].numpy(), attn.numpy(), atol=1e-5, rtol=0)


def test_cli_json_names_kernels_and_dtype(tiny_dir, capsys):
    code, out, err = run_cli(capsys, "dla", "--model", str(tiny_dir.gguf), "--backend", "torch", "--threads", "1",
                             "--prompt", PROMPT, "--answer", ANSWER, "--wrong", WRONG, "--top", "3", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert np.asarray(d["heads"]).shape == (2, 4) and len(d["top"]) == 3
    assert d["kernels"] == "exact" and d["dtype"] == "float32"
    assert {"sum", "logit_diff", "frozen_norm_error", "embeddings", "mlp", "definition"} <= d.keys()
    code, out, err = run_cli(capsys, "dla", "--model", str(tiny_dir.gguf), "--backend", "torch", "--threads", "1",
                             "--prompt", PROMPT, "--answer", ANSWER, "--wrong", WRONG)
    assert code == 0 and "frozen-norm error" in out and "top components" in out, err


@pytest.mark.parametrize("argv, code, needle", [
    (["--answer", " the k"], 2, "--answer ' the k' is 3 tokens"),
    (["--wrong", "k"], 2, "--answer and --wrong are the same token"),
    (["--url", "http://127.0.0.1:9"], 2, "drop --url"),
    (["--backend", "llama.cpp"], 1, "needs gradients"),
])
def test_cli_refuses_in_one_line(tiny_dir, capsys, argv, code, needle):
    args = {"--prompt": PROMPT, "--answer": ANSWER, "--wrong": WRONG, "--backend": "torch"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        args[flag] = value
    got, _, err = run_cli(capsys, "dla", "--model", str(tiny_dir.gguf), *[s for kv in args.items() for s in kv])
    assert got == code and needle in err and len(err.strip().splitlines()) == 1, err


# ---- the default model ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_components_sum_to_the_logit_difference_on_smollm2(real_lm):
    got = dla(Session(real_lm), "The Eiffel Tower is in the city of", " Paris", " Rome")
    assert np.asarray(got["heads"]).shape == (30, 9) and got["logit_diff"] > 0
    assert abs(got["frozen_norm_error"]) < 1e-4 * max(1.0, abs(got["logit_diff"]))
    print(f"\nSmolLM2 DLA ' Paris' - ' Rome': logit diff {got['logit_diff']:.4f}, sum {got['sum']:.4f}, "
          f"frozen-norm error {got['frozen_norm_error']:.1e}; top", got["top"][:3])
