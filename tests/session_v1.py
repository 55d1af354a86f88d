"""Session files of the first format, as the app wrote them before the packed one: the engine still reads them
(engine/session_file.py, "Version 1") but no longer writes them, so the tests that hold that reading make them here.

Version 1: session.json with every record tagged one by one ({"$type": name, "fields": {...}}, an array as
{"$array": "a0"}), and arrays.npz, an uncompressed np.savez archive holding a0.npy, a1.npy, … (an array two records
share stored once), stored in the session's zip as it is.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from engine.session_file import FORMAT, SavedSession, _Encoder, save_session


def save_v1(path: str | os.PathLike[str], s: SavedSession) -> None:
    """Write `s` to `path` in the first session format."""
    arrays: dict[str, np.ndarray] = {}
    names: dict[int, str] = {}

    def name(a: np.ndarray) -> str:
        if a.dtype.kind not in "biufc":
            raise TypeError(f"cannot store an array of dtype {a.dtype}")
        if id(a) not in names:
            names[id(a)] = f"a{len(names)}"
            arrays[names[id(a)]] = a  # held: its id stays its own for the whole save
        return names[id(a)]

    enc = _Encoder(name)
    doc = {
        "format": FORMAT, "version": 1, "created": s.created or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": s.model, "prompt": s.prompt, "chat": s.chat, "settings": enc(s.settings), "info": enc(s.info),
        "cfg": enc(s.cfg), **({"dropped": list(s.dropped)} if s.dropped else {}),
        "events": [enc(e) for e in s.events],
        "branches": [{**{k: v for k, v in b.items() if k != "events"}, "events": [enc(e) for e in b.get("events", [])]}
                     for b in s.branches],
    }
    npz = io.BytesIO()
    np.savez(npz, **arrays)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("session.json", json.dumps(doc, ensure_ascii=False), zipfile.ZIP_DEFLATED)
        z.writestr("arrays.npz", npz.getvalue(), zipfile.ZIP_STORED)
        if s.tokenizer is not None:
            with tempfile.TemporaryDirectory() as td:
                s.tokenizer.save(td)
                for f in sorted(Path(td).iterdir()):
                    z.write(f, f"tokenizer/{f.name}")


def save(path: str | os.PathLike[str], s: SavedSession, version: int) -> None:
    """Write `s` in the given format: 1 (this module's) or 2 (the engine's)."""
    if version == 1:
        save_v1(path, s)
    else:
        save_session(path, s)
