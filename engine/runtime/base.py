"""The runtime seam: what the engine's loops (batched decode, speculative decoding) run on.

A runtime holds one model and a KV cache of several sequences. Its one verb is `forward`: a batch of rows, each a
sequence id with the tokens that follow what the cache holds of that sequence. The runtime alone counts positions
(`length(seq)`): a row's tokens take the sequence's next positions, so no caller keeps a second count that could
drift from the cache's. The KV verbs (remove, copy, keep) change what a sequence holds.

A row may also ask for captures (a Capture: attention weights, residual norms, the residual stream for the lens);
`captured(seq)` then hands over what its last forward pass recorded, in the shapes the events carry. A generation
(engine.run.session.Generation) is a loop of one-row forwards with captures on a one-sequence runtime; the labs
(engine.labs) loop over batches of rows without them. Implementations: engine.runtime.torch and
engine.runtime.llamacpp.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.costs import formulas as costs
from engine.events import Capability, KVCacheGrew, ModelInfo, StepCost
from engine.model.config import ModelConfig
from engine.protocol import Capture


@dataclass(frozen=True)
class Row:
    """One sequence's part of a forward batch: its next tokens, and whether every token's logits are wanted (a
    verify pass) or only the last one's."""

    seq: int
    tokens: Sequence[int]
    all_logits: bool = False
    capture: Capture | None = None  # what the pass records for this row (`Runtime.captured`); None: nothing


@dataclass(frozen=True)
class Captured:
    """What one row's forward pass recorded, as the events carry it.

    attention: layer -> ((H, rows, keys) float32 weights of the step's last `rows` queries, query rows left out
    before them); norms: the residual stream's norm after the embedding and after each layer (L + 1,); stream: the
    residual stream itself at the newest position (L + 1, d), which the lens projects. None: not asked for.
    """

    attention: Mapping[int, tuple[np.ndarray, int]]
    norms: np.ndarray | None = None
    stream: np.ndarray | torch.Tensor | None = None


class Runtime(ABC):
    """A model with a cache of up to `n_seq` sequences of up to `capacity` positions each."""

    info: ModelInfo  # the model's facts, built once by whoever loaded it
    cfg: ModelConfig
    tokenizer: object  # engine.tokenizer.Tokenizer
    n_seq: int
    capacity: int
    weight_dtype: str  # how the weights are stored, for engine.costs (a file's own bytes override them)
    kv_dtype: str
    dtype_name: str  # what a user reads as the model's precision (float32, bfloat16, Q4_K_M…)
    device: torch.device  # where the logits `forward` returns live
    page_size: int  # positions the cache hands a sequence at a time (llama.cpp's cells: 1)
    cannot: tuple[Capability, ...] = ()  # captures this runtime cannot make (llama.cpp's fused attention)

    @abstractmethod
    def forward(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Run every row's tokens at its sequence's next positions; float32 logits per row: (V,) of its last token,
        or (T, V) of each with all_logits. ValueError when a row would not fit."""

    @abstractmethod
    def length(self, seq: int) -> int:
        """Positions the cache holds for `seq` (0 when it holds none): where its next token goes."""

    @abstractmethod
    def remove(self, seq: int, start: int = 0) -> None:
        """Forget `seq`'s positions from `start` on (from 0: the whole sequence)."""

    @abstractmethod
    def copy(self, src: int, dst: int, n: int) -> None:
        """Make `dst` hold the first n positions of `src` (whatever `dst` held is forgotten)."""

    @abstractmethod
    def keep(self, seq: int) -> None:
        """Forget every sequence but `seq`."""

    @abstractmethod
    def pages_in_use(self) -> int:
        """Pages (of `page_size` positions) the cache has handed to sequences."""

    def held(self, seq: int) -> list[int]:
        """The tokens whose keys and values the cache holds for `seq`, positions 0…length − 1 (a generation's
        runtime keeps them for prefix reuse; a lab's does not)."""
        raise NotImplementedError(f"{type(self).__name__} does not keep its sequences' tokens")

    def reuse(self, seq: int, ids: Sequence[int]) -> int:
        """Keep the positions of `seq` that start `ids` (never its last token: it gives the logits), forget the
        rest; returns how many are kept (the cache may keep fewer: a sliding window that moved on)."""
        held = self.held(seq)
        n, limit = 0, min(len(held), len(ids) - 1)
        while n < limit and held[n] == ids[n]:
            n += 1
        self.remove(seq, n)
        return self.length(seq)

    def captured(self, seq: int) -> Captured:
        """What `seq`'s row of the last forward pass recorded (its Row.capture)."""
        raise NotImplementedError(f"{type(self).__name__} records no captures")

    def lens_head(self) -> torch.nn.Module:
        """The module whose `head` takes the residual stream to logits (the final norm and the output matrix)."""
        raise NotImplementedError(f"{type(self).__name__} has no lens head")

    def kv_event(self, step: int, seq: int = 0) -> KVCacheGrew:
        """The KV cache after a step of `seq`: positions held, bytes they use and bytes the cache reserves."""
        per_position = self.kv_bytes_per_position()
        n = self.length(seq)
        return KVCacheGrew(step=step, n_tokens=n, bytes_used=round(per_position * n),
                           bytes_allocated=round(per_position * self.capacity))

    def close(self) -> None:
        """Free what the runtime holds beyond the model (its cache, a context)."""
        return None  # the torch runtime's cache is freed with it

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step_weight_bytes(self, rows: int) -> float:
        """Weight bytes one step over `rows` token rows reads (the output head's, once per row with logits)."""
        return costs.step_weight_bytes(self.cfg, self.weight_dtype, rows=rows)

    def kv_bytes_per_position(self) -> float:
        """Bytes of keys and values one position of one sequence holds, over all layers."""
        return costs.kv_bytes_per_token(self.cfg, self.kv_dtype)

    def cells_reserved(self, n_seq: int, capacity: int) -> int:
        """Positions a runtime of n_seq sequences of `capacity` positions allocates (memory checks before one)."""
        return n_seq * capacity

    def step_cost(self, n_tokens: int, start: int, batch: int = 1, all_logits: bool = False) -> StepCost:
        """engine.costs.formulas' step of `batch` sequences of n_tokens each after `start` cached positions."""
        c = costs.prefill_cost(self.cfg, n_tokens, start=start, batch=batch, weight_dtype=self.weight_dtype,
                               kv_dtype=self.kv_dtype, all_logits=all_logits)
        return replace(c, weight_bytes=self.step_weight_bytes(n_tokens * batch))

    def check_fits(self, rows: Sequence[Row]) -> None:
        """ValueError naming the first row that names an unknown sequence or runs past its capacity."""
        seen: set[int] = set()
        for r in rows:
            if not 0 <= r.seq < self.n_seq:
                raise ValueError(f"sequence {r.seq} is not one of this runtime's {self.n_seq}")
            if r.seq in seen:
                raise ValueError(f"sequence {r.seq} appears twice in one forward batch")
            seen.add(r.seq)
            if not r.tokens:
                raise ValueError(f"sequence {r.seq} has no tokens in this forward batch")
            end = self.length(r.seq) + len(r.tokens)
            if end > self.capacity:
                raise ValueError(f"sequence {r.seq} would hold {end} positions; this runtime holds {self.capacity}")
