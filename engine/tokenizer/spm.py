"""SentencePiece-style (`tokenizer.ggml.model` "llama") vocabularies: llama.cpp's score-driven merge as BPE merges."""

from __future__ import annotations

from collections.abc import Sequence


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
