"""Control vectors in llama.cpp's and repeng's GGUF format, read and written.

The format (llama.cpp common/common.cpp `common_control_vector_load_one`, repeng `ControlVector.export_gguf`) is a
GGUF file with
    general.architecture       string "controlvector"
    controlvector.model_hint   string, the model family it was made for (repeng writes the HF model_type, "llama")
    controlvector.layer_count  uint32, how many directions the file holds (llama.cpp's loader does not read it)
and one float32 1-D tensor per steered layer, `direction.N`, of length n_embd.

Layers: N is the 0-based index of the transformer block whose OUTPUT the direction is added to. llama.cpp adds
direction.N to the residual stream at the end of block N (`build_cvec(cur, il)` just before `l_out-il`); repeng's
layer ids mean the same (it trains layer N on hidden_states[N + 1], the output of block N). llama.cpp cannot steer
block 0: its loader refuses a file holding direction.0, and `llama_set_adapter_cvec` takes one flat float32 buffer
of (n_layer - 1) × n_embd holding layers 1 … n_layer - 1, layer 1 first (`as_llama_buffer` builds it). So `save`
refuses layer 0, while `load` without a model accepts it (repeng can write one).

A control vector file may come from anyone, so `load` is bounded before GGUFReader sees it: a regular file of at
most MAX_FILE_BYTES, its header walked first (engine.formats.gguf_meta: how many keys, tensors and string-array items
it declares, each inside the file), so that GGUFReader, which builds Python objects per item, cannot be made to
build many; then only the direction tensors themselves are read. Whatever is wrong, it raises ControlVectorError (a
ValueError) with one sentence naming the file.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

import numpy as np

from engine.formats.gguf_meta import every_key_but, read_metadata

ARCH = "controlvector"
KEY_MODEL_HINT = f"{ARCH}.model_hint"
KEY_LAYER_COUNT = f"{ARCH}.layer_count"

MAX_FILE_BYTES = 1 << 30  # a control vector is n_layers × n_embd floats: far below this for any model
MAX_ENTRIES = 4096  # keys, and tensors (one per layer); a control vector has three keys
MAX_STRING_ITEMS = 4096  # items of string arrays, in all: GGUFReader builds objects per item

_NAME = re.compile(r"direction\.([0-9]{1,9})")


class ControlVectorError(ValueError):
    """A control vector file that cannot be used: one sentence naming the file and what is wrong."""


@dataclass(frozen=True, eq=False)
class ControlVector:
    """Steering directions by layer: `directions[N]` (float32, (d_model,)) is added to block N's output.

    Held as read-only float32 copies, sorted by layer; every direction finite and of one width.
    """

    directions: dict[int, np.ndarray]
    model_hint: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_hint, str):
            raise TypeError(f"model_hint must be a str, not {type(self.model_hint).__name__}")
        if not self.directions:
            raise ValueError("a control vector needs at least one direction")
        for layer in self.directions:
            if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
                raise ValueError(f"layer {layer!r} is not a block index (an int >= 0)")
        out: dict[int, np.ndarray] = {}
        for layer in sorted(self.directions):
            a = np.array(self.directions[layer], dtype=np.float32)  # a copy: the caller's array stays theirs
            if a.ndim != 1 or a.size == 0:
                raise ValueError(f"layer {layer}'s direction has shape {a.shape}, not (d_model,)")
            if not np.isfinite(a).all():
                raise ValueError(f"layer {layer}'s direction holds non-finite values")
            if out and a.size != len(next(iter(out.values()))):
                raise ValueError(f"layer {layer}'s direction has width {a.size}, the others "
                                 f"{len(next(iter(out.values())))}")
            a.setflags(write=False)
            out[int(layer)] = a
        object.__setattr__(self, "directions", out)

    @property
    def layers(self) -> tuple[int, ...]:
        """The steered blocks, in order."""
        return tuple(self.directions)

    @property
    def width(self) -> int:
        """d_model: every direction's length."""
        return len(next(iter(self.directions.values())))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ControlVector):
            return NotImplemented
        return (self.model_hint == other.model_hint and self.layers == other.layers
                and all(np.array_equal(a, other.directions[k]) for k, a in self.directions.items()))

    __hash__ = None  # type: ignore[assignment]  # holds arrays


def save(vector: ControlVector, path: str | os.PathLike[str]) -> None:
    """Write `vector` as a control vector GGUF that llama.cpp and repeng read (replacing `path` at once)."""
    import gguf

    if 0 in vector.directions:
        raise ValueError("layer 0 cannot be saved: llama.cpp refuses a control vector file holding direction.0")
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.tmp"  # beside it, so the replace is one rename
    try:
        writer = gguf.GGUFWriter(tmp, ARCH)  # writes general.architecture
        writer.add_string(KEY_MODEL_HINT, vector.model_hint)
        writer.add_uint32(KEY_LAYER_COUNT, len(vector.directions))  # as repeng writes it
        for layer, direction in vector.directions.items():
            writer.add_tensor(f"direction.{layer}", direction)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike[str], n_layers: int | None = None, d_model: int | None = None) -> ControlVector:
    """Read a control vector GGUF; with `n_layers` / `d_model`, also check that it fits that model as llama.cpp
    would use it (layers 1 … n_layers - 1, width d_model). Anything else raises ControlVectorError."""
    import gguf

    name = os.fspath(path)

    def refuse(what: str) -> ControlVectorError:
        return ControlVectorError(f"control vector {name}: {what}")

    try:
        st = os.stat(name)
        if not stat.S_ISREG(st.st_mode):
            raise refuse("is not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise refuse(f"is {st.st_size} bytes, more than the {MAX_FILE_BYTES} a control vector file may be")
        meta = read_metadata(name, every_key_but("general.architecture", KEY_MODEL_HINT), tensors=True,
                             max_entries=MAX_ENTRIES, max_strings=MAX_STRING_ITEMS)
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise refuse(str(e)) from None

    try:
        reader = gguf.GGUFReader(name, "r")
    except Exception as e:  # any damage GGUFReader trips over (the header walk above let through only a bounded file)
        raise refuse(f"is not a readable GGUF file ({type(e).__name__}: {e})") from None

    arch, hint = meta.get("general.architecture"), meta.get(KEY_MODEL_HINT, "")
    if arch != ARCH:
        raise refuse(f"is a GGUF of architecture {arch!r}, not {ARCH!r}" if arch else "has no general.architecture")
    if not isinstance(hint, str):
        raise refuse(f"has a {KEY_MODEL_HINT} that is not a string")

    float_types = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F64}
    directions: dict[int, np.ndarray] = {}
    for t in reader.tensors:
        m = _NAME.fullmatch(t.name)
        if m is None:
            raise refuse(f"holds a tensor named {t.name[:80]!r}, not direction.<layer>")
        layer = int(m.group(1))
        if layer in directions:
            raise refuse(f"holds two directions for layer {layer}")
        if len(t.shape) != 1:
            raise refuse(f"{t.name} has {len(t.shape)} dimensions, not 1")
        if t.tensor_type not in float_types:
            raise refuse(f"{t.name} is of type {t.tensor_type.name}, not a float type")
        if t.data.size != t.n_elements or t.n_elements == 0:
            raise refuse(f"{t.name} is cut short or empty ({t.data.size} of {t.n_elements} values)")
        with np.errstate(over="ignore"):  # a float64 beyond float32 becomes inf, which ControlVector refuses
            a = np.array(t.data, dtype=np.float32)  # reads this tensor alone, from the mapped file
        if n_layers is not None and not 1 <= layer <= n_layers - 1:
            raise refuse(f"steers layer {layer}, but the loaded model's {n_layers} layers can be steered at "
                         f"1 … {n_layers - 1} only")
        if d_model is not None and a.size != d_model:
            raise refuse(f"has width {a.size}, but the loaded model's d_model is {d_model}")
        directions[layer] = a
    del reader  # lets the file's mapping go
    if not directions:
        raise refuse("holds no directions")
    try:
        return ControlVector(directions, hint)  # every direction finite, all of one width
    except ValueError as e:
        raise refuse(str(e)) from None


def as_llama_buffer(vector: ControlVector, n_layers: int, d_model: int, scale: float = 1.0) -> np.ndarray:
    """The flat float32 buffer llama.cpp's `llama_set_adapter_cvec` takes: (n_layers - 1) × d_model values, layer 1
    at offset 0 and layer N at (N - 1) × d_model, zeros for layers the vector leaves alone, each × `scale`."""
    if n_layers < 2:
        raise ValueError(f"a model of {n_layers} layers has no layer llama.cpp can steer (1 … n_layers - 1)")
    if vector.width != d_model:
        raise ValueError(f"the control vector has width {vector.width}, the model's d_model is {d_model}")
    if not np.isfinite(scale):
        raise ValueError(f"scale {scale} is not finite")
    buf = np.zeros((n_layers - 1) * d_model, dtype=np.float32)
    for layer, direction in vector.directions.items():
        if layer == 0:
            raise ValueError("llama.cpp cannot steer layer 0 (it adds directions from block 1's output on)")
        if layer > n_layers - 1:
            raise ValueError(f"the control vector steers layer {layer}, past this model's last, {n_layers - 1}")
        buf[(layer - 1) * d_model:layer * d_model] = direction * np.float32(scale)
    return buf
