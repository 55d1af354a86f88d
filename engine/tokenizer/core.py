"""The Tokenizer: encode text as llama.cpp does, with the bookkeeping a live view needs (byte and character spans,
readable pieces, special-token flags, the input bytes no token stands for), decode, and wrap prompts in the chat
template. Building one is engine.tokenizer.build's, its disk cache engine.tokenizer.cache's.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from engine.tokenizer import build, cache, chat
from engine.tokenizer.chat import CHATML_TEMPLATE, CHATML_TOKENS
from engine.tokenizer.vocab import (
    _BYTE_TOKEN,
    _LSTRIP,
    _NEEDS_PARSE_SPECIAL,
    _RSTRIP,
    _SPACE,
    _TYPE_BYTE,
    _TYPE_CONTROL,
    _TYPE_NORMAL,
    _TYPE_UNKNOWN,
    _TYPE_USER_DEFINED,
    _byte_level_tables,
    _readable,
    _Rules,
    bytes_to_unicode,
)

__all__ = ["Tokenization", "Tokenizer", "StreamDecoder", "char_spans"]

_ASCII_SPACE = " \t\n\v\f\r"  # C isspace(), which llama.cpp's lstrip/rstrip use


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
        self._chat_refused: str | None = None  # why the chat template was refused, once it has been

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
        literal = (_TYPE_CONTROL, _TYPE_UNKNOWN, _TYPE_USER_DEFINED)
        spm = rules is not None and rules.kind == "spm"
        # a Hugging Face directory's added tokens are matched in the raw text, as a GGUF's literal kinds are
        kinds = self._types.tolist() if rules is not None else [
            _TYPE_USER_DEFINED if i in added else _TYPE_NORMAL for i in range(len(texts))]
        for text, kind in zip(texts, kinds, strict=True):
            if text is None:
                out.append(b"")
            elif kind in literal:  # stands for its own UTF-8 bytes
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

    # ------------------------------------------------------------------------ constructors (build.py), cache (cache.py)
    # build's and cache's functions take the class (or the tokenizer) first, as a classmethod (or method) is called.
    from_vocab = classmethod(build.from_vocab)
    from_gguf = classmethod(build.from_gguf)
    from_dir = classmethod(build.from_dir)
    load = classmethod(cache.load)
    save = cache.save

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
            starts, ends, unrepresentable = self._spans(text, data, enc, {})

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
        char_to_byte = None if len(data) == len(text) else _char_to_byte(text)
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
            s, e, bad = self._spans(core, core.encode("utf-8"), enc, self._core_bytes)
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

    def _spans(self, text: str, data: bytes, enc: Any, core_bytes: dict[int, bytes]
               ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Byte spans of an encoding's tokens over `data`, and the bytes no token stands for. `core_bytes`: the
        tokens that stand for other bytes inside the merged text than token_bytes says (_core_bytes)."""
        tb, ids = self._token_bytes, enc.ids
        if b"".join([core_bytes.get(i) or tb[i] for i in ids]) == data:
            # The common case: tokens tile the input, so spans are running sums of cached byte lengths.
            lengths = (self._core_lengths if core_bytes else self._lengths)[np.asarray(ids, dtype=np.int64)]
            ends = np.cumsum(lengths)
            return ends - lengths, ends, []
        view = [core_bytes.get(i) or tb[i] for i in range(self.vocab_size)] if core_bytes else tb
        return self._align(text, data, ids, enc.offsets, view)

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
                char_to_byte = _char_to_byte(text)
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
        model never saw in training. A template refused once (see apply_chat_template) stays refused."""
        if self._chat_refused is not None:
            return self._chat_refused
        if self.chat_template or all(self.token_id(t) is not None for t in CHATML_TOKENS):
            return None
        return ("this model has no chat template (a base model, not an instruction-tuned one) and its vocabulary has "
                "no ChatML tokens; give the prompt as plain text (without --chat / the Chat toggle)")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (ChatML when it has none and its vocabulary has ChatML's tokens) in a
        Jinja sandbox, within a time and size budget (engine.tokenizer.chat); ValueError when it has neither
        (chat_unavailable says why) or the template fails.

        A template that breaks the sandbox or the budget or does not compile is remembered as refused: later calls
        (the GUI renders on every keystroke) raise at once instead of running it again."""
        if (why := self.chat_unavailable) is not None:
            raise ValueError(why)
        try:
            return chat.render(
                self.chat_template or CHATML_TEMPLATE,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_id),
                eos_token=self._token_text(self.eos_ids[0] if self.eos_ids else None),
                tools=None,
                documents=None,
            )
        except chat.ChatTemplateRefused as exc:
            self._chat_refused = str(exc)
            raise

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
    byte_to_char = np.append(np.repeat(np.arange(len(text), dtype=np.int64), np.diff(_char_to_byte(text))), len(text))
    cstart = byte_to_char[starts]
    cend = np.where(ends > starts, byte_to_char[np.maximum(ends - 1, 0)] + 1, cstart)
    return list(zip(cstart.tolist(), cend.tolist(), strict=True))


def _char_to_byte(text: str) -> np.ndarray:
    """Where each character of `text` starts in its UTF-8 encoding, and where the encoding ends (len(text) + 1)."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    char_len = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(char_len)])
