"""Saved sessions: a `.ilab` file holds everything needed to show a run again without the model.

The format is open and holds no pickle: a zip archive with
    session.json     format version, model identity (name, path, SHA-256 of the weights file), prompt, settings,
                     the model's config and facts, and every event in order, as JSON
    arrays.npz       every numpy array the events carry, named a0, a1, … and referenced from session.json as
                     {"$array": "a0"}; read back with np.load(allow_pickle=False)
    tokenizer/       the model's tokenizer (tokenizer.json and its metadata), so pieces can be drawn
Objects in session.json are tagged: {"$type": "TokenSampled", "fields": {...}} for the engine's dataclasses (only
the ones listed in TYPES can be read back), {"$tuple": [...]}, {"$frozenset": [...]}.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine import events as ev_mod
from engine.model.config import ModelConfig
from engine.protocol import Capture, SamplingParams  # plain data: the GUI process reads session files, torch-free

FORMAT = "inference-lab-session"
VERSION = 1
SUFFIX = ".ilab"
TYPES: dict[str, type] = {
    c.__name__: c for c in vars(ev_mod).values() if dataclasses.is_dataclass(c) and c.__module__ == ev_mod.__name__
}
TYPES.update(SamplingParams=SamplingParams, ModelConfig=ModelConfig, Capture=Capture)


class SessionFileError(ValueError):
    """A file that is not a session this version can read; the message says why in one sentence."""


@dataclass
class SavedSession:
    """What a .ilab file holds."""

    events: list = field(default_factory=list)  # engine events, in the order they arrived
    prompt: str = ""
    chat: bool = False
    settings: dict = field(default_factory=dict)  # e.g. sampling params, max new tokens: plain JSON
    model: dict = field(default_factory=dict)  # identity: name, path, sha256, architecture
    info: ev_mod.ModelInfo | None = None
    cfg: ModelConfig | None = None
    tokenizer: Any = None  # engine.tokenizer.core.Tokenizer, or None
    branches: list = field(default_factory=list)  # [{"name", "parent", "step", "token", "events": [...]}, …]
    created: str = ""


# ---- model identity ------------------------------------------------------------------------------------------
_HASHES: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a weights file, or of a model folder's config.json and *.safetensors in name order ("" if none).

    Remembered per (path, size, mtime), so saving twice does not hash 300 MB twice.
    """
    p = Path(path)
    files = [p] if p.is_file() else sorted([*p.glob("config.json"), *p.glob("*.safetensors")]) if p.is_dir() else []
    if not files:
        return ""
    st = [f.stat() for f in files]
    key = (str(p.resolve()), sum(s.st_size for s in st), max(s.st_mtime_ns for s in st))
    if key not in _HASHES:
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def model_identity(info: ev_mod.ModelInfo | None) -> dict:
    if info is None:
        return {}
    return {"name": info.name, "path": info.path, "architecture": info.architecture, "file_type": info.file_type,
            "n_params": info.n_params, "sha256": file_sha256(info.path) if info.path else ""}


def same_model(saved: dict, info: ev_mod.ModelInfo | None) -> str | None:
    """None when the loaded model is the one a session was recorded with, else one sentence saying how not."""
    if not saved or info is None:
        return None
    here = model_identity(info)
    if saved.get("sha256") and here.get("sha256"):
        if saved["sha256"] == here["sha256"]:
            return None
    elif (saved.get("name"), saved.get("n_params")) == (here["name"], here["n_params"]):
        return None
    return (f"this session was recorded with {saved.get('name', '?')} (SHA-256 {saved.get('sha256', '?')[:12]}…); "
            f"the loaded model is {here['name']} (SHA-256 {here['sha256'][:12]}…)")


# ---- encoding ------------------------------------------------------------------------------------------------
class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def __call__(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biufc":
                raise TypeError(f"cannot store an array of dtype {x.dtype}")
            key = f"a{len(self.arrays)}"
            self.arrays[key] = x
            return {"$array": key}
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, tuple):
            return {"$tuple": [self(v) for v in x]}
        if isinstance(x, list):
            return [self(v) for v in x]
        if isinstance(x, (set, frozenset)):
            return {"$frozenset": [self(v) for v in sorted(x)]}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError("only dicts with string keys can be stored")
            return {k: self(v) for k, v in x.items()}
        name = type(x).__name__
        if dataclasses.is_dataclass(x) and TYPES.get(name) is type(x):
            return {"$type": name,
                    "fields": {f.name: self(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}}
        raise TypeError(f"cannot store a {type(x).__module__}.{name} in a session file")


class _Decoder:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def __call__(self, x: Any) -> Any:
        if isinstance(x, list):
            return [self(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "$array" in x:
            key = x["$array"]
            if key not in self.arrays:
                raise SessionFileError(f"the session names an array {key!r} that arrays.npz lacks")
            return self.arrays[key]
        if "$tuple" in x:
            return tuple(self(v) for v in x["$tuple"])
        if "$frozenset" in x:
            return frozenset(self(v) for v in x["$frozenset"])
        if "$type" in x:
            cls = TYPES.get(x["$type"])
            if cls is None:
                raise SessionFileError(f"the session holds an unknown kind of record, {x['$type']!r}")
            known = {f.name for f in dataclasses.fields(cls) if f.init}
            kw = {k: self(v) for k, v in x["fields"].items() if k in known}  # fields of a newer version: skipped
            try:
                return cls(**kw)
            except TypeError as e:
                raise SessionFileError(f"a saved {x['$type']} does not fit this version: {e}") from None
        return {k: self(v) for k, v in x.items()}


# ---- files ---------------------------------------------------------------------------------------------------
def save_session(path: str | os.PathLike[str], s: SavedSession) -> None:
    """Write `s` to `path` (write to a temporary file, then rename: an existing file is never left half-written).

    OSError with one sentence naming the path when it cannot be written.
    """
    path = Path(path)
    enc = _Encoder()
    doc = {
        "format": FORMAT, "version": VERSION, "created": s.created or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": s.model, "prompt": s.prompt, "chat": s.chat, "settings": enc(s.settings),
        "info": enc(s.info), "cfg": enc(s.cfg), "events": [enc(e) for e in s.events],
        "branches": [dict(b, events=[enc(e) for e in b.get("events", [])]) for b in s.branches],
    }
    npz = io.BytesIO()
    np.savez_compressed(npz, **enc.arrays)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OSError(f"cannot save the session to {path}: it is a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".ilab-", suffix=".tmp", dir=folder)
    except OSError as e:
        raise OSError(f"cannot save the session to {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("session.json", json.dumps(doc, ensure_ascii=False))
            z.writestr("arrays.npz", npz.getvalue())
            if s.tokenizer is not None:
                with tempfile.TemporaryDirectory() as td:
                    s.tokenizer.save(td)
                    for f in sorted(Path(td).iterdir()):
                        z.write(f, f"tokenizer/{f.name}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; a saved session is an ordinary document
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(f"cannot save the session to {path}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_session(path: str | os.PathLike[str], with_tokenizer: bool = True) -> SavedSession:
    """Read a .ilab file. SessionFileError (a ValueError) or OSError with one sentence when it cannot."""
    path = Path(path)
    try:
        z = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise SessionFileError(f"{path} is not an Inference Lab session (not a zip archive)") from None
    except OSError as e:
        raise OSError(f"cannot open {path}: {e.strerror or e}") from None
    with z:
        names = set(z.namelist())
        if "session.json" not in names:
            raise SessionFileError(f"{path} is not an Inference Lab session (no session.json inside)")
        try:
            doc = json.loads(z.read("session.json"))
        except (ValueError, UnicodeDecodeError) as e:
            raise SessionFileError(f"{path}: session.json is damaged ({e})") from None
        if doc.get("format") != FORMAT:
            raise SessionFileError(f"{path} is not an Inference Lab session")
        if int(doc.get("version", 0)) > VERSION:
            raise SessionFileError(f"{path} was written by a newer Inference Lab (format {doc['version']})")
        arrays: dict[str, np.ndarray] = {}
        if "arrays.npz" in names:
            try:
                with np.load(io.BytesIO(z.read("arrays.npz")), allow_pickle=False) as npz:
                    arrays = {k: npz[k] for k in npz.files}
            except (ValueError, OSError, zipfile.BadZipFile) as e:
                raise SessionFileError(f"{path}: arrays.npz is damaged ({e})") from None
        tokenizer = None
        tok_files = [n for n in names if n.startswith("tokenizer/") and not n.endswith("/")]
        if with_tokenizer and tok_files:
            from engine.tokenizer import Tokenizer

            with tempfile.TemporaryDirectory() as td:
                for n in tok_files:
                    (Path(td) / Path(n).name).write_bytes(z.read(n))
                try:
                    tokenizer = Tokenizer.load(td)
                except (ValueError, OSError) as e:
                    raise SessionFileError(f"{path}: the saved tokenizer cannot be read ({e})") from None
    dec = _Decoder(arrays)
    return SavedSession(
        events=[dec(e) for e in doc.get("events", [])], prompt=doc.get("prompt", ""), chat=bool(doc.get("chat")),
        settings=dec(doc.get("settings", {})), model=doc.get("model", {}), info=dec(doc.get("info")),
        cfg=dec(doc.get("cfg")), tokenizer=tokenizer,
        branches=[dict(b, events=[dec(e) for e in b.get("events", [])]) for b in doc.get("branches", [])],
        created=doc.get("created", ""),
    )
