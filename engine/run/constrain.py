"""Constrained decoding: a regular expression or a JSON schema decides which tokens may come next.

The grammar engine is llguidance (Microsoft's Rust library behind Guidance, also used by llama.cpp and vLLM). It was
chosen by measuring it against outlines-core on both default vocabularies (SmolLM2's 49,152 tokens, Gemma 3's
262,144): a step's mask is cheap with either, but a new regex or schema compiles many times faster with llguidance,
because outlines-core first builds an index over the whole vocabulary, which grows with it; and llguidance hands back
a bitmask, not a Python list of allowed ids. Its view of the tokenizer costs a noticeable moment to build on a large
vocabulary, so it is built once per model and kept.

Each step: `allowed()` gives the (V,) boolean mask for the next token; the sampler sets the logits of the rest to
−∞ (the funnel shows them as "removed by the grammar", before temperature); `advance(token)` feeds the chosen
token. When the grammar is complete and allows nothing more, `stopped` is true and the generation ends.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

# The last tokenizer's llguidance twin (building it reads every token's bytes). One entry only: the twin holds its
# tokenizer alive, and a large vocabulary (Gemma 3: 262k pieces) must go when its model does.
_LL_LAST: list[tuple[Any, Any]] = []  # [(tokenizer, llguidance.LLTokenizer)]


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: list[int]):
    import llguidance

    if _LL_LAST and _LL_LAST[0][0] is tokenizer:
        return _LL_LAST[0][1]

    class _Wrapped:  # what llguidance.TokenizerWrapper reads: token bytes, EOS/BOS, special ids, an encoder
        eos_token_id = eos_ids[0]
        bos_token_id = tokenizer.bos_id
        tokens = [tokenizer.token_bytes(i) if i < tokenizer.vocab_size else b"" for i in range(vocab_size)]
        special_token_ids = [i for i in range(min(vocab_size, tokenizer.vocab_size)) if tokenizer.is_special(i)]

        def __call__(self, data: bytes) -> list[int]:
            ids = tokenizer.encode(data.decode("utf-8", "replace")).ids
            return ids[1:] if ids and tokenizer.add_bos and ids[0] == tokenizer.bos_id else ids

    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()), n_vocab=vocab_size, eos_token=eos_ids)
    _LL_LAST[:] = [(tokenizer, ll)]
    return ll


class Constraint:
    """A grammar over the output: regex or JSON schema. One per generation (it keeps the parse state)."""

    def __init__(self, kind: str, source: str, matcher, vocab_size: int) -> None:
        self.kind, self.source, self._matcher, self.vocab_size = kind, source, matcher, vocab_size

    @classmethod
    def build(cls, tokenizer, vocab_size: int, eos_ids: list[int], *, regex: str | None = None,
              json_schema: str | dict | None = None) -> Constraint:
        """ValueError with one sentence when the regex or the schema cannot be used."""
        import llguidance

        if (regex is None) == (json_schema is None):
            raise ValueError("give either a regular expression or a JSON schema")
        if not eos_ids:
            raise ValueError("constrained decoding needs the model's end-of-text token, and this model names none")
        if regex is not None:
            kind, source, grammar = "regex", regex, llguidance.LLMatcher.grammar_from_regex(regex)
        else:
            try:
                schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is a JSON object")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema cannot be used: {e}") from None
            kind, source = "json-schema", json.dumps(schema)
        ll = _ll_tokenizer(tokenizer, vocab_size, list(eos_ids))
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            what = "regular expression" if kind == "regex" else "JSON schema"
            raise ValueError(f"the {what} cannot be used: {matcher.get_error()}")
        return cls(kind, source, matcher, vocab_size)

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: self.vocab_size]
        return bits.astype(bool)

    def mask_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Logits with every token the grammar forbids set to −∞, and how many tokens it allows."""
        allowed = torch.from_numpy(self.allowed()).to(logits.device)
        return logits.masked_fill(~allowed, float("-inf")), int(allowed.sum())

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise ValueError(f"token {token} does not fit the {self.kind}: {self._matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return bool(self._matcher.is_stopped())

