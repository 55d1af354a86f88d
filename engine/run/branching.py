"""Forcing and branching: put a chosen token at a chosen step and let the model continue from there.

A fork of a generation at step K with token X is a new generation whose prompt is the old prompt plus the first
K generated tokens, and whose first token is forced to X. The session's KV cache already holds that prefix (prefix
caching), so only the last prefix token is run again: the fork costs one decode step, not a new prefill.

    prompt p₀…pₙ₋₁ → t₀ t₁ … t_{K-1} │ t_K …     the original generation
                                     └ X  u₁ u₂ …  the fork: X forced, then sampled with the current settings
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from engine.tokenizer import Tokenization, Tokenizer, char_spans


def parse_force(items: Sequence[str]) -> dict[int, int]:
    """`["STEP:TOKEN_ID", …]` → {step: token id}; ValueError naming the bad item."""
    forced: dict[int, int] = {}
    for item in items:
        step, sep, token = item.partition(":")
        try:
            if not sep:
                raise ValueError
            s, t = int(step), int(token)
        except ValueError:
            raise ValueError(f"--force takes STEP:TOKEN_ID (two integers), got {item!r}") from None
        if s < 0 or t < 0:
            raise ValueError(f"--force needs a step ≥ 0 and a token id ≥ 0, got {item!r}")
        if s in forced and forced[s] != t:
            raise ValueError(f"--force names step {s} twice ({forced[s]} and {t})")
        forced[s] = t
    return forced


def check_forced(forced: Mapping[int, int], vocab_size: int, max_new_tokens: int) -> dict[int, int]:
    """The forced tokens as a plain dict, or ValueError if a step or an id cannot be used."""
    out = {}
    for step, token in sorted(forced.items()):
        if not 0 <= int(token) < vocab_size:
            raise ValueError(f"forced token {token} at step {step} is outside the vocabulary (0..{vocab_size - 1})")
        if not 0 <= int(step) < max_new_tokens:
            raise ValueError(f"a token is forced at step {step}; the generation has steps 0..{max_new_tokens - 1}")
        out[int(step)] = int(token)
    return out


def tokenization_of(tokenizer: Tokenizer, ids: Sequence[int]) -> Tokenization:
    """A Tokenization for a sequence of ids that came from the model rather than from a text.

    The text is the decoded bytes; byte spans are the tokens' byte lengths laid end to end, and character spans
    map them onto the decoded text (a token inside a multi-byte character gets that character's span).
    """
    ids = [int(i) for i in ids]
    raw = [tokenizer.token_bytes(i) for i in ids]
    data = b"".join(raw)
    text = data.decode("utf-8", "replace")
    ends = np.cumsum([len(b) for b in raw], dtype=np.int64) if ids else np.zeros(0, np.int64)
    starts = ends - np.asarray([len(b) for b in raw], dtype=np.int64)
    byte_offsets = list(zip(starts.tolist(), ends.tolist(), strict=True))
    if data == text.encode("utf-8") and len(data) != len(text):
        offsets = char_spans(text, starts, ends)
    elif len(data) == len(text):
        offsets = byte_offsets
    else:  # invalid UTF-8 somewhere: character spans are only approximate, clip them to the text
        offsets = [(min(s, len(text)), min(e, len(text))) for s, e in byte_offsets]
    return Tokenization(
        text=text, ids=ids, pieces=[tokenizer.piece(i) for i in ids], offsets=offsets, byte_offsets=byte_offsets,
        special=[tokenizer.is_special(i) for i in ids], unrepresentable=[],
    )
