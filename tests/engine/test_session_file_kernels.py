"""A saved session keeps the kernel mode its model ran in (ModelInfo.kernels): it reads back as saved; a file saved
before the mode was recorded reads back as "not recorded", never as a guessed "exact"; a mode that is none of the
known ones (another word, another type, a huge string) is refused in one sentence, as the file's other fields are."""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path

import pytest

from engine.events import ModelInfo
from engine.session_file import (
    KERNELS_NOT_RECORDED,
    SavedSession,
    SessionFileError,
    load_session,
)
from tests.session_v1 import save


def info(kernels: str = "exact") -> ModelInfo:
    return ModelInfo(name="tiny", path="/nonexistent/tiny.gguf", architecture="llama", n_layers=2, d_model=64,
                     n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=100, context_length=256,
                     rope_base=10000.0, n_params=12345, dtype="float32", device="cpu", weight_bytes=49380,
                     kv_bytes_per_token=256, file_type="Q4_1", load_s=0.1, from_cache=False,
                     decode_weight_bytes=40000, sha256="0" * 64, kernels=kernels)


def rewrite(path: Path, change) -> Path:
    """The same archive with session.json passed through `change(doc)`."""
    with zipfile.ZipFile(path) as z:
        members = {i.filename: (z.read(i), i.compress_type) for i in z.infolist()}
    doc = json.loads(members["session.json"][0])
    change(doc)
    members["session.json"] = (json.dumps(doc).encode(), zipfile.ZIP_STORED)  # a huge field is no zip bomb
    out = path.with_name("edited-" + path.name)
    with zipfile.ZipFile(out, "w") as z:
        for name, (data, kind) in members.items():
            z.writestr(name, data, kind)
    return out


def info_fields(doc: dict) -> dict:
    assert doc["info"]["$type"] == "ModelInfo"
    return doc["info"]["fields"]


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("mode", ["exact", "file", "fast"])
def test_the_kernel_mode_round_trips(mode, version, tmp_path):
    save(tmp_path / "s.ilab", SavedSession(info=info(mode)), version)
    back = load_session(tmp_path / "s.ilab", with_tokenizer=False)
    assert back.info == info(mode) and back.info.kernels == mode


@pytest.mark.parametrize("version", [2, 1])
def test_a_file_saved_before_the_mode_was_recorded_says_not_recorded(version, tmp_path):
    save(tmp_path / "s.ilab", SavedSession(info=info("fast")), version)
    old = rewrite(tmp_path / "s.ilab", lambda d: info_fields(d).pop("kernels"))
    back = load_session(old, with_tokenizer=False)
    assert back.info.kernels == KERNELS_NOT_RECORDED != "exact"
    assert dataclasses.replace(back.info, kernels="fast") == info("fast")  # everything else as saved
    # saved again as it is, it still says not recorded (never becomes "exact" on the way)
    save(tmp_path / "again.ilab", back, version)
    assert load_session(tmp_path / "again.ilab", with_tokenizer=False).info.kernels == KERNELS_NOT_RECORDED


HOSTILE = {"unknown_word": "turbo", "a_number": 5, "a_list": ["exact"], "huge": "fast" * 1_000_000,
           "exact_with_padding": " exact"}


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_kernel_mode_is_refused_in_one_sentence(name, version, tmp_path):
    save(tmp_path / "s.ilab", SavedSession(info=info()), version)
    path = rewrite(tmp_path / "s.ilab", lambda d: info_fields(d).__setitem__("kernels", HOSTILE[name]))
    with pytest.raises(SessionFileError) as e:
        load_session(path, with_tokenizer=False)
    message = str(e.value)
    assert "\n" not in message and len(message) <= 300 and "kernel" in message, message


@pytest.mark.parametrize("version", [2, 1])
def test_a_hostile_mode_among_the_events_is_refused_too(version, tmp_path):
    """A ModelInfo is a record a file may hold anywhere: as an event (version 2 reads events as columns), too."""
    save(tmp_path / "s.ilab", SavedSession(events=[info("turbo")]), version)  # stored as given
    with pytest.raises(SessionFileError) as e:
        load_session(tmp_path / "s.ilab", with_tokenizer=False)
    assert "turbo" in str(e.value) and "kernel mode" in str(e.value)
