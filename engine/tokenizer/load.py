"""A model's tokenizer on its own, without its weights: a GGUF file's vocabulary (cached by file: a large one takes
seconds to build) or a Hugging Face folder's tokenizer files."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from engine.formats.locate import ModelLoadError, cache_dir_for, resolve_model_path
from engine.tokenizer.cache import CACHE_FORMAT as TOKENIZER_CACHE_FORMAT
from engine.tokenizer.core import Tokenizer


def tokenizer_cache_dir(path: Path) -> Path:
    """Where load_tokenizer caches the tokenizer of the GGUF file `path` (Tokenizer.save's files)."""
    return cache_dir_for(path, "tokenizers", TOKENIZER_CACHE_FORMAT)


def load_tokenizer(model: str | os.PathLike | None = None) -> Tokenizer:
    """Only the tokenizer of a model: a GGUF file's metadata is read, its weights never (vocabulary-only files work).

    A large vocabulary (Gemma's 262,144 tokens) takes seconds to build, so GGUF tokenizers are cached by file.
    """
    path = resolve_model_path(model)
    try:
        if path.is_dir():
            return Tokenizer.from_dir(path)
        cdir = tokenizer_cache_dir(path)
        with contextlib.suppress(FileNotFoundError, ValueError, OSError):
            return Tokenizer.load(cdir)
        tok = Tokenizer.from_gguf(path)
        with contextlib.suppress(OSError):  # a read-only or full disk only costs the next start
            tok.save(cdir)
        return tok
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read the tokenizer of {path.name}: {e}") from None
