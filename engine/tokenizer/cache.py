"""The on-disk tokenizer cache: building from a large GGUF vocabulary takes a while, reading this back is quick.

The layout is tokenizer.json (the `tokenizers` backend), token_bytes.npy (the exact bytes of every token: lengths,
then the bytes; plain arrays, never pickles) and a metadata file written last, so an interrupted save is never read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypeVar

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from engine.tokenizer.vocab import _Rules

# The Tokenizer class is passed in (its classmethods call these with cls): this module never imports core.py, which
# imports it.
Tokenizer = TypeVar("Tokenizer")

# Bump when the cache layout changes: load() refuses other versions so callers rebuild instead of misreading.
CACHE_FORMAT = 2
CACHE_META = "inference_lab_tokenizer.json"
CACHE_TOKENIZER = "tokenizer.json"
CACHE_BYTES = "token_bytes.npy"


def save(tok: Tokenizer, directory: str | Path) -> None:
    """Write a cache of `tok` that `load` reads back quickly (tokenizer.json plus a small metadata file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": CACHE_FORMAT,
        "bos_id": tok.bos_id,
        "eos_ids": list(tok.eos_ids),
        "chat_template": tok.chat_template,
        "add_bos": tok.add_bos,
        "warnings": tok.warnings,
        "special_ids": np.flatnonzero(tok._special).tolist(),
        "extra_tokens": {str(i): t for i, t in tok._extra_tokens.items()},
        "rules": None if tok._rules is None else tok._rules.to_json(),
    }
    # Write then rename, metadata last: an interrupted save never leaves a cache that load() accepts.
    tmp = directory / (CACHE_TOKENIZER + ".tmp")
    tok._backend.save(str(tmp))
    os.replace(tmp, directory / CACHE_TOKENIZER)
    blob = b"".join(tok._token_bytes)
    tmp = directory / (CACHE_BYTES + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, tok._lengths)
        np.save(f, np.frombuffer(blob, dtype=np.uint8))
    os.replace(tmp, directory / CACHE_BYTES)
    tmp = directory / (CACHE_META + ".tmp")
    tmp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, directory / CACHE_META)

def load(cls: type[Tokenizer], directory: str | Path) -> Tokenizer:
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
