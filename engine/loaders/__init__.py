"""Find, read and cache a model: a GGUF file, a Hugging Face directory, or (elsewhere) a hub repository.

The first load of a GGUF file parses and dequantizes it (seconds) and writes the converted float32 weights,
config and tokenizer to a cache directory; later loads map that cache in well under a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.costs import formulas as costs
from engine.costs.info import model_info
from engine.events import ModelInfo
from engine.formats.locate import (  # noqa: F401 — ModelLoadError, default_model_path: where callers have always found them
    ModelLoadError,
    cache_dir_for,
    cache_root,
    default_model_path,
    resolve_model_path,
)
from engine.model.config import ModelConfig
from engine.model.kernel_cache import KERNEL_MODES
from engine.model.transformer import Transformer, build_model, fuse_state_dict
from engine.text import clean_text
from engine.tokenizer import Tokenizer

CACHE_VERSION = "7"  # bump when the converted weights or the tokenizer change (7: a tied head's blocks)

Progress = Callable[[float, str], None]


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    cfg: ModelConfig
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelLoadError(f"unknown device {device!r} (choose auto, cpu or cuda)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but torch sees no CUDA GPU")
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def preferred_dtype(device: str = "cpu") -> str:
    """The dtype the app loads by default: the fastest one whose greedy continuations equal float32's.

    bfloat16 on CUDA, and on CPUs with native bf16 dot products (avx512_bf16, AMX), where decode reads half the bytes
    (engine.model.transformer.pack_for_decode); the default model's greedy continuations on the test prompts match
    as float32's (tests/engine/test_bf16_decode.py). float32 on other CPUs, where bf16 products are emulated.
    """
    from engine.model.transformer import _bf16_packing

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return "bfloat16"
    return "bfloat16" if _bf16_packing() else "float32"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (the fastest there, no AMX), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose auto, {', '.join(DTYPES)})")
    if dtype == "float16" and device.type == "cpu":
        raise ModelLoadError("float16 runs on CUDA only here; use float32 or bfloat16 on the CPU")
    return DTYPES[dtype]


def _read_source(
    path: Path, progress: Progress
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, dict]:
    """Config, weights (float32, engine names), tokenizer and facts about the file (its format, bytes by type)."""
    if path.is_dir():
        from engine.loaders import hf

        progress(0.1, "reading config.json")
        cfg = hf.read_config(path)
        progress(0.2, "reading safetensors")
        sd = hf.read_weights(path, cfg)
        hf.check_tokenizer_files(path)
        tok = _tokenizer(Tokenizer.from_dir, path, "tokenizer.json")
        return cfg, sd, tok, {"file_type": "safetensors", **hf.tensor_stats(path)}
    from engine.loaders import gguf as gg

    progress(0.05, f"parsing {path.name}")
    reader = gg.open_reader(path)
    cfg = gg.read_config(reader, path.stem)
    progress(0.3, "building the tokenizer")
    tok = _tokenizer(Tokenizer.from_gguf, reader, "the GGUF tokenizer")
    sd = gg.read_weights(reader, cfg, lambda f, m: progress(0.35 + 0.5 * f, m))
    return cfg, sd, tok, {"file_type": gg.file_type_name(reader), **gg.tensor_stats(reader)}


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


def _check_finite(sd: dict[str, torch.Tensor]) -> None:
    """Every weight is a finite number (a NaN or inf would surface only later, as garbage or a failed draw)."""
    for name, t in sd.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"tensor {name!r} holds NaN or infinite values: the weights are damaged")


def _sha256(path: Path, use_cache: bool) -> str:
    """The weights' SHA-256, hashed once per file version (remembered in the cache); "" when unreadable."""
    from engine.formats.locate import file_sha256

    try:
        return file_sha256(path, memo=cache_root() / "sha256" if use_cache else None)
    except OSError:
        return ""


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

    from engine.loaders.hf import CACHE_DTYPES, check_safetensors

    check_safetensors(directory / "model.safetensors", CACHE_DTYPES)
    cfg = ModelConfig.from_dict(json.loads((directory / "config.json").read_text()))
    meta = json.loads((directory / "meta.json").read_text())
    return cfg, load_file(str(directory / "model.safetensors")), Tokenizer.load(directory / "tokenizer"), meta


def load(
    model: str | os.PathLike | None = None, device: str = "auto", dtype: str = "auto",
    progress: Progress | None = None, use_cache: bool = True, kernels: str = "exact",
) -> LoadedModel:
    """Load a model ready to run; every failure becomes a ModelLoadError with one clear sentence.

    kernels: how its decode products compute (engine.model.kernel_cache.KERNEL_MODES): "exact" (the default) the
    file's weights dequantized exactly in `dtype`; "file" and "fast" a GGUF's quantized blocks as they are, or
    also requantized (engine.model.quant)."""
    t0 = time.perf_counter()
    if kernels not in KERNEL_MODES:
        raise ModelLoadError(f"unknown kernel mode {kernels!r} (choose {', '.join(KERNEL_MODES)})")
    report = progress or (lambda f, m: None)
    path = resolve_model_path(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cuda":
        from engine.model.transformer import leave_out_cudnn_attention

        leave_out_cudnn_attention()
    try:
        cdir = cache_dir_for(path, "models", CACHE_VERSION) if use_cache and path.is_file() else None
        from_cache = cdir is not None and (cdir / "meta.json").is_file()
        if from_cache:
            report(0.2, "reading cached weights")
            try:
                cfg, sd, tok, meta = _read_cache(cdir)
            except Exception:  # noqa: BLE001 — a damaged cache (a crash, a full disk) is rebuilt, not reported
                shutil.rmtree(cdir, ignore_errors=True)
                from_cache = False
        if not from_cache:
            cfg, sd, tok, meta = _read_source(path, report)
            _check_finite(sd)
            meta["source"] = str(path)
            if cdir is not None:
                report(0.85, "writing the weight cache for a fast next start")
                sd = fuse_state_dict(sd, cfg)
                with contextlib.suppress(OSError):  # a read-only or full disk only costs the fast start
                    _write_cache(cdir, cfg, sd, tok, meta)
        # a first load on this machine also times each weight shape's decode kernels (seconds; cached after)
        report(0.9, f"building the model ({dt}) and choosing its decode kernels")
        net = build_model(cfg, sd, dtype=dt, device=dev, kernel_mode=kernels)
    except ModelLoadError:
        raise
    except (ValueError, FileNotFoundError, OSError) as e:
        text = str(e) if str(e).startswith(f"{path.name} ") else f"cannot load {path.name}: {e}"  # named once
        raise ModelLoadError(clean_text(text, 400)) from None
    except MemoryError:
        raise ModelLoadError(f"cannot load {path.name}: it needs more memory than this machine gives") from None
    except Exception as e:  # noqa: BLE001 — a model file is untrusted input: one clear line, never a traceback
        raise ModelLoadError(clean_text(f"cannot load {path.name}: {type(e).__name__}: {e}", 400)) from None
    del sd
    n_params = sum(p.numel() for p in net.parameters())
    dname = str(dt).removeprefix("torch.")
    info = model_info(
        cfg, str(path), n_params=n_params, dtype=dname, device=str(dev), kv_dtype=dname, kv_windowed=True,
        weight_bytes=costs.weight_bytes(cfg, dname),
        # at the bytes the chosen decode kernels stream (a Q4 file's int4 form where that kernel won here)
        decode_weight_bytes=round(costs.step_weight_bytes(cfg, dname, rows=1)) - net.decode_bytes_saved(),
        file_type=meta.get("file_type", "unknown"), file_tensors=meta.get("file_tensors", {}),
        file_embedding_bytes=meta.get("file_embedding_bytes", 0), load_s=time.perf_counter() - t0,
        from_cache=from_cache, sha256=_sha256(path, use_cache),
        kernels=net.kernel_mode,  # the mode that runs: exact where no form was built
    )
    from engine.formats.discover import remember

    remember(path)  # for the model picker's recent files
    report(1.0, "ready")
    return LoadedModel(model=net, tokenizer=tok, cfg=cfg, info=info, device=dev, dtype=dt)
