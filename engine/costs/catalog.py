"""Catalogues of real models and real hardware, read from resources/models.json and resources/hardware.json.

Model entries use ModelConfig's field names and carry the Hugging Face config.json they were copied from.
Hardware entries give each chip's dense peak throughput per dtype, memory bandwidth and memory size with the
vendor document they come from; `engine.costs.hardware` produces the same `Hardware` record by measuring this
machine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from engine.model import dtypes
from engine.model.config import ModelConfig


class UnknownNameError(KeyError, ValueError):
    """A name missing from a catalogue; the message lists the valid ones. Both a KeyError and a ValueError."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


canonical_dtype = dtypes.canonical  # the short name ("fp16", "bf16", …) for any accepted spelling of a dtype


@dataclass(frozen=True)
class Hardware:
    """One machine as the roofline model sees it: peak FLOP/s per dtype, memory bandwidth and memory size."""

    name: str
    label: str
    peak_flops: dict[str, float]  # canonical dtype name -> dense peak, FLOP/s
    bandwidth_bytes_per_s: float
    memory_bytes: float
    source: str
    measured: bool = False
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # how a measurement was taken (sizes, repeats, …)

    def peak_for(self, dtype: str) -> float:
        """Dense peak for `dtype`, else for the nearest dtype listed (e.g. int4→int8→fp16), in FLOP/s."""
        if not self.peak_flops:
            raise ValueError(f"hardware {self.name!r} lists no peak FLOP/s")
        for candidate in dtypes.lookup(dtype).peak_fallback:
            if candidate in self.peak_flops:
                return float(self.peak_flops[candidate])
        return float(max(self.peak_flops.values()))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str | None = None) -> Hardware:
        """Build from a catalogue or cache entry (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if name is not None:
            kw["name"] = name
        kw.setdefault("label", kw.get("name", "hardware"))
        kw.setdefault("source", "")
        kw["peak_flops"] = {canonical_dtype(k): float(v) for k, v in kw.get("peak_flops", {}).items()}
        kw["bandwidth_bytes_per_s"] = float(kw["bandwidth_bytes_per_s"])
        kw["memory_bytes"] = float(kw["memory_bytes"])
        return cls(**kw)


@functools.cache
def _load(filename: str) -> dict[str, Any]:
    text = resources.files("resources").joinpath(filename).read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def model_presets() -> dict[str, ModelConfig]:
    """Every catalogue model, by key (e.g. "llama-2-70b"), as fresh ModelConfig objects."""
    return {key: ModelConfig.from_dict(entry) for key, entry in _load("models.json").items()}


def hardware_presets() -> dict[str, Hardware]:
    """Every catalogue chip, by key (e.g. "h100-sxm")."""
    return {key: Hardware.from_dict(entry, name=key) for key, entry in _load("hardware.json").items()}


def _preset(presets: dict[str, Any], name: str, what: str) -> Any:
    """One catalogue entry; an unknown name raises UnknownNameError listing the valid ones."""
    key = name.strip().lower()
    if key not in presets:
        raise UnknownNameError(f"unknown {what} {name!r}; valid: {', '.join(presets)}")
    return presets[key]


def model_preset(name: str) -> ModelConfig:
    return _preset(model_presets(), name, "model preset")


def hardware_preset(name: str) -> Hardware:
    return _preset(hardware_presets(), name, "hardware")
