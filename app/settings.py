"""Every QSettings key the app uses, in one place, with typed readers and writers.

The settings live where Qt keeps them for organisation "InferenceLab", application "Inference Lab", unless the
environment variable INFERENCE_LAB_SETTINGS names an .ini file: tests (and anyone wanting a clean start) point it at
a temporary file so the user's own settings are never read or written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from PySide6 import QtCore

from engine.model.kernel_cache import DEFAULT_MODE, KERNEL_MODES
from engine.protocol import SamplingParams

ORGANISATION = "InferenceLab"
APPLICATION = "Inference Lab"
ENV_FILE = "INFERENCE_LAB_SETTINGS"

# ---- keys ---------------------------------------------------------------------------------------------------------
GEOMETRY = "window/geometry"  # QByteArray from QMainWindow.saveGeometry()
WINDOW_STATE = "window/state"  # QByteArray from QMainWindow.saveState(): docks and their sizes
LAYOUT_VERSION = "window/layout_version"  # restoreState() is skipped when the dock set changed
PROMPT_TEXT = "prompt/text"
CHAT = "prompt/chat"  # wrap the prompt in the model's chat template
MAX_NEW_TOKENS = "generation/max_new_tokens"
MODEL_PATH = "model/path"  # the last model the user opened ("" = the default model)
THREADS = "engine/threads"  # decode threads: "auto" or a positive count (engine.model.threads)
KERNELS = "engine/kernels"  # the torch runtime's kernel mode (engine.model.kernel_cache.KERNEL_MODES)
SAMPLING_PREFIX = "sampling/"  # + a SamplingParams field name
STEER_SCALE = "steer/scale"  # the Steering panel's last scale
STEER_LAYERS = "steer/layers"  # its layers as typed ("" = the middle third of the loaded model's blocks)
STEER_PAIRS = "steer/pairs"  # its contrast pairs: JSON, [[positive, negative], …]
STEER_METHOD = "steer/method"  # "mean" or "pca"

DEFAULT_PROMPT = "Explain what a KV cache is in two sentences."
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_STEER_PAIRS = (
    ("I love this. It is wonderful and makes me happy.", "I hate this. It is awful and makes me miserable."),
    ("What a great day, everything went well.", "What a terrible day, everything went wrong."),
    ("She smiled, delighted by the good news.", "She frowned, upset by the bad news."),
    ("This film is brilliant: I enjoyed every minute.", "This film is dreadful: I regretted every minute."),
)
MAX_STORED_PAIRS = 256


@dataclass(frozen=True)
class SteerSettings:
    """What the Steering panel remembers between runs of the app."""

    scale: float = 0.5
    layers: str = ""  # "" = the middle third of the loaded model's blocks
    pairs: tuple[tuple[str, str], ...] = DEFAULT_STEER_PAIRS
    method: str = "mean"


def open_settings() -> QtCore.QSettings:
    """The app's settings store (the ini file named by INFERENCE_LAB_SETTINGS when that is set)."""
    path = os.environ.get(ENV_FILE)
    if path:
        return QtCore.QSettings(path, QtCore.QSettings.Format.IniFormat)
    return QtCore.QSettings(ORGANISATION, APPLICATION)


class Settings:
    """Typed access to the stored values; every read falls back to a default when a value is missing or bad."""

    def __init__(self, store: QtCore.QSettings | None = None) -> None:
        self.store = store if store is not None else open_settings()

    def _get(self, key: str, default, kind: type):
        raw = self.store.value(key)
        if raw is None:
            return default
        try:
            if kind is bool:
                return raw if isinstance(raw, bool) else str(raw).lower() in ("true", "1", "yes")
            if kind is bytes:
                return QtCore.QByteArray(raw) if not isinstance(raw, QtCore.QByteArray) else raw
            return kind(raw)
        except (TypeError, ValueError):
            return default

    # ---- window ----
    def geometry(self) -> QtCore.QByteArray | None:
        return self._get(GEOMETRY, None, bytes)

    def window_state(self, version: int) -> QtCore.QByteArray | None:
        if self._get(LAYOUT_VERSION, -1, int) != version:
            return None
        return self._get(WINDOW_STATE, None, bytes)

    def save_window(self, geometry: QtCore.QByteArray, state: QtCore.QByteArray, version: int) -> None:
        self.store.setValue(GEOMETRY, geometry)
        self.store.setValue(WINDOW_STATE, state)
        self.store.setValue(LAYOUT_VERSION, version)

    # ---- prompt and generation ----
    def prompt_text(self) -> str:
        return self._get(PROMPT_TEXT, DEFAULT_PROMPT, str)

    def chat(self) -> bool:
        return self._get(CHAT, True, bool)

    def max_new_tokens(self) -> int:
        return max(1, self._get(MAX_NEW_TOKENS, DEFAULT_MAX_NEW_TOKENS, int))

    def model_path(self) -> str:
        return self._get(MODEL_PATH, "", str)

    def save_session(self, prompt: str, chat: bool, max_new_tokens: int) -> None:
        self.store.setValue(PROMPT_TEXT, prompt)
        self.store.setValue(CHAT, bool(chat))
        self.store.setValue(MAX_NEW_TOKENS, int(max_new_tokens))

    def save_model_path(self, path: str) -> None:
        self.store.setValue(MODEL_PATH, path)

    def threads(self) -> int | str:
        raw = str(self._get(THREADS, "auto", str))
        return int(raw) if raw.isdigit() and int(raw) >= 1 else "auto"

    def save_threads(self, setting: int | str) -> None:
        self.store.setValue(THREADS, str(setting))

    def kernels(self) -> str:
        """The kernel mode models load in: one of KERNEL_MODES (anything else stored: the default, exact)."""
        raw = str(self._get(KERNELS, DEFAULT_MODE, str))
        return raw if raw in KERNEL_MODES else DEFAULT_MODE

    def save_kernels(self, mode: str) -> None:
        self.store.setValue(KERNELS, mode)

    # ---- steering ----
    def steer(self) -> SteerSettings:
        """The Steering panel's scale, layers, pairs and method (each a default when missing or bad)."""
        d = SteerSettings()
        scale = self._get(STEER_SCALE, d.scale, float)
        method = str(self._get(STEER_METHOD, d.method, str))
        pairs = d.pairs
        try:
            raw = json.loads(str(self._get(STEER_PAIRS, "", str)) or "null")
            if isinstance(raw, list) and 0 < len(raw) <= MAX_STORED_PAIRS and all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(t, str) for t in p) for p in raw):
                pairs = tuple((p[0], p[1]) for p in raw)
        except ValueError:
            pass
        return SteerSettings(scale=scale if abs(scale) <= 1e4 else d.scale,
                             layers=str(self._get(STEER_LAYERS, d.layers, str)),
                             pairs=pairs, method=method if method in ("mean", "pca") else d.method)

    def save_steer(self, steer: SteerSettings) -> None:
        self.store.setValue(STEER_SCALE, float(steer.scale))
        self.store.setValue(STEER_LAYERS, steer.layers)
        self.store.setValue(STEER_PAIRS, json.dumps([list(p) for p in steer.pairs[:MAX_STORED_PAIRS]]))
        self.store.setValue(STEER_METHOD, steer.method)

    # ---- sampling ----
    def sampling_params(self) -> SamplingParams:
        defaults = SamplingParams()
        values = {}
        for f in fields(SamplingParams):
            if f.name == "logit_bias":
                continue
            default = getattr(defaults, f.name)
            key = SAMPLING_PREFIX + f.name
            if f.name == "seed":
                raw = self.store.value(key)
                values[f.name] = None if raw in (None, "", "none") else self._get(key, None, int)
            else:
                values[f.name] = self._get(key, default, type(default))
        try:
            return SamplingParams(**values)
        except ValueError:  # a hand-edited file with an out-of-range knob: start from the defaults
            return defaults

    def save_sampling_params(self, params: SamplingParams) -> None:
        for f in fields(SamplingParams):
            if f.name == "logit_bias":
                continue
            value = getattr(params, f.name)
            self.store.setValue(SAMPLING_PREFIX + f.name, "none" if value is None else value)

    def sync(self) -> None:
        self.store.sync()
