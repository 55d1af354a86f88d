"""What the tokens of a GGUF vocabulary mean to llama.cpp: token types, the texts it forces to control or
end-of-generation, the order and lstrip/rstrip rules of special-token matching, and GPT-2's byte-to-character table.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

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


@dataclass
class _Rules:
    """How llama.cpp treats the text around the merging, for a GGUF vocabulary."""

    kind: str  # "spm" (SentencePiece-style, tokenizer.ggml.model "llama") or "bpe" (byte-level, "gpt2")
    token_types: np.ndarray  # GGUF token type per id, after llama.cpp's overrides
    specials: list[tuple[int, int]]  # (id, flags) of the tokens matched in text, in llama.cpp's order
    add_space_prefix: bool = False
    add_eos: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "token_types": self.token_types.tolist()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Rules:
        return cls(kind=d["kind"], token_types=np.asarray(d["token_types"], dtype=np.int32),
                   specials=[(int(i), int(f)) for i, f in d["specials"]],
                   add_space_prefix=bool(d["add_space_prefix"]), add_eos=bool(d["add_eos"]))


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
