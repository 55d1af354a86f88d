"""Tokenizers that reproduce llama.cpp's tokenization exactly, with the bookkeeping a live view needs.

The merging runs in Hugging Face `tokenizers` (Rust, fast enough to re-tokenize on every keystroke). This module
builds that tokenizer from a GGUF vocabulary or a Hugging Face model directory, then adds what the UI shows:
per-token byte and character spans, readable pieces, special-token flags, and the input bytes the vocabulary cannot
represent (byte-level BPE drops those; we report them instead).

Two GGUF vocabulary kinds (`tokenizer.ggml.model`), each as llama.cpp's llama-vocab.cpp treats it:
- `gpt2`, byte-level BPE (SmolLM2, Llama 3, Qwen2, GPT-2, Falcon, DeepSeek, StarCoder, ...): llama.cpp first splits
  the text with the regexes of its pre-tokenizer (`tokenizer.ggml.pre`), then merges by rank. Every pre-tokenizer
  name llama.cpp knows is either reproduced here (`SUPPORTED_PRE`) or refused with an error naming it.
- `llama`, SentencePiece-style (Llama 2, Mistral, Phi-3, Gemma): spaces become U+2581, a space is put in front of
  each piece of text that starts the prompt or follows a special token (if `add_space_prefix`), and symbols are
  merged greedily by the *score* of the token they would form (ties: leftmost first). Characters left without a token
  become byte-fallback tokens `<0xNN>`. That score-driven merge is expressed as a BPE merge list: every way a token
  splits into two tokens is a merge, ranked by the token's score (`_spm_merges`).
Special tokens are found in the text the way llama.cpp's tokenizer_st_partition finds them (longest first, with its
lstrip/rstrip rules); the merging then runs on the text between them.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

if TYPE_CHECKING:
    import gguf


__all__ = [
    "Tokenization",
    "Tokenizer",
    "StreamDecoder",
    "CHATML_TEMPLATE",
    "SUPPORTED_PRE",
    "bytes_to_unicode",
    "llama_cpp_pre_type",
]

# Bump when the cache layout changes: load() refuses other versions so callers rebuild instead of misreading.
CACHE_FORMAT = 2
CACHE_META = "inference_lab_tokenizer.json"
CACHE_TOKENIZER = "tokenizer.json"
CACHE_BYTES = "token_bytes.npy"

# Used when a model ships no template; the same ChatML that transformers used as its default.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")  # the fallback needs both as tokens of the vocabulary

# ------------------------------------------------------------------------------------------- pre-tokenizers
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

# Texts llama.cpp treats as end-of-generation whatever the metadata says; stopping on them avoids
# run-on output.
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
# Texts llama.cpp forces to control type when it finds them (end-of-turn, end-of-generation and fill-in-the-middle
# markers), which decides whether they are matched in text and shown as special.
_CONTROL_TEXTS = frozenset(
    [
        *_EOG_TEXTS,
        "<｜end▁of▁sentence｜>",
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
        "<|file_sep|>",
    ]
)

# GGUF token types (llama.cpp's llama_token_type).
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = 1, 2, 3, 4, 5, 6
# Flags of a special token in the partition list.
_NEEDS_PARSE_SPECIAL, _LSTRIP, _RSTRIP = 1, 2, 4
_SPACE = "\u2581"  # SentencePiece's visible space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(), which llama.cpp's lstrip/rstrip use


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


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """llama.cpp's SentencePiece merge as a BPE merge list.

    llama.cpp merges any two neighbouring symbols whose concatenation is a token, best token score first, leftmost
    first among equal scores. So every split of a token into two tokens is a merge, ranked by the token's score.
    Equal scores (e.g. Llama 2's runs of U+2581, all at -1e9) rank the split with the longer left part first: then a
    run is built by growing its leftmost symbol, which is the order llama.cpp's leftmost-first rule produces.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, text in enumerate(tokens):
        n = len(text)
        if n < 2:
            continue
        score = -float(scores[i])
        for k in range(1, n):
            left = text[:k]
            if left in vocab:
                right = text[k:]
                if right in vocab:
                    ranked.append((score, -k, i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by every byte-level BPE vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _byte_level_tables() -> tuple[dict[int, int], re.Pattern[str]]:
    enc = bytes_to_unicode()
    translate = {ord(ch): b for b, ch in enc.items()}
    outside = re.compile("[^" + "".join(re.escape(ch) for ch in enc.values()) + "]")
    return translate, outside


def _readable(data: bytes) -> str:
    """Text of a token for display: printable characters as themselves, anything else as <0xNN> per byte."""
    # surrogateescape turns each byte of an incomplete/invalid UTF-8 sequence into U+DC80..U+DCFF, so one
    # decode both decodes the valid part and pinpoints the stray bytes.
    text = data.decode("utf-8", "surrogateescape")
    if text.isprintable():
        return text
    out: list[str] = []
    for ch in text:
        cp = ord(ch)
        if 0xDC80 <= cp <= 0xDCFF:
            out.append(f"<0x{cp - 0xDC00:02X}>")
        elif ch.isprintable() or ch in "\t\n\r":
            # Ordinary whitespace stays as text; making it visible is the UI's choice.
            out.append(ch)
        else:
            out.extend(f"<0x{b:02X}>" for b in ch.encode("utf-8"))
    return "".join(out)


@dataclass(frozen=True)
class Tokenization:
    """One encoded text with everything needed to draw it token by token.

    `byte_offsets` index `text.encode("utf-8")`; for text the vocabulary can represent they tile it exactly.
    `offsets` index the Python string; tokens that cover only part of a multi-byte character get that
    character's whole span. An added BOS token has the empty span (0, 0).
    `unrepresentable` lists (byte_offset, byte_value) of input bytes no token stands for: BPE skipped them.
    """

    text: str
    ids: list[int]
    pieces: list[str]
    offsets: list[tuple[int, int]]
    byte_offsets: list[tuple[int, int]]
    special: list[bool]
    unrepresentable: list[tuple[int, int]]


class _GenerationBlock(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` markers and renders their body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides jinja's tojson: no HTML escaping, non-ASCII kept; templates rely on that.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Templates come from model files, i.e. from strangers: the sandbox blocks attribute tricks that reach
    # Python internals, and the immutable variant also blocks mutating the objects passed in.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    try:
        return _jinja_env().from_string(source)
    except TemplateError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc


def _gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _unrepresentable_class(vocab: dict[str, int]) -> str:
    """A regex character class of the byte-level characters of the bytes the vocabulary has no token for."""
    byte_char = bytes_to_unicode()
    missing = [ord(byte_char[b]) for b in range(256) if byte_char[b] not in vocab]
    return "[" + "".join(f"\\x{{{c:X}}}" for c in missing) + "]" if missing else ""



class _ReaderView:
    """A gguf.GGUFReader seen through the read_metadata() interface (for readers not backed by a file)."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        return _gguf_field(self._reader, key, default)


def _strings(meta: Any, key: str) -> list[str] | None:
    value = meta.get(key)
    if value is None:
        return None
    return [v.decode("utf-8", "replace") if isinstance(v, bytes | bytearray) else str(v) for v in value]


@dataclass
class _Rules:
    """How llama.cpp treats the text around the merging, for a GGUF vocabulary."""

    kind: str  # "spm" (SentencePiece-style, tokenizer.ggml.model "llama") or "bpe" (byte-level, "gpt2")
    token_types: np.ndarray  # GGUF token type per id, after llama.cpp's overrides
    specials: list[tuple[int, int]]  # (id, flags) of the tokens matched in text, in llama.cpp's order
    add_space_prefix: bool = False
    add_eos: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "token_types": self.token_types.tolist(),
            "specials": [list(s) for s in self.specials],
            "add_space_prefix": self.add_space_prefix,
            "add_eos": self.add_eos,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Rules:
        return cls(
            kind=d["kind"],
            token_types=np.asarray(d["token_types"], dtype=np.int32),
            specials=[(int(i), int(f)) for i, f in d["specials"]],
            add_space_prefix=bool(d["add_space_prefix"]),
            add_eos=bool(d["add_eos"]),
        )


def _partition_order(
    texts: Sequence[str], types: np.ndarray, name: str = "", pre: str = ""
) -> list[tuple[int, int]]:
    """llama.cpp's special-token cache: control, user-defined and unknown tokens, longest text first, with the
    lstrip/rstrip attributes llama.cpp gives some models by name."""
    kinds = (_TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNKNOWN)
    ids = [i for i in np.flatnonzero(np.isin(types, kinds)).tolist()]
    ids.sort(key=lambda i: (-len(texts[i].encode("utf-8")), i))
    flags = {i: _NEEDS_PARSE_SPECIAL if types[i] in (_TYPE_CONTROL, _TYPE_UNKNOWN) else 0 for i in ids}
    name = name.lower()
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")):
        for i in ids:
            if texts[i] == "<mask>":
                flags[i] |= _LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i in ids:
            flags[i] |= _RSTRIP
        for i, t in enumerate(texts):
            if t == "</s>" and i in flags:
                flags[i] |= _RSTRIP
            if t in ("<unk>", "<s>", "<|endoftext|>") and i in flags:
                flags[i] &= ~_RSTRIP
    return [(i, flags[i]) for i in ids]


class Tokenizer:
    """A tokenizer plus the metadata (BOS/EOS, chat template) that goes with it."""

    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None
    add_bos: bool
    warnings: list[str]

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_id: int | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos: bool = False,
        warnings: Iterable[str] = (),
        extra_tokens: dict[int, str] | None = None,
        rules: _Rules | None = None,
        token_bytes: list[bytes] | None = None,
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`. Prefer the `from_*` / `load` constructors.

        `extra_tokens` names ids the backend's vocabulary cannot hold (a GGUF vocabulary may repeat a
        string; a dict keeps only one id for it) so that they still decode to the right bytes.
        `rules` (GGUF vocabularies) makes encode() find special tokens and space prefixes as llama.cpp does; without
        it the backend's own added tokens do that (Hugging Face directories).
        """
        self._backend = backend
        self.chat_template = chat_template
        self.add_bos = bool(add_bos)
        self.warnings = list(warnings)
        self._extra_tokens = dict(extra_tokens or {})
        self._rules = rules

        added = backend.get_added_tokens_decoder()
        size = max(backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in self._extra_tokens), 0)
        if rules is not None:
            size = max(size, len(rules.token_types))
        self.vocab_size = size

        special = np.zeros(size, dtype=bool)
        if rules is None:
            for i, tok in added.items():
                special[i] = tok.special
        else:
            types = np.full(size, _TYPE_NORMAL, dtype=np.int32)
            types[: len(rules.token_types)] = rules.token_types
            special[:] = np.isin(types, (_TYPE_CONTROL, _TYPE_UNKNOWN))
            self._types = types
        self._special = special
        if token_bytes is None:
            token_bytes = self._compute_token_bytes(added)
        elif len(token_bytes) != size:
            raise ValueError(f"{len(token_bytes)} token byte strings for {size} tokens")
        self._token_bytes = token_bytes
        # The bytes a token stands for inside the merged text; differs from token_bytes only for SentencePiece
        # control/user-defined tokens, whose U+2581 stands for a space there.
        core_bytes: dict[int, bytes] = {}
        if rules is not None and rules.kind == "spm":
            literal = np.flatnonzero(np.isin(self._types, (_TYPE_CONTROL, _TYPE_UNKNOWN, _TYPE_USER_DEFINED)))
            for i in literal.tolist():
                text = self._text(i)
                if text and _SPACE in text:
                    core_bytes[i] = text.replace(_SPACE, " ").encode("utf-8")
        self._core_bytes = core_bytes
        self._lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=size)
        self._core_lengths = self._lengths.copy()
        for i, b in core_bytes.items():
            self._core_lengths[i] = len(b)
        self._pieces: list[str | None] = [None] * size

        # Special-token matching for GGUF vocabularies. Gemma has ~6,400 such tokens, so encode() first finds which
        # occur at all: it walks the prefixes of the special texts from every position where one could start.
        self._specials: list[tuple[int, str, int]] = []
        self._special_index: dict[str, int] = {}
        self._special_prefixes: set[str] = set()
        starts: set[str] = set()
        if rules is not None:
            for i, flags in rules.specials:
                text = self._text(i)
                if not text:
                    continue
                self._special_index[text] = len(self._specials)
                self._specials.append((i, text, flags))
                starts.add(text[0])
                self._special_prefixes.update(text[:k] for k in range(1, len(text) + 1))
        self._special_start = re.compile("[" + "".join(re.escape(c) for c in sorted(starts)) + "]") if starts else None

        if bos_id is not None and not 0 <= bos_id < size:
            self.warnings.append(f"BOS id {bos_id} is outside the vocabulary ({size} tokens); ignoring it")
            bos_id = None
        if self.add_bos and bos_id is None:
            self.warnings.append("the model asks for a BOS token but names none; no BOS is added")
            self.add_bos = False
        self.bos_id = bos_id
        eos: list[int] = []
        for i in eos_ids:
            if 0 <= i < size and i not in eos:
                eos.append(int(i))
        self.eos_ids = tuple(eos)
        self.add_eos = bool(rules is not None and rules.add_eos and eos)

        if rules is not None and rules.kind == "spm":
            # Bytes with no <0xNN> token: byte fallback has nothing to emit for them.
            self._unrepresentable_bytes = frozenset(
                b for b in range(256) if backend.token_to_id(f"<0x{b:02X}>") is None
            )
        else:
            # Byte values whose single-byte token is missing: BPE cannot start from them, so it drops them.
            enc = bytes_to_unicode()
            self._unrepresentable_bytes = frozenset(b for b in range(256) if backend.token_to_id(enc[b]) is None)

    def _text(self, token_id: int) -> str | None:
        """The vocabulary string of a token (byte-level or U+2581 form), or None for an id without one."""
        text = self._extra_tokens.get(token_id)
        return text if text is not None else self._backend.id_to_token(token_id)

    def _compute_token_bytes(self, added: dict[int, Any]) -> list[bytes]:
        """The exact bytes each token stands for, from its vocabulary string and (GGUF) type."""
        texts: list[str | None] = [None] * self.vocab_size
        for text, i in self._backend.get_vocab(with_added_tokens=True).items():
            texts[i] = text
        for i, text in self._extra_tokens.items():
            texts[i] = text
        for i, tok in added.items():
            texts[i] = tok.content
        translate, outside = _byte_level_tables()
        out: list[bytes] = []
        rules = self._rules
        if rules is None:
            for i, text in enumerate(texts):
                if text is None:
                    out.append(b"")
                elif i in added or outside.search(text):
                    # Added tokens are matched in the raw text, so they stand for their own UTF-8 bytes.
                    out.append(text.encode("utf-8"))
                else:
                    out.append(text.translate(translate).encode("latin-1"))
            return out
        literal = (_TYPE_CONTROL, _TYPE_UNKNOWN, _TYPE_USER_DEFINED)
        spm = rules.kind == "spm"
        for text, kind in zip(texts, self._types.tolist(), strict=True):
            if text is None:
                out.append(b"")
            elif kind in literal:
                out.append(text.encode("utf-8"))
            elif spm:
                m = _BYTE_TOKEN.fullmatch(text) if kind == _TYPE_BYTE else None
                out.append(bytes([int(m.group(1), 16)]) if m else text.replace(_SPACE, " ").encode("utf-8"))
            elif outside.search(text):
                out.append(text.encode("utf-8"))
            else:
                out.append(text.translate(translate).encode("latin-1"))
        return out

    @property
    def kind(self) -> str:
        """"spm" (SentencePiece-style GGUF), "bpe" (byte-level GGUF) or "hf" (a Hugging Face tokenizer.json)."""
        return self._rules.kind if self._rules is not None else "hf"

    # ----------------------------------------------------------------------------------------- constructors

    @classmethod
    def from_vocab(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str] | Sequence[tuple[str, str]] = (),
        token_types: Sequence[int] | None = None,
        *,
        model: str = "gpt2",
        scores: Sequence[float] | None = None,
        pre: str | None = "smollm",
        bos_id: int | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos: bool | None = None,
        add_eos: bool = False,
        add_space_prefix: bool | None = None,
        name: str = "",
    ) -> Tokenizer:
        """Build from a vocabulary in GGUF form, tokenizing exactly as llama.cpp does.

        `model` is GGUF's `tokenizer.ggml.model`: "gpt2" (byte-level BPE: byte-level token strings and "a b" merges;
        `pre` is `tokenizer.ggml.pre` and picks the pre-tokenizer) or "llama" (SentencePiece-style: token strings
        with U+2581 for spaces, `scores`, byte tokens <0xNN>; `add_space_prefix` defaults to true as in llama.cpp).
        `add_bos=None` means llama.cpp's default (true for SentencePiece-style and for Llama 3's pre-tokenizer).
        `name` is `general.name` (llama.cpp gives Phi-3's special tokens an rstrip by it).
        """
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer model {model!r}")
        warnings: list[str] = []
        types_in = list(token_types) if token_types is not None else [_TYPE_NORMAL] * len(tokens)
        if len(types_in) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(types_in)} token types")
        # llama.cpp names empty tokens "[EMPTY_<id>]" and forces marker-looking tokens to control type.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = np.asarray(types_in, dtype=np.int32)
        for i, text in enumerate(tokens):
            if text in _CONTROL_TEXTS:
                types[i] = _TYPE_CONTROL

        vocab: dict[str, int] = {}
        extra: dict[int, str] = {}
        for i, text in enumerate(tokens):
            if text in vocab:
                extra[i] = text
            else:
                vocab[text] = i

        if model == "llama":
            if extra:
                i = next(iter(extra))
                raise ValueError(f"duplicate token in vocabulary: {tokens[i]!r} has ids {vocab[tokens[i]]} and {i}")
            if scores is None:
                scores = [0.0] * len(tokens)
            if len(scores) != len(tokens):
                raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores")
            merge_pairs = _spm_merges(tokens, scores, vocab)
            try:
                backend = _HFTokenizer(models.BPE(vocab, merge_pairs, byte_fallback=True))
            except Exception as exc:
                raise ValueError(f"invalid SentencePiece-style vocabulary: {exc}") from exc
            # A character that is no token but starts one would merge in llama.cpp and fall back to bytes here.
            orphans = {ch for t, k in zip(tokens, types.tolist(), strict=True) if k == _TYPE_NORMAL for ch in t}
            orphans -= vocab.keys()
            if orphans:
                warnings.append(
                    f"{len(orphans)} characters occur inside tokens but are no token themselves; text with them "
                    "may tokenize differently from llama.cpp"
                )
            rules = _Rules(
                "spm",
                types,
                _partition_order(tokens, types, name),
                add_space_prefix=True if add_space_prefix is None else bool(add_space_prefix),
                add_eos=add_eos,
            )
            if add_bos is None:
                add_bos = True
            eos = list(eos_ids)
            eos += [i for text in _EOG_TEXTS if (i := vocab.get(text)) is not None]
            return cls(backend, bos_id=bos_id, eos_ids=eos, chat_template=chat_template, add_bos=add_bos,
                       warnings=warnings, rules=rules)

        pre_name = "default" if pre is None or pre == "" else str(pre)
        group = llama_cpp_pre_type(pre_name)
        if extra:
            warnings.append(
                f"{len(extra)} token strings occur more than once; later copies are never produced"
            )
        pairs: list[tuple[str, str]] = []
        for m in merges:
            if isinstance(m, str):
                left, sep, right = m.partition(" ")
                if not sep:
                    raise ValueError(f"malformed merge {m!r}: expected two tokens separated by a space")
                pairs.append((left, right))
            else:
                pairs.append((m[0], m[1]))
        try:
            bpe = models.BPE(vocab, pairs, ignore_merges=pre_name in _PRE_IGNORE_MERGES)
        except Exception as exc:
            raise ValueError(f"invalid BPE vocabulary or merges: {exc}") from exc
        backend = _HFTokenizer(bpe)
        backend.pre_tokenizer = _bpe_pre_tokenizer(group)
        isolate = _unrepresentable_class(vocab)
        if isolate:
            # llama.cpp's BPE cannot merge across a byte that has no token (it sits between its neighbours and is
            # dropped at the end); `tokenizers` drops it first and would merge the neighbours. Isolating such bytes
            # after the byte-level split (so the regex's word boundaries stay llama.cpp's) gives llama.cpp's result.
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [backend.pre_tokenizer, pre_tokenizers.Split(Regex(isolate), behavior="isolated", invert=False)]
            )
        backend.decoder = decoders.ByteLevel()

        if add_bos is None:
            add_bos = pre_name in _PRE_ADD_BOS
        if pre_name in _PRE_NO_BOS:
            bos_id = None
            add_bos = False
        eos = list(eos_ids)
        for text in _EOG_TEXTS:
            i = vocab.get(text)
            if i is not None:
                eos.append(i)
        rules = _Rules("bpe", types, _partition_order(tokens, types, name, pre_name), add_eos=add_eos)
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos,
            chat_template=chat_template,
            add_bos=add_bos,
            warnings=warnings,
            extra_tokens=extra,
            rules=rules,
        )

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """Build from the tokenizer metadata of a GGUF file: a path, a `gguf.GGUFReader`, or read_metadata()'s dict.

        A path is read with engine.formats.gguf_meta (the metadata only: fast, and it works on vocabulary-only files).
        """
        from engine.formats.gguf_meta import GGUFMetadata, read_metadata

        if isinstance(source, GGUFMetadata):
            meta: Any = source
        elif hasattr(source, "fields"):
            filename = getattr(getattr(source, "data", None), "filename", None)
            meta = read_metadata(filename) if filename else _ReaderView(source)
        else:
            meta = read_metadata(source)

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(key)
            return default if value is None else value

        model = get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("gpt2", "llama"):
            raise ValueError(
                f"unsupported tokenizer model {model!r} in GGUF: byte-level BPE ('gpt2': SmolLM2, Llama 3, Qwen2, "
                "...) and SentencePiece-style ('llama': Llama 2, Mistral, Phi-3, Gemma) are supported"
            )
        tokens = _strings(meta, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
        n = len(tokens)
        merges = _strings(meta, "tokenizer.ggml.merges") or []
        if model == "gpt2" and not merges:
            raise ValueError("the GGUF file has a BPE vocabulary without tokenizer.ggml.merges")
        types = get("tokenizer.ggml.token_type")
        scores = get("tokenizer.ggml.scores")
        for key, arr in (("token_type", types), ("scores", scores)):
            if arr is not None and len(arr) < n:
                raise ValueError(f"tokenizer.ggml.{key} has {len(arr)} entries for {n} tokens")

        def token_id(key: str, default: int | None) -> int | None:
            # llama.cpp keeps its default when the file names an id outside the vocabulary.
            value = get(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < n:
                return int(value)
            return default if default is not None and 0 <= default < n else None

        spm = model == "llama"
        bos = token_id("bos_token_id", 1 if spm else 11)
        eos = [i for key, d in (("eos_token_id", 2 if spm else 11), ("eot_token_id", None), ("eom_token_id", None))
               if (i := token_id(key, d)) is not None]
        if get("tokenizer.ggml.add_sep_token"):
            raise ValueError("the GGUF vocabulary appends a separator token (an encoder's); that is not supported")
        add_bos = get("tokenizer.ggml.add_bos_token")
        add_prefix = get("tokenizer.ggml.add_space_prefix")
        return cls.from_vocab(
            tokens,
            merges,
            None if types is None else [int(t) for t in types[:n]],
            model=model,
            scores=None if scores is None else np.asarray(scores[:n], dtype=np.float64).tolist(),
            pre=get("tokenizer.ggml.pre"),
            bos_id=bos,
            eos_ids=eos,
            chat_template=get("tokenizer.chat_template"),
            add_bos=None if add_bos is None else bool(add_bos),
            add_eos=bool(get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=None if add_prefix is None else bool(add_prefix),
            name=str(get("general.name", "")),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory (tokenizer.json, tokenizer_config.json, ...)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}: a Hugging Face model directory with a fast-tokenizer "
                "file is needed"
            )
        raw_text = tok_file.read_text(encoding="utf-8")
        raw = json.loads(raw_text)
        model_type = (raw.get("model") or {}).get("type")
        byte_level = "ByteLevel" in json.dumps([raw.get("pre_tokenizer"), raw.get("decoder")])
        if model_type != "BPE" or not byte_level:
            raise ValueError(
                f"unsupported tokenizer in {tok_file}: only byte-level BPE is supported "
                f"(found model {model_type!r}{'' if byte_level else ' without a ByteLevel pre-tokenizer'})"
            )
        backend = _HFTokenizer.from_str(raw_text)
        warnings: list[str] = []

        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text(encoding="utf-8"))

        # Added tokens that only the config declares (older exports) are added so they are matched in text.
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            content = entry.get("content")
            if not content or backend.token_to_id(content) is not None:
                continue
            token = AddedToken(content, special=bool(entry.get("special")), normalized=False)
            backend.add_tokens([token])
            got = backend.token_to_id(content)
            if str(got) != str(key):
                warnings.append(
                    f"added token {content!r} is id {got} here but {key} in tokenizer_config.json"
                )

        def token_id(value: Any) -> int | None:
            text = _token_content(value)
            return None if text is None else backend.token_to_id(text)

        bos_id = token_id(config.get("bos_token"))
        eos: list[int] = []
        if (i := token_id(config.get("eos_token"))) is not None:
            eos.append(i)
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen = json.loads(gen_file.read_text(encoding="utf-8"))
            value = gen.get("eos_token_id")
            eos.extend(value if isinstance(value, list) else [] if value is None else [value])
            if bos_id is None and isinstance(gen.get("bos_token_id"), int):
                bos_id = gen["bos_token_id"]
        for text in _EOG_TEXTS:
            if (i := backend.token_to_id(text)) is not None:
                eos.append(i)

        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            # Without an explicit flag the post-processor decides, as it does in transformers.
            prefix = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and prefix[:1] == [bos_id]

        template = cls._template_from_dir(path, config)
        return cls(
            backend, bos_id=bos_id, eos_ids=eos, chat_template=template, add_bos=add_bos, warnings=warnings
        )

    @staticmethod
    def _template_from_dir(path: Path, config: dict[str, Any]) -> str | None:
        # Newer transformers write the template to its own file; it takes precedence over the config entry.
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        json_file = path / "chat_template.json"
        template: Any = config.get("chat_template")
        if json_file.is_file():
            template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template", template)
        if isinstance(template, list):
            # Several named templates: the plain chat one is called "default".
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return template if isinstance(template, str) else None

    # ---------------------------------------------------------------------------------------------- cache


    def save(self, directory: str | Path) -> None:
        """Write a cache that `load` reads back quickly (tokenizer.json plus a small metadata file)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": CACHE_FORMAT,
            "bos_id": self.bos_id,
            "eos_ids": list(self.eos_ids),
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
            "warnings": self.warnings,
            "special_ids": np.flatnonzero(self._special).tolist(),
            "extra_tokens": {str(i): t for i, t in self._extra_tokens.items()},
            "rules": None if self._rules is None else self._rules.to_json(),
        }
        # Write then rename, metadata last: an interrupted save never leaves a cache that load() accepts.
        tmp = directory / (CACHE_TOKENIZER + ".tmp")
        self._backend.save(str(tmp))
        os.replace(tmp, directory / CACHE_TOKENIZER)
        blob = b"".join(self._token_bytes)
        tmp = directory / (CACHE_BYTES + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, self._lengths)
            np.save(f, np.frombuffer(blob, dtype=np.uint8))
        os.replace(tmp, directory / CACHE_BYTES)
        tmp = directory / (CACHE_META + ".tmp")
        tmp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, directory / CACHE_META)

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read a cache written by `save`.

        Raises FileNotFoundError when it is missing and ValueError when it is stale or inconsistent.
        """
        directory = Path(directory)
        meta_file = directory / CACHE_META
        tok_file = directory / CACHE_TOKENIZER
        if not meta_file.is_file() or not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer cache in {directory}")
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT:
            raise ValueError(
                f"tokenizer cache in {directory} has format {meta.get('format')}, need {CACHE_FORMAT}"
            )
        backend = _HFTokenizer.from_file(str(tok_file))
        rules = meta.get("rules")
        token_bytes = None
        bytes_file = directory / CACHE_BYTES
        if bytes_file.is_file():
            with open(bytes_file, "rb") as f:
                lengths = np.load(f)
                blob = np.load(f).tobytes()
            ends = np.cumsum(lengths).tolist()
            if not ends or ends[-1] != len(blob):
                raise ValueError(f"tokenizer cache in {directory} is inconsistent (token bytes)")
            starts = [0, *ends[:-1]]
            token_bytes = [blob[s:e] for s, e in zip(starts, ends, strict=True)]
        tok = cls(
            backend,
            bos_id=meta["bos_id"],
            eos_ids=meta["eos_ids"],
            chat_template=meta["chat_template"],
            add_bos=meta["add_bos"],
            warnings=meta["warnings"],
            extra_tokens={int(i): t for i, t in meta["extra_tokens"].items()},
            rules=None if rules is None else _Rules.from_json(rules),
            token_bytes=token_bytes,
        )
        if np.flatnonzero(tok._special).tolist() != meta["special_ids"]:
            raise ValueError(f"tokenizer cache in {directory} is inconsistent (special tokens differ)")
        return tok

    # -------------------------------------------------------------------------------------------- encoding

    def encode(self, text: str, *, parse_special: bool = True, add_special: bool = True) -> Tokenization:
        """Tokenize `text` as llama.cpp's llama_tokenize(text, add_special, parse_special) does.

        Special-token strings in the text become special tokens (`parse_special=False`: only user-defined ones, as in
        llama.cpp; Hugging Face directories always match them). `add_special` adds BOS (and EOS) where the model
        asks for them.
        """
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text is not valid Unicode: lone surrogate at index {exc.start}") from None
        if self._rules is not None:
            ids, starts, ends, unrepresentable = self._encode_gguf(text, data, parse_special)
        else:
            enc = self._backend.encode(text, add_special_tokens=False)
            ids = enc.ids
            tb = self._token_bytes
            if b"".join([tb[i] for i in ids]) == data:
                # The common case: tokens tile the input, so spans are running sums of cached byte lengths.
                lengths = self._lengths[np.asarray(ids, dtype=np.int64)]
                ends = np.cumsum(lengths)
                starts = ends - lengths
                unrepresentable = []
            else:
                starts, ends, unrepresentable = self._align(text, data, ids, enc.offsets, tb)

        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
            starts = np.concatenate([np.zeros(1, np.int64), starts])
            ends = np.concatenate([np.zeros(1, np.int64), ends])
        if add_special and self.add_eos:
            ids = [*ids, self.eos_ids[0]]
            starts = np.concatenate([starts, np.full(1, len(data), np.int64)])
            ends = np.concatenate([ends, np.full(1, len(data), np.int64)])

        byte_offsets = list(zip(starts.tolist(), ends.tolist(), strict=True))
        if len(data) == len(text):
            offsets = byte_offsets
        else:
            offsets = char_spans(text, starts, ends)

        return Tokenization(
            text=text,
            ids=ids,
            pieces=self._pieces_for(ids),
            offsets=offsets,
            byte_offsets=byte_offsets,
            special=self._special[np.asarray(ids, dtype=np.int64)].tolist() if ids else [],
            unrepresentable=unrepresentable,
        )

    def _partition(self, text: str, parse_special: bool) -> list[tuple[int, int, int]]:
        """llama.cpp's tokenizer_st_partition: (token id, start, end) for special tokens, (-1, start, end) for the
        text between them (character offsets). A token's span includes the whitespace its lstrip/rstrip removed."""
        frags: list[tuple[int, int, int]] = [(-1, 0, len(text))] if text else []
        if not text or self._special_start is None:
            return frags
        prefixes, index = self._special_prefixes, self._special_index
        found: set[int] = set()
        for m in self._special_start.finditer(text):
            p = m.start()
            end = p + 1
            while end <= len(text) and (s := text[p:end]) in prefixes:
                if (k := index.get(s)) is not None:
                    found.add(k)
                end += 1
        for k in sorted(found):
            tid, token, flags = self._specials[k]
            if flags & _NEEDS_PARSE_SPECIAL and not parse_special:
                continue
            out: list[tuple[int, int, int]] = []
            for frag in frags:
                if frag[0] != -1:
                    out.append(frag)
                    continue
                _, pos, end = frag
                while True:
                    m = text.find(token, pos, end)
                    if m < 0:
                        break
                    left = m
                    if flags & _LSTRIP:
                        while left > pos and text[left - 1] in _ASCII_SPACE:
                            left -= 1
                    if left > pos:
                        out.append((-1, pos, left))
                    pos = m + len(token)
                    if flags & _RSTRIP:
                        while pos < end and text[pos] in _ASCII_SPACE:
                            pos += 1
                    out.append((tid, left, pos))
                if pos < end:
                    out.append((-1, pos, end))
            frags = out
        return frags

    def _encode_gguf(
        self, text: str, data: bytes, parse_special: bool
    ) -> tuple[list[int], np.ndarray, np.ndarray, list[tuple[int, int]]]:
        rules = self._rules
        assert rules is not None
        spm = rules.kind == "spm"
        if len(data) == len(text):
            char_to_byte = None
        else:
            cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            char_len = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
            char_to_byte = np.concatenate([np.zeros(1, np.int64), np.cumsum(char_len)])
        ids: list[int] = []
        starts: list[np.ndarray] = []
        ends: list[np.ndarray] = []
        unrepresentable: list[tuple[int, int]] = []
        prev_special = True  # the start of the text counts as "after a special token" for the space prefix
        for tid, a, b in self._partition(text, parse_special):
            base = a if char_to_byte is None else int(char_to_byte[a])
            if tid >= 0:
                stop = b if char_to_byte is None else int(char_to_byte[b])
                ids.append(tid)
                starts.append(np.array([base], np.int64))
                ends.append(np.array([stop], np.int64))
                prev_special = True
                continue
            piece = text[a:b]
            prefix = 1 if spm and rules.add_space_prefix and prev_special else 0
            core = " " + piece if prefix else piece
            enc = self._backend.encode(core.replace(" ", _SPACE) if spm else core, add_special_tokens=False)
            fids = enc.ids
            fdata = core.encode("utf-8")
            cb = self._core_bytes
            tb = self._token_bytes
            if b"".join([cb.get(i) or tb[i] for i in fids]) == fdata:
                lengths = self._core_lengths[np.asarray(fids, dtype=np.int64)]
                e = np.cumsum(lengths)
                s = e - lengths
            else:
                view = [cb.get(i) or tb[i] for i in range(self.vocab_size)] if cb else tb
                s, e, bad = self._align(core, fdata, fids, enc.offsets, view)
                unrepresentable.extend((base + j - prefix, v) for j, v in bad if j >= prefix)
            if prefix:
                s = np.maximum(s - 1, 0)
                e = np.maximum(e - 1, 0)
            ids.extend(fids)
            starts.append(s + base)
            ends.append(e + base)
            prev_special = False
        if not ids:
            return [], np.zeros(0, np.int64), np.zeros(0, np.int64), unrepresentable
        return ids, np.concatenate(starts), np.concatenate(ends), unrepresentable

    def _align(
        self, text: str, data: bytes, ids: list[int], char_offsets: list[tuple[int, int]], tb: Sequence[bytes]
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Place tokens on the input bytes when they do not simply tile it (some bytes were dropped)."""
        unrep = self._unrepresentable_bytes
        n = len(data)
        starts = np.zeros(len(ids), np.int64)
        ends = np.zeros(len(ids), np.int64)
        char_to_byte: np.ndarray | None = None
        p = 0
        for k, i in enumerate(ids):
            b = tb[i]
            q = p
            while q < n and data[q] in unrep and not data.startswith(b, q):
                q += 1
            if data.startswith(b, q):
                starts[k], ends[k] = q, q + len(b)
                p = q + len(b)
                continue
            # Only a normaliser or an unknown-token substitute (possible in tokenizer.json files) gets here:
            # the token's bytes are not in the input, so trust the backend's own character offsets.
            if char_to_byte is None:
                lens = [len(ch.encode("utf-8", "surrogatepass")) for ch in text]
                char_to_byte = np.concatenate([np.zeros(1, np.int64), np.cumsum(lens, dtype=np.int64)])
            cs, ce = char_offsets[k]
            starts[k], ends[k] = char_to_byte[cs], char_to_byte[ce]
            p = max(p, int(ends[k]))
        covered = np.zeros(n + 1, np.int64)
        np.add.at(covered, starts, 1)
        np.add.at(covered, ends, -1)
        uncovered = np.flatnonzero(np.cumsum(covered)[:n] == 0)
        return starts, ends, [(int(j), data[j]) for j in uncovered]

    def _pieces_for(self, ids: Sequence[int]) -> list[str]:
        cache = self._pieces
        out: list[str] = []
        for i in ids:
            piece = cache[i]
            if piece is None:
                piece = cache[i] = self._make_piece(i)
            out.append(piece)
        return out

    def _make_piece(self, token_id: int) -> str:
        if self._special[token_id]:
            return self._text(token_id) or ""
        return _readable(self._token_bytes[token_id])

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return token_id

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a token sequence; byte sequences that are not valid UTF-8 come out as U+FFFD."""
        tb = self._token_bytes
        return b"".join([tb[self._check_id(i)] for i in ids]).decode("utf-8", "replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (special tokens: their text in UTF-8)."""
        return self._token_bytes[self._check_id(token_id)]

    def piece(self, token_id: int) -> str:
        """Readable text of one token, as in `Tokenization.pieces`."""
        return self._pieces_for([self._check_id(token_id)])[0]

    def is_special(self, token_id: int) -> bool:
        return bool(self._special[self._check_id(token_id)])

    def token_id(self, text: str) -> int | None:
        """Id of a token given its vocabulary string (byte-level form, e.g. "Ġthe"), or None."""
        return self._backend.token_to_id(text)

    # ------------------------------------------------------------------------------------------------ chat

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return (self._text(token_id) or "") if self._special[token_id] else self.decode([token_id])

    @property
    def chat_unavailable(self) -> str | None:
        """Why this model cannot wrap a prompt in a chat template, or None when it can.

        A model with no template of its own falls back to ChatML only if its vocabulary has ChatML's special tokens;
        otherwise (a base model such as Gemma 3 270M) ChatML's markers would be split into ordinary text pieces the
        model never saw in training."""
        if self.chat_template or all(self.token_id(t) is not None for t in CHATML_TOKENS):
            return None
        return ("this model has no chat template (a base model, not an instruction-tuned one) and its vocabulary has "
                "no ChatML tokens; give the prompt as plain text (without --chat / the Chat toggle)")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (ChatML when it has none and its vocabulary has ChatML's tokens) in a
        Jinja sandbox; ValueError when it has neither (chat_unavailable says why)."""
        if (why := self.chat_unavailable) is not None:
            raise ValueError(why)
        template = _compile_template(self.chat_template or CHATML_TEMPLATE)
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_id),
                eos_token=self._token_text(self.eos_ids[0] if self.eos_ids else None),
                tools=None,
                documents=None,
            )
        except SecurityError as exc:
            raise ValueError(f"chat template attempted an operation the sandbox forbids: {exc}") from exc
        except TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def chat_prompt(self, user_text: str) -> str:
        """The prompt for one user message, ready for the assistant's reply."""
        return self.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids})"


class StreamDecoder:
    """Incremental detokenizer: feed token ids one by one, get back the text each adds (empty while a
    multi-byte UTF-8 character is incomplete)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Text still held back (an unfinished character comes out as U+FFFD); the decoder starts afresh."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


def char_spans(text: str, starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    """Character spans of byte spans over text's UTF-8 encoding (a span inside a multi-byte character gets that
    character's span; an empty span stays empty at its start)."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    char_len = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    byte_to_char = np.append(np.repeat(np.arange(len(text), dtype=np.int64), char_len), len(text))
    cstart = byte_to_char[starts]
    cend = np.where(ends > starts, byte_to_char[np.maximum(ends - 1, 0)] + 1, cstart)
    return list(zip(cstart.tolist(), cend.tolist(), strict=True))
