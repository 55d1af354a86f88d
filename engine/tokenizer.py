"""Byte-level BPE tokenizer that reproduces llama.cpp's tokenization, with the bookkeeping a live view needs.

The BPE itself runs in Hugging Face `tokenizers` (Rust, fast enough to re-tokenize on every keystroke).
This module builds that tokenizer from a GGUF vocabulary or a Hugging Face model directory, then adds what
the UI shows: per-token byte and character spans, readable pieces, special-token flags, and the input bytes
the vocabulary cannot represent (byte-level BPE drops those; we report them instead).

Only byte-level BPE vocabularies are supported (GGUF `tokenizer.ggml.model == "gpt2"`): SmolLM/SmolLM2,
Llama 3, Qwen2 and GPT-2-style models. SentencePiece vocabularies (Llama 2, Mistral) are rejected.
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

__all__ = ["Tokenization", "Tokenizer", "StreamDecoder", "CHATML_TEMPLATE", "bytes_to_unicode"]

# Bump when the cache layout changes: load() refuses other versions so callers rebuild instead of misreading.
CACHE_FORMAT = 1
CACHE_META = "inference_lab_tokenizer.json"
CACHE_TOKENIZER = "tokenizer.json"

# Used when a model ships no template; the same ChatML that transformers used as its default.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# llama.cpp's pre-tokenizer regexes. The `(?i:'s|...)` of the Hugging Face originals is spelled out as
# character classes, as llama.cpp does: case-insensitive matching would also accept e.g. "'ſ" (long s).
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF `tokenizer.ggml.pre` names grouped the way llama.cpp groups them (same regexes => same tokenization).
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
_PRE_GPT2 = {"gpt2", "default", "mpt", "olmo", "jais"}
_PRE_LLAMA3 = {"llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"}
_PRE_QWEN2 = {"qwen2", "stablelm2", "hunyuan"}

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

# GGUF token types (llama.cpp's llama_token_type).
_TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED = 2, 3, 4


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


class Tokenizer:
    """A byte-level BPE tokenizer plus the metadata (BOS/EOS, chat template) that goes with it."""

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
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`. Prefer the `from_*` / `load` constructors.

        `extra_tokens` names ids the backend's vocabulary cannot hold (a GGUF vocabulary may repeat a
        string; a dict keeps only one id for it) so that they still decode to the right bytes.
        """
        self._backend = backend
        self.chat_template = chat_template
        self.add_bos = bool(add_bos)
        self.warnings = list(warnings)
        self._extra_tokens = dict(extra_tokens or {})

        vocab = backend.get_vocab(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        size = max([*vocab.values(), *added.keys(), *self._extra_tokens.keys(), -1]) + 1
        self.vocab_size = size

        texts: list[str | None] = [None] * size
        for text, i in vocab.items():
            texts[i] = text
        for i, text in self._extra_tokens.items():
            texts[i] = text
        for i, tok in added.items():
            texts[i] = tok.content
        self._texts = texts

        translate, outside = _byte_level_tables()
        token_bytes: list[bytes] = []
        for i, text in enumerate(texts):
            if text is None:
                token_bytes.append(b"")
            elif i in added or outside.search(text):
                # Added tokens are matched in the raw text, so they stand for their own UTF-8 bytes.
                token_bytes.append(text.encode("utf-8"))
            else:
                token_bytes.append(text.translate(translate).encode("latin-1"))
        self._token_bytes = token_bytes
        self._lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=size)

        special = np.zeros(size, dtype=bool)
        for i, tok in added.items():
            special[i] = tok.special
        self._special = special
        self._pieces: list[str | None] = [None] * size

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

        # Byte values whose single-byte token is missing: BPE cannot start from them, so it drops them.
        enc = bytes_to_unicode()
        unrep = bytes(b for b in range(256) if enc[b] not in vocab)
        self._unrepresentable_bytes = frozenset(unrep)

    # ----------------------------------------------------------------------------------------- constructors

    @classmethod
    def from_vocab(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str] | Sequence[tuple[str, str]],
        token_types: Sequence[int] | None = None,
        *,
        pre: str = "smollm",
        bos_id: int | None = None,
        eos_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos: bool | None = None,
    ) -> Tokenizer:
        """Build from a vocabulary in GGUF form: byte-level token strings, "a b" merges, GGUF token types.

        `pre` is the GGUF `tokenizer.ggml.pre` name; it picks the pre-tokenizer llama.cpp would use.
        `add_bos=None` means the llama.cpp default for that pre-tokenizer (true only for Llama 3).
        """
        warnings: list[str] = []
        types = list(token_types) if token_types is not None else [1] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")

        vocab: dict[str, int] = {}
        extra: dict[int, str] = {}
        for i, text in enumerate(tokens):
            if text in vocab:
                extra[i] = text
            else:
                vocab[text] = i
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

        pre_name = (pre or "default").lower()
        ignore_merges = pre_name in _PRE_LLAMA3
        try:
            model = models.BPE(vocab, pairs, ignore_merges=ignore_merges)
        except Exception as exc:
            raise ValueError(f"invalid BPE vocabulary or merges: {exc}") from exc
        backend = _HFTokenizer(model)

        if pre_name in _PRE_DIGITS_GPT2:
            # llama.cpp splits every numeric character off first, then applies the GPT-2 regex.
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        elif pre_name in _PRE_LLAMA3 or pre_name in _PRE_QWEN2:
            pattern = _LLAMA3_SPLIT if pre_name in _PRE_LLAMA3 else _QWEN2_SPLIT
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:
            if pre_name not in _PRE_GPT2:
                warnings.append(
                    f"unknown pre-tokenizer {pre!r}; using the plain GPT-2 byte-level split, so tokenization "
                    "may differ from llama.cpp's"
                )
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        isolate = _unrepresentable_class(vocab)
        if isolate:
            # llama.cpp's BPE cannot merge across a byte that has no token (it sits between its neighbours and is
            # dropped at the end); `tokenizers` drops it first and would merge the neighbours. Isolating such bytes
            # after the byte-level split (so the regex's word boundaries stay llama.cpp's) gives llama.cpp's result.
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [backend.pre_tokenizer, pre_tokenizers.Split(Regex(isolate), behavior="isolated", invert=False)]
            )
        backend.decoder = decoders.ByteLevel()

        # llama.cpp recognises control, unknown and user-defined tokens written in the text; only the first
        # two are special (rendered as markup rather than text).
        added: list[AddedToken] = []
        for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
            if i in extra or not text:
                continue
            if kind in (_TYPE_CONTROL, _TYPE_UNKNOWN):
                added.append(AddedToken(text, special=True, normalized=False))
            elif kind == _TYPE_USER_DEFINED:
                added.append(AddedToken(text, special=False, normalized=False))
        backend.add_tokens(added)

        if add_bos is None:
            add_bos = pre_name in _PRE_LLAMA3
        eos = list(eos_ids)
        for text in _EOG_TEXTS:
            i = vocab.get(text)
            if i is not None:
                eos.append(i)
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos,
            chat_template=chat_template,
            add_bos=add_bos,
            warnings=warnings,
            extra_tokens=extra,
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader | str | os.PathLike[str]) -> Tokenizer:
        """Build from the tokenizer metadata of a GGUF file (a `gguf.GGUFReader`, or a path to open)."""
        if not hasattr(reader, "fields"):
            import gguf

            reader = gguf.GGUFReader(reader)
        model = _gguf_field(reader, "tokenizer.ggml.model")
        if model is None:
            raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        if model != "gpt2":
            raise ValueError(
                f"unsupported tokenizer model {model!r} in GGUF: only byte-level BPE ('gpt2', as used by "
                "SmolLM2, Llama 3 and Qwen2) is supported"
            )
        tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
        merges = _gguf_field(reader, "tokenizer.ggml.merges", [])
        types = _gguf_field(reader, "tokenizer.ggml.token_type")
        eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        eos = [i for key in eos_keys if (i := _gguf_field(reader, f"tokenizer.ggml.{key}")) is not None]
        add_bos = _gguf_field(reader, "tokenizer.ggml.add_bos_token")
        return cls.from_vocab(
            tokens,
            merges,
            types,
            pre=_gguf_field(reader, "tokenizer.ggml.pre", "default"),
            bos_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_ids=eos,
            chat_template=_gguf_field(reader, "tokenizer.chat_template"),
            add_bos=None if add_bos is None else bool(add_bos),
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
        }
        # Write then rename, metadata last: an interrupted save never leaves a cache that load() accepts.
        tmp = directory / (CACHE_TOKENIZER + ".tmp")
        self._backend.save(str(tmp))
        os.replace(tmp, directory / CACHE_TOKENIZER)
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
        tok = cls(
            backend,
            bos_id=meta["bos_id"],
            eos_ids=meta["eos_ids"],
            chat_template=meta["chat_template"],
            add_bos=meta["add_bos"],
            warnings=meta["warnings"],
            extra_tokens={int(i): t for i, t in meta["extra_tokens"].items()},
        )
        if np.flatnonzero(tok._special).tolist() != meta["special_ids"]:
            raise ValueError(f"tokenizer cache in {directory} is inconsistent (special tokens differ)")
        return tok

    # -------------------------------------------------------------------------------------------- encoding

    def encode(self, text: str) -> Tokenization:
        """Tokenize `text`. Special-token strings in it become special tokens; BOS only if the model asks."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text is not valid Unicode: lone surrogate at index {exc.start}") from None
        enc = self._backend.encode(text, add_special_tokens=False)
        ids: list[int] = enc.ids
        tb = self._token_bytes
        if b"".join([tb[i] for i in ids]) == data:
            # The common case: tokens tile the input, so spans are running sums of cached byte lengths.
            lengths = self._lengths[np.asarray(ids, dtype=np.int64)]
            ends = np.cumsum(lengths)
            starts = ends - lengths
            unrepresentable: list[tuple[int, int]] = []
        else:
            starts, ends, unrepresentable = self._align(text, data, ids, enc.offsets)

        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
            starts = np.concatenate([np.zeros(1, np.int64), starts])
            ends = np.concatenate([np.zeros(1, np.int64), ends])

        byte_offsets = list(zip(starts.tolist(), ends.tolist(), strict=True))
        if len(data) == len(text):
            offsets = byte_offsets
        else:
            cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            char_len = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
            byte_to_char = np.append(np.repeat(np.arange(len(text), dtype=np.int64), char_len), len(text))
            cstart = byte_to_char[starts]
            cend = np.where(ends > starts, byte_to_char[np.maximum(ends - 1, 0)] + 1, cstart)
            offsets = list(zip(cstart.tolist(), cend.tolist(), strict=True))

        return Tokenization(
            text=text,
            ids=ids,
            pieces=self._pieces_for(ids),
            offsets=offsets,
            byte_offsets=byte_offsets,
            special=self._special[np.asarray(ids, dtype=np.int64)].tolist() if ids else [],
            unrepresentable=unrepresentable,
        )

    def _align(
        self, text: str, data: bytes, ids: list[int], char_offsets: list[tuple[int, int]]
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """Place tokens on the input bytes when they do not simply tile it (some bytes were dropped)."""
        tb = self._token_bytes
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
            return self._texts[token_id] or ""
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
        return self._texts[token_id] if self._special[token_id] else self.decode([token_id])

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (ChatML when it has none) in a Jinja sandbox."""
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
