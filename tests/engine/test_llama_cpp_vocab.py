"""GGUF tokenizers held to llama.cpp: its own test vocabularies and expected ids, and a transcription of its code.

References, neither sharing code with engine/tokenizer/core.py (which runs every merge in Hugging Face `tokenizers`):
- tests/data/llama_cpp_vocab/: llama.cpp's tokenizer test files, `NAME.gguf.out` being the ids llama.cpp's
  test-tokenizer-0 expects for each text of `NAME.gguf.inp` (origin and licence in the README there).
- `_SpmReference`: a slow pure-Python transcription of llama.cpp's SentencePiece-style tokenizer as llama-vocab.cpp
  has it: special tokens split off longest first (tokenizer_st_partition), a space put before text that starts the
  prompt or follows a special token, spaces escaped to U+2581, then a heap of neighbouring-symbol pairs whose
  concatenation is a token, highest score first and leftmost first among equal scores, and byte fallback for
  characters that end up without a token.
"""

from __future__ import annotations

import heapq
import lzma
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.formats.gguf_meta import read_metadata
from engine.tokenizer import SUPPORTED_PRE, Tokenization, Tokenizer, llama_cpp_pre_type
from engine.tokenizer.pretokenize import _PRE_GROUP
from engine.tokenizer.vocab import _LSTRIP, _RSTRIP
from tests.requires import gemma3, import_required
from tests.tiny_tokenizer import tiny_vocab

DATA = Path(__file__).resolve().parent.parent / "data" / "llama_cpp_vocab"
_WS = b" \t\n\v\f\r"  # C isspace(), what llama.cpp's lstrip/rstrip take

# test file -> vocabulary file (qwen2's own vocabulary is too large to keep; DeepSeek-R1-Distill-Qwen's is Qwen2.5's)
FAMILIES = {
    "llama-spm": "llama-spm",
    "phi-3": "phi-3",
    "gpt-2": "gpt-2",
    "mpt": "mpt",
    "starcoder": "starcoder",
    "refact": "refact",
    "falcon": "falcon",
    "deepseek-coder": "deepseek-coder",
    "deepseek-llm": "deepseek-llm",
    "deepseek-r1-qwen": "deepseek-r1-qwen",
    "qwen2": "deepseek-r1-qwen",
}


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama_cpp_vocab")
    for packed in DATA.glob("*.gguf.xz"):
        with lzma.open(packed) as src, open(out / packed.name.removesuffix(".xz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(vocab_dir: Path, name: str) -> Tokenizer:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = Tokenizer.from_gguf(vocab_dir / f"ggml-vocab-{name}.gguf")
    return _TOKENIZERS[name]


def _cases(family: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's read_tests(): texts split on the separator, one line of ids per text."""
    texts = (DATA / f"ggml-vocab-{family}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = (DATA / f"ggml-vocab-{family}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts)
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines[: len(texts)], strict=True)]


def _check_consistent(tok: Tokenizer, t: Tokenization) -> None:
    """Spans tile the input in order (the added BOS spans nothing); each token's bytes are its span's bytes, or a
    space and them for a SentencePiece token carrying the space prefix; pieces and flags agree with the vocabulary.
    SentencePiece as llama.cpp runs it escapes every space to U+2581 before merging, so a U+2581 typed in the text is
    a space to it: a token over one holds a space there (llama.cpp decodes it as one). A token matched in the text
    with lstrip/rstrip (phi-3's) spans the whitespace it swallowed, so that nothing of the text is left between."""
    data = t.text.encode("utf-8")
    strips = {i: f for i, _, f in tok._specials if f & (_LSTRIP | _RSTRIP)}
    skipped = {pos for pos, _ in t.unrepresentable}
    assert t.pieces == [tok.piece(i) for i in t.ids] and t.special == [tok.is_special(i) for i in t.ids]
    pos = 0
    for k, (i, (bs, be)) in enumerate(zip(t.ids, t.byte_offsets, strict=True)):
        if k == 0 and i == tok.bos_id and tok.add_bos and bs == be == 0:
            continue
        while pos < bs:
            assert pos in skipped
            pos += 1
        assert bs == pos, (k, i, bs, pos)
        span = data[bs:be]
        if i in strips:
            span = span.lstrip(_WS) if strips[i] & _LSTRIP else span
            span = span.rstrip(_WS) if strips[i] & _RSTRIP else span
        spans = (span, span.replace("\u2581".encode(), b" ")) if tok.kind == "spm" else (span,)
        assert tok.token_bytes(i) in (*spans, *(b" " + s for s in spans)) or tok.is_special(i), (k, i, span)
        pos = be
    assert all(p in skipped for p in range(pos, len(data)))


def _llama_cpp_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, parse_special=False, add_special=False).ids


# ------------------------------------------------------------------------------------ llama.cpp's test files


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_test_file(vocab_dir: Path, family: str) -> None:
    tok = _tokenizer(vocab_dir, FAMILIES[family])
    assert tok.warnings == []
    cases = _cases(family)
    assert len(cases) >= 40
    failed = [(text, _llama_cpp_ids(tok, text), ids) for text, ids in cases if _llama_cpp_ids(tok, text) != ids]
    print(f"{family}: {len(cases) - len(failed)}/{len(cases)} cases as llama.cpp")
    assert not failed, f"{len(failed)} of {len(cases)} differ from llama.cpp, first: {failed[0]}"
    for text, _ in cases:
        _check_consistent(tok, tok.encode(text))


def test_the_grouping_matters(vocab_dir: Path) -> None:
    """deepseek-r1-qwen tokenized with another group's rules misses llama.cpp's output: the test file can fail."""
    meta = read_metadata(vocab_dir / "ggml-vocab-deepseek-r1-qwen.gguf")
    tokens = meta.strings("tokenizer.ggml.tokens")
    merges = meta.strings("tokenizer.ggml.merges")
    wrong = Tokenizer.from_vocab(tokens, merges, meta["tokenizer.ggml.token_type"].tolist(), pre="gpt-2")
    cases = _cases("deepseek-r1-qwen")
    bad = sum(_llama_cpp_ids(wrong, text) != ids for text, ids in cases)
    assert bad >= 4


def test_every_llama_cpp_pre_tokenizer_is_reproduced_or_refused_by_name() -> None:
    tokens, merges, types = tiny_vocab(300)
    built, refused = [], []
    for name in sorted(_PRE_GROUP):
        try:
            tok = Tokenizer.from_vocab(tokens, merges, types, pre=name, bos_id=1)
        except ValueError as exc:
            assert repr(name) in str(exc) and "not reproduced" in str(exc)
            refused.append(name)
            continue
        assert tok.encode("ab 12345 x").ids and tok.warnings == []
        built.append(name)
    assert set(built) == SUPPORTED_PRE
    assert {"deepseek-r1-qwen", "qwen2", "llama-bpe", "smollm", "gpt-2", "falcon", "deepseek-llm"} <= set(built)
    assert {"tekken", "gpt-4o", "deepseek-v3", "chameleon", "bloom"} <= set(refused)
    assert llama_cpp_pre_type("deepseek-r1-qwen") == llama_cpp_pre_type("qwen2") == "qwen2"
    assert llama_cpp_pre_type(None) == "default"
    with pytest.raises(ValueError, match="unknown GGUF pre-tokenizer 'no-such-thing'"):
        Tokenizer.from_vocab(tokens, merges, types, pre="no-such-thing")


def test_other_vocabulary_kinds_are_refused(vocab_dir: Path) -> None:
    with pytest.raises(ValueError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf(vocab_dir / "ggml-vocab-bert-bge.gguf")


def test_missing_pre_tokenizer_means_llama_cpp_default(vocab_dir: Path) -> None:
    tok = _tokenizer(vocab_dir, "gpt-neox")  # no tokenizer.ggml.pre: llama.cpp's DEFAULT regexes
    # DEFAULT splits runs of punctuation and three-digit groups off before the GPT-2 split.
    pieces = tok.encode("a+=b 12345").pieces
    assert pieces[:3] == ["a", "+=", "b"] and "".join(pieces) == "a+=b 12345"
    assert [p.strip() for p in pieces if p.strip().isdigit()] == ["123", "45"]


# ------------------------------------------------------------------------------------ SentencePiece reference

_EOG_LIKE = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"}


class _SpmReference:
    def __init__(self, meta: dict) -> None:
        self.tokens = [b.decode("utf-8") for b in meta["tokenizer.ggml.tokens"]]
        self.scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
        types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
        types = [3 if t in _EOG_LIKE else k for t, k in zip(self.tokens, types, strict=True)]
        self.id = {t: i for i, t in enumerate(self.tokens)}
        self.bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        self.prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        phi3 = "phi3" in str(meta.get("general.name", "")).lower()
        special = [i for i, k in enumerate(types) if k in (2, 3, 4)]
        special.sort(key=lambda i: -len(self.tokens[i].encode()))  # ties do not overlap in these vocabularies
        self.special = []
        for i in special:
            rstrip = phi3 and self.tokens[i] not in ("<unk>", "<s>", "<|endoftext|>")
            self.special.append((i, self.tokens[i], types[i] != 4, rstrip))

    def tokenize(self, text: str, parse_special: bool = True, add_bos: bool = True) -> list[int]:
        frags: list[object] = [text] if text else []
        for i, s, needs_parse, rstrip in self.special:
            if needs_parse and not parse_special:
                continue
            out: list[object] = []
            for f in frags:
                if not isinstance(f, str) or s not in f:
                    out.append(f)
                    continue
                parts = f.split(s)
                for k, part in enumerate(parts):
                    if k > 0:
                        out.append(i)
                        if rstrip:
                            part = part.lstrip(" \t\n\v\f\r")
                    if part:
                        out.append(part)
            frags = out
        ids = [self.bos] if add_bos and self.add_bos else []
        after_special = True
        for f in frags:
            if isinstance(f, int):
                ids.append(f)
                after_special = True
            else:
                ids += self._merge(((" " if self.prefix and after_special else "") + f).replace(" ", "\u2581"))
                after_special = False
        return ids

    def _merge(self, text: str) -> list[int]:
        sym = list(text)  # "" marks a symbol merged into its left neighbour
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0 and (t := self.id.get(sym[left] + sym[right])) is not None:
                heapq.heappush(heap, (-self.scores[t], left, right, len(sym[left]) + len(sym[right])))

        for k in range(1, len(sym)):
            push(k - 1, k)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        out: list[int] = []
        k = 0
        while k >= 0:
            s = sym[k]
            if s in self.id:
                out.append(self.id[s])
            else:
                out += [self.id[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
            k = nxt[k]
        return out


spm_text = st.lists(
    st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=12),
        st.text(" \n\t", min_size=1, max_size=20),  # whitespace runs: Llama 2's tie-scored U+2581 tokens
        st.sampled_from(
            ["<s>", "</s>", "<unk>", "<|end|>", "<|user|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "\n\n",
             " the", "The", "  hello", "ing", "😀", "世界", "\u2581", "<0x41>", "[multimodal]", "<unused1>"]
        ),
    ),
    max_size=10,
).map("".join)


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "baichuan"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=spm_text, parse_special=st.booleans())
def test_spm_matches_reference(vocab_dir: Path, name: str, text: str, parse_special: bool) -> None:
    tok = _tokenizer(vocab_dir, name)
    ref = _reference(vocab_dir / f"ggml-vocab-{name}.gguf")
    assert tok.encode(text, parse_special=parse_special).ids == ref.tokenize(text, parse_special)
    _check_consistent(tok, tok.encode(text, parse_special=parse_special))


_REFS: dict[Path, _SpmReference] = {}


def _reference(path: Path) -> _SpmReference:
    if path not in _REFS:
        _REFS[path] = _SpmReference(read_metadata(path))
    return _REFS[path]


def test_spm_details(vocab_dir: Path) -> None:
    tok = _tokenizer(vocab_dir, "llama-spm")
    assert tok.kind == "spm" and tok.add_bos and tok.bos_id == 1 and tok.eos_ids == (2,)
    t = tok.encode("Hello world")
    assert t.ids == [1, 15043, 3186]
    assert t.pieces == ["<s>", " Hello", " world"] and t.byte_offsets == [(0, 0), (0, 5), (5, 11)]
    # Byte fallback: a character without a token becomes its UTF-8 bytes, each shown as a byte.
    t = tok.encode("\U0001f9ff")
    assert t.pieces[1:] == [" ", "<0xF0>", "<0x9F>", "<0xA7>", "<0xBF>"]
    assert t.byte_offsets[2:] == [(0, 1), (1, 2), (2, 3), (3, 4)] and t.unrepresentable == []
    assert tok.decode(t.ids[1:]) == " \U0001f9ff"
    # Special tokens are matched in the text and the text after them gets the space prefix again.
    t = tok.encode("a</s>b")
    assert t.ids == [1, 263, 2, 289] and t.special == [True, False, True, False]
    assert tok.encode("a</s>b", parse_special=False).ids != t.ids
    assert tok.encode("", add_special=True).ids == [1] and tok.encode("", add_special=False).ids == []
    _check_consistent(tok, tok.encode("  x\U0001f9ff</s> y\n\n"))
    # a typed U+2581 is a space to llama.cpp: its token spans the three bytes and holds a space
    t = tok.encode("x \u2581\u2581 y\u2581the")
    assert t.pieces == ["<s>", " x", "   ", " y", " the"] and t.byte_offsets[2:] == [(1, 8), (8, 10), (10, 16)]
    _check_consistent(tok, t)


def test_spm_chat_template_from_the_gguf(vocab_dir: Path) -> None:
    tok = _tokenizer(vocab_dir, "phi-3")
    assert tok.chat_prompt("hi") == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    ids = tok.encode(tok.chat_prompt("hi")).ids
    assert ids[:3] == [1, 1, 32010]  # the template writes <s> and llama.cpp adds BOS too (it warns about that)
    assert ids == _reference(vocab_dir / "ggml-vocab-phi-3.gguf").tokenize(tok.chat_prompt("hi"))


def test_spm_cache_round_trip(vocab_dir: Path, tmp_path: Path) -> None:
    tok = _tokenizer(vocab_dir, "phi-3")
    tok.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    for text, _ in _cases("phi-3"):
        assert loaded.encode(text) == tok.encode(text)
    assert [loaded.token_bytes(i) for i in range(tok.vocab_size)] == [tok.token_bytes(i) for i in range(tok.vocab_size)]


def test_duplicate_spm_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate token"):
        Tokenizer.from_vocab(["<unk>", "a", "a"], model="llama", scores=[0, -1, -2], token_types=[2, 1, 1])


# ---------------------------------------------------------------------------------------------- the CLI


def test_tokenize_cli_on_a_vocabulary_only_file(vocab_dir: Path, tmp_path: Path) -> None:
    """`tokenize` reads the tokenizer only: a vocabulary-only GGUF works, and neither torch nor weights load."""
    import json
    import os
    import subprocess
    import sys

    probe = (
        "import sys; from engine.__main__ import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'tokenize imported torch'; sys.exit(rc)"
    )
    env = {**os.environ, "INFERENCE_LAB_CACHE": str(tmp_path)}
    root = str(Path(__file__).resolve().parents[2])

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", probe, "tokenize", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=120)

    path = vocab_dir / "ggml-vocab-llama-spm.gguf"
    for _ in range(2):  # built, then from the tokenizer cache
        done = run("--model", str(path), "--text", "Hello world", "--json")
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["ids"] == [1, 15043, 3186] and out["pieces"] == ["<s>", " Hello", " world"]
    done = run("--model", str(vocab_dir / "ggml-vocab-bert-bge.gguf"), "--text", "x")
    assert done.returncode == 1 and "unsupported tokenizer model 'bert'" in done.stderr
    assert done.stderr.count("\n") == 1  # one line, no traceback
    # Llama 1/2's vocabulary has no chat template and no ChatML tokens: --chat is refused, not wrapped in ChatML
    done = run("--model", str(path), "--text", "hi", "--chat")
    assert done.returncode == 1 and "has no chat template" in done.stderr and done.stdout == ""
    assert done.stderr.count("\n") == 1


# ------------------------------------------------------------------------------------- Gemma 3 270M (real)


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf(gemma3())


@pytest.mark.slow
def test_gemma_known_tokenizations(gemma: Tokenizer) -> None:
    assert gemma.kind == "spm" and gemma.vocab_size == 262144 and gemma.bos_id == 2 and gemma.add_bos
    assert gemma.encode("The capital of France is").ids == [2, 818, 5279, 529, 7001, 563]  # llama.cpp's
    t = gemma.encode("<start_of_turn>user\nhi<end_of_turn>\n")
    assert t.pieces == ["<bos>", "<start_of_turn>", "user", "\n", "hi", "<end_of_turn>", "\n"]
    assert t.special == [True, True, False, False, False, True, False]
    assert 106 in gemma.eos_ids  # <end_of_turn>
    # the base model has no chat template and ChatML's markers are not in its vocabulary: chat is refused
    assert gemma.chat_template is None and gemma.token_id("<|im_start|>") is None
    assert gemma.chat_unavailable is not None
    with pytest.raises(ValueError, match="no chat template"):
        gemma.chat_prompt("hi")
    t = gemma.encode("𝔘")  # no token: four byte-fallback tokens
    assert t.pieces[1:] == ["<0xF0>", "<0x9D>", "<0x94>", "<0x98>"] and t.unrepresentable == []
    t = gemma.encode("a\u2581b \u2581the\u2581")  # a typed U+2581 is a space (no space prefix on Gemma)
    assert t.pieces[1:] == ["a", " b", " ", " the", " "]
    assert t.byte_offsets[1:] == [(0, 1), (1, 5), (5, 6), (6, 12), (12, 15)]
    _check_consistent(gemma, t)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=spm_text, parse_special=st.booleans())
def test_gemma_matches_reference(gemma: Tokenizer, text: str, parse_special: bool) -> None:
    ref = _reference(gemma3())
    assert gemma.encode(text, parse_special=parse_special).ids == ref.tokenize(text, parse_special)
    _check_consistent(gemma, gemma.encode(text, parse_special=parse_special))


@pytest.mark.slow
def test_gemma_long_text_is_one_line_repeated(gemma: Tokenizer) -> None:
    """A long text encodes as its repeated line does. (Encode speed is measured by `python -m benchmarks bench`,
    benchmarks.bench.gemma3_tokenizer_timings: a unit test asserts no wall-clock time.)"""
    line = "The quick brown fox <start_of_turn> jumps over 12345 lazy dogs. 😀\n"
    one = gemma.encode(line).ids[1:]  # without <bos>; the line starts after a newline each time, as at the start
    ids = gemma.encode(line * 30).ids
    assert ids == [gemma.bos_id, *one * 30] and len(ids) > 500


def test_scores_drive_the_merge_not_merge_order() -> None:
    """A hand-made vocabulary where the greedy-by-score result differs from left-to-right merging."""
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "bc", "\u2581a"]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0, -5.0, -2.0, -3.0]
    types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1]
    tok = Tokenizer.from_vocab(tokens, model="llama", scores=scores, token_types=types, bos_id=1)
    ids = tok.encode("abc").ids
    ref = _SpmReference(
        {
            "tokenizer.ggml.tokens": [t.encode() for t in tokens],
            "tokenizer.ggml.scores": np.asarray(scores),
            "tokenizer.ggml.token_type": np.asarray(types),
            "tokenizer.ggml.bos_token_id": 1,
        }
    )
    assert ids == ref.tokenize("abc") == [1, 9, 8]  # "▁a" (-3) and "bc" (-2) beat "ab" (-5)


@pytest.mark.slow
def test_gemma_matches_transformers_on_random_text(gemma: Tokenizer) -> None:
    """Hugging Face transformers' GemmaTokenizer, built from the same GGUF, as a second independent reference.

    Measured on 3,000 random strings: all agree; where the text holds a typed U+2581 (llama.cpp treats it exactly like
    a space, transformers does not) 64 of 3,000 differ, so those are left out here.
    """
    import random

    transformers = import_required("transformers")
    path = gemma3()
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    rng = random.Random(0)
    alphabet = [*"abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"()[]{}<>-_=+*/\\\n\t  ", "é", "ß", "中", "文",
                "😀", "𝔘", "ñ", "ю", "\u00a0", "\u3000"]
    words = ["the", " the", "The", "hello", " world", "  ", "\n\n", "function", "ing", "tion", "12345", "    ", "\t\t"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) if rng.random() < 0.6 else rng.choice(words)
                       for _ in range(rng.randint(1, 30)))
        assert gemma.encode(text, parse_special=False).ids == hf(text, add_special_tokens=True)["input_ids"], text
