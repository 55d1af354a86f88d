"""The models on this machine, for the model picker and `python -m engine models`: what each is and whether it fits.

Looked at, in this order: the bundled default (SmolLM2), Gemma 3 270M when its package is installed, recently loaded
files, Hugging Face hub cache snapshots ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub), LM Studio's model
folders (~/.lmstudio/models, ~/.cache/lm-studio/models) and Ollama's ($OLLAMA_MODELS, ~/.ollama/models,
/usr/share/ollama/.ollama/models; GGUF files stored as blobs named by digest, found through JSON manifests).

Every fact comes from file headers only: a GGUF file's metadata and tensor table (arrays such as the vocabulary are
stepped over), a safetensors file's JSON header, config.json. Nothing is dequantized and torch is not imported, so a
listing of dozens of models takes a fraction of a second. Scans are bounded (files per folder, header sizes).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from engine.formats.gguf_meta import BULK_KEYS, GGUFMetadata, read_metadata
from engine.formats.runtime_rule import auto_backend, llamacpp_bytes

__all__ = ["ModelEntry", "discover", "memory_available", "read_model_facts", "remember", "recent_files"]

MAX_FILES_PER_ROOT = 500  # a bound on how much of a folder is walked
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header
RECENT_MAX = 20
# Bytes per parameter when the engine runs a model at these dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# GGUF tensor types (ggml_type) by number, as the gguf package names them.
_GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


@dataclass
class ModelEntry:
    """One model the picker can offer."""

    name: str
    path: str
    source: str  # "default", "gemma3", "recent", "huggingface", "lmstudio", "ollama"
    format: str  # "gguf" or "safetensors"
    file_bytes: int
    architecture: str | None = None
    n_params: int | None = None
    quant_types: dict[str, int] = field(default_factory=dict)  # tensor type -> number of tensors
    weight_bytes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes of the weights when loaded
    fits: dict[str, bool] = field(default_factory=dict)  # dtype -> weights fit in the memory available now
    error: str | None = None  # why the header could not be read (the entry is still listed)
    runtime: str = "torch"  # what --backend auto runs it on: "torch" (weights at the dtype) or "llama.cpp" (as it is)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ headers


def _gguf_facts(path: Path) -> tuple[GGUFMetadata, int, dict[str, int]]:
    """(the header's metadata, parameter count, tensor types) of a GGUF file."""
    meta = read_metadata(path, skip=BULK_KEYS, tensors=True)
    types = Counter(_GGML_TYPES.get(t.ggml_type, f"type {t.ggml_type}") for t in meta.tensors)
    return meta, sum(math.prod(t.dims) for t in meta.tensors), dict(types)


def _safetensors_facts(directory: Path) -> tuple[str | None, int, dict[str, int]]:
    """(architecture, parameter count, dtypes) of a Hugging Face directory from config.json and safetensors headers."""
    arch = None
    cfg = directory / "config.json"
    if cfg.is_file():
        config = json.loads(cfg.read_text(encoding="utf-8"))
        archs = config.get("architectures") or []
        arch = config.get("model_type") or (archs[0] if archs else None)
    n_params = 0
    types: dict[str, int] = {}
    for file in sorted(directory.glob("*.safetensors"))[:MAX_FILES_PER_ROOT]:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{file.name} is too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_SAFETENSORS_HEADER:
                raise ValueError(f"{file.name}: implausible header length {n}")
            header = json.loads(f.read(n))
        for key, t in header.items():
            if key == "__metadata__":
                continue
            n_params += math.prod(int(d) for d in t["shape"])
            types[t["dtype"]] = types.get(t["dtype"], 0) + 1
    return arch, n_params, types


def memory_available() -> int:
    """Bytes of memory available to a new model now (MemAvailable on Linux, else physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def read_model_facts(path: str | os.PathLike[str], name: str, source: str, memory: int | None = None) -> ModelEntry:
    """One entry from a GGUF file or a Hugging Face directory; a header that cannot be read becomes `error`."""
    path = Path(path)
    memory = memory_available() if memory is None else memory
    is_dir = path.is_dir()
    try:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if is_dir else path.stat().st_size
    except OSError:
        size = 0
    entry = ModelEntry(name=name, path=str(path), source=source, format="safetensors" if is_dir else "gguf",
                       file_bytes=size)
    try:
        if is_dir:
            entry.architecture, entry.n_params, entry.quant_types = _safetensors_facts(path)
        else:
            meta, entry.n_params, entry.quant_types = _gguf_facts(path)
            entry.architecture = meta.text("general.architecture")
        # a GGUF that "auto" sends to llama.cpp runs as it is at any dtype: the file plus llama.cpp's KV cache
        on_llamacpp = auto_backend(not is_dir, entry.n_params) == "llama.cpp"
        llamacpp_need = llamacpp_bytes(meta, size) if on_llamacpp else 0
        entry.runtime = "llama.cpp" if on_llamacpp else "torch"
    except (OSError, ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError) as e:
        entry.error = f"{type(e).__name__}: {e}"
        return entry
    if entry.n_params:
        for dtype, nbytes in DTYPE_BYTES.items():
            need = llamacpp_need or entry.n_params * nbytes  # the torch engine: every weight at the dtype
            entry.weight_bytes[dtype] = need
            entry.fits[dtype] = bool(memory) and need <= memory
    return entry


# ------------------------------------------------------------------------------------------------- places


def _hf_hub_roots() -> list[Path]:
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    return roots


def _huggingface(root: Path) -> Iterator[tuple[Path, str]]:
    """Snapshots in a hub cache: models--ORG--NAME/snapshots/REV, the revision refs/main names first."""
    if not root.is_dir():
        return
    for repo in sorted(root.glob("models--*"))[:MAX_FILES_PER_ROOT]:
        repo_id = repo.name.removeprefix("models--").replace("--", "/")
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        revs = [ref.read_text(encoding="ascii").strip()] if ref.is_file() else []
        revs += sorted(p.name for p in snapshots.iterdir() if p.is_dir())
        for rev in dict.fromkeys(revs):
            snap = snapshots / rev
            if not snap.is_dir():
                continue
            ggufs = sorted(snap.glob("*.gguf"))
            for g in ggufs[:MAX_FILES_PER_ROOT]:
                yield g, f"{repo_id}/{g.name}"
            if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
                yield snap, repo_id
            break  # the current revision only


def _lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def _gguf_files(root: Path) -> Iterator[tuple[Path, str]]:
    if not root.is_dir():
        return
    for dirpath, _dirs, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".gguf"):
                path = Path(dirpath) / f
                yield path, str(path.relative_to(root))


def _ollama_roots() -> list[Path]:
    roots = []
    if os.environ.get("OLLAMA_MODELS"):
        roots.append(Path(os.environ["OLLAMA_MODELS"]))
    roots += [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]
    return roots


def _ollama(root: Path) -> Iterator[tuple[Path, str]]:
    """Ollama: manifests/HOST/NAMESPACE/MODEL/TAG (JSON) name a layer of type ...image.model by digest; the GGUF is
    blobs/sha256-HEX."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for dirpath, _dirs, files in os.walk(manifests):
        for tag in sorted(files):
            manifest = Path(dirpath) / tag
            try:
                doc = json.loads(manifest.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            layers = doc.get("layers") if isinstance(doc, dict) else None
            for layer in layers or []:
                if not isinstance(layer, dict) or layer.get("mediaType") != "application/vnd.ollama.image.model":
                    continue
                digest = str(layer.get("digest", ""))
                blob = root / "blobs" / digest.replace(":", "-")
                if not blob.is_file():
                    continue
                parts = manifest.relative_to(manifests).parts  # host, namespace, model, tag
                model = parts[-2] if len(parts) >= 2 else manifest.parent.name
                namespace = parts[-3] if len(parts) >= 3 else "library"
                name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
                yield blob, name


# ----------------------------------------------------------------------------------------------- recent files


def _recent_file() -> Path:
    from engine.formats.locate import cache_root

    return cache_root() / "recent_models.json"


def recent_files() -> list[Path]:
    """Models loaded recently, newest first (those that still exist)."""
    try:
        items = json.loads(_recent_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [Path(p) for p in items if isinstance(p, str) and Path(p).exists()]


def remember(path: str | os.PathLike[str]) -> None:
    """Put a model at the top of the recent list (best effort: a read-only cache only loses the list)."""
    p = str(Path(path).resolve())
    items = [str(x) for x in recent_files() if str(x) != p]
    target = _recent_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps([p, *items][:RECENT_MAX]), encoding="utf-8")
        os.replace(tmp, target)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------ listing


def _known() -> Iterator[tuple[Path, str, str]]:
    from engine.formats.locate import GEMMA3_DIST, ModelLoadError, default_model_path, gemma3_path

    with contextlib.suppress(ModelLoadError):
        yield default_model_path(), "SmolLM2-135M-Instruct (default)", "default"
    try:
        path = gemma3_path(assemble=False)
    except ModelLoadError:
        path = None
    if path is not None:
        yield path, "Gemma 3 270M", "gemma3"
    else:
        import importlib.metadata

        try:
            importlib.metadata.distribution(GEMMA3_DIST)
        except importlib.metadata.PackageNotFoundError:
            return
        # Installed, not yet joined into one file: loading it by name ("gemma3-270m") assembles it.
        yield Path("gemma3-270m"), "Gemma 3 270M (assembled on first load)", "gemma3"


def discover(
    *,
    hf_roots: Iterable[Path] | None = None,
    lmstudio_roots: Iterable[Path] | None = None,
    ollama_roots: Iterable[Path] | None = None,
    include_known: bool = True,
    include_recent: bool = True,
    memory: int | None = None,
) -> list[ModelEntry]:
    """Every model found, each once (by resolved path), in the order the module docstring gives."""
    memory = memory_available() if memory is None else memory
    seen: set[str] = set()
    out: list[ModelEntry] = []

    def add(path: Path, name: str, source: str) -> None:
        key = str(path.resolve()) if path.exists() else str(path)
        if key in seen:
            return
        seen.add(key)
        if not path.exists():
            out.append(ModelEntry(name=name, path=str(path), source=source, format="gguf", file_bytes=0))
            return
        out.append(read_model_facts(path, name, source, memory))

    if include_known:
        for path, name, source in _known():
            add(path, name, source)
    if include_recent:
        for path in recent_files():
            add(path, path.name, "recent")
    for root in _hf_hub_roots() if hf_roots is None else hf_roots:
        for path, name in _huggingface(Path(root)):
            add(path, name, "huggingface")
    for root in _lmstudio_roots() if lmstudio_roots is None else lmstudio_roots:
        for path, name in islice(_gguf_files(Path(root)), MAX_FILES_PER_ROOT):
            add(path, name, "lmstudio")
    for root in _ollama_roots() if ollama_roots is None else ollama_roots:
        for path, name in islice(_ollama(Path(root)), MAX_FILES_PER_ROOT):
            add(path, name, "ollama")
    return out
