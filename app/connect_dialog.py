"""File → Connect to server…: the URL of an OpenAI-compatible server and, optionally, an API key.

The key is typed for this session only: it goes to the engine process's memory and is never saved (nor shown).
Left empty, the engine process reads it from the INFERENCE_LAB_API_KEY (or OPENAI_API_KEY) environment variable.
Before a key would travel unencrypted (http://) to another machine, the user must confirm it.
"""

from __future__ import annotations

from PySide6 import QtWidgets

from engine.remote.client import API_KEY_ENV, default_api_key, insecure_key_warning

HELP = (
    "A vLLM or llama.cpp server (or any OpenAI-compatible one): e.g. http://127.0.0.1:8000. A multi-GPU vLLM "
    "deployment is just another URL: tensor and pipeline parallelism are the server's business.\n"
    "A server gives its tokenization, the streamed tokens with their top-N log-probabilities and its own metrics; "
    "it gives no attention maps, residual norms or per-step costs."
)


def key_warning(url: str, api_key: str | None) -> str | None:
    """The warning to confirm before connecting, or None: the key typed (or, left empty, the environment's, which
    the engine process will use) would travel unencrypted to another machine."""
    w = insecure_key_warning(url, api_key or default_api_key())
    return None if w is None else w[0].upper() + w[1:] + "."


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

    def accept(self) -> None:
        warning = key_warning(self.url(), self.api_key())
        if warning is None or self.confirm_insecure(warning):
            super().accept()

    def confirm_insecure(self, warning: str) -> bool:
        """Ask before the key goes out in clear; the default answer keeps it home."""
        Btn = QtWidgets.QMessageBox.StandardButton
        answer = QtWidgets.QMessageBox.warning(self, "Send the API key unencrypted?",
                                               f"{warning}\n\nConnect and send it anyway?", Btn.Yes | Btn.Cancel,
                                               Btn.Cancel)
        return answer == Btn.Yes

    def url(self) -> str:
        return self.url_edit.text().strip()

    def api_key(self) -> str | None:
        return self.key_edit.text() or None
