"""Saved sessions: every event, the model's identity and its tokenizer survive a save and a load; no pickle."""

import dataclasses
import hashlib
import json
import os
import zipfile

import numpy as np
import pytest

from engine.events import LensCaptured, ModelInfo, TokenSampled
from engine.run.sampling import SamplingParams
from engine.run.session import Capture, Session
from engine.session_file import (
    SavedSession,
    SessionFileError,
    load_session,
    model_identity,
    same_model,
    save_session,
)
from tests.session_v1 import save


def assert_same(a, b, where="event"):
    """Deep equality for events: same types, equal arrays with the same dtype and shape, equal numbers."""
    assert type(a) is type(b), where
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), where
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _arrays(x):
    """Every numpy array a record holds, its nested records' included."""
    if isinstance(x, np.ndarray):
        yield x
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from _arrays(getattr(x, f.name))
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _arrays(v)


@pytest.fixture(scope="module")
def recorded(tiny_lm):
    cap = Capture(attention_layers=frozenset({0, 1}), residual_norms=True, funnel_top=8, logits=True, lens_top=4)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    events = list(Session(tiny_lm).generate("the cat sat", params, 5, cap, ignore_eos=True, forced={2: 9}))
    return SavedSession(events=events, prompt="the cat sat", chat=False,
                        settings={"params": params, "max_new_tokens": 5, "capture": cap},
                        model=model_identity(tiny_lm.info), info=tiny_lm.info, cfg=tiny_lm.cfg,
                        tokenizer=tiny_lm.tokenizer,
                        branches=[{"name": "b1", "parent": None, "step": 2, "token": 9, "events": events[-3:]}])


@pytest.mark.parametrize("version", [2, 1])  # 1: files written before the packed format are still read
def test_round_trip_keeps_every_event(recorded, tmp_path, version):
    path = tmp_path / "run.ilab"
    save(path, recorded, version)
    back = load_session(path)
    assert len(back.events) == len(recorded.events)
    kinds = {type(e).__name__ for e in back.events}
    assert {"PromptTokenized", "AttentionCaptured", "ResidualNorms", "LensCaptured", "KVCacheGrew", "PrefillDone",
            "TokenSampled", "Finished"} <= kinds
    for i, (a, b) in enumerate(zip(recorded.events, back.events, strict=True)):
        assert_same(a, b, f"events[{i}]")
    assert_same(recorded.settings["params"], back.settings["params"])
    assert back.settings["capture"] == recorded.settings["capture"] and back.settings["max_new_tokens"] == 5
    assert_same(recorded.info, back.info) and back.cfg == recorded.cfg
    assert back.model["sha256"] and back.model == recorded.model
    assert back.branches[0]["step"] == 2 and len(back.branches[0]["events"]) == 3
    tok = back.tokenizer
    assert tok.encode("the cat sat").ids == recorded.tokenizer.encode("the cat sat").ids
    assert [e.forced for e in back.events if isinstance(e, TokenSampled)] == [False, False, True, False, False]
    assert isinstance(next(e for e in back.events if isinstance(e, LensCaptured)).pieces[0][0], str)


def test_the_file_is_open_json_and_npy_without_pickle(recorded, tmp_path):
    import io

    path = tmp_path / "run.ilab"
    save_session(path, recorded)
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        packs = sorted(n for n in names if n.startswith("arrays/"))
        assert "session.json" in names and any(n.startswith("tokenizer/") for n in names)
        doc = json.loads(z.read("session.json"))
        assert doc["format"] == "inference-lab-session" and doc["version"] == 2 and doc["prompt"] == "the cat sat"
        # one stored 1-D .npy per dtype, each readable by numpy without pickle, holding every array's values
        assert packs == [f"arrays/{i}.npy" for i in range(len(packs))] and 2 <= len(packs) <= 4
        stored = [np.load(io.BytesIO(z.read(n)), allow_pickle=False) for n in packs]  # a pickle would raise here
        assert all(a.ndim == 1 and a.dtype != object for a in stored)
        assert all(z.getinfo(n).compress_type == zipfile.ZIP_STORED for n in packs)
    # every array the events hold is in a pack, each value once per array object
    arrays = {id(a): a for e in recorded.events + recorded.branches[0]["events"] for a in _arrays(e)}
    assert sum(a.nbytes for a in stored) == sum(a.nbytes for a in arrays.values())
    with pytest.raises(TypeError, match="dtype object"):
        save_session(tmp_path / "bad.ilab", SavedSession(events=[], settings={"x": np.array([object()])}))


def test_unwritable_and_unreadable_files_say_so(recorded, tmp_path):
    with pytest.raises(OSError, match="cannot save the session to .*nope"):
        save_session(tmp_path / "nope" / "x.ilab", recorded)
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if not os.access(ro, os.W_OK):  # root can write anywhere: the check needs an ordinary user
            with pytest.raises(OSError, match="cannot save the session"):
                save_session(ro / "x.ilab", recorded)
            assert list(ro.iterdir()) == []
    finally:
        os.chmod(ro, 0o700)
    (tmp_path / "text.ilab").write_text("hello")
    with pytest.raises(SessionFileError, match="not a zip"):
        load_session(tmp_path / "text.ilab")
    with zipfile.ZipFile(tmp_path / "other.ilab", "w") as z:
        z.writestr("session.json", json.dumps({"format": "something else"}))
    with pytest.raises(SessionFileError, match="not an Inference Lab session"):
        load_session(tmp_path / "other.ilab")


def test_a_session_from_another_model_says_so(recorded, tiny_lm):
    assert same_model(recorded.model, tiny_lm.info) is None
    with open(tiny_lm.info.path, "rb") as f:  # the engine hashed the weights file once, at load
        assert tiny_lm.info.sha256 == hashlib.sha256(f.read()).hexdigest() == recorded.model["sha256"]
    other = dataclasses.replace(tiny_lm.info, name="other", path="/nonexistent/other.gguf", n_params=1, sha256="")
    msg = same_model(recorded.model, other)
    assert msg and "recorded with" in msg and "other" in msg
    renamed = dataclasses.replace(tiny_lm.info, sha256="0" * 64)  # same name, other weights
    assert "recorded with" in same_model(recorded.model, renamed)


def test_model_info_round_trips_through_json_only(tiny_lm, tmp_path):
    save_session(tmp_path / "m.ilab", SavedSession(info=tiny_lm.info, cfg=tiny_lm.cfg))
    back = load_session(tmp_path / "m.ilab", with_tokenizer=False)
    assert isinstance(back.info, ModelInfo) and back.info == tiny_lm.info and back.tokenizer is None
