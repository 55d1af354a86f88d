"""Building a Tokenizer: from a vocabulary in GGUF form (tokenizing exactly as llama.cpp does), from a GGUF file's
metadata, or from a Hugging Face model directory (tokenizer.json and its companions).

Tokenizer.from_vocab / from_gguf / from_dir call these with the class to build.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from engine.formats.gguf_meta import GGUFMetadata, read_metadata
from engine.tokenizer.pretokenize import (
    _PRE_ADD_BOS,
    _PRE_IGNORE_MERGES,
    _PRE_NO_BOS,
    _bpe_pre_tokenizer,
    _unrepresentable_class,
    llama_cpp_pre_type,
)
from engine.tokenizer.spm import _spm_merges
from engine.tokenizer.vocab import _CONTROL_TEXTS, _EOG_TEXTS, _TYPE_CONTROL, _TYPE_NORMAL, _partition_order, _Rules

# The Tokenizer class is passed in (its classmethods call these with cls): this module never imports core.py, which
# imports it.
Tokenizer = TypeVar("Tokenizer")


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def from_vocab(
    cls: type[Tokenizer],
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
            warnings.append(f"{len(orphans)} characters occur inside tokens but are no token themselves; text with "
                            "them may tokenize differently from llama.cpp")
        rules = _Rules("spm", types, _partition_order(tokens, types, name), add_eos=add_eos,
                       add_space_prefix=True if add_space_prefix is None else bool(add_space_prefix))
        eos = [*eos_ids, *(i for text in _EOG_TEXTS if (i := vocab.get(text)) is not None)]
        return cls(backend, bos_id=bos_id, eos_ids=eos, chat_template=chat_template,
                   add_bos=True if add_bos is None else add_bos, warnings=warnings, rules=rules)

    pre_name = "default" if pre is None or pre == "" else str(pre)
    group = llama_cpp_pre_type(pre_name)
    if extra:
        warnings.append(f"{len(extra)} token strings occur more than once; later copies are never produced")
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
    eos = [*eos_ids, *(i for text in _EOG_TEXTS if (i := vocab.get(text)) is not None)]
    rules = _Rules("bpe", types, _partition_order(tokens, types, name, pre_name), add_eos=add_eos)
    return cls(backend, bos_id=bos_id, eos_ids=eos, chat_template=chat_template, add_bos=add_bos, warnings=warnings,
               extra_tokens=extra, rules=rules)

def from_gguf(cls: type[Tokenizer], source: Any) -> Tokenizer:
    """Build from the tokenizer metadata of a GGUF file: a path, a `gguf.GGUFReader`, or read_metadata()'s dict.

    A path is read with engine.formats.gguf_meta (the metadata only: fast, and it works on vocabulary-only files).
    """
    if isinstance(source, GGUFMetadata):
        meta = source
    elif hasattr(source, "fields"):
        # A GGUFReader maps its file; its fields are read again here, much faster than building them as gguf does.
        filename = getattr(getattr(source, "data", None), "filename", None)
        if not filename:
            raise ValueError("this GGUF reader is not backed by a file; pass the file's path instead")
        meta = read_metadata(filename)
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
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    n = len(tokens)
    merges = meta.strings("tokenizer.ggml.merges") or []
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
    return from_vocab(
        cls,
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


def from_dir(cls: type[Tokenizer], path: str | Path) -> Tokenizer:
    """Build from a Hugging Face model directory (tokenizer.json, tokenizer_config.json, ...)."""
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}: a Hugging Face model directory with a fast-tokenizer "
                                "file is needed")
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
            warnings.append(f"added token {content!r} is id {got} here but {key} in tokenizer_config.json")

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

    template = _template_from_dir(path, config)
    return cls(backend, bos_id=bos_id, eos_ids=eos, chat_template=template, add_bos=add_bos, warnings=warnings)

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
