"""Capture is keyword-only, and Capture.everything() sets what it names (a positional call once put funnel_top=True
and attention_max_bytes=True after a field was inserted, and every funnel failed in topk)."""

from __future__ import annotations

import pytest

from engine.run.session import ATTENTION_MAX_BYTES, Capture


def test_everything_sets_its_fields():
    cap = Capture.everything(3, funnel_top=5)
    assert cap.attention_layers == frozenset({0, 1, 2})
    assert cap.residual_norms is True and cap.logits is True
    assert cap.funnel_top == 5 and type(cap.funnel_top) is int
    assert cap.attention_max_bytes == ATTENTION_MAX_BYTES


def test_positional_capture_is_refused():
    with pytest.raises(TypeError):
        Capture(frozenset({0}), True, 20, True)  # type: ignore[misc]
