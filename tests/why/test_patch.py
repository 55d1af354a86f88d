"""Activation patching (engine.why.patch) held to TransformerLens's patching (get_act_patch_resid_pre,
get_act_patch_attn_head_out_all_pos, and its hooks for the last block's output) on the same weights: the tiny
random Llama checkpoint, and SmolLM2 exported to a Hugging Face folder (slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.run.session import Session
from engine.why import Cancelled
from engine.why.patch import patch
from tests.requires import import_required
from tests.why.conftest import run_cli
from tests.why.tl_reference import boot, export_default

CLEAN, CORRUPT, ANSWER, WRONG = "zq vx kj wy", "zq vx kb wy", "k", "j"  # 10 tokens each on the tiny vocabulary


def transformer_lens_grids(bridge, clean: list[int], corrupt: list[int], answer: int, wrong: int,
                           heads: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """TransformerLens's residual grid ((L + 1) × T) and heads grid (L × H) for the same restored-share metric."""
    patching = import_required("transformer_lens.patching", "references", dist="transformer-lens")
    c, x = torch.tensor([clean]), torch.tensor([corrupt])
    L = bridge.cfg.n_layers
    with torch.no_grad():
        clean_logits, cache = bridge.run_with_cache(c)
        d_clean = float(clean_logits[0, -1, answer] - clean_logits[0, -1, wrong])
        corrupt_logits = bridge(x)
        d_corrupt = float(corrupt_logits[0, -1, answer] - corrupt_logits[0, -1, wrong])

        def metric(logits):
            return (logits[0, -1, answer] - logits[0, -1, wrong] - d_corrupt) / (d_clean - d_corrupt)

        resid = patching.get_act_patch_resid_pre(bridge, x, cache, metric)  # (L, T): rows 0 … L − 1
        last = []  # row L: the last block's output, patched by hand with the same kind of hook
        for p in range(len(corrupt)):
            def put(act, hook, p=p):
                act = act.clone()
                act[:, p] = cache[f"blocks.{L - 1}.hook_resid_post"][:, p]
                return act
            last.append(float(metric(bridge.run_with_hooks(x, fwd_hooks=[(f"blocks.{L - 1}.hook_resid_post", put)]))))
        grid = np.concatenate([resid.numpy(), np.array([last])])
        head_grid = patching.get_act_patch_attn_head_out_all_pos(bridge, x, cache, metric).numpy() if heads else None
    return grid, head_grid


def transformer_lens_batched(bridge, clean: list[int], corrupt: list[int], answer: int, wrong: int) -> np.ndarray:
    """The residual grid by hand with TransformerLens's hooks, a forward per layer whose batch row p patches position
    p (get_act_patch_resid_pre runs a forward per cell: hundreds on SmolLM2, too slow for the suite)."""
    c, x = torch.tensor([clean]), torch.tensor([corrupt])
    L, T = bridge.cfg.n_layers, len(corrupt)
    rows = torch.arange(T)
    with torch.no_grad():
        clean_logits, cache = bridge.run_with_cache(c)
        d_clean = float(clean_logits[0, -1, answer] - clean_logits[0, -1, wrong])
        corrupt_logits = bridge(x)
        d_corrupt = float(corrupt_logits[0, -1, answer] - corrupt_logits[0, -1, wrong])
        grid = []
        for layer in range(L + 1):
            name = f"blocks.{layer}.hook_resid_pre" if layer < L else f"blocks.{L - 1}.hook_resid_post"

            def put(act, hook, name=name):
                act = act.clone()
                act[rows, rows] = cache[name][0, rows]  # (T, T, d): row p, position p
                return act

            logits = bridge.run_with_hooks(x.repeat(T, 1), fwd_hooks=[(name, put)])  # (T, T, V)
            d = logits[:, -1, answer] - logits[:, -1, wrong]
            grid.append(((d - d_corrupt) / (d_clean - d_corrupt)).numpy())
    return np.array(grid)


def test_patching_equals_transformer_lens_on_the_tiny_model(tiny_session, tiny_bridge):
    got = patch(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    assert abs(got["clean_logit_diff"] - got["corrupt_logit_diff"]) > 0.1  # something to restore
    grid, head_grid = transformer_lens_grids(tiny_bridge, got["ids"]["clean"], got["ids"]["corrupt"],
                                             got["answer"]["id"], got["wrong"]["id"], heads=True)
    restored = np.asarray(got["restored"])
    assert restored.shape == (3, 10) and np.asarray(got["restored_heads"]).shape == (2, 4)
    np.testing.assert_allclose(restored, grid, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["restored_heads"], head_grid, atol=1e-4, rtol=0)
    batched = transformer_lens_batched(tiny_bridge, got["ids"]["clean"], got["ids"]["corrupt"],
                                       got["answer"]["id"], got["wrong"]["id"])
    np.testing.assert_allclose(batched, grid, atol=1e-5, rtol=0)  # the by-hand reference the slow test uses
    assert np.ptp(restored[0]) > 0.1 and np.ptp(got["restored_heads"]) > 0.01  # the grids are not flat
    assert restored[-1, -1] == pytest.approx(1, abs=1e-5) and np.abs(restored[-1, :-1]).max() < 1e-5


def test_more_rows_than_one_forward_takes_give_the_same_grid(tiny_session, monkeypatch):
    import engine.why.patch as p

    whole = patch(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    monkeypatch.setattr(p, "MAX_ROWS", 3)  # 10 positions in forwards of 3, 3, 3, 1 rows; 4 heads in 3 + 1
    split = patch(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    assert split["forwards"] == 2 + 3 * 4 + 2 * 2
    np.testing.assert_allclose(split["restored"], whole["restored"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(split["restored_heads"], whole["restored_heads"], atol=1e-5, rtol=0)


def test_progress_and_cancel(tiny_session):
    seen: list[float] = []
    out = patch(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, progress=lambda f, _m: seen.append(f))
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 1 and len(seen) == out["forwards"] + 1
    calls = []
    with pytest.raises(Cancelled):
        patch(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, should_stop=lambda: len(calls.append(0) or calls) > 4)
    assert len(calls) == 5  # it stopped at the fifth forward, not at the end


def test_cli_json(tiny_dir, capsys):
    code, out, err = run_cli(capsys, "patch", "--model", str(tiny_dir.gguf), "--backend", "torch", "--threads", "1",
                          "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", ANSWER, "--wrong", WRONG, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["tokens"]["clean"][7] == "j" and d["tokens"]["corrupt"][7] == "b"
    assert np.asarray(d["restored"]).shape == (3, 10) and "restored_heads" not in d
    assert {"clean_logit_diff", "corrupt_logit_diff", "definition"} <= d.keys()
    assert d["kernels"] == "exact"  # patching forces F.linear: exact, whatever mode the model was loaded in


def test_cli_json_names_the_products_it_ran_not_the_models_mode(tiny_dir, capsys, tmp_path):
    """A Q4_0 file loaded in the fast mode is patched through F.linear: the output says exact."""
    from engine.formats.requantize import requantize

    q4 = tmp_path / "tiny-q4_0.gguf"
    requantize(tiny_dir.gguf, q4, "Q4_0")
    code, out, err = run_cli(capsys, "patch", "--model", str(q4), "--backend", "torch", "--threads", "1",
                             "--kernels", "fast", "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", ANSWER,
                             "--wrong", WRONG, "--json")
    assert code == 0, err
    assert json.loads(out)["kernels"] == "exact"


@pytest.mark.parametrize("argv, code, needle", [
    (["--corrupt", "zq vx kb wyy"], 2, "the clean prompt is 10 tokens and the corrupted one 11"),
    (["--answer", " the k"], 2, "--answer ' the k' is 3 tokens (' the', ' ', 'k')"),
    (["--wrong", "k"], 2, "--answer and --wrong are the same token"),
    (["--url", "http://127.0.0.1:9"], 2, "drop --url"),
])
def test_cli_refuses_in_one_line(tiny_dir, capsys, argv, code, needle):
    args = {"--clean": CLEAN, "--corrupt": CORRUPT, "--answer": ANSWER, "--wrong": WRONG, "--backend": "torch"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        args[flag] = value
    got, _, err = run_cli(capsys, "patch", "--model", str(tiny_dir.gguf), *[s for kv in args.items() for s in kv])
    assert got == code and needle in err and len(err.strip().splitlines()) == 1, err


# ---- llama.cpp: the same grids through its graph callback ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tiny_dir):
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession

    s = LlamaCppSession(tiny_dir.gguf, threads=1)
    yield s
    s.close()


def test_llamacpp_patching_equals_the_torch_engines(tiny_session, tiny_llama, tiny_dir, capsys):
    """The tiny file is float32: llama.cpp's grids equal the torch engine's (itself held to TransformerLens above)
    to llama.cpp's own differences (it keeps K and V in float16); the CLI runs it too."""
    want = patch(tiny_session, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    seen: list[float] = []
    got = patch(tiny_llama, CLEAN, CORRUPT, ANSWER, WRONG, heads=True, progress=lambda f, _m: seen.append(f))
    assert seen[-1] == 1 and len(seen) == got["forwards"] + 1
    np.testing.assert_allclose(got["restored"], want["restored"], atol=1e-2, rtol=0)
    np.testing.assert_allclose(got["restored_heads"], want["restored_heads"], atol=1e-2, rtol=0)
    assert np.ptp(got["restored_heads"]) > 0.01
    code, out, err = run_cli(capsys, "patch", "--model", str(tiny_dir.gguf), "--backend", "llama.cpp",
                             "--threads", "1", "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", ANSWER,
                             "--wrong", WRONG, "--json")
    assert code == 0, err
    np.testing.assert_allclose(json.loads(out)["restored"], want["restored"], atol=1e-2, rtol=0)


@pytest.mark.slow
def test_llamacpp_patching_on_the_default_models_file(real_lm):
    """The issue's pair on the Q4_1 file: llama.cpp (which also rounds activations to 8 bits for its Q4_1 products)
    against the torch engine's exact run of the same weights, residual and per-head grids within 0.05 of the
    clean-corrupt difference."""
    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    from engine.backends.llamacpp import LlamaCppSession
    from tests.requires import default_model

    pair = ("The Eiffel Tower is in the city of", "The Colosseum is in the city of", " Paris", " Rome")
    want = patch(Session(real_lm), *pair, heads=True)
    llama = LlamaCppSession(default_model(), threads=2)
    try:
        got = patch(llama, *pair, heads=True)
    finally:
        llama.close()
    assert abs(np.asarray(got["restored"]) - want["restored"]).max() < 0.05
    assert abs(np.asarray(got["restored_heads"]) - want["restored_heads"]).max() < 0.05


# ---- the default model ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_patching_equals_transformer_lens_on_smollm2(real_lm, tmp_path_factory):
    got = patch(Session(real_lm), "The Eiffel Tower is in the city of", "The Colosseum is in the city of", " Paris",
                " Rome")
    bridge = boot(export_default(tmp_path_factory.mktemp("smollm2") / "hf"))
    grid = transformer_lens_batched(bridge, got["ids"]["clean"], got["ids"]["corrupt"], got["answer"]["id"],
                                    got["wrong"]["id"])
    assert got["clean_logit_diff"] > 0 > got["corrupt_logit_diff"]  # each prompt prefers its own city
    np.testing.assert_allclose(got["restored"], grid, atol=1e-3, rtol=0)  # shares of a ~11.6 logit margin
