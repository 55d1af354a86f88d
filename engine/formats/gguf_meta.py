"""A small, fast reader for the metadata section of a GGUF file (no tensors, no weights).

`gguf.GGUFReader` maps the whole file and builds Python objects for every field and tensor; that costs seconds on a
large vocabulary and it rejects vocabulary-only files (llama.cpp's test vocabularies have no tensor section). This
reader walks the key/value section once: numeric arrays come back as numpy views, string arrays as lists of `bytes`
(decoded only where the caller wants), and `skip` leaves chosen keys unread so a model list can read headers cheaply.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFMetadata", "read_metadata"]

_MAGIC = b"GGUF"
# GGUF value types: 0..7 and 10..12 are scalars, 8 a string, 9 an array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KV = 1 << 20  # a sanity bound: a damaged count must not make us loop for ever


class GGUFMetadata(dict):
    """Key -> value. Strings are `str`, string arrays `list[bytes]`, numeric arrays 1-D numpy arrays."""

    version: int
    n_tensors: int
    end: int  # byte offset where the key/value section ends (the tensor infos start there)

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


def read_metadata(path: str | os.PathLike[str], skip: frozenset[str] | set[str] = frozenset()) -> GGUFMetadata:
    """Read the key/value metadata of a GGUF file. Keys in `skip` are stepped over without building values.

    Raises ValueError for a file that is not GGUF or whose metadata is cut short or damaged.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"{path.name} is not a GGUF file (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return _parse(mm, size, path.name, skip)
            except (struct.error, IndexError, OverflowError) as exc:
                raise ValueError(f"{path.name}: the GGUF metadata is cut short or damaged ({exc})") from None


def _parse(buf: mmap.mmap, size: int, name: str, skip: frozenset[str] | set[str]) -> GGUFMetadata:
    if buf[:4] != _MAGIC:
        raise ValueError(f"{name} is not a GGUF file (it does not start with 'GGUF')")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{name}: unsupported GGUF version {version} (2 and 3 are read)")
    if n_kv > _MAX_KV:
        raise ValueError(f"{name}: implausible metadata count {n_kv}")
    out = GGUFMetadata()
    out.version, out.n_tensors = int(version), int(n_tensors)
    unpack = struct.unpack_from
    o = 24

    def read_str(o: int) -> tuple[bytes, int]:
        (n,) = unpack("<Q", buf, o)
        o += 8
        if o + n > size:
            raise ValueError(f"{name}: a string runs past the end of the file")
        return buf[o : o + n], o + n

    def skip_str(o: int) -> int:
        (n,) = unpack("<Q", buf, o)
        o += 8 + n
        if o > size:
            raise ValueError(f"{name}: a string runs past the end of the file")
        return o

    def read_value(kind: int, o: int, keep: bool) -> tuple[Any, int]:
        if kind in _SCALAR:
            fmt = _SCALAR[kind]
            return (unpack(fmt, buf, o)[0] if keep else None), o + struct.calcsize(fmt)
        if kind == _STRING:
            if not keep:
                return None, skip_str(o)
            raw, o = read_str(o)
            return raw.decode("utf-8", "replace"), o
        if kind == _ARRAY:
            item, n = unpack("<IQ", buf, o)
            o += 12
            if item == _STRING:
                if not keep:
                    for _ in range(n):
                        o = skip_str(o)
                    return None, o
                items = []
                for _ in range(n):
                    raw, o = read_str(o)
                    items.append(raw)
                return items, o
            if item in _SCALAR:
                dt = np.dtype(_SCALAR[item])
                end = o + n * dt.itemsize
                if end > size:
                    raise ValueError(f"{name}: an array runs past the end of the file")
                arr = np.frombuffer(buf[o:end], dtype=dt) if keep else None
                return arr, end
            if item == _ARRAY:  # nested arrays: legal, rare; read element by element
                values = []
                for _ in range(n):
                    v, o = read_value(_ARRAY, o, keep)
                    values.append(v)
                return (values if keep else None), o
            raise ValueError(f"{name}: unknown GGUF array item type {item}")
        raise ValueError(f"{name}: unknown GGUF value type {kind}")

    for _ in range(n_kv):
        key_raw, o = read_str(o)
        key = key_raw.decode("utf-8", "replace")
        (kind,) = unpack("<I", buf, o)
        o += 4
        keep = key not in skip
        value, o = read_value(kind, o, keep)
        if keep:
            out[key] = value
    out.end = o
    return out
