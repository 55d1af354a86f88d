"""A .ilab file may come from anyone: every malformed or hostile one ends in SessionFileError with one sentence, in
bounded memory and time, and never runs code; a server run's events save and reopen like a local run's.

Each hostile file is opened in a child process under an address-space limit, which reports how far its resident
memory grew; the child's timeout catches a hang.
"""

import io
import json
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from engine.events import (
    Failed,
    Finished,
    Funnel,
    PromptTokenized,
    RunSource,
    RunStarted,
    StepCost,
    TokenSampled,
)
from engine.model.config import ModelConfig
from engine.protocol import SamplingParams
from engine.remote.backend import RemoteTokenSampled, ServerConnected, ServerMetricsSampled, TopNFunnel
from engine.remote.client import ServerInfo
from engine.remote.metrics import ServerMetrics
from engine.session_file import MAX_ARRAYS, SavedSession, SessionFileError, load_session, save_session
from tests.engine.test_session_file import assert_same
from tests.session_v1 import save, save_v1

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20
GROWTH_LIMIT = 150 * MB  # resident memory a refused file may cost the reader (its bombs expand to 200 MB and more)

COST = StepCost(flops=0.0, weight_bytes=0.0, kv_read_bytes=0.0, kv_write_bytes=0.0)


def funnel(n: int = 3, cls=Funnel, **extra) -> Funnel:
    p = np.full(n, 1.0 / n, np.float32)
    return cls(ids=np.arange(n, dtype=np.int64), pieces=tuple(f"t{i}" for i in range(n)),
               logits=np.zeros(n, np.float32), p_raw=p, p_temperature=p, p_top_k=p, p_top_p=p, p_final=p,
               kept_top_k=n, kept_top_p=n, kept_final=n, vocab_size=100, greedy=False, **extra)


def prompt_event() -> PromptTokenized:
    return PromptTokenized(text="ab", ids=np.array([5, 6], np.int64), pieces=("a", "b"),
                           offsets=np.array([[0, 1], [1, 2]], np.int64),
                           byte_offsets=np.array([[0, 1], [1, 2]], np.int64), special=np.zeros(2, bool))


def server_run() -> list:
    """A server run's events, built by hand as the remote backend yields them."""
    params = SamplingParams(temperature=0.7, seed=3)
    info = ServerInfo(url="http://127.0.0.1:8000", kind="vllm", model="m", version="0.9", max_model_len=4096,
                      tokenize="/tokenize", metrics=True, notes=("a note",),
                      config=ModelConfig(name="m", n_layers=2, d_model=64, n_heads=4))
    toks = [RemoteTokenSampled(step=i, phase="prefill" if i == 0 else "decode", position=2 + i, token_id=7 + i,
                               piece=f"x{i}", text=f"x{i}", seconds=0.01 * i, cost=COST,
                               funnel=funnel(4, TopNFunnel, top_n=4), params=params, arrival_s=0.1 * i, chunk=i,
                               logprob=-0.5 if i else None)
            for i in range(3)]
    return [RunStarted(source=RunSource(kind="server", name="m @ 127.0.0.1:8000",
                                        cannot=("attention", "residual_norms", "costs"))),
            ServerConnected(info=info), prompt_event(), *toks,
            ServerMetricsSampled(t=0.3, metrics=ServerMetrics(kv_usage=0.25, running=1.0)),
            Finished(reason="length", prompt_ids=np.array([5, 6], np.int64), ids=np.array([7, 8, 9], np.int64),
                     text="x0x1x2", ttft_s=0.1, tpot_s=0.05, step_seconds=np.array([0.01, 0.02]), total_s=0.2)]


def test_a_server_run_saves_and_reopens_equal(tmp_path):
    events = server_run()
    params = events[3].params
    s = SavedSession(events=events, prompt="ab", settings={"params": params, "max_new_tokens": 3},
                     branches=[{"name": "b", "parent": None, "step": 1, "token": 8, "events": events[-3:]}])
    save_session(tmp_path / "server.ilab", s)
    back = load_session(tmp_path / "server.ilab")
    assert [type(e).__name__ for e in back.events] == [type(e).__name__ for e in events]
    for i, (a, b) in enumerate(zip(events, back.events, strict=True)):
        assert_same(a, b, f"events[{i}]")
    assert back.events[0].source.cannot == ("attention", "residual_norms", "costs")
    assert isinstance(back.events[1].info.config, ModelConfig)
    assert_same(back.branches[0]["events"][0], events[-3])


def test_opening_a_session_keeps_the_gui_process_torch_free(tmp_path):
    save_session(tmp_path / "server.ilab", SavedSession(events=server_run()))
    code = ("import sys; from engine.session_file import load_session; "
            f"s = load_session({str(tmp_path / 'server.ilab')!r}); "
            "assert type(s.events[3]).__name__ == 'RemoteTokenSampled'; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---- building hostile files ---------------------------------------------------------------------------------
def valid_doc() -> dict:
    """session.json of a small valid session (arrays a0… in arrays.npz), as the writer makes it."""
    with zipfile.ZipFile(valid_file_bytes()) as z:
        return json.loads(z.read("session.json"))


_VALID: dict[str, bytes] = {}


def valid_file_bytes() -> io.BytesIO:
    if "v" not in _VALID:
        tok = TokenSampled(step=0, phase="prefill", position=2, token_id=1, piece="t1", text="t1", seconds=0.1,
                           cost=COST, funnel=funnel(3), logits=np.zeros(10, np.float32),
                           params=SamplingParams())
        with tempfile.TemporaryDirectory() as td:
            # the cases below are edits of a version-1 file (session.json's records tagged one by one, arrays.npz):
            # files written before the packed format; the version-2 cases follow them
            save_v1(Path(td) / "valid.ilab", SavedSession(events=[prompt_event(), tok], prompt="ab"))
            _VALID["v"] = (Path(td) / "valid.ilab").read_bytes()
            save_session(Path(td) / "valid2.ilab", SavedSession(events=[prompt_event(), tok], prompt="ab"))
            _VALID["v2"] = (Path(td) / "valid2.ilab").read_bytes()
    return io.BytesIO(_VALID["v"])


def arrays_of_valid() -> bytes:
    with zipfile.ZipFile(valid_file_bytes()) as z:
        return z.read("arrays.npz")


def write_ilab(path: Path, members: dict[str, bytes | str], stored: tuple[str, ...] = ("arrays.npz",)) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data, zipfile.ZIP_STORED if name in stored else zipfile.ZIP_DEFLATED)
    return path


def with_doc(path: Path, doc, arrays: bytes | None = None) -> Path:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    return write_ilab(path, {"session.json": text, "arrays.npz": arrays if arrays is not None else arrays_of_valid()})


def npy_header(shape: tuple, descr: str = "<f4") -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
    return f.getvalue()


def npz(members: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> bytes:
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w", compress) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return f.getvalue()


def zeros_member(z: zipfile.ZipFile, name: str, n_bytes: int, prefix: bytes = b"") -> None:
    """A member of `n_bytes` zeros (after `prefix`), deflated as it is written: a bomb without holding it."""
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    with z.open(info, "w", force_zip64=True) as f:
        f.write(prefix)
        block = bytes(MB)
        for _ in range(n_bytes // MB):
            f.write(block)


def bomb_json(path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("session.json", "w", force_zip64=True) as f:  # 200 MB of spaces after a valid start
            f.write(b'{"format": "inference-lab-session", "version": 1, "prompt": "')
            block = b" " * MB
            for _ in range(200):
                f.write(block)
            f.write(b'"}')
    return path


def lying_bomb_json(path: Path) -> Path:
    """The same bomb with its directory entries claiming 1,000 bytes: the reader stops where the header says."""
    bomb_json(path)
    data = bytearray(path.read_bytes())
    for sig, size_at in ((b"PK\x01\x02", 24),):  # central directory: uncompressed size
        i = data.find(sig)
        struct.pack_into("<I", data, i + size_at, 1000)
    path.write_bytes(bytes(data))
    return path


def bomb_npz_member(path: Path) -> Path:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w", zipfile.ZIP_DEFLATED) as z:
        zeros_member(z, "a0.npy", 256 * MB, npy_header((64 * MB,)))
    return with_doc(path, valid_doc(), inner.getvalue())


def nested_npz_bomb(path: Path) -> Path:
    """Old-format files deflate arrays.npz itself: a stored npz of zeros, deflated, inside a deflated member."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w", zipfile.ZIP_STORED) as z:
        with z.open(zipfile.ZipInfo("a0.npy"), "w", force_zip64=True) as f:
            f.write(npy_header((64 * MB,)))
            block = bytes(MB)
            for _ in range(256):
                f.write(block)
    return write_ilab(path, {"session.json": json.dumps(valid_doc()), "arrays.npz": inner.getvalue()}, stored=())


def huge_npy_header(path: Path) -> Path:
    return with_doc(path, valid_doc(), npz({"a0.npy": npy_header((1 << 40,)) + bytes(64)}))


class Payload:
    """Unpickling this would create the marker file."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickled_objects(path: Path) -> Path:
    Payload.marker = str(path.with_suffix(".pwned"))
    f = io.BytesIO()
    np.save(f, np.array([Payload(), 1], dtype=object), allow_pickle=True)
    assert b"pwned" in f.getvalue()
    doc = valid_doc()
    doc["settings"] = {"x": {"$array": "a0"}}
    return with_doc(path, doc, npz({"a0.npy": f.getvalue()}))


def many_members(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("session.json", json.dumps(valid_doc()))
        for i in range(100_000):
            z.writestr(f"x{i}", b"")
    return path


def many_arrays(path: Path) -> Path:
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w") as z:
        empty = npy_header((0,))
        for i in range(MAX_ARRAYS + 1):
            z.writestr(f"a{i}.npy", empty)
    return with_doc(path, valid_doc(), f.getvalue())


def list_document(path: Path) -> Path:
    return with_doc(path, "[1, 2]")


def deep_nesting(path: Path) -> Path:
    return with_doc(path, "[" * 100_000 + "]" * 100_000)


def nesting_past_the_limit(path: Path) -> Path:
    doc = valid_doc()
    doc["settings"] = {"x": json.loads("[" * 500 + "]" * 500)}
    return with_doc(path, doc)


def edit(change):
    def build(path: Path) -> Path:
        doc = valid_doc()
        change(doc)
        return with_doc(path, doc)
    build.__name__ = change.__name__
    return build


def token_fields(doc):
    return doc["events"][1]["fields"]


def funnel_fields(doc):
    return token_fields(doc)["funnel"]["fields"]


def prompt_fields(doc):
    return doc["events"][0]["fields"]


def damaged_tokenizer(path: Path, tiny_tokenizer) -> Path:
    good = path.with_name("good.ilab")
    save_session(good, SavedSession(events=[prompt_event()], tokenizer=tiny_tokenizer))
    with zipfile.ZipFile(good) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members["tokenizer/tokenizer.json"] = b'{"version": "1.0", "model": {"type": "BPE", "vocab": [1, 2'
    return write_ilab(path, members)


def huge_token_bytes(path: Path, tiny_tokenizer) -> Path:
    good = path.with_name("good.ilab")
    save_session(good, SavedSession(events=[prompt_event()], tokenizer=tiny_tokenizer))
    with zipfile.ZipFile(good) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members["tokenizer/token_bytes.npy"] = npy_header((1 << 40,), "<i8") + bytes(64)
    return write_ilab(path, members)


def zip_slip_tokenizer(path: Path) -> Path:
    return write_ilab(path, {"session.json": json.dumps(valid_doc()), "arrays.npz": arrays_of_valid(),
                             "tokenizer/../../evil.json": b"{}"})


def corrupted_member(path: Path) -> Path:
    data = bytearray(valid_file_bytes().getvalue())
    i = data.find(b"session.json") + len("session.json") + 20  # inside session.json's deflated bytes
    data[i:i + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    return path


def flipped_array_value(path: Path) -> Path:
    """One byte of an array's values changed inside the stored arrays.npz: only its checksum can tell."""
    arrays = bytearray(arrays_of_valid())
    member = zipfile.ZipFile(io.BytesIO(bytes(arrays))).infolist()[0]
    name_len, extra_len = struct.unpack("<HH", arrays[member.header_offset + 26:member.header_offset + 30])
    arrays[member.header_offset + 30 + name_len + extra_len + member.file_size - 1] ^= 0xFF
    return with_doc(path, valid_doc(), bytes(arrays))


def truncated(fraction: float):
    def build(path: Path) -> Path:
        data = valid_file_bytes().getvalue()
        path.write_bytes(data[: int(len(data) * fraction)])
        return path
    build.__name__ = f"truncated_at_{fraction:g}"
    return build


# ---- version 2: records as columns, arrays in packs ----------------------------------------------------------
def v2_members() -> dict[str, bytes]:
    valid_file_bytes()
    with zipfile.ZipFile(io.BytesIO(_VALID["v2"])) as z:
        return {n: z.read(n) for n in z.namelist()}


def v2_doc() -> dict:
    return json.loads(v2_members()["session.json"])


def pack_of(dtype: str) -> str:
    """The member of the valid file's pack of this dtype."""
    members = v2_members()
    return next(n for n, data in members.items() if n.startswith("arrays/")
                and np.load(io.BytesIO(data)).dtype == np.dtype(dtype))


def write_v2(path: Path, doc: dict | None = None, replace: dict[str, bytes] | None = None,
             deflated: tuple[str, ...] = ()) -> Path:
    members = v2_members()
    if doc is not None:
        members["session.json"] = json.dumps(doc).encode()
    members.update(replace or {})
    stored = tuple(n for n in members if n.startswith("arrays/") and n not in deflated)
    return write_ilab(path, members, stored=stored)


def pack_lying_header(path: Path) -> Path:
    """A pack whose .npy header claims 2⁴⁰ values in a member of a few bytes: refused before allocating."""
    return write_v2(path, replace={pack_of("<f4"): npy_header((1 << 40,)) + bytes(64)})


def pack_header_short_of_its_bytes(path: Path) -> Path:
    return write_v2(path, replace={pack_of("<f4"): npy_header((2,)) + bytes(64)})


def pack_deflated_bomb(path: Path) -> Path:
    members = v2_members()
    name = pack_of("<f4")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in members.items():
            if n != name:
                z.writestr(n, data, zipfile.ZIP_STORED if n.startswith("arrays/") else zipfile.ZIP_DEFLATED)
        zeros_member(z, name, 256 * MB, npy_header((64 * MB,)))
    return path


def pack_lying_directory(path: Path) -> Path:
    """The bomb above with its directory entry claiming 1,000 bytes: the .npy header's 64 M values do not fit in
    what the directory says, so nothing is allocated or inflated past it."""
    pack_deflated_bomb(path)
    data = bytearray(path.read_bytes())
    name = pack_of("<f4").encode()
    at = 0
    while (at := data.find(b"PK\x01\x02", at + 1)) >= 0:
        if data[at + 46:at + 46 + len(name)] == name:
            struct.pack_into("<I", data, at + 24, 1000)
            struct.pack_into("<I", data, at + 20, 1000)
    path.write_bytes(bytes(data))
    return path


def pack_of_objects(path: Path) -> Path:
    f = io.BytesIO()
    np.save(f, np.array([Payload(), 1], dtype=object), allow_pickle=True)
    Payload.marker = str(path.with_suffix(".pwned"))
    return write_v2(path, replace={pack_of("<f4"): f.getvalue()})


def pack_2d(path: Path) -> Path:
    f = io.BytesIO()
    np.save(f, np.zeros((4, 8), np.float32))
    return write_v2(path, replace={pack_of("<f4"): f.getvalue()})


def pack_missing(path: Path) -> Path:
    members = v2_members()
    del members["arrays/0.npy"]
    return write_ilab(path, members, stored=tuple(n for n in members if n.startswith("arrays/")))


def pack_stray_member(path: Path) -> Path:
    return write_v2(path, replace={"arrays/../a.npy": npy_header((1,)) + bytes(4)})


def pack_flipped_value(path: Path) -> Path:
    """One byte of a stored pack's values changed in the file: only its checksum can tell."""
    write_v2(path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(pack_of("<f4"))
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + info.file_size - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def kinds(doc):
    return doc["events"]["c"]


def token_columns(doc):
    return kinds(doc)["c"][1]["f"]


def prompt_columns(doc):
    return kinds(doc)["c"][0]["f"]


def edit2(change):
    def build(path: Path) -> Path:
        doc = v2_doc()
        change(doc)
        return write_v2(path, doc)
    build.__name__ = "v2_" + change.__name__
    return build


def _put(where, key, value, name):
    def change(doc):
        where(doc)[key] = value
    change.__name__ = name
    return change


V2_CASES = [
    pack_lying_header, pack_header_short_of_its_bytes, pack_deflated_bomb, pack_lying_directory, pack_of_objects,
    pack_2d, pack_missing, pack_stray_member, pack_flipped_value,
    edit2(_put(lambda d: d, "events", [], "events_a_list")),
    edit2(_put(lambda d: d, "events", {"rows": 3, "c": {"v": [1, 2]}}, "rows_miscounted")),
    edit2(_put(lambda d: d["events"], "rows", "2", "rows_not_a_number")),
    edit2(_put(kinds, "i", [0, 5], "order_names_a_missing_kind")),
    edit2(_put(kinds, "k", ["PromptTokenized", "Popen"], "unknown_record_kind")),
    edit2(_put(kinds, "c", [{"v": [1]}], "a_kind_without_its_column")),
    edit2(_put(prompt_columns, "ids", {"z": [1]}, "unknown_column_kind")),
    edit2(_put(prompt_columns, "ids", {"a": [0, 10 ** 9, 2], "d": 1}, "array_past_its_pack")),
    edit2(_put(prompt_columns, "ids", {"a": [0, -1, 2], "d": 1}, "array_at_a_negative_offset")),
    edit2(_put(prompt_columns, "ids", {"a": [9, 0, 2], "d": 1}, "array_in_a_missing_pack")),
    edit2(_put(prompt_columns, "offsets", {"a": [0, 0, 1 << 62, 1 << 62], "d": 2}, "shape_whose_product_wraps")),
    edit2(_put(prompt_columns, "ids", {"a": [0, 0, 1 << 70], "d": 1}, "number_past_64_bits")),
    edit2(_put(prompt_columns, "ids", {"a": [0, 0, 2.5], "d": 1}, "reference_not_whole")),
    edit2(_put(prompt_columns, "ids", {"a": [0, 0, 2, 0, 0, 2], "d": 1}, "column_longer_than_its_rows")),
    edit2(_put(prompt_columns, "ids", {"a": [0, 0, 2], "d": 99}, "arrays_of_99_dimensions")),
    edit2(_put(prompt_columns, "pieces", {"t": [[["a"], "b"]]}, "tuple_of_lists")),
    edit2(_put(prompt_columns, "pieces", {"t": [["a"]]}, "pieces_not_matching_ids")),
    edit2(_put(prompt_columns, "offsets", {"a": [0, 0, 2, 1], "d": 2}, "offsets_not_pairs")),
    edit2(_put(token_columns, "step", {"v": ["x"]}, "step_is_text")),
    edit2(_put(token_columns, "phase", {"v": ["sideways"]}, "phase_unknown")),
    edit2(_put(token_columns, "step", {"v": [{"$type": "Popen"}]}, "plain_column_holding_an_object")),
    edit2(_put(token_columns, "params", {"x": [{"$type": "SamplingParams", "fields": {"temperature": -1.0}}]},
               "params_refused_by_their_own_check")),
    edit2(_put(token_columns, "params", {"n": [3], "c": {"v": []}}, "null_row_outside_its_column")),
    edit2(_put(token_columns, "logits", {"x": [{"$array": "a0"}]}, "version_1_array_name")),
    edit2(_put(token_columns, "logits", {"x": [{"$array": 5}]}, "tagged_array_not_a_place")),
    edit2(_put(lambda d: d, "events", {"rows": 1 << 40, "c": {"n": [], "c": {"r": "StepCost", "f": {}}}},
               "a_trillion_rows_of_nothing")),
    edit2(_put(lambda d: d, "events", {"rows": 1 << 40, "c": {"n": [0], "c": {"v": [1]}}},
               "a_trillion_rows_mostly_null")),
    edit2(lambda d: token_columns(d).pop("cost")),
]
V2_CASES[-1].__name__ = "v2_cost_column_missing"


@pytest.mark.parametrize("build", V2_CASES, ids=lambda b: b.__name__)
def test_a_hostile_packed_file_is_refused_in_one_sentence(build, tmp_path):
    path = build(tmp_path / "hostile.ilab")
    r = assert_refused(path)
    print(f"{build.__name__}: {r['growth'] / MB:.0f} MB: {r['error']}")
    assert not list(tmp_path.glob("*.pwned")) and not (tmp_path.parent / "a.npy").exists()


def test_the_valid_packed_base_file_opens(tmp_path):
    """The packed cases are edits of this file: it is accepted, and so is its document written again unchanged."""
    assert open_in_child(write_v2(tmp_path / "valid2.ilab"))["error"] is None
    assert open_in_child(write_v2(tmp_path / "rewritten2.ilab", v2_doc()))["error"] is None


def _set(where, key, value):
    def change(doc):
        where(doc)[key] = value
    change.__name__ = f"{key}_is_{type(value).__name__}"
    return change


CASES = [
    bomb_json, lying_bomb_json, bomb_npz_member, nested_npz_bomb, huge_npy_header, pickled_objects, many_members,
    many_arrays, deep_nesting, nesting_past_the_limit, zip_slip_tokenizer, corrupted_member, flipped_array_value,
    *(truncated(f) for f in (0.1, 0.5, 0.9, 0.99)),
    list_document,
    edit(_set(lambda d: d, "events", 5)), edit(_set(lambda d: d, "prompt", 5)), edit(_set(lambda d: d, "chat", "y")),
    edit(_set(lambda d: d, "model", [1])), edit(_set(lambda d: d, "info", "x")),
    edit(_set(lambda d: d, "version", "1")),
    edit(_set(lambda d: d["model"], "sha256", {"a": 1})), edit(_set(lambda d: d, "settings", {"max_new_tokens": "9"})),
    edit(_set(lambda d: d, "branches", [{"name": 1, "events": []}])),
    edit(_set(lambda d: d, "branches", [{"name": "a", "events": []}, {"name": "b", "parent": 1, "events": []}])),
    edit(_set(lambda d: d["events"][1], "fields", 5)), edit(_set(lambda d: d["events"][1], "$type", "Popen")),
    edit(_set(lambda d: d["events"][1], "$type", ["TokenSampled"])), edit(_set(lambda d: d["events"], 0, {"$foo": 1})),
    edit(_set(lambda d: d["events"], 0, {"$tuple": 5})), edit(_set(lambda d: d["events"], 0, {"$array": 7})),
    edit(_set(lambda d: d["events"], 0, {"$array": "a999"})), edit(_set(lambda d: d["events"], 0, 3)),
    edit(_set(token_fields, "step", "x")), edit(_set(token_fields, "phase", "sideways")),
    edit(_set(token_fields, "params", {"$tuple": [1]})), edit(_set(prompt_fields, "ids", 5)),
    edit(_set(prompt_fields, "pieces", {"$tuple": ["a"]})), edit(_set(funnel_fields, "pieces", {"$tuple": ["a"]})),
    edit(_set(token_fields, "cost", {"$type": "StepCost", "fields": {"flops": "many"}})),
    edit(lambda d: d["events"].append({"$type": "SamplingParams", "fields": {"temperature": -1.0}})),
]
LENGTH_CASES = {  # per-step arrays whose lengths disagree, written by the ordinary writer
    "funnel_p_raw_short": lambda: [TokenSampled(step=0, phase="prefill", position=0, token_id=1, piece="a",
                                                text="a", seconds=0.0, cost=COST,
                                                funnel=_replace(funnel(3), p_raw=np.ones(2, np.float32)))],
    "offsets_not_pairs": lambda: [_replace(prompt_event(), offsets=np.zeros((2, 3), np.int64))],
    "offsets_not_matching_ids": lambda: [_replace(prompt_event(), byte_offsets=np.zeros((3, 2), np.int64))],
    "attention_2d": lambda: [_attention(np.zeros((2, 3), np.float32))],
    "finished_ids_2d": lambda: [Failed(message="x"), Finished(reason="eos", prompt_ids=np.zeros((2, 2), np.int64),
                                                              ids=np.zeros(1, np.int64), text="", ttft_s=0.0,
                                                              tpot_s=0.0)],
}


def _replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def _attention(w):
    from engine.events import AttentionCaptured

    return AttentionCaptured(step=0, phase="prefill", layer=0, query_start=0, weights=w, group_size=1)


CHILD = r"""
import json, resource, sys
from engine.session_file import load_session
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
rss0, vm0 = status("VmRSS:"), status("VmSize:")
resource.setrlimit(resource.RLIMIT_AS, (vm0 + 2 * 2**30, vm0 + 2 * 2**30))
try:
    load_session(sys.argv[1])
    out = {"error": None}
except Exception as e:
    out = {"type": type(e).__name__, "error": str(e)}
out["growth"] = status("VmHWM:") - rss0  # peak of this process's own memory (ru_maxrss counts the parent's)
print(json.dumps(out))
"""


def open_in_child(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def assert_refused(path: Path) -> dict:
    r = open_in_child(path)
    assert r["error"] is not None, "a hostile file was accepted"
    assert r["type"] == "SessionFileError", r
    assert "\n" not in r["error"] and r["error"].startswith(path.name), r["error"]
    assert "memory" not in r["error"], r["error"]  # refused for what it is, not for running out
    assert r["growth"] < GROWTH_LIMIT, r
    return r


@pytest.mark.parametrize("build", CASES, ids=lambda b: b.__name__)
def test_a_hostile_file_is_refused_in_one_sentence(build, tmp_path):
    path = build(tmp_path / "hostile.ilab")
    r = assert_refused(path)
    print(f"{build.__name__}: {r['growth'] / MB:.0f} MB: {r['error']}")
    assert not list(tmp_path.glob("*.pwned")) and not (tmp_path.parent / "evil.json").exists()


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("name", sorted(LENGTH_CASES))
def test_per_step_arrays_that_disagree_are_refused(name, version, tmp_path):
    path = tmp_path / f"{name}.ilab"
    save(path, SavedSession(events=LENGTH_CASES[name]()), version)  # it stores what it is given
    with pytest.raises(SessionFileError) as e:
        load_session(path)
    assert "inconsistent" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("build", [damaged_tokenizer, huge_token_bytes], ids=lambda b: b.__name__)
def test_a_damaged_tokenizer_is_refused_in_one_sentence(build, tmp_path, tiny_lm):
    path = build(tmp_path / "hostile.ilab", tiny_lm.tokenizer)
    r = assert_refused(path)
    assert "tokenizer" in r["error"]


def test_the_valid_base_file_opens(tmp_path):
    """The hostile files above are edits of this one: it must itself be accepted, so each refusal is the edit's."""
    path = tmp_path / "valid.ilab"
    path.write_bytes(valid_file_bytes().getvalue())
    assert open_in_child(path)["error"] is None
    assert open_in_child(with_doc(tmp_path / "rewritten.ilab", valid_doc()))["error"] is None


def test_the_app_exits_with_one_line_on_a_hostile_session(tmp_path):
    path = tmp_path / "hostile.ilab"
    edit(_set(funnel_fields, "pieces", {"$tuple": ["a"]}))(path)
    out = subprocess.run([sys.executable, "-m", "app", "--open-session", str(path), "--screenshot",
                          str(tmp_path / "out.png"), "--timeout", "300"], capture_output=True, text=True, timeout=240,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("inference-lab:")]
    assert len(lines) == 1 and "hostile.ilab" in lines[0] and "inconsistent" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out.png").exists()
