"""A tiny byte-level BPE vocabulary for tests that must not load the real model.

`tiny_vocab` returns the vocabulary in GGUF form (token strings, "a b" merges, GGUF token types), so tests can
write it with `gguf.GGUFWriter` (tokenizer.ggml.tokens / .merges / .token_type). The merges come from a real
(if small) BPE training run on a fixed English paragraph, so common pairs such as "Ġ t", "h e" and "Ġt he"
appear early, exactly as in real vocabularies; the result is deterministic.

Layout: ids 0, 1, 2 are "<|endoftext|>", "<|im_start|>", "<|im_end|>" (control, type 3); ids 3..258 are the
256 byte-level characters in byte order (normal, type 1); the rest are merged tokens (type 1).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

from engine.tokenizer import Tokenizer, bytes_to_unicode

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
BYTE_TOKENS_START = len(SPECIAL_TOKENS)
FIRST_MERGED_ID = BYTE_TOKENS_START + 256
TYPE_NORMAL, TYPE_CONTROL = 1, 3

# SmolLM2's template, so chat tests on the tiny tokenizer see the same system-prompt logic as the real model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. There is the house of the other man, and then the three of them
went there together. This is what they say: the weather is nice, the tea is hot, and the theatre is open.
Inference is the process of running a trained model on new input. The model reads the prompt, then it writes
one token at a time; each new token depends on all of the tokens before it. A cache keeps the keys and values
of the attention layers so that the model does not have to compute them again. Language models learn from
large amounts of text: books, articles, code, conversations, and questions with their answers. When you type
a message, it is split into tokens, and every token becomes a vector of numbers. Those numbers flow through
many layers of matrix multiplication, normalisation and attention before a probability for every possible
next token comes out at the end. Sampling picks one of them; greedy decoding always picks the most likely.
Hello world! How are you today? I think that this should work well enough for a small test vocabulary.
Numbers like 2024, 365 and 42 are written digit by digit; prices such as $19.99 or 3.14159 appear too.
Some people prefer tabs, others prefer spaces; everyone agrees that consistent formatting helps readers.
def main(): return sum(x * x for x in range(10)) # small Python function with a comment
""".strip()


def _pretokenize(text: str) -> list[str]:
    # An ASCII-only approximation of the Digits + GPT-2 split: good enough to learn realistic merges.
    return re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", text)


@lru_cache(maxsize=8)
def _train(n_merges: int) -> tuple[str, ...]:
    byte_char = bytes_to_unicode()
    words = Counter(tuple(byte_char[b] for b in w.encode("utf-8")) for w in _pretokenize(_CORPUS))
    merges: list[str] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += freq
        if not pairs:
            merges.extend(_filler_merges(merges, n_merges - len(merges)))
            break
        # Highest count wins; ties go to the alphabetically first pair so the result never varies.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        joined = best[0] + best[1]
        updated: Counter[tuple[str, ...]] = Counter()
        for word, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            updated[tuple(out)] += freq
        words = updated
    return tuple(merges)


def _filler_merges(merges: list[str], count: int) -> list[str]:
    # The corpus runs out of pairs after a few hundred merges; bigger vocabularies get valid but unnatural
    # merges: each existing merged token extended by one lowercase letter.
    have = {m.replace(" ", "") for m in merges}
    bases = [m.replace(" ", "") for m in merges]
    out: list[str] = []
    for letter in "etaoinshrdlucmfwypvbgkjqxz":
        for base in bases:
            if len(out) == count:
                return out
            if base + letter not in have:
                have.add(base + letter)
                out.append(f"{base} {letter}")
    raise ValueError(f"tiny_vocab cannot make {count} more merges")


def add_tiny_vocab(writer, vocab_size: int = 300) -> None:
    """Write the tiny vocabulary into a gguf.GGUFWriter as a byte-level BPE (gpt2) tokenizer, SmolLM-pre-tokenized."""
    tokens, merges, types = tiny_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)


def tiny_vocab(vocab_size: int = 300) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types) of a byte-level BPE vocabulary with exactly `vocab_size` tokens."""
    if vocab_size < FIRST_MERGED_ID:
        raise ValueError(f"vocab_size must be at least {FIRST_MERGED_ID} (3 special + 256 byte tokens)")
    byte_char = bytes_to_unicode()
    merges = list(_train(vocab_size - FIRST_MERGED_ID))
    tokens = [*SPECIAL_TOKENS, *(byte_char[b] for b in range(256)), *(m.replace(" ", "") for m in merges)]
    types = [TYPE_CONTROL] * len(SPECIAL_TOKENS) + [TYPE_NORMAL] * (len(tokens) - len(SPECIAL_TOKENS))
    assert len(set(tokens)) == len(tokens) == vocab_size
    return tokens, merges, types


def tiny_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A `Tokenizer` over `tiny_vocab(vocab_size)`, configured like SmolLM2 (BOS <|im_start|>, EOS <|im_end|>)."""
    tokens, merges, types = tiny_vocab(vocab_size)
    return Tokenizer.from_vocab(
        tokens,
        merges,
        types,
        pre="smollm",
        bos_id=IM_START_ID,
        eos_ids=[IM_END_ID],
        chat_template=CHAT_TEMPLATE,
        add_bos=False,
    )


def write_tiny_tokenizer_json(directory: str | Path, vocab_size: int = 300) -> Path:
    """Write a Hugging Face style tokenizer.json + tokenizer_config.json for `tiny_vocab`; returns `directory`.

    The files have the shape of SmolLM2's own (Digits + ByteLevel pre-tokenizer, BPE model, ChatML template).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokens, merges, types = tiny_vocab(vocab_size)
    added = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, kind in enumerate(types)
        if kind == TYPE_CONTROL
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        },
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ") for m in merges],
        },
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "bos_token": SPECIAL_TOKENS[IM_START_ID],
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[IM_END_ID],
        "unk_token": SPECIAL_TOKENS[ENDOFTEXT_ID],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer",
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return directory
