"""Named instrumentation points, captured only when someone subscribed to them.

Point names (in the spirit of TransformerLens hook points):
    layers.{i}.attn.pattern   attention weights (B, n_heads, T_query, T_key) after softmax, causal mask applied
    resid.norms               L2 norm of the residual stream of the last position: after the embedding, then after
                              every layer, (B, n_layers + 1)
    resid.stream              the residual stream itself at the last position, same points, (B, n_layers + 1, d)
                              (the logit lens projects it through the final norm and the LM head)

Values are detached and copied to numpy at record time, so nothing keeps a tensor alive after the step.

Attention weights are bounded: a step keeps all its query rows, or, when they would take more than
`max_attention_bytes` (a long prefill: 4,054 prompt tokens × 9 heads would be 590 MB for one layer), only its last
rows, as many as fit. A panel cannot show more rows than that anyway; the event says how many were left out.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from engine.protocol import ATTENTION_MAX_BYTES, Capture


def attn_point(layer: int) -> str:
    return f"layers.{layer}.attn.pattern"


RESID_NORMS = "resid.norms"
RESID_STREAM = "resid.stream"


class Probe:
    """A set of subscribed point names and the values recorded for them during one forward step."""

    def __init__(self, names: Iterable[str] = (), max_attention_bytes: int = ATTENTION_MAX_BYTES) -> None:
        self.names = frozenset(names)
        self.max_attention_bytes = max_attention_bytes
        self.values: dict[str, np.ndarray] = {}

    @classmethod
    def for_capture(
        cls, attention_layers: Iterable[int] = (), residual_norms: bool = False, residual_stream: bool = False,
        max_attention_bytes: int = ATTENTION_MAX_BYTES,
    ) -> Probe:
        names = {attn_point(i) for i in attention_layers}
        if residual_norms:
            names.add(RESID_NORMS)
        if residual_stream:
            names.add(RESID_STREAM)
        return cls(names, max_attention_bytes)

    @classmethod
    def for_request(cls, capture: Capture) -> Probe | None:
        """The probe a Capture asks for, or None when it asks for nothing a forward pass must record."""
        if not capture.attention_layers and not capture.residual_norms and not capture.lens_top:
            return None
        return cls.for_capture(capture.attention_layers, capture.residual_norms, residual_stream=capture.lens_top > 0,
                               max_attention_bytes=capture.attention_max_bytes)

    def attention_rows(self, n_heads: int, n_queries: int, n_keys: int) -> int:
        """How many of a step's query rows (the last ones) to capture: all that fit in max_attention_bytes, ≥ 1."""
        return max(1, min(n_queries, self.max_attention_bytes // (n_heads * n_keys * 4)))

    def wants(self, name: str) -> bool:
        return name in self.names

    def record(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = value.detach().float().cpu().numpy()

    def clear(self) -> None:
        self.values = {}

    def __bool__(self) -> bool:
        return bool(self.names)
