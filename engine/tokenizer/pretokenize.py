"""llama.cpp's pre-tokenizers: the regexes it splits text with before BPE merging, by `tokenizer.ggml.pre` name.

Every pre-tokenizer name llama.cpp knows is either reproduced here (`SUPPORTED_PRE`) or refused with an error naming
it, so a vocabulary is never tokenized differently from llama.cpp.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, pre_tokenizers

from engine.tokenizer.vocab import bytes_to_unicode

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe). The `(?i:'s|...)` of the Hugging Face
# originals is spelled out as character classes, as llama.cpp does: case-insensitive matching would also accept
# e.g. "'ſ" (long s).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp matches regexes with explicit non-ASCII ranges against the text with every non-ASCII whitespace
# character replaced by U+000B, so such a range never matches U+3000, U+2028 and the like even where it spans them;
# `&&[^\s]` removes them here too.
_CJK_SPLIT = (
    r"[[\x{4e00}-\x{9fa5}\x{800}-\x{4e00}\x{ac00}-\x{d7ff}]&&[^\s]]+"
)
_DEEPSEEK_LLM_LETTERS = (
    r"\s?[[A-Za-z\x{b5}\x{c0}-\x{d6}\x{d8}-\x{f6}\x{f8}-\x{1ba}\x{1bc}-\x{1bf}\x{1c4}-\x{293}\x{295}-\x{2af}"
    r"\x{370}-\x{373}\x{376}\x{377}\x{37b}-\x{37d}\x{37f}\x{386}\x{388}-\x{38a}\x{38c}\x{38e}-\x{3a1}\x{3a3}"
    r"-\x{3f5}\x{3f7}-\x{481}\x{48a}-\x{52f}\x{531}-\x{556}\x{10a0}-\x{10c5}\x{13a0}-\x{13f5}\x{13f8}-\x{13fd}"
    r"\x{1c90}-\x{1cba}\x{1cbd}-\x{1cbf}\x{1d00}-\x{1d2b}\x{1d6b}-\x{1d77}\x{1d79}-\x{1d9a}\x{1e00}-\x{1f15}"
    r"\x{1f18}-\x{1f1d}\x{1f20}-\x{1f45}\x{1f48}-\x{1f4d}\x{1f50}-\x{1f57}\x{1f59}\x{1f5b}\x{1f5d}\x{1f5f}"
    r"-\x{1f7d}\x{1f80}-\x{1fb4}\x{1fb6}-\x{1fbc}\x{1fbe}\x{1fc2}-\x{1fc4}\x{1fc6}-\x{1fcc}\x{1fd0}-\x{1fd3}"
    r"\x{1fd6}-\x{1fdb}\x{1fe0}-\x{1fec}\x{1ff2}-\x{1ff4}\x{1ff6}-\x{1ffc}\x{2102}\x{2107}\x{210a}-\x{2113}"
    r"\x{2115}\x{2119}-\x{211d}\x{2124}\x{2126}\x{2128}\x{212a}-\x{212d}\x{212f}-\x{2134}\x{2139}\x{213c}"
    r"-\x{213f}\x{2145}-\x{2149}\x{214e}\x{2183}\x{2184}\x{2c00}-\x{2c7b}\x{2c7e}-\x{2ce4}\x{2ceb}-\x{2cee}"
    r"\x{2cf2}\x{2cf3}\x{a640}-\x{a66d}\x{a680}-\x{a69b}\x{a722}-\x{a76f}\x{a771}-\x{a787}\x{a78b}-\x{a78e}"
    r"\x{ab70}-\x{abbf}\x{fb00}-\x{fb06}\x{fb13}-\x{fb17}\x{ff21}-\x{ff3a}\x{ff41}-\x{ff5a}\x{10400}-\x{1044f}"
    r"\x{104b0}-\x{104d3}\x{104d8}-\x{104fb}\x{10c80}-\x{10cb2}\x{10cc0}-\x{10cf2}\x{118a0}-\x{118df}\x{1e900}"
    r"-\x{1e943}]&&[^\s]]+"
)
_DEEPSEEK_LLM_PUNCT = (
    r"\s?[[!-/:-~\x{ff01}-\x{ff0f}\x{ff1a}-\x{ff5e}\x{2018}-\x{201f}\x{3000}-\x{3002}]&&[^\s]]+"
)

# The pre-tokenizer steps reproduced here, by llama.cpp pre type. Each is the list of regexes llama.cpp applies in
# turn (every match and every gap between matches becomes a piece), then the GPT-2 byte-to-character mapping.
# "gpt2" and "digits" use the `tokenizers` ByteLevel regex, which is the same GPT-2 split.
_PRE_STEPS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (_GPT2_SPLIT,),
    "digits": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, "[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_SPLIT, r"\p{N}"),
    "deepseek-llm": (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+\z", _CJK_SPLIT, r"\p{N}+"),
}

# Every `tokenizer.ggml.pre` name llama.cpp's llama-vocab.cpp knows, mapped to the pre-tokenizer rules it applies
# (names sharing a regex set share a group here). Groups in _PRE_STEPS are reproduced; the others are refused.
_PRE_NAMES: dict[str, tuple[str, ...]] = {
    "default": ("default",),
    "llama3": (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
        "dbrx", "smaug-bpe", "glm4", "chatglm-bpe",
    ),
    "qwen2": (
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2",
    ),
    "gpt2": (
        "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling",
    ),
    "digits": (
        "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2",
    ),
    "falcon": ("falcon",),
    "deepseek-coder": ("deepseek-coder",),
    "deepseek-llm": ("deepseek-llm",),
    # Known to llama.cpp, not reproduced here (their regexes are not implemented, or not checked against llama.cpp).
    "gpt2+sep": ("jina-v1-en", "jina-v2-code", "roberta-bpe"),
    "deepseek-v3": ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
    "spark2.5": ("spark2_5",),
    "youtu": ("youtu",),
    "jais2": ("jais-2",),
    "gemma4": ("gemma4", "granite-embed-multi-311m"),
    "sarvam-moe": ("sarvam-moe",),
    "whitespace": ("whitespace",),
    "qwen35": ("qwen35",),
    "poro": ("poro-chat", "bloom", "gpt3-finnish"),
    "viking": ("viking",),
    "tekken": ("tekken",),
    "exaone-moe": ("exaone-moe",),
    "chameleon": ("chameleon",),
    "gpt4o": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    "granite-embed-multi": ("granite-embed-multi-97m",),
    "tiny-aya": ("tiny_aya", "cohere2moe"),
    "superbpe": ("superbpe",),
    "bailingmoe": ("bailingmoe", "bailingmoe2", "llada-moe"),
    "seed-coder": ("seed-coder",),
    "kimi-k2": ("kimi-k2",),
    "ufakzeka": ("ufakzeka",),
    "afmoe": ("afmoe",),
    "laguna": ("laguna",),
    "minicpm5": ("minicpm5",),
}
_PRE_GROUP = {name: group for group, names in _PRE_NAMES.items() for name in names}
# The names llama.cpp gives `ignore_merges` (a pre-split word that is itself a token is not merged) and add_bos.
_PRE_IGNORE_MERGES = {
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
}
_PRE_ADD_BOS = _PRE_IGNORE_MERGES
_PRE_NO_BOS = {"glm4", "chatglm-bpe"}  # llama.cpp clears the BOS id for these

SUPPORTED_PRE: frozenset[str] = frozenset(n for n, g in _PRE_GROUP.items() if g in _PRE_STEPS)


def llama_cpp_pre_type(pre: str | None) -> str:
    """The pre-tokenizer group llama.cpp applies for a GGUF `tokenizer.ggml.pre` value (None: missing -> default).

    Raises ValueError naming the value when llama.cpp does not know it or this module does not reproduce it.
    """
    name = "default" if pre is None or pre == "" else str(pre)
    group = _PRE_GROUP.get(name)
    if group is None:
        raise ValueError(
            f"unknown GGUF pre-tokenizer {name!r}: llama.cpp does not know it either (it refuses such a file)"
        )
    if group not in _PRE_STEPS:
        raise ValueError(
            f"the GGUF pre-tokenizer {name!r} (llama.cpp's {group!r} rules) is not reproduced by Inference Lab; "
            "refusing it rather than tokenizing differently from llama.cpp"
        )
    return group


def _bpe_pre_tokenizer(group: str) -> Any:
    if group == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if group == "digits":
        # llama.cpp splits every numeric character off first, then applies the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    steps = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in _PRE_STEPS[group]]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _unrepresentable_class(vocab: dict[str, int]) -> str:
    """A regex character class of the byte-level characters of the bytes the vocabulary has no token for."""
    byte_char = bytes_to_unicode()
    missing = [ord(byte_char[b]) for b in range(256) if byte_char[b] not in vocab]
    return "[" + "".join(f"\\x{{{c:X}}}" for c in missing) + "]" if missing else ""
