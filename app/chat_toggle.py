"""The Chat toggles (prompt and generation panels) follow the loaded model: a model that cannot wrap a prompt in a
chat template (a base model without one, whose vocabulary has no ChatML tokens either: Gemma 3 270M) gets its toggle
unchecked and disabled, with the reason as its tooltip; the next model that can chat gets the user's choice back."""

from __future__ import annotations

from typing import Any

from PySide6 import QtWidgets

_TOOLTIP = "chat_toggle_tooltip"  # the toggle's own tooltip, kept while the reason replaces it
_WANTED = "chat_toggle_wanted"  # whether the user had it checked when a model without a template came in


def chat_unavailable(tokenizer: Any) -> str | None:
    """Why the loaded model cannot chat (engine.tokenizer.Tokenizer.chat_unavailable), or None."""
    return None if tokenizer is None else getattr(tokenizer, "chat_unavailable", None)


def fit_chat_box(box: QtWidgets.QCheckBox, tokenizer: Any) -> None:
    """Enable `box` when `tokenizer` has a chat template; otherwise uncheck and disable it and say why."""
    why = chat_unavailable(tokenizer)
    if why is not None:
        if box.isEnabled():
            box.setProperty(_TOOLTIP, box.toolTip())
            box.setProperty(_WANTED, box.isChecked())
        box.setChecked(False)
        box.setEnabled(False)
        box.setToolTip(f"Chat is off: {why}.")
    elif not box.isEnabled():
        box.setEnabled(True)
        box.setToolTip(str(box.property(_TOOLTIP) or ""))
        box.setChecked(bool(box.property(_WANTED)))
