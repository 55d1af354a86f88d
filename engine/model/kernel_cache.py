"""The decode autotuner's memory, without torch: which product won for each shape on this machine, kept as JSON.

engine.model.kernels measures; this module names a measurement (the key), reads and writes the file
($INFERENCE_LAB_CACHE or ~/.cache/inference-lab, `kernels.json`) and turns it into rows for `python -m engine kernels`
and the app's Engine → Decode kernels dialog, which reads it without loading torch.

A choice holds only where it was measured: the key names the CPU model, its core count, the torch version, torch's
kernel set (ATEN_CPU_CAPABILITY: an AVX-512 CPU told to use AVX2 runs other kernels), the dtype, the thread count and
the weight's shape, and whether the weights have quantized forms (a GGUF file's Q4 blocks: the int4 and int8
candidates). Any of them changing is a different key, so the engine measures again. A file that cannot be
read, or an entry that does not look like one this code wrote, is ignored (and measured again), never trusted.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from engine.protocol import DEFAULT_MODE, KERNEL_MODES  # noqa: F401 — the modes are the protocol's words

CACHE_FILE = "kernels.json"
FORMAT = 1
MAX_ENTRIES = 400  # the oldest go first: a file that outlives many torch versions stays small
# Candidates closer than this are a tie that F.linear, torch's own choice, wins: under another program's load the
# order of two near-equal candidates flipped from one measurement to the next (BENCHMARKS.md, "Decode kernels chosen
# by measuring the machine"), and a tie has nothing to gain from leaving torch's default path.
PLAIN_MARGIN = 1.05
# Else, among the candidates within LIGHT_MARGIN of the fastest (the tolerance issue 27 sets), the one that streams the
# fewest bytes per weight wins: a decode product is memory-bound, and one that reads more loses more when the memory
# bus is shared or slower: an LM head larger than the cache swapped its near-equal candidates' order between
# measurements minutes apart, the heavier one losing more (BENCHMARKS.md, "AMD EPYC with AVX-512 and avx512_bf16").
LIGHT_MARGIN = 1.10
QUANT_BYTES = {"int4": 0.625, "int8": 1.0}  # per weight, with the scales (engine.model.quant)
FLOAT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# the weights of a measured group: float only, with the Q4 file's int4 and int8 forms (kernel mode "fast"), or with
# the file's own int4 blocks only (kernel mode "file")
FLOAT, Q4, Q4_FILE = "float", "q4", "q4-file"
WEIGHTS = (FLOAT, Q4, Q4_FILE)

KERNEL_ENV = "INFERENCE_LAB_KERNEL"  # forces one candidate everywhere it applies (the app's engine process reads it)
ATTENTION_ENV = "INFERENCE_LAB_ATTENTION"  # forces one way of a decode query's attention (attention_choice)

# The candidates, by name: what each one is, for the CLI, the dialog and the benchmark.
DESCRIPTIONS: dict[str, str] = {
    "linear": "F.linear (torch's own choice: MKL sgemv, or its bf16 kernel)",
    "split": "a batched product over row blocks of W, one block per thread (torch.bmm)",
    "onednn": "oneDNN's linear on the plain weight",
    "packed": "oneDNN's linear on a bf16 weight reordered once at load",
    "int4": "torch's int4 weight-only kernel on the file's Q4_0/Q4_1/Q4_K blocks (bf16 activations)",
    "int8": "torch's int8 weight-only kernel on the weight requantized per row (bf16 activations)",
}
NAMES: tuple[str, ...] = tuple(DESCRIPTIONS)

# A decode query's attention (engine.model.attention_choice): the ways, by name.
ATTENTION_DESCRIPTIONS: dict[str, str] = {
    "upcast": "two float32 products on upcast copies of a bf16/fp16 cache, the softmax between",
    "blocked": "bf16/fp16 products over whole blocks of 256 keys, float32 over the rest",
    "explicit": "two float32 products over the cache, the softmax between",
    "sdpa": "torch's fused scaled_dot_product_attention (never forms the weights a panel shows)",
}
WEIGHT_WAYS = ("upcast", "blocked", "explicit")  # the ways that form the weights (a captured layer runs one of them)


def _named(value: str, names: tuple[str, ...] | dict, what: str) -> str:
    name = value.strip().lower()
    if name not in names:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(names)}")
    return name


def kernel_name(value: str) -> str:
    """A candidate's name as typed (--kernel, $INFERENCE_LAB_KERNEL); ValueError naming the valid ones."""
    return _named(value, NAMES, "kernel")


@dataclass(frozen=True)
class Machine:
    """What a measurement depends on besides the product itself."""

    cpu: str  # /proc/cpuinfo's model name
    cores: int  # cores this process may run on
    torch: str  # torch.__version__
    capability: str  # torch.backends.cpu.get_cpu_capability(): the kernel set ATen dispatches to

    def key(self, dtype: str) -> str:
        """The start of every measurement's key on this machine (the products', the attention's, the chain's)."""
        return f"{self.cpu}|{self.cores} cores|torch {self.torch}|{self.capability}|{dtype}"


def attention_way(value: str) -> str:
    """A way's name as typed ($INFERENCE_LAB_ATTENTION, --attention); ValueError naming the valid ones."""
    return _named(value, ATTENTION_DESCRIPTIONS, "attention way")


def entry_key(machine: Machine, dtype: str, threads: int, shape: tuple[int, int], weights: str = FLOAT) -> str:
    """One measurement's identity: machine, dtype, thread count, weight shape (out, in) and weights (WEIGHTS)."""
    kind = "" if weights == FLOAT else f"|{weights}"
    return machine.key(dtype) + f"|{threads} threads|{shape[0]}x{shape[1]}{kind}"


@dataclass(frozen=True)
class Entry:
    """A measured shape: every candidate's median seconds for one product, and the fastest."""

    FILE: ClassVar[str] = CACHE_FILE

    machine: Machine
    dtype: str  # "float32", "bfloat16"
    threads: int
    shape: tuple[int, int]  # (out, in) of the weight
    seconds: dict[str, float]  # candidate -> median seconds for one product of one row
    count: int  # the model's weights of this shape, streamed one after another when timed (a decode step's order)
    rounds: int  # interleaved rounds the medians are over
    measured_at: float  # time.time()
    weights: str = FLOAT  # Q4 (Q4_FILE): the weights had quantized forms, so int4 and int8 (int4) were measured too
    # other processes' CPU use while it was measured, in cores (None: unknown): a multi-thread choice made under load
    # is measured again at a later load that finds the machine quiet (engine.model.kernels.tune)
    others_cores: float | None = None

    @property
    def key(self) -> str:
        return entry_key(self.machine, self.dtype, self.threads, self.shape, self.weights)

    @property
    def choice(self) -> str:
        """F.linear where it is within PLAIN_MARGIN of the fastest, else among the candidates within LIGHT_MARGIN
        of the fastest the one that reads the fewest bytes per weight ("packed" is a bf16 weight), the faster of
        equals."""
        fastest = min(self.seconds.values())
        if self.seconds.get("linear", float("inf")) <= PLAIN_MARGIN * fastest:
            return "linear"
        near = [k for k, s in self.seconds.items() if s <= LIGHT_MARGIN * fastest]
        own = 2.0 if self.dtype not in FLOAT_BYTES else FLOAT_BYTES[self.dtype]
        return min(near, key=lambda k: (QUANT_BYTES.get(k, 2.0 if k == "packed" else own), self.seconds[k]))

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["choice"] = self.choice
        return d

    @classmethod
    def from_json(cls, d: object) -> Entry | None:
        """The entry, or None where `d` is not one this code wrote (a hand edit, another version, damage)."""
        try:
            m = d["machine"]
            machine = Machine(str(m["cpu"]), int(m["cores"]), str(m["torch"]), str(m["capability"]))
            seconds = {str(k): float(v) for k, v in d["seconds"].items()}
            out_f, in_f = (int(v) for v in d["shape"])
            e = cls(machine, str(d["dtype"]), int(d["threads"]), (out_f, in_f), seconds, int(d["count"]),
                    int(d["rounds"]), float(d["measured_at"]), str(d.get("weights", FLOAT)),
                    None if d.get("others_cores") is None else float(d["others_cores"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        ok = (seconds and all(k in DESCRIPTIONS and 0 < v < float("inf") for k, v in seconds.items())
              and e.threads >= 1 and min(e.shape) >= 1 and e.weights in WEIGHTS)
        return e if ok else None


def attention_key(machine: Machine, dtype: str, threads: int, heads: tuple[int, int, int], keys: int) -> str:
    """One attention measurement's identity: machine, dtype, thread count, heads (KV heads, queries per KV head,
    head size) and key count."""
    return machine.key(dtype) + f"|{threads} threads|heads {heads[0]}x{heads[1]}x{heads[2]}|{keys} keys"


@dataclass(frozen=True)
class AttentionEntry:
    """A measured key count: every way's median seconds for one decode query over one layer's cache."""

    FILE: ClassVar[str] = "attention.json"

    machine: Machine
    dtype: str
    threads: int
    heads: tuple[int, int, int]  # KV heads, query heads per KV head, head size
    keys: int
    seconds: dict[str, float]  # way -> median seconds
    rounds: int
    measured_at: float
    # other processes' CPU use while it was measured, in cores (None: unknown): as Entry.others_cores, a
    # multi-thread timing made under load is measured again at a later load that finds the machine quiet
    others_cores: float | None = None

    @property
    def key(self) -> str:
        return attention_key(self.machine, self.dtype, self.threads, self.heads, self.keys)

    def fastest(self, weights: bool = False) -> str:
        """The fastest way measured; weights: of those that form the weights."""
        timed = {k: v for k, v in self.seconds.items() if not weights or k in WEIGHT_WAYS}
        return min(timed, key=timed.__getitem__)

    def to_json(self) -> dict:
        d = asdict(self)
        d["heads"] = list(self.heads)
        d["fastest"] = self.fastest()
        return d

    @classmethod
    def from_json(cls, d: object) -> AttentionEntry | None:
        """The entry, or None where `d` is not one this code wrote."""
        try:
            m = d["machine"]
            machine = Machine(str(m["cpu"]), int(m["cores"]), str(m["torch"]), str(m["capability"]))
            seconds = {str(k): float(v) for k, v in d["seconds"].items()}
            kv, g, hd = (int(v) for v in d["heads"])
            others = d.get("others_cores")
            e = cls(machine, str(d["dtype"]), int(d["threads"]), (kv, g, hd), int(d["keys"]), seconds,
                    int(d["rounds"]), float(d["measured_at"]), None if others is None else float(others))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        ok = (seconds and all(k in ATTENTION_DESCRIPTIONS and 0 < v < float("inf") for k, v in seconds.items())
              and e.threads >= 1 and min(e.heads) >= 1 and e.keys >= 1)
        return e if ok else None


def cache_path(kind: type = Entry) -> Path:
    """The file `kind`'s measurements are kept in (Entry: the products'; AttentionEntry: the attention's)."""
    from engine.formats.locate import cache_root

    return cache_root() / kind.FILE


def read(path: Path | None = None, kind: type = Entry, records: str = "entries") -> dict:
    """Every valid record of `kind` in the file (its list `records`) by key; {} when it is missing, unreadable or
    not this format."""
    path = path or cache_path(kind)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get(records), list):
        return {}
    entries = (kind.from_json(d) for d in doc[records])
    return {e.key: e for e in entries if e is not None}


def write(new: list, path: Path | None = None, kind: type = Entry, records: str = "entries",
          most: int = MAX_ENTRIES) -> None:
    """Merge `new` into the file (replacing records of the same key, keeping the `most` newest), atomically; a
    read-only disk only costs the next start a measurement."""
    path = path or cache_path(kind)
    entries = read(path, kind, records)
    entries.update({e.key: e for e in new})
    keep = sorted(entries.values(), key=lambda e: e.measured_at)[-most:]
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, records: [e.to_json() for e in keep]}, indent=1),
                       encoding="utf-8")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def rows(entries: list[Entry]) -> list[dict]:
    """One row per measured shape, as `python -m engine kernels --json` prints it and the dialog shows it."""
    out = []
    for e in sorted(entries, key=lambda e: (e.dtype, e.threads, -e.shape[0] * e.shape[1])):
        best = min(e.seconds.values())
        out.append({
            "dtype": e.dtype, "threads": e.threads, "shape": list(e.shape), "weights": e.weights, "count": e.count,
            "choice": e.choice,
            "seconds": dict(sorted(e.seconds.items(), key=lambda kv: kv[1])),
            "vs_fastest": {k: v / best for k, v in e.seconds.items()},
            "rounds": e.rounds, "torch": e.machine.torch, "capability": e.machine.capability,
            "measured": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.measured_at)),
        })
    return out


def attention_rows(entries: list[AttentionEntry]) -> list[dict]:
    """One row per measured key count, as `python -m engine kernels --json` prints it."""
    out = []
    for e in sorted(entries, key=lambda e: (e.dtype, e.heads, e.threads, e.keys)):
        best = min(e.seconds.values())
        out.append({"dtype": e.dtype, "threads": e.threads, "heads": list(e.heads), "keys": e.keys,
                    "fastest": e.fastest(), "fastest_with_weights": e.fastest(weights=True),
                    "seconds": dict(sorted(e.seconds.items(), key=lambda kv: kv[1])),
                    "vs_fastest": {k: v / best for k, v in e.seconds.items()}, "rounds": e.rounds,
                    "others_cores": e.others_cores,
                    "measured": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.measured_at))})
    return out


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name as the OS reports it (a machine's measurements are keyed by it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def this_cpu() -> tuple[str, int]:
    """The CPU model name and the cores this process may use (the part of the key known without torch)."""
    return cpu_model(), available_cores()


def entries_for_this_cpu(path: Path | None = None, kind: type = Entry) -> list:
    """The file's entries measured on this CPU model with this many cores (any torch version)."""
    cpu, cores = this_cpu()
    return [e for e in read(path, kind).values() if e.machine.cpu == cpu and e.machine.cores == cores]
