"""export-hf: the exported Hugging Face directory computes and tokenizes exactly like the GGUF it came from."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytestmark = pytest.mark.slow

TEXTS = [
    "In 2024, 1,234.56 apples cost $99 each.",
    "  leading spaces and a tab\there, then 7 8 9 and 0x1F",
    "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — 東京 🙂 x²",
]


def test_files_and_config(exported_hf):
    names = {p.name for p in exported_hf.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cfg = json.loads((exported_hf / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (30, 576, 3)
    assert cfg["tie_word_embeddings"] is True
    tc = json.loads((exported_hf / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and "<|im_start|>" in tc["chat_template"]
    assert json.loads((exported_hf / "generation_config.json").read_text())["eos_token_id"][0] == 2


def test_same_logits_as_gguf(exported_hf, real_lm):
    """Our HF loader on the exported directory gives the GGUF's logits (same float32 values, RoPE layout undone)."""
    from engine.loaders import load
    from engine.model import kernels
    from engine.run.session import Session

    hf = load(exported_hf, device="cpu", dtype="float32")
    ids = real_lm.tokenizer.encode(real_lm.tokenizer.chat_prompt("Explain what a KV cache is.")).ids
    # the float products on both: the GGUF's weights keep quantized decode forms (the LM head's int8 one may be the
    # tuner's choice for its last row), held to their own tolerance in tests/engine/test_quant_*.py
    with kernels.forced("linear"):
        a, _, _ = Session(real_lm).next_token_logits(ids)
        b, _, _ = Session(hf).next_token_logits(ids)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    assert int(a.argmax()) == int(b.argmax())


def test_plain_tokenizers_reads_it_like_our_tokenizer(exported_hf, real_lm):
    """tokenizer.json loaded by plain `tokenizers` (as vLLM/transformers do) splits digits one by one, as llama.cpp."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(exported_hf / "tokenizer.json"))
    ours = real_lm.tokenizer
    rng = random.Random(0)
    alphabet = "ab xyz019 \n\t.,'-é東🙂"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for t in texts:
        assert plain.encode(t, add_special_tokens=True).ids == ours.encode(t).ids, t
    year = plain.encode(" 2024").ids
    assert [plain.id_to_token(i) for i in year] == ["Ġ", "2", "0", "2", "4"]
    assert plain.decode(ours.encode(TEXTS[3]).ids) == TEXTS[3]
