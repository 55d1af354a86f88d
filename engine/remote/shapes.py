"""What a server's measured decode rate means on a roofline: the model's real shapes, where they can be known.

A server's API names its model but not its shapes. vLLM's /v1/models gives `root`, the directory it loaded; when
that directory (or the model id) is a Hugging Face directory readable here — a server on this machine, e.g. the
default model exported with `python -m engine export-hf` — its config.json gives the shapes; llama.cpp's servers name
the model by its GGUF path, whose metadata gives them when the file is readable here. Otherwise the caller
says in one line that they are missing (the user may pick the model from the catalogue instead).

Those paths are read only for a server on this machine (loopback): a remote server's paths name its own files, and
letting any server choose which local files this process opens would be a way in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.costs import formulas as costs
from engine.events import StepCost
from engine.model.config import ModelConfig
from engine.remote.client import clean_text


def server_model_config(model: str, root: str | None, loopback: bool = False) -> tuple[ModelConfig | None, str]:
    """(config, where it came from) or (None, one line saying what is missing). The paths the server names are
    read only when `loopback` (ServerInfo.loopback). Imports torch (the HF loader): call it in the engine process."""
    shown = clean_text(model, 120)
    if not loopback:
        return None, (f"the server's model shapes are unknown: it serves {shown!r} from another machine, whose "
                      "files are not read here — pick its model under Model to place the measured rate")
    for cand in (root, model):
        if not cand:
            continue
        d = Path(cand).expanduser()
        try:
            is_gguf = d.suffix.lower() == ".gguf" and d.is_file()
            if not is_gguf and not (d / "config.json").is_file():
                continue
        except (OSError, ValueError):  # ValueError: a NUL in the name
            continue
        if is_gguf:  # llama.cpp's servers name the model by the GGUF file they loaded
            from engine.loaders import gguf

            try:
                return gguf.read_config(gguf.open_reader(d), d.stem), f"metadata of {d}"
            except Exception as e:  # noqa: BLE001 — any unreadable file is reported, not raised
                return None, clean_text(f"the server's model shapes are unknown: {d} could not be read ({e})", 300)
        from engine.loaders.hf import read_config

        try:
            return read_config(d), f"config.json in {d}"
        except Exception as e:  # noqa: BLE001 — any unreadable config is reported, not raised
            return None, clean_text(f"the server's model shapes are unknown: {d}/config.json could not be read "
                                    f"({e})", 300)
    where = f" (loaded from {clean_text(root, 120)})" if root and root != model else ""
    return None, (f"the server's model shapes are unknown: it serves {shown!r}{where} and no config.json or GGUF "
                  "for it is readable here — pick its model under Model to place the measured rate")


@dataclass(frozen=True)
class MeasuredDecode:
    """A server's decode as measured from chunk arrivals, costed with the model's shapes."""

    tokens_per_s: float
    tpot_s: float
    cost: StepCost  # one decode step at the run's final context

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.tpot_s

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.tpot_s


def measured_decode(cfg: ModelConfig, context: int, decode_seconds: list[float], weight_dtype: str,
                    batch: int = 1) -> MeasuredDecode | None:
    """The decode tokens' arrival gaps (s; 0 inside a chunk) → mean TPOT, tokens/s and the achieved FLOP/s and
    bytes/s of a decode step at `context` (None before a decode token with time arrived)."""
    total = float(sum(decode_seconds))
    if not decode_seconds or total <= 0:
        return None
    tpot = total / len(decode_seconds)
    cost = costs.decode_cost(cfg, max(1, context), batch=batch, weight_dtype=weight_dtype)
    return MeasuredDecode(tokens_per_s=1.0 / tpot, tpot_s=tpot, cost=cost)
