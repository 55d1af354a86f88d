"""Constrain output: a regular expression or a JSON schema the next generation must match (constrained decoding)."""

from __future__ import annotations

import json

from PySide6 import QtCore, QtWidgets

from app import theme
from app.bridge import Bridge
from app.panels.base import Panel

EXAMPLES = {
    "regex": r" [0-9]{4}\.",
    "json_schema": json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                                "age": {"type": "integer"}},
                               "required": ["name", "age"], "additionalProperties": False}, indent=1),
}


class ConstrainPanel(Panel):
    title = "Constrain output"
    object_name = "panel_constrain"
    shortcut = "Alt+-"
    help_text = (
        "Constrained decoding: before the sampling funnel, a grammar removes every token that could not continue "
        "a text matching a regular expression or a JSON schema (the engine uses llguidance). The model still "
        "computes its full distribution; the Logits & sampling panel says how many tokens the grammar kept and "
        "hatches the removed ones. The output always matches; when the pattern is complete, the generation ends. "
        "Applies to the next Generate (forks from the Branches panel run free)."
    )

    subscriptions = {"sig_failed": "_on_failed"}

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.mode = QtWidgets.QComboBox()
        self.mode.addItem("off", None)
        self.mode.addItem("regular expression", "regex")
        self.mode.addItem("JSON schema", "json_schema")
        self.text = QtWidgets.QPlainTextEdit()
        self.text.setPlaceholderText("a regular expression, or a JSON schema")
        self.example_btn = QtWidgets.QPushButton("Example")
        self.status = QtWidgets.QLabel("")
        self.status.setWordWrap(True)
        self.status.setTextFormat(QtCore.Qt.TextFormat.RichText)
        row = QtWidgets.QHBoxLayout()
        row.addWidget(self.mode, 1)
        row.addWidget(self.example_btn)
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(row)
        layout.addWidget(self.text, 1)
        layout.addWidget(self.status)
        self.mode.currentIndexChanged.connect(lambda _i: self._apply())
        self.text.textChanged.connect(self._apply)
        self.example_btn.clicked.connect(self._example)
        self._apply()

    def set_constraint(self, kind: str | None, text: str = "") -> None:
        self.mode.setCurrentIndex(max(0, self.mode.findData(kind)))
        self.text.setPlainText(text)
        self._apply()

    def _example(self) -> None:
        kind = self.mode.currentData() or "regex"
        self.set_constraint(kind, EXAMPLES[kind])

    def _apply(self) -> None:
        kind, text = self.mode.currentData(), self.text.toPlainText()
        self.text.setEnabled(kind is not None)
        if kind is None or not text.strip():
            self.bridge.options.set_grammar()
            self.status.setText(f"<span style='color:{theme.MUTED}'>Off: the model samples freely.</span>")
            return
        if kind == "json_schema":
            try:
                if not isinstance(json.loads(text), dict):
                    raise ValueError("a JSON schema is a JSON object")
            except ValueError as e:
                self.bridge.options.set_grammar()
                self.status.setText(f"<span style='color:{theme.ERROR_COLOR}'>Not a JSON schema: "
                                    f"{_escape(str(e))}</span>")
                return
        self.bridge.options.set_grammar(**{kind: text})
        what = "match this regular expression" if kind == "regex" else "be JSON valid under this schema"
        self.status.setText(f"The next generation's output must {what}.")

    @QtCore.Slot(str)
    def _on_failed(self, message: str) -> None:
        if "cannot be used" in message:  # the engine refused the grammar: say it here too
            self.status.setText(f"<span style='color:{theme.ERROR_COLOR}'>{_escape(message)}</span>")


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


PANEL = ConstrainPanel
