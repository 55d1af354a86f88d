"""Events are built by keyword only: a positional call would silently shift a field when one is added."""

import dataclasses

import pytest

from engine import events


def _event_classes() -> list[type]:
    return [c for c in vars(events).values() if dataclasses.is_dataclass(c) and c.__module__ == events.__name__]


def test_every_event_is_frozen_and_keyword_only() -> None:
    classes = _event_classes()
    assert len(classes) >= 12
    for cls in classes:
        params = cls.__dataclass_params__
        assert params.frozen, cls.__name__
        fields = dataclasses.fields(cls)
        assert all(f.kw_only for f in fields), cls.__name__
        with pytest.raises(TypeError):
            cls(*range(len(fields)))
