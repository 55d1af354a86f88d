"""A session's tokenizer files, when the engine's cache has none, are written by a child process from the model
file (serialising a 262k vocabulary held the GIL for a second or two, freezing the GUI after a run), and they are
the loaded tokenizer's own: read back, it tokenizes as the one in memory."""

from __future__ import annotations

import tempfile
from pathlib import Path

from app import session_io
from engine.tokenizer import Tokenizer


def test_tokenizer_files_come_from_a_child_and_equal_the_loaded_tokenizer(tiny_dir, tiny_lm, monkeypatch):
    tok = tiny_lm.tokenizer
    monkeypatch.setattr(session_io, "_cached_tokenizer_files", lambda _path: None)
    monkeypatch.setattr(session_io, "_tok_cache", [None, None])
    calls = []
    real = session_io._files_from_child
    monkeypatch.setattr(session_io, "_files_from_child", lambda p, t: calls.append(p) or real(p, t))
    files = session_io.tokenizer_files(tok, str(tiny_dir.gguf))
    assert calls == [str(tiny_dir.gguf)] and real(str(tiny_dir.gguf), tok) is not None
    with tempfile.TemporaryDirectory() as td:
        for name, data in files.files.items():
            (Path(td) / name).write_bytes(data)
        back = Tokenizer.load(td)
    text = "the cat sat on the mat, 2024 times"
    assert back.encode(text) == tok.encode(text)
    assert session_io._same_tokenizer(files.files, tok)
    other = dict(files.files)
    other["token_bytes.npy"] = other["token_bytes.npy"][:-1] + b"\x00"  # one byte of one token changed
    assert not session_io._same_tokenizer(other, tok)
