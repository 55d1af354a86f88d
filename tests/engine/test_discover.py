"""The model list (engine.formats.discover, `python -m engine models`): fake Hugging Face, LM Studio and Ollama folders.

Independent reference for the header facts: the `gguf` package's reader (parameter count and tensor types of the
same files) and the tiny checkpoint's own known shapes for safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import pytest

from engine.formats.discover import discover, memory_available, read_model_facts, recent_files, remember


def _gguf_reference(path: Path) -> tuple[int, dict[str, int]]:
    r = gguf.GGUFReader(str(path))
    return sum(int(t.n_elements) for t in r.tensors), dict(Counter(t.tensor_type.name for t in r.tensors))


@pytest.fixture
def places(tiny_dir, tmp_path: Path) -> dict[str, Path]:
    """A hub cache with a GGUF snapshot and a safetensors snapshot, an LM Studio folder, an Ollama store."""
    hub = tmp_path / "hf" / "hub"
    for repo, rev in (("models--someone--tiny-gguf", "aaa111"), ("models--someone--tiny-hf", "bbb222")):
        (hub / repo / "refs").mkdir(parents=True)
        (hub / repo / "refs" / "main").write_text(rev)
        snap = hub / repo / "snapshots" / rev
        snap.mkdir(parents=True)
        if "gguf" in repo:
            shutil.copy(tiny_dir.gguf, snap / "tiny-Q8_0.gguf")
        else:
            for f in tiny_dir.hf_dir.iterdir():
                shutil.copy(f, snap / f.name)
    # An older snapshot that refs/main does not name is not listed.
    (hub / "models--someone--tiny-gguf" / "snapshots" / "000old").mkdir()
    shutil.copy(tiny_dir.gguf, hub / "models--someone--tiny-gguf" / "snapshots" / "000old" / "old.gguf")

    lms = tmp_path / "lmstudio" / "models" / "publisher" / "repo"
    lms.mkdir(parents=True)
    shutil.copy(tiny_dir.gguf, lms / "tiny-lms.gguf")

    ollama = tmp_path / "ollama"
    blob = "sha256-" + "ab" * 32
    (ollama / "blobs").mkdir(parents=True)
    shutil.copy(tiny_dir.gguf, ollama / "blobs" / blob)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "tinyllama"
    manifest.mkdir(parents=True)
    (manifest / "latest").write_text(json.dumps({
        "schemaVersion": 2,
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": blob.replace("-", ":", 1), "size": 1},
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32, "size": 1},
        ],
    }))
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "broken").mkdir()
    (ollama / "manifests" / "registry.ollama.ai" / "library" / "broken" / "x").write_text("{not json")
    return {"hub": hub, "lmstudio": tmp_path / "lmstudio" / "models", "ollama": ollama, "tiny": tiny_dir.gguf}


def test_finds_models_in_every_place(places: dict[str, Path], tiny_dir) -> None:
    entries = discover(hf_roots=[places["hub"]], lmstudio_roots=[places["lmstudio"]], ollama_roots=[places["ollama"]],
                       include_known=False, include_recent=False, memory=8 << 30)
    by_name = {e.name: e for e in entries}
    assert set(by_name) == {
        "someone/tiny-gguf/tiny-Q8_0.gguf", "someone/tiny-hf", "publisher/repo/tiny-lms.gguf", "tinyllama:latest",
    }
    n_params, types = _gguf_reference(tiny_dir.gguf)
    for name in ("someone/tiny-gguf/tiny-Q8_0.gguf", "publisher/repo/tiny-lms.gguf", "tinyllama:latest"):
        e = by_name[name]
        assert e.error is None and e.format == "gguf" and e.architecture == "llama"
        assert e.n_params == n_params and e.quant_types == types
        assert e.file_bytes == tiny_dir.gguf.stat().st_size
        assert e.weight_bytes["float32"] == 4 * n_params and e.fits == {"float32": True, "bfloat16": True,
                                                                      "float16": True}
    assert by_name["tinyllama:latest"].source == "ollama" and by_name["tinyllama:latest"].path.endswith("ab" * 32)
    hf = by_name["someone/tiny-hf"]
    assert hf.format == "safetensors" and hf.architecture == "llama" and hf.source == "huggingface"
    assert hf.n_params == sum(w.numel() for w in tiny_dir.hf_weights.values())


def test_fits_follows_the_memory(places: dict[str, Path]) -> None:
    (e,) = discover(hf_roots=[], lmstudio_roots=[places["lmstudio"]], ollama_roots=[], include_known=False,
                    include_recent=False, memory=3 * read_model_facts(places["tiny"], "t", "t", 1).n_params)
    assert e.fits == {"float32": False, "bfloat16": True, "float16": True}


def test_damaged_file_is_listed_with_its_error(tmp_path: Path) -> None:
    bad = tmp_path / "lm" / "bad.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 30)
    (e,) = discover(hf_roots=[], lmstudio_roots=[tmp_path / "lm"], ollama_roots=[], include_known=False,
                    include_recent=False)
    assert e.name == "bad.gguf" and e.error and e.n_params is None


def test_recent_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_dir) -> None:
    monkeypatch.setenv("INFERENCE_LAB_CACHE", str(tmp_path / "cache"))
    assert recent_files() == []
    remember(tiny_dir.gguf)
    remember(tiny_dir.hf_dir)
    remember(tiny_dir.gguf)
    assert recent_files() == [tiny_dir.gguf.resolve(), tiny_dir.hf_dir.resolve()]
    names = [e.name for e in discover(hf_roots=[], lmstudio_roots=[], ollama_roots=[], include_known=False)]
    assert names == [tiny_dir.gguf.name, tiny_dir.hf_dir.name]


def test_models_cli_json(places: dict[str, Path], tmp_path: Path) -> None:
    """`python -m engine models --json` with HOME, HF_HOME and OLLAMA_MODELS pointing at the fake places."""
    home = tmp_path / "home"
    (home / ".lmstudio").mkdir(parents=True)
    shutil.copytree(places["lmstudio"], home / ".lmstudio" / "models")
    env = {**os.environ, "HOME": str(home), "HF_HOME": str(places["hub"].parent),
           "OLLAMA_MODELS": str(places["ollama"]), "INFERENCE_LAB_CACHE": str(tmp_path / "cache")}
    env.pop("HF_HUB_CACHE", None)
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-m", "engine", "models", "--json"], capture_output=True, text=True,
                          env=env, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["memory_available"] > 0
    sources = {m["name"]: m["source"] for m in out["models"]}
    assert sources["tinyllama:latest"] == "ollama" and sources["someone/tiny-hf"] == "huggingface"
    assert sources["publisher/repo/tiny-lms.gguf"] == "lmstudio"
    assert memory_available() > 0
