"""Control vectors (engine/formats/control_vector.py) in llama.cpp's and repeng's GGUF format: read and written, held
to repeng's own export_gguf and import_gguf, and every hostile file refused with one sentence naming it."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from engine.formats import control_vector as cv
from tests import requires

repeng = requires.repeng()  # the reference: missing, it fails where the run requires references (make test)

D = 8
RNG = np.random.default_rng(0)


def _directions(*layers: int, d: int = D) -> dict[int, np.ndarray]:
    return {layer: RNG.standard_normal(d).astype(np.float32) for layer in layers}


def _write(path, tensors: dict[str, np.ndarray], arch: str = "controlvector", hint: str | None = "llama") -> None:
    """A GGUF written with gguf's own writer, holding whatever it is given."""
    w = gguf.GGUFWriter(str(path), arch)
    if hint is not None:
        w.add_string("controlvector.model_hint", hint)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _refused(path, **model) -> str:
    with pytest.raises(ValueError) as e:
        cv.load(path, **model)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


def test_round_trip(tmp_path):
    v = cv.ControlVector(_directions(3, 1, 7), model_hint="llama")
    cv.save(v, tmp_path / "v.gguf")
    w = cv.load(tmp_path / "v.gguf", n_layers=8, d_model=D)
    assert w == v and w.layers == (1, 3, 7) and w.model_hint == "llama" and w.width == D
    assert all(a.dtype == np.float32 and a.shape == (D,) for a in w.directions.values())
    assert [p.name for p in tmp_path.iterdir()] == ["v.gguf"]  # no temporary file left beside it


def test_the_file_holds_exactly_the_format_keys(tmp_path):
    cv.save(cv.ControlVector(_directions(2, 5), "qwen2"), tmp_path / "v.gguf")
    r = gguf.GGUFReader(tmp_path / "v.gguf")
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert fields == {"general.architecture": "controlvector", "controlvector.model_hint": "qwen2",
                      "controlvector.layer_count": 2}
    assert r.fields["controlvector.layer_count"].types == [gguf.GGUFValueType.UINT32]
    assert [(t.name, t.tensor_type, list(t.shape)) for t in r.tensors] == [
        ("direction.2", gguf.GGMLQuantizationType.F32, [D]), ("direction.5", gguf.GGMLQuantizationType.F32, [D])]


def test_repeng_export_loads_through_ours(tmp_path):
    directions = _directions(1, 4, 9)
    repeng.ControlVector(model_type="llama", directions=directions).export_gguf(tmp_path / "r.gguf")
    v = cv.load(tmp_path / "r.gguf", n_layers=10, d_model=D)
    assert v.model_hint == "llama" and v.layers == (1, 4, 9)
    for layer, a in directions.items():
        np.testing.assert_array_equal(v.directions[layer], a)


def test_ours_loads_through_repeng(tmp_path):
    v = cv.ControlVector(_directions(2, 6), model_hint="llama")
    cv.save(v, tmp_path / "v.gguf")
    r = repeng.ControlVector.import_gguf(tmp_path / "v.gguf")
    assert r.model_type == "llama" and sorted(r.directions) == [2, 6]
    for layer, a in v.directions.items():
        np.testing.assert_array_equal(np.asarray(r.directions[layer]), a)


def test_float16_directions_load_as_float32(tmp_path):
    a = RNG.standard_normal(D).astype(np.float16)
    _write(tmp_path / "h.gguf", {"direction.1": a})
    np.testing.assert_array_equal(cv.load(tmp_path / "h.gguf").directions[1], a.astype(np.float32))


def test_layer_zero_is_never_written(tmp_path):
    with pytest.raises(ValueError, match="direction.0"):
        cv.save(cv.ControlVector(_directions(0, 1)), tmp_path / "v.gguf")
    assert not list(tmp_path.iterdir())


def test_a_truncated_file_is_refused(tmp_path):
    cv.save(cv.ControlVector(_directions(1, 2, 3)), tmp_path / "v.gguf")
    data = (tmp_path / "v.gguf").read_bytes()
    for cut in (3, 20, 60, len(data) // 2, len(data) - 4):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        _refused(tmp_path / "cut.gguf")


def test_random_bytes_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    for i, head in enumerate((b"", b"GGUF", b"GGUF\x03\x00\x00\x00")):
        p = tmp_path / f"r{i}.gguf"
        p.write_bytes(head + rng.bytes(4096))
        _refused(p)
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "not a GGUF" in _refused(tmp_path / "empty.gguf")


def test_wrong_architecture_is_refused(tmp_path):
    _write(tmp_path / "m.gguf", {"direction.1": _directions(1)[1]}, arch="llama")
    assert "'llama'" in _refused(tmp_path / "m.gguf")


def test_a_tensor_not_a_direction_is_refused(tmp_path):
    for i, name in enumerate(("blk.1.attn_q.weight", "direction.x", "direction.-1", "direction.1.0", "direction")):
        _write(tmp_path / f"n{i}.gguf", {"direction.1": _directions(1)[1], name: _directions(1)[1]})
        assert "not direction.<layer>" in _refused(tmp_path / f"n{i}.gguf")


def test_a_duplicate_layer_is_refused(tmp_path):
    _write(tmp_path / "d.gguf", {"direction.1": _directions(1)[1], "direction.01": _directions(1)[1]})
    assert "two directions for layer 1" in _refused(tmp_path / "d.gguf")


def test_shape_and_type_are_checked(tmp_path):
    _write(tmp_path / "2d.gguf", {"direction.1": np.ones((2, D), np.float32)})
    assert "2 dimensions" in _refused(tmp_path / "2d.gguf")
    _write(tmp_path / "int.gguf", {"direction.1": np.ones(D, np.int32)})
    assert "not a float type" in _refused(tmp_path / "int.gguf")


def test_mismatched_widths_are_refused(tmp_path):
    _write(tmp_path / "w.gguf", {"direction.1": np.ones(D, np.float32), "direction.2": np.ones(D + 1, np.float32)})
    assert "width" in _refused(tmp_path / "w.gguf")


def test_non_finite_values_are_refused(tmp_path):
    for i, bad in enumerate((np.nan, np.inf)):
        a = np.ones(D, np.float32)
        a[3] = bad
        _write(tmp_path / f"f{i}.gguf", {"direction.1": a})
        assert "non-finite" in _refused(tmp_path / f"f{i}.gguf")
    _write(tmp_path / "big.gguf", {"direction.1": np.full(D, 1e300)})  # float64 beyond float32
    assert "non-finite" in _refused(tmp_path / "big.gguf")


def test_a_file_without_directions_is_refused(tmp_path):
    _write(tmp_path / "e.gguf", {})
    assert "no directions" in _refused(tmp_path / "e.gguf")


def test_the_loaded_model_bounds_layers_and_width(tmp_path):
    cv.save(cv.ControlVector(_directions(1, 5)), tmp_path / "v.gguf")
    assert "model's 5 layers" in _refused(tmp_path / "v.gguf", n_layers=5)  # layer 5 is past 1 … 4
    assert cv.load(tmp_path / "v.gguf", n_layers=6).layers == (1, 5)
    assert f"d_model is {D + 2}" in _refused(tmp_path / "v.gguf", d_model=D + 2)
    repeng.ControlVector(model_type="llama", directions=_directions(0, 1)).export_gguf(tmp_path / "z.gguf")
    assert cv.load(tmp_path / "z.gguf").layers == (0, 1)  # repeng may write layer 0; llama.cpp cannot use it
    assert "layer 0" in _refused(tmp_path / "z.gguf", n_layers=4)


def test_a_file_too_large_is_refused_before_reading(tmp_path, monkeypatch):
    cv.save(cv.ControlVector(_directions(1)), tmp_path / "v.gguf")
    monkeypatch.setattr(cv, "MAX_FILE_BYTES", 64)
    assert "more than the 64" in _refused(tmp_path / "v.gguf")


def test_a_header_declaring_too_much_is_refused(tmp_path):
    bomb = tmp_path / "keys.gguf"
    bomb.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40) + bytes(64))
    assert "keys" in _refused(bomb)
    w = gguf.GGUFWriter(str(tmp_path / "strings.gguf"), "controlvector")  # GGUFReader makes objects per item
    w.add_array("general.tags", [""] * (cv.MAX_STRING_ITEMS + 1))
    w.add_tensor("direction.1", np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "array of" in _refused(tmp_path / "strings.gguf")


def test_what_is_not_a_file_is_refused(tmp_path):
    _refused(tmp_path)
    _refused(tmp_path / "absent.gguf")


def test_as_llama_buffer_layout():
    dirs = _directions(1, 3)
    buf = cv.as_llama_buffer(cv.ControlVector(dirs), n_layers=5, d_model=D, scale=2.0)
    assert buf.dtype == np.float32 and buf.shape == (4 * D,)
    np.testing.assert_array_equal(buf[:D], dirs[1] * np.float32(2.0))  # direction.1 at offset 0
    np.testing.assert_array_equal(buf[2 * D:3 * D], dirs[3] * np.float32(2.0))  # direction.3 at offset 2·d
    assert not buf[D:2 * D].any() and not buf[3 * D:].any()
    with pytest.raises(ValueError, match="layer 0"):
        cv.as_llama_buffer(cv.ControlVector(_directions(0, 1)), n_layers=5, d_model=D)
    with pytest.raises(ValueError, match="layer 5"):
        cv.as_llama_buffer(cv.ControlVector(_directions(5)), n_layers=5, d_model=D)
    with pytest.raises(ValueError, match="d_model"):
        cv.as_llama_buffer(cv.ControlVector(dirs), n_layers=5, d_model=D + 1)


def test_a_control_vector_holds_read_only_float32_copies():
    a = np.arange(D, dtype=np.float64)
    v = cv.ControlVector({2: a})
    a[0] = 99
    assert v.directions[2][0] == 0 and v.directions[2].dtype == np.float32 and not v.directions[2].flags.writeable
    bad_ones = ({}, {-1: np.ones(D)}, {1: np.ones((2, D))}, {1: np.ones(D), 2: np.ones(D + 1)}, {1: np.full(D, np.nan)})
    for bad in bad_ones:
        with pytest.raises(ValueError):
            cv.ControlVector(bad)
