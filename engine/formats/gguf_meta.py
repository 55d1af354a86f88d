"""A small, fast reader for the header of a GGUF file: its metadata and, when asked, its tensor descriptions.

`gguf.GGUFReader` maps the whole file and builds Python objects for every field and tensor; that costs seconds on a
large vocabulary and it rejects vocabulary-only files (llama.cpp's test vocabularies have no tensor section). This
reader walks the header once: numeric arrays come back as numpy views, string arrays as lists of `bytes` (decoded
only where the caller wants), and `skip` leaves chosen keys unread so a model list can read headers cheaply.

A GGUF file may come from anyone, and the gguf package trusts its numbers (a huge count or length makes it loop or
read past the end). So every count, length and shape is held against the bytes that remain, and the counts against
`max_entries`, before anything is built: the loaders and the control-vector reader walk a header here before
GGUFReader sees it.

Layout (v2/v3, either byte order): "GGUF", version u32, tensor count u64, metadata count u64; each metadata entry is
a key (u64 length + UTF-8), a value type u32 and the value; each tensor description is a name, n_dims u32, n_dims
u64 sizes, a ggml type u32 and a data offset u64; the data starts at the next multiple of general.alignment.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BULK_KEYS", "EVERY_KEY", "GGUFMetadata", "TensorInfo", "every_key_but", "read_metadata"]

# GGUF value types: 0..7 and 10..12 are scalars, 8 a string, 9 an array.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SIZE = {code: struct.calcsize("<" + code) for code in _SCALAR.values()}
_STRING, _ARRAY = 8, 9
MAX_NAME = 65535  # bytes of a key or a tensor's name (the GGUF spec's bound on keys)
MAX_ENTRIES = 1 << 20  # metadata entries or tensors: real files hold hundreds to a few thousand
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
# The metadata arrays a model list or a memory estimate never needs: stepped over without being read.
BULK_KEYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                       "tokenizer.ggml.merges", "tokenizer.ggml.precompiled_charsmap", "tokenizer.chat_template"})


class _AllBut:
    """A `skip` of every key but `keep`: the whole header is walked and checked, only those values built
    (general.alignment is always read: where the data starts depends on it)."""

    def __init__(self, keep: frozenset[str]) -> None:
        self.keep = keep

    def __contains__(self, key: object) -> bool:
        return key not in self.keep


EVERY_KEY = _AllBut(frozenset())


def every_key_but(*keys: str) -> Container[str]:
    return _AllBut(frozenset(keys))


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it."""

    name: str
    dims: tuple[int, ...]  # ggml's order (ne): the row length first
    ggml_type: int
    offset: int  # of its data, from the start of the data section


class GGUFMetadata(dict):
    """Key -> value. Strings are `str`, string arrays `list[bytes]`, numeric arrays 1-D numpy arrays."""

    version: int
    n_tensors: int
    end: int  # byte offset where the key/value section ends (the tensor infos start there)
    alignment: int
    tensors: list[TensorInfo]  # read with tensors=True, else empty
    data_start: int  # where the tensors' data begins (with tensors=True)

    def text(self, key: str) -> str | None:
        value = self.get(key)
        return value if isinstance(value, str) else None

    def strings(self, key: str) -> list[str] | None:
        """A string array decoded as UTF-8 (invalid bytes become U+FFFD, as they would anywhere)."""
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise ValueError(f"GGUF key {key} is not an array of strings")
        return [b.decode("utf-8", "replace") for b in value]


def read_metadata(path: str | os.PathLike[str], skip: Container[str] = frozenset(), *, tensors: bool = False,
                  max_entries: int = MAX_ENTRIES, max_strings: int | None = None) -> GGUFMetadata:
    """Read the key/value metadata of a GGUF file (and with `tensors`, its tensor descriptions). Keys in `skip` are
    stepped over without building values; more than `max_entries` keys or tensors, or `max_strings` string-array
    items in all, are refused before they are walked.

    Raises ValueError, one sentence naming the file, for a file that is not GGUF or whose header is cut short or
    damaged.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError(f"{path.name} is not a GGUF file (it is empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _Walk(mm, size, path.name, max_entries, max_strings).header(skip, tensors)


class _Walk:
    """The header read from a map, with every length checked against the bytes that remain."""

    def __init__(self, buf: mmap.mmap, size: int, name: str, max_entries: int, max_strings: int | None) -> None:
        self.buf, self.size, self.file, self.pos, self.order = buf, size, name, 0, "<"
        self.max_entries, self.strings_left = max_entries, max_strings

    def damaged(self, what: str) -> ValueError:
        return ValueError(f"{self.file} is damaged: {what}")

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.damaged(
                f"{what} claims {n:,} bytes at byte {self.pos:,}, but the file ends at byte {self.size:,}")
        self.pos += n
        return self.pos - n

    def scalar(self, code: str, what: str) -> Any:
        return struct.unpack_from(self.order + code, self.buf, self.take(_SIZE[code], what))[0]

    def string(self, what: str, keep: bool = True) -> bytes | None:
        n = self.scalar("Q", what)
        start = self.take(n, what)
        return self.buf[start:start + n] if keep else None

    def name(self, what: str) -> str:
        n = struct.unpack_from(self.order + "Q", self.buf, self.pos)[0] if self.size - self.pos >= 8 else 0
        if MAX_NAME < n <= self.size - self.pos - 8:  # a name past the end is said so by string()
            raise self.damaged(f"{what} has a name of {n:,} bytes (at most {MAX_NAME:,})")
        return self.string(what).decode("utf-8", "replace")

    def strings(self, n: int, what: str, keep: bool) -> list[bytes] | None:
        """n strings one after another: the vocabulary's hundreds of thousands, so in one loop of its own."""
        buf, size, pos, fmt, items = self.buf, self.size, self.pos, self.order + "Q", []
        for _ in range(n):
            k = struct.unpack_from(fmt, buf, pos)[0] if size - pos >= 8 else size
            if k > size - pos - 8:
                self.pos = pos
                self.string(what)  # says where it runs past the end
            if keep:
                items.append(buf[pos + 8:pos + 8 + k])
            pos += 8 + k
        self.pos = pos
        return items if keep else None

    def count(self, n: int, what: str) -> None:
        if n > self.max_entries:
            raise self.damaged(f"it claims {n:,} {what}, more than the {self.max_entries:,} a file may hold")

    def value(self, kind: int, what: str, keep: bool, depth: int = 0) -> Any:
        if kind in _SCALAR:
            return self.scalar(_SCALAR[kind], what) if keep else self.take(_SIZE[_SCALAR[kind]], what)
        if kind == _STRING:
            raw = self.string(what, keep)
            return None if raw is None else raw.decode("utf-8", "replace")
        if kind != _ARRAY or depth > 1:
            raise self.damaged(f"{what} has unknown value type {kind}")
        item, n = self.scalar("I", what), self.scalar("Q", what)
        if item in _SCALAR:
            dt = np.dtype(self.order + _SCALAR[item])
            start = self.take(n * dt.itemsize, what)
            return np.frombuffer(self.buf[start:start + n * dt.itemsize], dt) if keep else None
        if item not in (_STRING, _ARRAY):
            raise self.damaged(f"{what} is an array of unknown value type {item}")
        if n * 8 > self.size - self.pos:  # a string or an array takes at least its 8-byte length
            raise self.damaged(f"{what} claims an array of {n:,} items at byte {self.pos:,}, but the file ends at "
                               f"byte {self.size:,}")
        if item == _STRING and self.strings_left is not None:
            if n > self.strings_left:
                raise self.damaged(f"{what} is an array of {n:,} strings, more than such a file holds")
            self.strings_left -= n
        if item == _STRING:
            return self.strings(n, what, keep)
        items = [self.value(_ARRAY, what, keep, depth + 1) for _ in range(n)]
        return items if keep else None

    def header(self, skip: Container[str], tensors: bool) -> GGUFMetadata:
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{self.file} is not a GGUF file (it does not start with the bytes 'GGUF')")
        self.pos = 4
        version = self.scalar("I", "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine, which GGUFReader reads too
            self.order = ">"
            version = struct.unpack(">I", self.buf[4:8])[0]
        if version not in (2, 3):
            raise ValueError(f"{self.file}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self.scalar("Q", "the tensor count"), self.scalar("Q", "the metadata count")
        self.count(n_kv, "metadata keys")
        self.count(n_tensors, "tensors")
        out = GGUFMetadata()
        out.version, out.n_tensors = int(version), int(n_tensors)
        for i in range(n_kv):
            key = self.name(f"the key of metadata entry {i}")
            kind = self.scalar("I", f"the type of metadata {key!r}")
            keep = key == "general.alignment" or key not in skip  # where the data starts depends on it
            value = self.value(kind, f"metadata {key!r}", keep)
            if keep:
                out[key] = value
        out.alignment = out.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(out.alignment) is not int or out.alignment <= 0 or out.alignment & (out.alignment - 1):
            raise self.damaged(f"general.alignment {out.alignment!r} is not a power of two (a uint32)")
        out.end = self.pos
        out.tensors = [self.tensor(i) for i in range(n_tensors)] if tensors else []
        out.data_start = -(-self.pos // out.alignment) * out.alignment
        return out

    def tensor(self, i: int) -> TensorInfo:
        name = self.name(f"the name of tensor {i}")
        n_dims = self.scalar("I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.damaged(f"tensor {name!r} has {n_dims:,} dimensions (GGUF allows 1…{MAX_DIMS})")
        dims = tuple(self.scalar("Q", f"the shape of tensor {name!r}") for _ in range(n_dims))
        if math.prod(dims) > 8 * self.size:  # no type packs more than eight values in a byte
            raise self.damaged(f"tensor {name!r} claims {math.prod(dims):,} values, but the file ends at byte "
                               f"{self.size:,}")
        kind = self.scalar("I", f"the type of tensor {name!r}")
        return TensorInfo(name, dims, kind, self.scalar("Q", f"the data offset of tensor {name!r}"))
