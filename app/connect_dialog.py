"""File → Connect to server…: the URL of an OpenAI-compatible server and, optionally, an API key.

The key is typed for this session only: it goes to the engine process's memory and is never saved (nor shown).
Left empty, the engine process reads it from the INFERENCE_LAB_API_KEY (or OPENAI_API_KEY) environment variable.
"""

from __future__ import annotations

from PySide6 import QtWidgets

from engine.remote.client import API_KEY_ENV

HELP = (
    "A vLLM or llama.cpp server (or any OpenAI-compatible one): e.g. http://127.0.0.1:8000. A multi-GPU vLLM "
    "deployment is just another URL: tensor and pipeline parallelism are the server's business.\n"
    "A server gives its tokenization, the streamed tokens with their top-N log-probabilities and its own metrics; "
    "it gives no attention maps, residual norms or per-step costs."
)


class ConnectDialog(QtWidgets.QDialog):
    def __init__(self, url: str = "", parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Connect to server")
        self.setObjectName("connect_dialog")
        self.url_edit = QtWidgets.QLineEdit(url or "http://127.0.0.1:8000")
        self.key_edit = QtWidgets.QLineEdit()
        self.key_edit.setEchoMode(QtWidgets.QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText(f"optional; empty = ${API_KEY_ENV} if set; never saved")
        form = QtWidgets.QFormLayout()
        form.addRow("Server URL", self.url_edit)
        form.addRow("API key", self.key_edit)
        note = QtWidgets.QLabel(HELP)
        note.setWordWrap(True)
        buttons = QtWidgets.QDialogButtonBox(
            QtWidgets.QDialogButtonBox.StandardButton.Ok | QtWidgets.QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QtWidgets.QDialogButtonBox.StandardButton.Ok).setText("Connect")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QtWidgets.QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(note)
        lay.addWidget(buttons)
        self.resize(520, 0)

    def url(self) -> str:
        return self.url_edit.text().strip()

    def api_key(self) -> str | None:
        return self.key_edit.text() or None
