"""Saved sessions: a `.ilab` file holds everything needed to show a run again without the model.

The format is open and holds no pickle: a zip archive with
    session.json     format version, model identity (name, path, SHA-256 of the weights file), prompt, settings,
                     the model's config and facts, and every event in order, as JSON: each kind of event as
                     columns, one list per field (see "version 2" below)
    arrays/0.npy …   every numpy array the events carry, packed: one 1-D .npy per dtype (and one more for the large
                     arrays) holding the arrays one after another, an array named in session.json by
                     [pack, offset, *shape]; stored in the archive as they are, so each is read in place at once
    tokenizer/       the model's tokenizer (tokenizer.json and its metadata), so pieces can be drawn
Settings and configs in session.json are tagged: {"$type": "SamplingParams", "fields": {...}} for the dataclasses
listed in `readable_types()` (the engine's events, a server run's events, settings and configs), {"$tuple": [...]},
{"$frozenset": [...]}, {"$array": [pack, offset, *shape]}.

Version 1 (still read) held every event tagged one by one, and arrays.npz with one member per array, named a0,
a1, … ({"$array": "a0"}): reading a long run's tens of thousands of both one at a time was most of the time it took
to reopen.

A session file may come from anyone, so reading one is bounded before anything is inflated: how many members,
how large each says it is and how far it is compressed (checked in the zip directory and again while reading, in
chunks, so a lying header gains nothing), each pack's or array's .npy header (shape × item size, no object dtypes,
its size the member's), every array's place inside its pack, the JSON's size and nesting depth; then every record's
fields are checked against its annotations (a column at once) and the per-step arrays against each other. Whatever
is wrong, the reader raises SessionFileError with one sentence.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import json
import math
import operator
import os
import re
import struct
import tempfile
import time
import types
import typing
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine import events as ev_mod
from engine.formats.locate import file_sha256
from engine.model.config import ModelConfig
from engine.protocol import (  # plain data: the GUI process reads session files, torch-free
    KERNEL_MODES,
    Capture,
    SamplingParams,
)
from engine.text import clean_text

FORMAT = "inference-lab-session"
VERSION = 2

# ---- what a file may make the reader hold -------------------------------------------------------------------
# Sized from a long real run: SmolLM2-135M with the app's captures (funnel, full logits, logit lens, and attention
# for one layer once the prompt is past the every-layer threshold) stores per step its logits (vocab × 4 bytes) and
# one attention row (heads × position × 4 bytes), about 15 arrays and its JSON. Each limit leaves room above what
# 8,192 such tokens hold (long runs' sessions: BENCHMARKS.md, "Long runs (issue 26)").
MAX_MEMBERS = 64  # session.json, arrays.npz and the tokenizer's few files
MAX_JSON_BYTES = 256 << 20
MAX_DEPTH = 64  # nesting of session.json; real documents go about 10 deep
MAX_TOKENIZER_BYTES = 128 << 20  # each tokenizer file (a 262k-token vocabulary's tokenizer.json is ~33 MB)
MAX_ARRAYS = 1 << 18
MAX_ARRAY_BYTES = 6 << 30  # all arrays together
# Real members compress at most ~10-fold (JSON; the arrays far less); deflate reaches ~1000-fold on filler, which
# is what a zip bomb is. Members below RATIO_FLOOR may compress as they like.
MAX_RATIO = 100
RATIO_FLOOR = 1 << 20
CHUNK = 1 << 20  # bytes inflated per read


class SessionFileError(ValueError):
    """A file that is not a session this version can read; the message says why in one sentence."""


# A session saved before ModelInfo recorded the kernel mode its model ran in reads back with this mode, never with a
# guessed "exact"; the app names it "kernels: not recorded" (app.units.fmt_kernels).
KERNELS_NOT_RECORDED = ""


def _not_recorded(cls: type, present: Any) -> dict[str, Any]:
    """Fields a record of an older file lacks that must not take their default: ModelInfo.kernels."""
    if cls is ev_mod.ModelInfo and "kernels" not in present:
        return {"kernels": KERNELS_NOT_RECORDED}
    return {}


# ---- the records a file may hold ----------------------------------------------------------------------------
@functools.cache
def readable_types() -> dict[str, type]:
    """Every dataclass a session file may hold, by name: the engine's events, a server run's events (their own
    subclasses), and the settings and configs saved beside them. Nothing else is ever built from a file."""
    # torch-free at import (torch is imported inside the functions that need it): the GUI process reads files
    from engine.remote import backend, client, metrics

    classes = [c for c in vars(ev_mod).values() if dataclasses.is_dataclass(c) and c.__module__ == ev_mod.__name__]
    classes += [SamplingParams, Capture, ModelConfig, backend.TopNFunnel, backend.RemoteTokenSampled,
                backend.ServerConnected, backend.ServerMetricsSampled, client.ServerInfo, metrics.ServerMetrics]
    by_name = {c.__name__: c for c in classes}
    if len(by_name) != len(classes):
        raise RuntimeError("two session record types share a name")
    return by_name


@functools.cache
def _checks(cls: type) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """For each field of a record type, a test of whether a decoded value fits its annotation, and its name."""
    return {name: (_checker(h), _label(h)) for name, h in _hints(cls).items()}


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 — annotations that cannot be resolved are not checked
        return {}


def _by_type(hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return all(_by_type(a) for a in typing.get_args(hint))
    return origin is None and (hint is None or isinstance(hint, type))


@functools.cache
def _checked_by_type(cls: type) -> frozenset[str]:
    """The fields whose check looks only at a value's type (not at a Literal's value or a container's items): a
    column of them is checked with one value of each type it holds."""
    return frozenset(name for name, h in _hints(cls).items() if _by_type(h))


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
    tokenizer: Any = None  # engine.tokenizer.Tokenizer, or None
    # [{"name", "parent" (index of an earlier branch or None), "step", "token", "shown", "events": [...],
    #   "dropped": [first, last] step whose attention and lens were not kept (absent: every step's were)}, …]
    branches: list = field(default_factory=list)
    created: str = ""
    dropped: list | None = None  # [first, last] step of `events` whose attention and lens are not in the file


# ---- model identity ------------------------------------------------------------------------------------------
def model_identity(info: ev_mod.ModelInfo | None) -> dict:
    """The model a session was recorded with. Its SHA-256 comes from the engine (ModelInfo.sha256, hashed once at
    load); a ModelInfo from before that field existed (read back with it empty) is hashed here."""
    if info is None:
        return {}
    sha = info.sha256 or (file_sha256(info.path) if info.path else "")
    return {"name": info.name, "path": info.path, "architecture": info.architecture, "file_type": info.file_type,
            "n_params": info.n_params, "sha256": sha}


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
    return (f"this session was recorded with {saved.get('name', '?')} (SHA-256 {str(saved.get('sha256', '?'))[:12]}…); "
            f"the loaded model is {here['name']} (SHA-256 {here['sha256'][:12]}…)")


# ---- encoding ------------------------------------------------------------------------------------------------
class _Encoder:
    """Values as tagged JSON: what is not a column (settings, configs), and version 1's records one by one."""

    def __init__(self, array: Callable[[np.ndarray], Any]) -> None:
        self.array = array  # an array → how the file names it (a place in a pack)
        self.types = readable_types()

    def __call__(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, np.ndarray):
            return {"$array": self.array(x)}
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, tuple):
            return {"$tuple": [self(v) for v in x]}
        if isinstance(x, list):
            return [self(v) for v in x]
        if isinstance(x, (set, frozenset)):
            return {"$frozenset": [self(v) for v in sorted(x)]}
        if isinstance(x, dict):
            if not all(isinstance(k, str) and not k.startswith("$") for k in x):
                raise TypeError("only dicts with string keys (not starting with $) can be stored")
            return {k: self(v) for k, v in x.items()}
        name = type(x).__name__
        if self.types.get(name) is type(x):
            return {"$type": name, "fields": {f: self(getattr(x, f)) for f in _init_fields(type(x))}}
        raise TypeError(f"cannot store a {type(x).__module__}.{name} in a session file")


@functools.cache
def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


# ---- decoding: every value checked against what the record declares ------------------------------------------
def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:39] + "…"


def _label(hint: Any) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return re.sub(r"\b(typing|numpy|engine\.[a-z_.]+)\.", "", text)


def _checker(hint: Any) -> Callable[[Any], bool]:
    """A test of whether a decoded value fits a field annotation (the kinds of annotation the engine's dataclasses
    use; any other is not checked)."""
    if hint is Any or hint is object:
        return lambda v: True
    if hint is None or hint is type(None):
        return lambda v: v is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        alts = [_checker(a) for a in args]
        return lambda v: any(c(v) for c in alts)
    if origin is typing.Literal:
        return lambda v: any(v == a and type(v) is type(a) for a in args)
    simple = {bool: (bool, ()), int: (int, bool), float: ((int, float), bool), str: (str, ()),
              np.ndarray: (np.ndarray, ())}
    if hint in simple:
        kinds, never = simple[hint]
        return lambda v: isinstance(v, kinds) and not isinstance(v, never)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            each = _checker(args[0])
            return lambda v: isinstance(v, tuple) and all(each(x) for x in v)
        parts = [_checker(a) for a in args]
        return lambda v: (isinstance(v, tuple) and len(v) == len(parts)
                          and all(c(x) for c, x in zip(parts, v, strict=True)))
    if origin in (frozenset, set, list):
        each, kinds = _checker(args[0]), (list if origin is list else (frozenset, set))
        return lambda v: isinstance(v, kinds) and all(each(x) for x in v)
    if origin is dict:
        key, value = _checker(args[0]), _checker(args[1])
        return lambda v: isinstance(v, dict) and all(key(k) and value(x) for k, x in v.items())
    if isinstance(hint, type):
        return lambda v: isinstance(v, hint)
    return lambda v: True


_TAGS = ("$array", "$tuple", "$frozenset", "$type", "fields")


class _Decoder:
    def __init__(self, packs: list[np.ndarray], array: Callable[[Any], np.ndarray] | None = None) -> None:
        self.columns = _ColumnDecoder(packs, self)
        # what a file names an array by → the array (version 1: a name in arrays.npz; 2: a place in a pack)
        self.array = array or self.columns.array

    def __call__(self, x: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise SessionFileError(f"session.json is nested more than {MAX_DEPTH} deep, as no session is")
        if isinstance(x, list):
            return [self(v, depth + 1) for v in x]
        if not isinstance(x, dict):
            return x
        tags = [k for k in x if k.startswith("$")]
        if not tags:
            return {k: self(v, depth + 1) for k, v in x.items()}
        if len(tags) > 1 or any(k not in _TAGS for k in x):
            raise SessionFileError(f"session.json holds a malformed tagged value with keys {_short(sorted(x))}")
        tag, value = tags[0], x[tags[0]]
        if tag == "$array":
            return self.array(value)
        if tag in ("$tuple", "$frozenset"):
            if not isinstance(value, list) or "fields" in x:
                raise SessionFileError(f"session.json holds a {tag[1:]} that is not a list")
            items = [self(v, depth + 1) for v in value]
            if tag == "$tuple":
                return tuple(items)
            try:
                return frozenset(items)
            except TypeError:
                raise SessionFileError("session.json holds a set of unhashable values") from None
        return self._record(value, x.get("fields"), depth + 1)

    def _record(self, name: Any, fields: Any, depth: int) -> Any:
        """One tagged record, read as a column of one row per field: checked as the columns' records are."""
        cols = {k: {"x": [v]} for k, v in fields.items()} if isinstance(fields, dict) else fields
        return self.columns.records(name, cols, 1, depth)[0]


def _shape_problem(obj: Any, spec: dict[str, tuple[tuple[Any, ...], str]]) -> str | None:
    """Check arrays against shapes like ("T", 2): the same letter must be the same length in every array."""
    sizes: dict[str, int] = {}
    for name, (shape, kinds) in spec.items():
        a = getattr(obj, name)
        if a is None and name in ("token_probs", "logits"):
            continue
        if not isinstance(a, np.ndarray) or a.ndim != len(shape):
            return f"{name} should be a {len(shape)}-D array"
        if a.size and a.dtype.kind not in kinds:
            return f"{name} holds {a.dtype} values"
        for want, got in zip(shape, a.shape, strict=True):
            if isinstance(want, int):
                if got != want:
                    return f"{name} has shape {a.shape}"
            elif sizes.setdefault(want, got) != got:
                return f"{name} has {got} entries where the record's other arrays have {sizes[want]}"
    return None


_INT, _FLOAT, _BOOL = "iu", "fiu", "biu"
_SHAPES: tuple[tuple[type, dict[str, tuple[tuple[Any, ...], str]]], ...] = (
    (ev_mod.PromptTokenized, {"ids": (("T",), _INT), "offsets": (("T", 2), _INT),
                              "byte_offsets": (("T", 2), _INT), "special": (("T",), _BOOL)}),
    (ev_mod.PromptScored, {"ids": (("n",), _INT), "probs": (("n",), _FLOAT), "surprise_bits": (("n",), _FLOAT),
                           "entropy_bits": (("n",), _FLOAT), "top_ids": (("n",), _INT)}),
    (ev_mod.AttentionCaptured, {"weights": (("h", "q", "k"), _FLOAT)}),
    (ev_mod.ResidualNorms, {"norms": (("L",), _FLOAT)}),
    (ev_mod.LensCaptured, {"ids": (("R", "N"), _INT), "probs": (("R", "N"), _FLOAT), "entropy_bits": (("R",), _FLOAT),
                           "token_probs": (("R",), _FLOAT)}),
    (ev_mod.Funnel, {k: (("N",), _INT if k == "ids" else _FLOAT) for k in (
        "ids", "logits", "p_raw", "p_temperature", "p_top_k", "p_top_p", "p_final")}),
    (ev_mod.TokenSampled, {"logits": (("V",), _FLOAT)}),
    (ev_mod.Finished, {"prompt_ids": (("P",), _INT), "ids": (("G",), _INT), "step_seconds": (("S",), _FLOAT)}),
)


@functools.cache
def _specs(cls: type) -> list[dict[str, tuple[tuple[Any, ...], str]]]:
    """The array shapes a record of this type must have (from _SHAPES)."""
    return [spec for c, spec in _SHAPES if issubclass(cls, c)]


def _inconsistent(obj: Any) -> str | None:
    """What a panel would trip over in a record whose fields each have the right type, or None."""
    for spec in _specs(type(obj)):
        problem = _shape_problem(obj, spec)
        if problem:
            return problem
    return _other_problem(obj)


def _other_problem(obj: Any) -> str | None:
    """`_inconsistent` but for the arrays' shapes."""
    if isinstance(obj, ev_mod.PromptTokenized) and len(obj.pieces) != len(obj.ids):
        return f"{len(obj.pieces)} pieces for {len(obj.ids)} tokens"
    if isinstance(obj, ev_mod.Funnel) and len(obj.pieces) != len(obj.ids):
        return f"{len(obj.pieces)} pieces for {len(obj.ids)} candidates"
    if isinstance(obj, ev_mod.LensCaptured) and obj.pieces and (
            len(obj.pieces) != obj.ids.shape[0] or any(len(row) != obj.ids.shape[1] for row in obj.pieces)):
        return "its pieces do not match its ids row for row"
    if isinstance(obj, ev_mod.AttentionCaptured) and (obj.layer < 0 or obj.step < 0 or obj.group_size < 1):
        return "a negative layer or step, or a group size below 1"
    if isinstance(obj, ev_mod.TokenSampled) and not (obj.params is None or isinstance(obj.params, SamplingParams)):
        return "its sampling settings are not sampling settings"
    if type(obj).__name__ == "ServerInfo" and not (obj.config is None or isinstance(obj.config, ModelConfig)):
        return "its model config is not a model config"
    if isinstance(obj, ev_mod.Steered):
        return obj.problem()
    if isinstance(obj, ev_mod.ModelInfo) and obj.kernels not in (*KERNEL_MODES, KERNELS_NOT_RECORDED):
        return f"its kernel mode {_short(obj.kernels)} is not one of {', '.join(KERNEL_MODES)}"
    return None


# ---- version 2: records as columns, arrays packed -----------------------------------------------------------
# A long run is thousands of records of a few kinds, each with a few small arrays: version 1 stored one tagged JSON
# object per record and one .npy member per array, and reading them one by one was most of reopening a long run.
# Version 2 stores each kind's records as columns (one JSON list per field, checked once per column) and every
# array in one pack per dtype (arrays/<n>.npy, a 1-D .npy read in place); an array is [pack, offset, *shape].
# A column is one of:
#   {"v": [...]}              plain JSON values (numbers, text, true/false, null)
#   {"t": [[...], ...]}       tuples of plain values
#   {"a": [p, o, *shape, …], "d": ndim}   arrays, each a reference into a pack
#   {"r": type, "f": {field: column}}     records of one type, field by field
#   {"k": [types], "i": [kind of each row], "c": [column of each kind]}   records of several types, in order
#   {"n": [rows that are null], "c": column of the others}
#   {"x": [...]}              anything else, each value tagged as in version 1 ({"$array": [p, o, *shape]})
# A list of records (the events, a branch's events) is {"rows": n, "c": column}.
_PLAIN = frozenset({type(None), bool, int, float, str})
MAX_PACKS = 32  # one per dtype: a run has about five
_PACK_NAME = re.compile(r"arrays/([0-9]{1,2})\.npy")
_PACK_DTYPE = re.compile(r"[<>|][biufc][0-9]{1,2}")


OWN_BUFFER = 16 << 10  # an array this large (a step's attention, its logits) is read into a buffer of its own


class _Packs:
    """The arrays of one save, gathered into one pack per dtype (and one more for the large ones); an array stored
    twice (an event in a branch and in the shown run) is stored once.

    The reader's small arrays are views of their pack, the large ones copies: the run store lets a long run's
    attention and logits go to bound memory, and a view would keep its whole pack alive."""

    def __init__(self) -> None:
        self.by_dtype: dict[str, int] = {}
        self.parts: list[list[np.ndarray]] = []
        self.counts: list[int] = []
        self.seen: dict[int, tuple[np.ndarray, list[int]]] = {}  # id → (the array, kept alive; its reference)

    def ref(self, a: np.ndarray) -> list[int]:
        hit = self.seen.get(id(a))
        if hit is not None:
            return hit[1]
        if a.dtype.kind not in "biufc":
            raise TypeError(f"cannot store an array of dtype {a.dtype}")
        key = a.dtype.str + ("+" if a.nbytes >= OWN_BUFFER else "")
        p = self.by_dtype.get(key)
        if p is None:
            p = self.by_dtype[key] = len(self.parts)
            self.parts.append([])
            self.counts.append(0)
        ref = [p, self.counts[p], *a.shape]
        self.parts[p].append(a)
        self.counts[p] += a.size
        self.seen[id(a)] = (a, ref)
        return ref


class _Columns:
    """Values as a column (see above)."""

    def __init__(self, packs: _Packs, tagged: _Encoder) -> None:
        self.packs, self.tagged, self.types = packs, tagged, readable_types()

    def rows(self, values: list) -> dict:
        return {"rows": len(values), "c": self(values)}

    def __call__(self, values: list) -> dict:
        kinds = set(map(type, values))
        if kinds <= _PLAIN:
            return {"v": values}
        if any(issubclass(k, np.generic) for k in kinds):
            values = [v.item() if isinstance(v, np.generic) else v for v in values]
            return self(values)
        if type(None) in kinds:
            nulls = [i for i, v in enumerate(values) if v is None]
            return {"n": nulls, "c": self([v for v in values if v is not None])}
        if kinds == {np.ndarray} and len({a.ndim for a in values}) == 1:
            flat: list[int] = []
            for a in values:
                flat += self.packs.ref(a)
            return {"a": flat, "d": values[0].ndim}
        if kinds == {tuple} and set(map(type, itertools.chain.from_iterable(values))) <= _PLAIN:
            return {"t": values}
        if all(self.types.get(k.__name__) is k for k in kinds):
            if len(kinds) == 1:
                cls = kinds.pop()
                return {"r": cls.__name__,
                        "f": {f: self(list(map(operator.attrgetter(f), values))) for f in _init_fields(cls)}}
            order: dict[type, int] = {}
            for v in values:
                order.setdefault(type(v), len(order))
            return {"k": [k.__name__ for k in order], "i": [order[type(v)] for v in values],
                    "c": [self([v for v in values if type(v) is k]) for k in order]}
        return {"x": [self.tagged(v) for v in values]}


def _write_json(out: Any, doc: Any) -> None:
    """A document written to a binary stream in pieces of about WRITE_CHUNK characters (a long list of plain values a
    slice at a time): many small json.dumps calls instead of one for the whole document, so no one call holds the
    GIL for long (the GUI thread keeps running while the writer thread saves)."""
    parts: list[str] = []
    size = 0

    def flush() -> None:
        nonlocal size
        out.write("".join(parts).encode("utf-8"))
        parts.clear()
        size = 0

    def put(text: str) -> None:
        nonlocal size
        parts.append(text)
        size += len(text)
        if size >= WRITE_CHUNK:
            flush()

    def dump(x: Any) -> None:
        if isinstance(x, dict):
            put("{")
            for i, (k, v) in enumerate(x.items()):
                put(("," if i else "") + json.dumps(k) + ":")
                dump(v)
            put("}")
        elif isinstance(x, list) and dict in set(map(type, x)):
            put("[")
            for i, v in enumerate(x):
                if i:
                    put(",")
                dump(v)
            put("]")
        elif isinstance(x, list) and len(x) > 4096:
            put("[")
            for i in range(0, len(x), 4096):
                put(("," if i else "") + json.dumps(x[i:i + 4096], ensure_ascii=False)[1:-1])
            put("]")
        else:
            put(json.dumps(x, ensure_ascii=False))

    dump(doc)
    flush()


def _put_bytes(out: Any, buf: bytearray, data: memoryview) -> None:
    """data to out through buf: small pieces gathered into writes of about CHUNK bytes, a large one written as is."""
    if data.nbytes > CHUNK // 4:
        out.write(buf)
        buf.clear()
        out.write(data)
    else:
        buf += data
        if len(buf) >= CHUNK:
            out.write(buf)
            buf.clear()


def _write_packs(z: zipfile.ZipFile, packs: _Packs) -> None:
    """Each pack as a stored 1-D .npy member (read in place, never inflated): a run's float32 arrays hardly
    shrink, and deflating them cost the autosave seconds of a core."""
    for key, p in packs.by_dtype.items():
        member = zipfile.ZipInfo(f"arrays/{p}.npy", time.localtime()[:6])
        member.compress_type = zipfile.ZIP_STORED
        with z.open(member, "w", force_zip64=True) as out:
            buf = bytearray(_npy_header(np.dtype(key.rstrip("+")), (packs.counts[p],)))
            for a in packs.parts[p]:
                _put_bytes(out, buf, memoryview(np.ascontiguousarray(a)).cast("B"))
            out.write(buf)


def _read_packs(z: zipfile.ZipFile, infos: dict[str, zipfile.ZipInfo], fh: Any) -> list[np.ndarray]:
    numbers = sorted(int(m.group(1)) for n in infos if (m := _PACK_NAME.fullmatch(n)))
    if numbers != list(range(len(numbers))) or len(numbers) > MAX_PACKS or any(
            n.startswith("arrays/") and not _PACK_NAME.fullmatch(n) for n in infos):
        raise SessionFileError("the archive's arrays/ folder is not packs 0, 1, 2, …")
    packs, budget = [], MAX_ARRAY_BYTES
    for i in numbers:
        name = f"arrays/{i}.npy"
        a = _read_npy_member(z, fh, infos[name], name, budget, {})
        if a.ndim != 1 or not _PACK_DTYPE.fullmatch(a.dtype.str):
            raise SessionFileError(f"{name} is not a pack (a 1-D array of numbers)")
        budget -= a.nbytes
        packs.append(a)
    return packs


def _ints(x: Any, what: str) -> np.ndarray:
    """A JSON list of whole numbers as int64, or SessionFileError."""
    if not isinstance(x, list) or not set(map(type, x)) <= {int}:
        raise SessionFileError(f"session.json's {what} is not a list of whole numbers")
    try:
        return np.array(x, dtype=np.int64)
    except OverflowError:
        raise SessionFileError(f"session.json's {what} holds a number past 64 bits") from None


class _ColumnDecoder:
    """Columns back into values: every reference checked against its pack, every field against its annotation."""

    def __init__(self, packs: list[np.ndarray], tagged: _Decoder) -> None:
        self.packs, self.tagged, self.types = packs, tagged, readable_types()
        self.shapes: tuple[np.ndarray, np.ndarray] | None = None  # the last column of arrays: (shapes, packs)

    def rows(self, x: Any) -> list:
        if not isinstance(x, dict) or set(x) != {"rows", "c"} or type(x["rows"]) is not int or x["rows"] < 0:
            raise SessionFileError("session.json holds a list of records without its number of rows")
        return self(x["c"], x["rows"], 1)

    def __call__(self, col: Any, n: int, depth: int) -> list:
        if depth > MAX_DEPTH:
            raise SessionFileError(f"session.json is nested more than {MAX_DEPTH} deep, as no session is")
        if not isinstance(col, dict) or not col:
            raise SessionFileError(f"session.json holds a column that is not one: {_short(col)}")
        kind = next(iter(col))
        self.shapes = None
        if kind == "v" and set(col) == {"v"}:
            out = col["v"]
            if not isinstance(out, list) or not set(map(type, out)) <= _PLAIN:
                raise SessionFileError("session.json holds a column of values that are not plain values")
        elif kind == "t" and set(col) == {"t"}:
            rows = col["t"]
            if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows) or not set(
                    map(type, itertools.chain.from_iterable(rows))) <= _PLAIN:
                raise SessionFileError("session.json holds a column of tuples that are not tuples of plain values")
            out = list(map(tuple, rows))
        elif kind == "a" and set(col) == {"a", "d"}:
            out = self.arrays(col["a"], col["d"], n)
        elif kind == "r" and set(col) == {"r", "f"}:
            out = self.records(col["r"], col["f"], n, depth)
        elif kind == "k" and set(col) == {"k", "i", "c"}:
            out = self.union(col["k"], col["i"], col["c"], n, depth)
        elif kind == "n" and set(col) == {"n", "c"}:
            nulls = _ints(col["n"], "list of null rows")
            if len(nulls) > n or len(nulls) and (nulls[0] < 0 or nulls[-1] >= n or np.any(np.diff(nulls) <= 0)):
                raise SessionFileError("session.json's null rows are not rows of their column, in order")
            rest = iter(self(col["c"], n - len(nulls), depth + 1))  # as many as the file holds: n is bounded
            null = np.zeros(n, bool)
            null[nulls] = True
            out = [None if x else next(rest) for x in null.tolist()]
        elif kind == "x" and set(col) == {"x"}:
            if not isinstance(col["x"], list):
                raise SessionFileError("session.json holds a column of tagged values that is not a list")
            out = [self.tagged(v, depth + 1) for v in col["x"]]
        else:
            raise SessionFileError(f"session.json holds a column of an unknown kind, {_short(sorted(col))}")
        if len(out) != n:
            raise SessionFileError(f"session.json holds a column of {len(out):,} rows where {n:,} belong")
        return out

    def arrays(self, flat: Any, ndim: Any, n: int) -> list[np.ndarray]:
        if type(ndim) is not int or not 0 <= ndim <= 32:
            raise SessionFileError(f"session.json holds arrays of {_short(ndim)} dimensions")
        refs = _ints(flat, "array references")
        if len(refs) != n * (2 + ndim):
            raise SessionFileError(f"session.json holds {len(refs):,} numbers for {n:,} array references")
        refs = refs.reshape(n, 2 + ndim)
        pack, at, shapes = refs[:, 0], refs[:, 1], refs[:, 2:]
        if n and (pack.min() < 0 or pack.max() >= len(self.packs) or at.min() < 0 or shapes.min(initial=0) < 0):
            raise SessionFileError("session.json names an array outside the file's packs")
        lengths = np.array([len(p) for p in self.packs], np.int64)[pack] if n else np.zeros(0, np.int64)
        # the product of a shape in floating point first: an int64 product of hostile sizes could wrap around
        if n and np.any(np.prod(shapes.astype(np.float64), axis=1) > lengths):
            raise SessionFileError("session.json names an array larger than its pack")
        sizes = np.prod(shapes, axis=1)
        if n and np.any(at + sizes > lengths):
            raise SessionFileError("session.json names an array past the end of its pack")
        packs = self.packs
        self.shapes = (shapes, pack)
        own = (sizes * np.array([p.itemsize for p in packs], np.int64)[pack] >= OWN_BUFFER).tolist() if n else []
        rows = zip(pack.tolist(), at.tolist(), sizes.tolist(), map(tuple, shapes.tolist()), own, strict=True)
        return [(packs[p][o:o + s].copy() if big else packs[p][o:o + s]).reshape(shape)
                for p, o, s, shape, big in rows]

    def array(self, ref: Any) -> np.ndarray:
        """One array named in a tagged value: {"$array": [pack, offset, *shape]}."""
        if not isinstance(ref, list) or len(ref) < 2:
            raise SessionFileError(f"session.json names an array {_short(ref)}, not a place in a pack")
        return self.arrays(ref, len(ref) - 2, 1)[0]

    def union(self, names: Any, which: Any, cols: Any, n: int, depth: int) -> list:
        if not isinstance(names, list) or not isinstance(cols, list) or len(names) != len(cols) or not all(
                isinstance(c, dict) and c.get("r") == k for c, k in zip(cols, names, strict=True)):
            raise SessionFileError("session.json holds records of several kinds without a column for each")
        order = _ints(which, "order of records")
        if len(order) != n or (n and (order.min() < 0 or order.max() >= len(names))):
            raise SessionFileError("session.json's order of records names a kind it does not hold")
        counts = np.bincount(order, minlength=len(names)).tolist() if n else [0] * len(names)
        parts = [iter(self(c, k, depth + 1)) for c, k in zip(cols, counts, strict=True)]
        return [next(parts[k]) for k in order.tolist()]

    def records(self, name: Any, fields: Any, n: int, depth: int) -> list:
        cls = self.types.get(name) if isinstance(name, str) else None
        if cls is None:
            raise SessionFileError(f"session.json holds an unknown kind of record, {_short(name)}")
        if not isinstance(fields, dict):
            raise SessionFileError(f"the saved {name}s have no fields object")
        checks, by_type = _checks(cls), _checked_by_type(cls)
        names, cols, shapes = [], [], {}
        for f in _init_fields(cls):
            if f not in fields:  # fields of a newer version are skipped; missing ones said below
                continue
            values = self(fields[f], n, depth + 1)
            if self.shapes is not None:  # a column of arrays: their shapes and dtypes, for the check below
                shapes[f], self.shapes = self.shapes, None
            fits, label = checks.get(f, (None, ""))
            if fits is not None and not all(map(fits, dict(zip(map(type, values), values, strict=True)).values()
                                                if f in by_type else values)):
                bad = next(v for v in values if not fits(v))
                raise SessionFileError(f"a saved {name}'s {f} is {_short(bad)}, not {label}")
            names.append(f)
            cols.append(values)
        for f, v in _not_recorded(cls, fields).items():
            names.append(f)
            cols.append([v] * n)
        if not cols and (_init_fields(cls) or n > MAX_ARRAYS):  # rows of nothing: their number bounds nothing
            raise SessionFileError(f"session.json holds {n:,} saved {name}s without any of their fields")
        try:
            if tuple(names) == _init_fields(cls) and not any(f.kw_only for f in dataclasses.fields(cls)):
                out = list(map(cls, *cols)) if cols else [cls() for _ in range(n)]
            else:
                out = [cls(**dict(zip(names, row, strict=True))) for row in zip(*cols, strict=True)] if cols \
                    else [cls() for _ in range(n)]
        except Exception as e:  # noqa: BLE001 — a missing field (TypeError) or a value __post_init__ refuses
            raise SessionFileError(f"a saved {name} does not fit this version ({type(e).__name__}: {e})") from None
        if _may_be_inconsistent(cls):
            # the arrays' shapes checked column by column where every array the spec names came as one
            check = _other_problem if _shapes_fit(_specs(cls), shapes, self.packs) else _inconsistent
            for obj in out:
                problem = check(obj)
                if problem:
                    raise SessionFileError(f"a saved {name} is inconsistent: {problem}")
        return out


def _shapes_fit(specs: list[dict[str, tuple[tuple[Any, ...], str]]], shapes: dict[str, tuple[np.ndarray, np.ndarray]],
                packs: list[np.ndarray]) -> bool:
    """`_shape_problem` for a whole column of records at once, from their arrays' references: True when every
    array each spec names came in a column of arrays and every record fits (False: check record by record)."""
    for spec in specs:
        sizes: dict[str, np.ndarray] = {}
        for name, (shape, kinds) in spec.items():
            if name not in shapes:
                return False
            dims, pack = shapes[name]
            if dims.shape[1] != len(shape):
                return False
            empty = np.prod(dims, axis=1) == 0
            if any(packs[p].dtype.kind not in kinds for p in np.unique(pack[~empty]).tolist()):
                return False
            for want, got in zip(shape, dims.T, strict=True):
                if isinstance(want, int):
                    if np.any(got != want):
                        return False
                elif np.any(sizes.setdefault(want, got) != got):
                    return False
    return True


_CHECKED = (ev_mod.PromptTokenized, ev_mod.Funnel, ev_mod.LensCaptured, ev_mod.AttentionCaptured,
            ev_mod.TokenSampled, ev_mod.ModelInfo, ev_mod.Steered, *(cls for cls, _spec in _SHAPES))


@functools.cache
def _may_be_inconsistent(cls: type) -> bool:
    """Whether `_inconsistent` has anything to check in a record of this type."""
    return issubclass(cls, _CHECKED) or cls.__name__ == "ServerInfo"


# ---- files ---------------------------------------------------------------------------------------------------
WRITE_CHUNK = 1 << 20  # characters of session.json encoded before each write


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The .npy header numpy writes for a C-ordered array of this dtype and shape."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                             "shape": shape})
    return f.getvalue()


def save_session(path: str | os.PathLike[str], s: SavedSession) -> None:
    """Write `s` to `path` (write to a temporary file, then rename: an existing file is never left half-written).

    Nothing is written outside the folder of `path`. OSError with one sentence naming the path when it cannot be
    written; TypeError when `s` holds something a session file cannot.
    """
    path = Path(path)
    packs = _Packs()
    enc = _Encoder(packs.ref)
    columns = _Columns(packs, enc)
    head = {
        "format": FORMAT, "version": VERSION, "created": s.created or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": s.model, "prompt": s.prompt, "chat": s.chat, "settings": enc(s.settings),
        "info": enc(s.info), "cfg": enc(s.cfg), **({"dropped": list(s.dropped)} if s.dropped else {}),
        "events": columns.rows(s.events),
        "branches": [{**{k: v for k, v in b.items() if k != "events"}, "events": columns.rows(b.get("events", []))}
                     for b in s.branches],
    }
    for b in s.branches:  # what a branch holds besides its events is plain data: checked before anything is written
        json.dumps({k: v for k, v in b.items() if k != "events"})
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OSError(f"cannot save the session to {path}: it is a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".ilab-", suffix=".tmp", dir=folder)
    except OSError as e:
        raise OSError(f"cannot save the session to {path}: {e.strerror or e}") from None
    try:
        # session.json deflated fast (level 1): most of a long run's JSON is repeated field names, which any level
        # shrinks several-fold, and level 6 took a second of the autosave on a long run
        with os.fdopen(fd, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
            doc = zipfile.ZipInfo("session.json", time.localtime()[:6])
            doc.compress_type = zipfile.ZIP_DEFLATED
            with z.open(doc, "w", force_zip64=True) as out:
                _write_json(out, head)
            _write_packs(z, packs)
            if s.tokenizer is not None:
                with tempfile.TemporaryDirectory(prefix=".ilab-", dir=folder) as td:  # beside the file, not in /tmp
                    s.tokenizer.save(td)
                    for f in sorted(Path(td).iterdir()):
                        z.write(f, f"tokenizer/{f.name}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; a saved session is an ordinary document
        # the file it replaces goes after the new one is in place: freeing a long run's hundreds of megabytes
        # took a third of a second of the rename here
        old = Path(tmp + ".old")
        try:
            os.link(path, old)
        except OSError:
            old = None
        os.replace(tmp, path)
        if old is not None:
            old.unlink(missing_ok=True)
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
        fh = open(path, "rb")  # noqa: SIM115 — closed below, after the archive that reads it
    except OSError as e:
        raise OSError(clean_text(f"cannot open {path}: {e.strerror or e}", 300)) from None
    try:
        with fh:
            return _load(fh, with_tokenizer)
    except SessionFileError as e:
        raise SessionFileError(clean_text(f"{path.name}: {e}", 300)) from None
    except MemoryError:
        raise SessionFileError(clean_text(f"{path.name}: needs more memory than this machine gives", 300)) from None
    except Exception as e:  # noqa: BLE001 — a session file is untrusted input: one sentence, never a traceback
        raise SessionFileError(clean_text(f"{path.name} is damaged ({type(e).__name__}: {e})", 300)) from None


def _load(fh: io.BufferedReader, with_tokenizer: bool) -> SavedSession:
    z = _open_zip(fh, MAX_MEMBERS, "not an Inference Lab session (not a zip archive)")
    with z:
        infos = {i.filename: i for i in z.infolist()}
        if "session.json" not in infos:
            raise SessionFileError("not an Inference Lab session (no session.json inside)")
        doc = _parse_json(_read_member(z, infos["session.json"], MAX_JSON_BYTES))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise SessionFileError("not an Inference Lab session")
        version = doc.get("version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise SessionFileError("session.json has no format version")
        if version > VERSION:
            raise SessionFileError(f"written by a newer Inference Lab (format {version})")
        _check_document(doc, version)
        if version >= 2:
            packs = _read_packs(z, infos, fh)
        else:
            arrays = _read_arrays(z, infos["arrays.npz"], fh) if "arrays.npz" in infos else {}

            def named(name: Any) -> np.ndarray:
                if not isinstance(name, str) or name not in arrays:
                    raise SessionFileError(f"session.json names an array {_short(name)} that arrays.npz lacks")
                return arrays[name]
        tokenizer = None
        tok_files = [i for n, i in infos.items() if n.startswith("tokenizer/") and not n.endswith("/")]
        if with_tokenizer and tok_files:
            tokenizer = _read_tokenizer(z, tok_files)
    if version >= 2:
        dec = _Decoder(packs)
        events: Callable[[Any], list] = dec.columns.rows
        empty: Any = {"rows": 0, "c": {"v": []}}
    else:
        dec = _Decoder([], named)
        events, empty = dec, []
    s = SavedSession(
        events=events(doc.get("events", empty)), prompt=doc.get("prompt", ""), chat=doc.get("chat", False),
        settings=dec(doc.get("settings", {})), model=doc.get("model", {}), info=dec(doc.get("info")),
        cfg=dec(doc.get("cfg")), tokenizer=tokenizer,
        branches=[dict(b, events=events(b["events"] if "events" in b else empty)) for b in doc.get("branches", [])],
        created=doc.get("created", ""), dropped=doc.get("dropped"),
    )
    _check_session(s)
    return s


# what each top-level entry of session.json must be, before any of it is decoded
_DOCUMENT = {"prompt": (str,), "chat": (bool,), "created": (str,), "model": (dict,), "settings": (dict,),
             "events": (list,), "branches": (list,), "info": (dict, type(None)), "cfg": (dict, type(None))}
_JSON_NAMES = {str: "text", bool: "true or false", dict: "an object", list: "a list", type(None): "null"}


def _check_document(doc: dict, version: int) -> None:
    for key, kinds in _DOCUMENT.items():
        if version >= 2 and key == "events":
            kinds = (dict,)
        if key in doc and not isinstance(doc[key], kinds):
            want = " or ".join(_JSON_NAMES[k] for k in kinds)
            raise SessionFileError(f"session.json's {key} is {_short(doc[key])}, not {want}")
    for k, v in doc.get("model", {}).items():
        if not isinstance(v, (str, int, float, bool, type(None))):
            raise SessionFileError(f"session.json's model identity has a {type(v).__name__} for {_short(k)}")
    for b in doc.get("branches", []):
        if not isinstance(b, dict) or not isinstance(b.get("events", []), dict if version >= 2 else list):
            raise SessionFileError("session.json's branches are not a list of branches")


def _check_session(s: SavedSession) -> None:
    """What the app reads from a decoded session is of the kind it expects."""
    def record(x: Any) -> bool:
        return dataclasses.is_dataclass(x) and not isinstance(x, type)

    if not isinstance(s.info, (ev_mod.ModelInfo, type(None))) or not isinstance(s.cfg, (ModelConfig, type(None))):
        raise SessionFileError("session.json's model facts are not model facts")
    if not all(record(e) for e in s.events):
        raise SessionFileError("session.json's events hold something that is not an event")
    want = {"params": SamplingParams, "capture": Capture, "max_new_tokens": int}
    for key, kind in want.items():
        v = s.settings.get(key)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            raise SessionFileError(f"session.json's settings have a {type(v).__name__} for {key}")
    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    for dropped in [s.dropped, *(b.get("dropped") for b in s.branches)]:
        if dropped is not None and not (isinstance(dropped, list) and len(dropped) == 2 and all(map(whole, dropped))
                                        and 0 <= dropped[0] <= dropped[1]):
            raise SessionFileError(f"session.json says steps {_short(dropped)} were dropped, which is not a range")
    for i, b in enumerate(s.branches):
        parent = b.get("parent")
        ok = (isinstance(b.get("name"), str) and all(whole(b.get(k, 0)) for k in ("step", "token"))
              and isinstance(b.get("shown", False), bool) and all(record(e) for e in b["events"]))
        if not ok:
            raise SessionFileError("session.json holds a branch without a name, a step and a token")
        if parent is not None and not (whole(parent) and 0 <= parent < i):  # a fork comes after what it forks
            raise SessionFileError(f"session.json holds a branch whose parent {_short(parent)} is not an earlier one")


# ---- bounded reading ---------------------------------------------------------------------------------------
def _open_zip(fp: Any, max_members: int, not_zip: str, entry_bytes: int = 1024) -> zipfile.ZipFile:
    """A zip archive whose directory is small enough to parse: its size, read from the end record first, is at most
    `entry_bytes` per member (zipfile parses the whole directory, whatever count the end record claims)."""
    try:
        end = zipfile._EndRecData(fp)  # the end record alone: how large the directory says it is
    except OSError:
        end = None
    if end is None:
        raise SessionFileError(not_zip)
    if end[zipfile._ECD_SIZE] > max_members * entry_bytes or end[zipfile._ECD_ENTRIES_TOTAL] > max_members:
        raise SessionFileError(f"the archive lists more than {max_members:,} members, more than a session holds")
    try:
        z = zipfile.ZipFile(fp)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as e:
        raise SessionFileError(f"{not_zip} ({e})") from None
    if len(z.infolist()) > max_members:
        z.close()
        raise SessionFileError(f"the archive holds more than {max_members:,} members, more than a session holds")
    return z


def _check_entry(info: zipfile.ZipInfo, cap: int) -> None:
    """Refuse a member by what the directory says before inflating any of it."""
    if info.flag_bits & 0x1:
        raise SessionFileError(f"{_short(info.filename)} is encrypted")
    if info.file_size > cap:
        raise SessionFileError(f"{_short(info.filename)} would unpack to {info.file_size:,} bytes, more than the "
                               f"{cap:,} a session may hold")
    if info.file_size > RATIO_FLOOR and info.file_size > MAX_RATIO * max(info.compress_size, 1):
        raise SessionFileError(f"{_short(info.filename)} is compressed "
                               f"{info.file_size // max(info.compress_size, 1):,}-fold, as only a zip bomb is")


def _read_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytearray:
    """A member's bytes, inflated in chunks and never past what the directory declared (nor past `cap`)."""
    _check_entry(info, cap)
    out = bytearray()
    with z.open(info) as m:
        while chunk := m.read(CHUNK):
            out += chunk
            if len(out) > info.file_size:
                raise SessionFileError(f"{_short(info.filename)} holds more than its header says")
    return out


def _parse_json(raw: bytearray) -> Any:
    """JSON of bounded size; nesting past the interpreter's recursion limit is refused by the parser itself (and
    past MAX_DEPTH by the decoder), so a document of brackets cannot overflow the stack."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise SessionFileError(f"session.json is nested more than {MAX_DEPTH} deep, as no session is") from None
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise SessionFileError(f"session.json is damaged ({e})") from None


class _Window(io.RawIOBase):
    """Bytes [start, start + size) of an open file, as a file: a stored member read in place, never copied."""

    def __init__(self, fh: Any, start: int, size: int) -> None:
        self.fh, self.start, self.size, self.pos = fh, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.size)[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        self.fh.seek(self.start + self.pos)
        got = self.fh.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def _member_window(fh: Any, info: zipfile.ZipInfo, name: str) -> _Window:
    """A stored member's bytes, read in place from the file (or window) `fh` the archive lies in."""
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise SessionFileError(f"{name} is damaged (no local header)")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > fh.seek(0, os.SEEK_END):
        raise SessionFileError(f"{name} is cut short")
    return _Window(fh, start, info.file_size)


def _read_arrays(z: zipfile.ZipFile, info: zipfile.ZipInfo, fh: Any) -> dict[str, np.ndarray]:
    """Version 1's arrays.npz: read in place when stored (as the last version 1 wrote it), else inflated under the
    same caps."""
    cap = MAX_ARRAY_BYTES + MAX_ARRAYS * 4096  # its arrays plus their headers and directory
    _check_entry(info, cap)
    if info.compress_type == zipfile.ZIP_STORED:
        source: Any = _member_window(fh, info, "arrays.npz")
    else:
        source = io.BytesIO(_read_member(z, info, cap))
    # an array's directory entry is ~60 bytes (a 46-byte record and its name)
    with _open_zip(source, MAX_ARRAYS, "arrays.npz is not an .npz archive", entry_bytes=96) as npz:
        arrays: dict[str, np.ndarray] = {}
        budget = MAX_ARRAY_BYTES
        headers: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}
        for member in npz.infolist():
            if not re.fullmatch(r"a[0-9]{1,7}\.npy", member.filename):
                raise SessionFileError(f"arrays.npz holds an unexpected member {_short(member.filename)}")
            a = _read_npy_member(npz, source, member, f"arrays.npz's {member.filename}", budget, headers)
            budget -= a.nbytes
            arrays[member.filename[:-4]] = a
    return arrays


def _parsed_npy_header(prefix: bytes, name: str, headers: dict) -> tuple[tuple[int, ...], bool, np.dtype]:
    """An .npy header (the bytes after the magic and version) parsed, checked, and remembered by its bytes: a long
    run's arrays share a few headers, and parsing one (ast.literal_eval) costs more than reading its data."""
    known = headers.get(prefix)
    if known is not None:
        return known
    read = np.lib.format.read_array_header_1_0 if len(prefix) - 2 == struct.unpack("<H", prefix[:2])[0] \
        else np.lib.format.read_array_header_2_0
    try:
        shape, fortran, dtype = read(io.BytesIO(prefix))
    except ValueError as e:
        raise SessionFileError(f"{name} has a damaged .npy header ({clean_text(str(e), 80)})") from None
    if dtype.hasobject or dtype.kind not in "biufc":
        raise SessionFileError(f"{name} holds {dtype} values, not numbers (Python objects are never read)")
    if len(headers) < 4096:
        headers[prefix] = (shape, fortran, dtype)
    return shape, fortran, dtype


def _read_npy_member(z: zipfile.ZipFile, fh: Any, info: zipfile.ZipInfo, name: str, budget: int,
                     headers: dict) -> np.ndarray:
    """One .npy member of `z`, which lies in `fh`: its .npy header checked against the member's size and the budget
    before anything is allocated, then its data read in chunks straight into the array; a stored member is read in
    place and its checksum checked here (zipfile checks a deflated one's as it reaches the end)."""
    _check_entry(info, budget + 4096)
    stored = info.compress_type == zipfile.ZIP_STORED
    with _member_window(fh, info, name) if stored else z.open(info) as source:
        head = source.read(10)
        if len(head) < 10 or head[:6] != b"\x93NUMPY" or head[6] not in (1, 2):
            raise SessionFileError(f"{name} is not an .npy array")
        if head[6] == 2:
            head += source.read(2)
        header_len = int.from_bytes(head[8:], "little")
        if len(head) + header_len > min(info.file_size, 4096):
            raise SessionFileError(f"{name} has an .npy header longer than its member")
        prefix = head[8:] + source.read(header_len)
        shape, fortran, dtype = _parsed_npy_header(prefix, name, headers)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes > budget or len(head) + header_len + nbytes != info.file_size:
            raise SessionFileError(f"{name} claims {count:,} values, not what its {info.file_size:,} bytes hold")
        flat = np.empty(count, dtype)
        view = memoryview(flat.view(np.uint8)) if count else memoryview(b"")
        done = 0
        while done < nbytes:
            got = source.readinto(view[done:done + CHUNK])
            if not got:
                raise SessionFileError(f"{name} is cut short")
            done += got
        if source.read(1):
            raise SessionFileError(f"{name} holds more bytes than its header says")
    if stored and zlib.crc32(view, zlib.crc32(head[:8] + prefix)) != info.CRC:
        raise SessionFileError(f"{name} is damaged (its checksum does not match)")
    return flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)


_TOKENIZER_NAME = re.compile(r"tokenizer/[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}")


def _read_tokenizer(z: zipfile.ZipFile, infos: list[zipfile.ZipInfo]) -> Any:
    from engine.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="ilab-tokenizer-") as td:
        for info in infos:
            if not _TOKENIZER_NAME.fullmatch(info.filename):
                raise SessionFileError(f"the saved tokenizer has an unexpected file {_short(info.filename)}")
            data = _read_member(z, info, MAX_TOKENIZER_BYTES)
            if info.filename.endswith(".npy"):
                _check_npy_stream(bytes(data), info.filename)
            (Path(td) / info.filename.removeprefix("tokenizer/")).write_bytes(data)
        try:
            return Tokenizer.load(td)
        except Exception as e:  # noqa: BLE001 — the tokenizers library raises a bare Exception on a bad file
            raise SessionFileError(f"the saved tokenizer cannot be read ({type(e).__name__}: {e})") from None


def _check_npy_stream(data: bytes, name: str) -> None:
    """.npy arrays one after another (the tokenizer's token bytes): each header's size fits in what follows."""
    f = io.BytesIO(data)
    while f.tell() < len(data):
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = read_header(f)
        nbytes = math.prod(shape) * dtype.itemsize
        if dtype.hasobject or nbytes > len(data) - f.tell():
            raise SessionFileError(f"the saved tokenizer's {_short(name)} claims more than it holds")
        f.seek(nbytes, 1)
