"""Why: experiments that say what a part of the model caused, run on the loaded model in the engine process.

Seven modes, each one engine.why experiment (engine.protocol's HeadsParams, AblateParams, PatchParams or
AtpParams, AttributeParams, CompareParams, DlaParams, GalleryParams): head roles, ablation, activation patching
(exact, attribution patching or both, by a toggle), token attribution, a comparison of two files of one model,
direct logit attribution, and the gallery of canned experiments (app.gallery picks one; its result is drawn in its
own experiment's view). Run sends one Experiment through the bridge; progress arrives as sig_why_progress and the
end as one ExperimentDone (sig_why_done): a result dict (what the CLI prints), cancelled, or a one-line failure.
The panel keeps the newest result of each kind and of each gallery experiment (sessions save them, exports write
them) and draws the one of the mode shown. Clicking a head in the head-roles heatmaps, the per-head patching grid
or the logit-attribution map asks the window to show that layer and head in the Attention panel (sig_show_head).
Nothing here imports torch.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import asdict
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6 import QtCore, QtGui, QtWidgets

from app.bridge import Bridge
from app.gallery import GalleryPicker
from app.panels.base import Panel, reserve_lines, spin_box
from app.run_store import store_for
from app.theme import (
    ACCENT,
    BACKGROUND,
    DECODE_COLOR,
    ERROR_COLOR,
    FOREGROUND,
    MUTED,
    OK_COLOR,
    PREFILL_COLOR,
    SURFACE,
    placeholder,
    set_number_cell,
    show_empty,
    style_plot,
    visible_whitespace,
)
from app.units import fmt_bytes
from engine.events import ModelInfo
from engine.model.config import ModelConfig
from engine.model.kernel_cache import KERNEL_MODES
from engine.protocol import (
    CORPUS_MAX_TOKENS,
    CORPUS_WINDOW,
    Ablated,
    AblateParams,
    AtpParams,
    AttributeParams,
    CompareParams,
    DlaParams,
    ExperimentDone,
    GalleryParams,
    GenerateRequest,
    HeadsParams,
    PatchParams,
)
from engine.why.gallery import NAMES as GALLERY_NAMES

FONT_PT = 9
MODES = (("heads", "Head roles"), ("ablate", "Ablate"), ("patch", "Patch"), ("attribute", "Attribute"),
         ("compare", "Compare"), ("dla", "Logit attribution"), ("gallery", "Gallery"))
MODE_KINDS = tuple(k for k, _ in MODES)
# The results kept, one of each kind: every mode's but the gallery's (kept per experiment), and attribution
# patching's, which the patch mode shows by its toggle
KINDS = tuple(k for k in MODE_KINDS if k != "gallery") + ("atp",)
PATCH_METHODS = (("exact", "exact"), ("AtP", "atp"), ("both", "both"))
OUTLINED = 8  # the cells where AtP and exact patching part most, outlined (engine.why.atp's TOP)
# Of those, the ones outlined: where the two differ by at least this share of the clean–corrupt difference (the
# engine lists its top cells even where every other cell agrees exactly, and an outline there would say they part)
PART = 0.05
DLA_GAP = 0.5  # between the heads' map and the MLP column (and the embeddings' cell below it), in cells
SCORES = (("previous_token", "previous token"), ("duplicate_token", "duplicate token"), ("induction", "induction"),
          ("sink", "attention sink"))
# Our own one-line reading of each score (TransformerLens's head_detector definitions); the engine's exact words, when
# a result carries them, are the label's tooltip.
DEFINITIONS = {
    "previous_token": "share of each query's attention on the token just before it (t − 1)",
    "duplicate_token": "share on the same token's earlier copy, N positions back (t − N)",
    "induction": "share on the token after that earlier copy (t − N + 1): 'A B … A → B' copying",
    "sink": "share on the first position, whatever it holds: attention parked where it changes little",
}
METHODS = (("integrated gradients", "ig"), ("gradient × input", "grad-input"), ("occlusion", "occlusion"))
HEADS_CMAP = pg.colormap.get("viridis")
DIVERGING = pg.colormap.get("CET-D1")  # blue (negative) … grey … red (positive)
DEFAULT_CLEAN, DEFAULT_CORRUPT = "The Eiffel Tower is in the city of", "The Colosseum is in the city of"
DEFAULT_ANSWER, DEFAULT_WRONG = " Paris", " Rome"
DEFAULT_PROMPT = "The capital of France is"
DEFAULT_DLA = ("The Eiffel Tower is in the city of", " Paris", " Rome")
HELP_PROMPT_TOKENS = 12  # the patching grid the model-specific help sentence prices
MAX_CELLS = 1 << 22  # a saved result larger than this (a hostile file) is not drawn


class ResultError(ValueError):
    """A result that cannot be drawn (a damaged or foreign session file): one sentence."""


def parse_heads(text: str) -> tuple[tuple[int, int], ...]:
    """"3:1, 5:2" or "3:1 5:2" → ((3, 1), (5, 2)); ValueError with one sentence on anything else."""
    out = []
    for part in filter(None, re.split(r"[,\s;]+", text.strip())):
        m = re.fullmatch(r"(\d+):(\d+)", part)
        if m is None:
            raise ValueError(f"{part!r} is not a head: write layer:head, e.g. 3:1")
        out.append((int(m.group(1)), int(m.group(2))))
    return tuple(dict.fromkeys(out))


def parse_layers(text: str) -> tuple[int, ...]:
    """"0, 4 7" → (0, 4, 7); ValueError with one sentence on anything else."""
    out = []
    for part in filter(None, re.split(r"[,\s;]+", text.strip())):
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a layer number")
        out.append(int(part))
    return tuple(dict.fromkeys(out))


def _numbers(x: Any, name: str, ndim: int) -> np.ndarray:
    """A float array of `ndim` dimensions from a result's (nested) lists, or ResultError."""
    what = "table" if ndim == 2 else "list"
    try:
        a = np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        raise ResultError(f"its {name} is not a {what} of numbers") from None
    if a.ndim != ndim or a.size > MAX_CELLS:
        raise ResultError(f"its {name} is not a {what} of numbers")
    return a


def _matrix(x: Any, name: str) -> np.ndarray:
    return _numbers(x, name, 2)


def _vector(x: Any, name: str) -> np.ndarray:
    return _numbers(x, name, 1)


def _strings(x: Any, name: str) -> list[str]:
    """Token texts: a list of pieces, {"ids": […], "pieces": […]} (attribution) or {"clean": […], "corrupt": […]}
    (patching: the corrupted prompt's, whose positions the grid's columns are)."""
    if isinstance(x, dict):
        x = x.get("pieces", x.get("corrupt"))
    if not isinstance(x, (list, tuple)) or not all(isinstance(s, str) for s in x) or len(x) > MAX_CELLS:
        raise ResultError(f"its {name} are not a list of texts")
    return list(x)


def pieces(x: Any) -> list[str]:
    """The token texts of a checked result's `tokens` (see _strings)."""
    return _strings(x, "tokens")


def check_result(kind: str, result: Any) -> None:
    """Raise ResultError (one sentence) unless `result` has what the panel draws for `kind`."""
    if not isinstance(result, dict):
        raise ResultError("it is not a result")
    if kind == "heads":
        scores = result.get("scores")
        if not isinstance(scores, dict) or not all(k in scores for k, _ in SCORES):
            raise ResultError("its scores lack one of the four head roles")
        shapes = {_matrix(scores[k], k).shape for k, _ in SCORES}
        if len(shapes) != 1:
            raise ResultError("its four score tables differ in shape")
    elif kind == "dla":
        heads = _matrix(result.get("heads"), "per-head contributions")
        if len(_vector(result.get("mlp"), "MLP contributions")) != heads.shape[0]:
            raise ResultError("its heads and its MLPs differ in layers")
        for key in ("embeddings", "logit_diff", "sum"):
            if not isinstance(result.get(key), (int, float)):
                raise ResultError(f"its {key.replace('_', ' ')} is not a number")
    elif kind == "atp":
        grid = _matrix(result.get("atp"), "AtP grid")
        if grid.shape[1] != len(_strings(result.get("tokens"), "tokens")):
            raise ResultError("its grid and its tokens differ in width")
        if result.get("restored") is not None and _matrix(result["restored"], "exact grid").shape != grid.shape:
            raise ResultError("its AtP and exact grids differ in shape")
        for key in ("atp_heads", "restored_heads"):
            if result.get(key) is not None:
                _matrix(result[key], "per-head grid")
    elif kind == "gallery":
        if result.get("name") not in GALLERY_NAMES:
            raise ResultError("it names no experiment of the gallery")
        if result.get("kind") not in ("heads", "patch", "dla") or not isinstance(result.get("params"), dict):
            raise ResultError("it does not say which experiment it ran")
        check_result(result["kind"], result.get("result"))
    elif kind == "ablate":
        for side in ("before", "after"):
            d = result.get(side)
            if not isinstance(d, dict):
                raise ResultError(f"it has no {side} distribution")
            if len(_strings(d.get("tokens"), f"{side} tokens")) != len(_vector(d.get("probs"), f"{side} probs")):
                raise ResultError(f"its {side} tokens and probabilities differ in number")
    elif kind == "patch":
        restored = _matrix(result.get("restored"), "restored grid")
        if restored.shape[1] != len(_strings(result.get("tokens"), "tokens")):
            raise ResultError("its grid and its tokens differ in width")
    elif kind == "attribute":
        if len(_vector(result.get("scores"), "scores")) != len(_strings(result.get("tokens"), "tokens")):
            raise ResultError("its scores and its tokens differ in number")
    elif kind == "compare" and result.get("mode") == "corpus":
        check_corpus_result(result)
    elif kind == "compare":
        kl = _vector(result.get("kl"), "kl")
        js = result.get("attention_js")  # per layer (one fewer than the residual points), None: not captured
        if js is not None and len(_vector(js, "attention_js")) not in (len(kl), len(kl) - 1):
            raise ResultError("its KL and attention divergence differ in length")
    else:
        raise ResultError(f"{kind!r} is not an experiment")
    if kind == "patch" and result.get("restored_heads") is not None:
        _matrix(result["restored_heads"], "per-head grid")


def mode_of(kind: str) -> str:
    """The mode that shows a result of experiment kind `kind` (attribution patching's: the patch mode)."""
    return "patch" if kind == "atp" else kind


def _piece(s: str) -> str:
    return visible_whitespace(s).replace("\n", "↵")


def blend(colour: str, weight: float, base: str = SURFACE) -> str:
    """`colour` mixed into `base` by weight in [0, 1]: an opaque colour for rich text (which has no alpha)."""
    a, b = QtGui.QColor(colour), QtGui.QColor(base)
    w = min(1.0, max(0.0, weight))
    mix = [round(w * x + (1 - w) * y) for x, y in zip(a.getRgb()[:3], b.getRgb()[:3], strict=True)]
    return QtGui.QColor(*mix).name()


def attribution_html(tokens: list[str], scores: np.ndarray) -> str:
    """The prompt's tokens, each on a background by its score: red pushes the target up, blue pushes it down, the
    strength by |score| over the largest |score|."""
    top = float(np.nanmax(np.abs(scores))) if scores.size else 0.0
    cells = []
    for piece, s in zip(tokens, scores, strict=True):
        w = abs(float(s)) / top if top > 0 and np.isfinite(s) else 0.0
        bg = blend(ERROR_COLOR if s > 0 else DECODE_COLOR, w)
        cells.append(f"<span title='{float(s):+.4g}' style='background:{bg};color:{FOREGROUND}'>"
                     f"{html.escape(_piece(piece))}</span>")
    return f"<div style='font-family:monospace;font-size:11pt;line-height:150%'>{''.join(cells)}</div>"


class WhyPanel(Panel):
    title = "Why"
    object_name = "panel_why"
    shortcut = "Ctrl+Alt+6"
    subscriptions = {"sig_why_progress": "_on_progress", "sig_why_done": "_on_done", "sig_failed": "_on_failed",
                     "sig_run_started": "_on_run_started", "sig_model_loaded": "_on_model_loaded"}
    sig_show_head = QtCore.Signal(int, int)
    """The user clicked a head in the head-roles heatmaps: (layer, head), for the Attention panel."""
    help_text = (
        "Attention weights and the logit lens show what the model computed; they do not say what caused the "
        "answer. A bright attention cell may change nothing downstream. This panel runs experiments on the loaded "
        "model that do say it, each in the engine process with progress and Cancel. Head roles: on a sequence of "
        "random tokens repeated once, each head's average attention share on a fixed position: the previous token, "
        "the earlier copy of the current token (duplicate), the token after that copy (induction: the head that "
        "lets a model continue a pattern it saw once), and the first position (a sink). Click a head to see its "
        "attention in the Attention panel. Ablate: set chosen heads, attention outputs or MLP outputs to zero (or "
        "to their mean over the prompt) and compare the next-token distribution with the untouched one (KL "
        "divergence in nats, whether the top token changed); Continue as a branch then generates from the same "
        "prompt with the same parts ablated, as a new run in the Branches panel, with the current sampling "
        "settings and max tokens. Patch: run a clean and a corrupted prompt of equal "
        "token length, then re-run the corrupted one with the clean residual stream copied in after one layer at "
        "one position; each cell is the share of the clean-minus-corrupted logit difference of the answer over the "
        "wrong token that this one copy restores (1 = all of it, 0 = none); click a cell of the per-head grid to see "
        "that head's attention in the Attention panel. Attribute: which prompt tokens drove "
        "the next token, as gradient × input, integrated gradients (the gradient averaged along a straight path "
        "from a neutral baseline input to the prompt, times the difference; the scores add up to the change in the "
        "target's log-probability between the two), or "
        "occlusion (re-run the prompt with each token masked: one forward pass per token, the way on a runtime "
        "without gradients). Compare: the same prompt through the loaded model and another file of the same "
        "model, e.g. a 4-bit and an 8-bit quantization: per layer, the KL divergence of their logit-lens "
        "distributions and the Jensen–Shannon distance of their attention rows, and the greedy steps whose top "
        "token differs. The other side on torch runs in the kernel mode chosen beside it: the loaded file itself in "
        "fast mode against the loaded model in exact mode shows what the fast kernels cost. With a corpus file, "
        "Compare judges the two over a text as llama-perplexity --kl-divergence does: windows of the text, each "
        "half context, half scored, both sides fed the same tokens; each side's perplexity, the KL divergence at "
        "every scored position (mean, median, 99th and 99.9th percentile, max), Δp (the actual next token's "
        "probability under the other side minus the loaded one's) and the share of positions with the same top "
        "token, with each position's KL and Δp drawn sorted. Patch's toggle: exact "
        "runs the grid as above; AtP (attribution patching) estimates the whole grid from one forward pass of each "
        "prompt and one backward pass, as the activation's change times the gradient of the restored share (a "
        "straight-line guess that fails where the model saturates: a softmax or a norm); both runs the two side by "
        "side, with their correlation and the cells where they part most outlined (AtP needs gradients: the torch "
        "runtime). Logit attribution: the logit difference of two tokens at a chosen step split into what each "
        "head, each MLP and the embeddings wrote into the residual stream, read off one forward pass with the final "
        "norm's scale held at this run's (the parts add up to the logit difference; the gap is shown); click a head "
        "to see its attention. Gallery: canned experiments set up for the loaded model (induction heads on repeated "
        "random tokens, an indirect-object name pair, greater-than, factual recall), each with a few words on what "
        "it shows and what to look for, drawn in its experiment's own view and kept in the session."
    )

    def model_help(self, cfg: ModelConfig, info: ModelInfo) -> str:
        n_layers, n_heads, t = cfg.n_layers, cfg.n_heads, HELP_PROMPT_TOKENS
        cells = (n_layers + 1) * t
        return (f"{info.name} has {n_layers} layers of {n_heads} query heads: the head-role scan scores "
                f"{n_layers * n_heads:,} heads from one forward pass. A patching grid over a {t}-token prompt has "
                f"({n_layers} + 1) × {t} = {cells:,} cells, each a forward pass of the corrupted prompt with one "
                f"patch, besides the clean and corrupted runs.")

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        # kind → {"kind", "params", "result", "seconds", "model"}: kept across runs and models; a session replaces them
        self.results: dict[str, dict] = {}
        self.running: int | None = None  # the request id of the experiment in progress
        self._running_kind = ""
        self._progress = (0.0, "")
        self._status = ""  # a failure or a cancellation, for the mode it happened in
        self._status_kind = ""
        self._selected_head: tuple[int, int] | None = None  # (layer, head) framed in the head-role maps
        self.gallery_results: dict[str, dict] = {}  # gallery name → an entry like results' (its kind "gallery")
        self._atp_refusal = ""  # the engine's sentence on why this runtime cannot run attribution patching
        self.branch_label: str | None = None  # the ablated branch asked for, until it starts or is refused
        self._branch_started = ""  # the last ablated branch that started, named in the summary
        self._build()
        if bridge.info is not None:
            self._on_model_loaded(bridge.info)
        self.clear()

    # ---- widgets -------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self.mode_combo = QtWidgets.QComboBox()
        for key, label in MODES:
            self.mode_combo.addItem(label, key)
        self.mode_combo.setToolTip("Which experiment to run and show")
        self.run_button = QtWidgets.QPushButton("Run")
        self.run_button.setToolTip("Run the experiment on the loaded model in the engine process")
        self.run_button.clicked.connect(lambda: self.run())
        self.cancel_button = QtWidgets.QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.progress_bar = QtWidgets.QProgressBar()
        self.progress_bar.setRange(0, 1000)
        self.progress_bar.setTextVisible(True)
        self.progress_bar.setFormat("")
        top = QtWidgets.QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.mode_combo)
        top.addWidget(self.run_button)
        top.addWidget(self.cancel_button)
        top.addWidget(self.progress_bar, 1)

        self.inputs = QtWidgets.QStackedWidget()
        self.inputs.addWidget(self._heads_inputs())
        self.inputs.addWidget(self._ablate_inputs())
        self.inputs.addWidget(self._patch_inputs())
        self.inputs.addWidget(self._attribute_inputs())
        self.inputs.addWidget(self._compare_inputs())
        self.inputs.addWidget(self._dla_inputs())
        self.gallery = GalleryPicker()
        self.gallery.sig_chosen.connect(lambda _name: self._on_mode(self.mode_combo.currentIndex()))
        self.gallery.sig_run.connect(lambda: self.run())
        self.inputs.addWidget(self.gallery)
        self.inputs.setSizePolicy(QtWidgets.QSizePolicy.Policy.Preferred, QtWidgets.QSizePolicy.Policy.Maximum)

        self.summary = QtWidgets.QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.summary.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        reserve_lines(self.summary, 3)

        self.views = QtWidgets.QStackedWidget()
        self.views.addWidget(self._heads_view())
        self.views.addWidget(self._ablate_view())
        self.views.addWidget(self._patch_view())
        self.views.addWidget(self._attribute_view())
        self.views.addWidget(self._compare_view())
        self.views.addWidget(self._dla_view())
        self.gallery_note = QtWidgets.QLabel("Pick an experiment above and Run it: its result shows here, in its own "
                                             "experiment's view.")
        self.gallery_note.setAlignment(QtCore.Qt.AlignmentFlag.AlignCenter)
        self.gallery_note.setStyleSheet(f"color: {MUTED}")
        self.views.addWidget(self.gallery_note)
        self.mode_combo.currentIndexChanged.connect(self._on_mode)
        self._on_mode(0)

        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addLayout(top)
        layout.addWidget(self.inputs)
        layout.addWidget(self.summary)
        layout.addWidget(self.views, 1)

    @staticmethod
    def _form(rows: list[tuple[str, QtWidgets.QWidget | QtWidgets.QLayout]]) -> QtWidgets.QWidget:
        w = QtWidgets.QWidget()
        form = QtWidgets.QFormLayout(w)
        form.setContentsMargins(0, 0, 0, 0)
        form.setSpacing(3)
        for label, field in rows:
            form.addRow(label, field)
        return w

    @staticmethod
    def _row(*widgets: QtWidgets.QWidget) -> QtWidgets.QHBoxLayout:
        row = QtWidgets.QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        for w in widgets:
            row.addWidget(w)
        row.addStretch(1)
        return row

    @staticmethod
    def _above(view: QtWidgets.QWidget, note: QtWidgets.QWidget) -> QtWidgets.QWidget:
        """A view taking the height, with its note (hover text, legend, definitions) in a line below it."""
        w = QtWidgets.QWidget()
        lay = QtWidgets.QVBoxLayout(w)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(view, 1)
        lay.addWidget(note)
        return w

    def _heads_inputs(self) -> QtWidgets.QWidget:
        self.repeat_spin = spin_box(2, 512, 24, "N: random tokens, then the same N again (induction needs the repeat)")
        self.seed_spin = spin_box(0, 2**31 - 1, 0, "Seed of the random tokens")
        return self._form([("random tokens", self._row(self.repeat_spin, QtWidgets.QLabel("seed"), self.seed_spin))])

    def _ablate_inputs(self) -> QtWidgets.QWidget:
        self.ablate_prompt = QtWidgets.QLineEdit(DEFAULT_PROMPT)
        self.ablate_heads = QtWidgets.QLineEdit()
        self.ablate_heads.setPlaceholderText("layer:head, e.g. 3:1, 5:0")
        self.ablate_attn = QtWidgets.QLineEdit()
        self.ablate_attn.setPlaceholderText("layers")
        self.ablate_attn.setToolTip("Layers whose whole attention output is removed")
        self.ablate_mlp = QtWidgets.QLineEdit()
        self.ablate_mlp.setPlaceholderText("layers")
        self.ablate_mlp.setToolTip("Layers whose MLP output is removed")
        self.mean_box = QtWidgets.QCheckBox("mean")
        self.mean_box.setToolTip("Replace each part's output by its mean over the prompt's positions, not by zero")
        self.ablate_chat = QtWidgets.QCheckBox("chat")
        self.diff_a, self.diff_b = QtWidgets.QLineEdit(DEFAULT_ANSWER), QtWidgets.QLineEdit(DEFAULT_WRONG)
        for e in (self.diff_a, self.diff_b):
            e.setToolTip("One token each (mind the leading space); leave empty for no logit difference")
        return self._form([("prompt", self.ablate_prompt), ("heads", self.ablate_heads),
                           ("attention", self._row(self.ablate_attn, QtWidgets.QLabel("MLP"), self.ablate_mlp,
                                                   self.mean_box, self.ablate_chat)),
                           ("logit diff of", self._row(self.diff_a, QtWidgets.QLabel("over"), self.diff_b))])

    def _patch_inputs(self) -> QtWidgets.QWidget:
        self.clean_edit = QtWidgets.QLineEdit(DEFAULT_CLEAN)
        self.corrupt_edit = QtWidgets.QLineEdit(DEFAULT_CORRUPT)
        self.corrupt_edit.setToolTip("The same number of tokens as the clean prompt")
        self.answer_edit = QtWidgets.QLineEdit(DEFAULT_ANSWER)
        self.answer_edit.setToolTip("The clean prompt's answer (its first token counts; mind the leading space)")
        self.wrong_edit = QtWidgets.QLineEdit(DEFAULT_WRONG)
        self.wrong_edit.setToolTip("The corrupted prompt's answer")
        self.patch_heads_box = QtWidgets.QCheckBox("per head too")
        self.patch_heads_box.setToolTip("Also patch each head's output (layers × heads more forward passes)")
        self.patch_method = QtWidgets.QComboBox()
        for label, key in PATCH_METHODS:
            self.patch_method.addItem(label, key)
        self.patch_method.setToolTip("exact: one patched forward pass per cell; AtP: attribution patching, the "
                                     "whole grid estimated from one backward pass (needs gradients: the torch "
                                     "runtime); both: the two side by side, where they part outlined")
        self.patch_method.currentIndexChanged.connect(self._on_patch_method)
        self.ig_steps = spin_box(0, 256, 0, "AtP's gradient averaged over this many points on the path between the "
                                 "two prompts' embeddings (EAP-IG: one forward and backward pass each); 0: taken at "
                                 "the corrupted run alone, as plain AtP")
        self.ig_label = QtWidgets.QLabel("path steps")
        self._on_patch_method()
        return self._form([("clean", self.clean_edit), ("corrupted", self.corrupt_edit),
                           ("answer", self._row(self.answer_edit, QtWidgets.QLabel("wrong"), self.wrong_edit,
                                                self.patch_heads_box, QtWidgets.QLabel("grid"),
                                                self.patch_method, self.ig_label, self.ig_steps))])

    def _on_patch_method(self, _index: int = 0) -> None:
        exact = self.patch_method.currentData() == "exact"
        self.ig_steps.setEnabled(not exact)
        self.ig_label.setEnabled(not exact)
        self.mark_dirty()

    def _attribute_inputs(self) -> QtWidgets.QWidget:
        self.attr_prompt = QtWidgets.QLineEdit(DEFAULT_PROMPT)
        self.method_combo = QtWidgets.QComboBox()
        for label, key in METHODS:
            self.method_combo.addItem(label, key)
        self.steps_spin = spin_box(2, 512, 32, "Integrated gradients: points along the path (more: closer sums)")
        self.attr_chat = QtWidgets.QCheckBox("chat")
        return self._form([("prompt", self.attr_prompt),
                           ("method", self._row(self.method_combo, QtWidgets.QLabel("steps"), self.steps_spin,
                                                self.attr_chat))])

    def _dla_inputs(self) -> QtWidgets.QWidget:
        self.dla_prompt = QtWidgets.QLineEdit(DEFAULT_DLA[0])
        self.dla_answer = QtWidgets.QLineEdit(DEFAULT_DLA[1])
        self.dla_answer.setToolTip("The token whose logit is credited, one token (mind the leading space)")
        self.dla_wrong = QtWidgets.QLineEdit(DEFAULT_DLA[2])
        self.dla_wrong.setToolTip("The token it is measured against, one token")
        self.dla_step = spin_box(0, 256, 0, "Generation step: 0 reads the prompt's last position; N reads the "
                                 "position after N greedy tokens")
        self.dla_chat = QtWidgets.QCheckBox("chat")
        return self._form([("prompt", self.dla_prompt),
                           ("logit diff of", self._row(self.dla_answer, QtWidgets.QLabel("over"), self.dla_wrong,
                                                       QtWidgets.QLabel("step"), self.dla_step, self.dla_chat))])

    def _compare_inputs(self) -> QtWidgets.QWidget:
        self.other_edit = QtWidgets.QLineEdit()
        self.other_edit.setPlaceholderText("another file of the loaded model (.gguf or a model folder)")
        browse = QtWidgets.QPushButton("…")
        browse.setToolTip("Pick the other model file")
        browse.clicked.connect(self._browse_other)
        this = QtWidgets.QPushButton("this file")
        this.setToolTip("The loaded model's own file: compare it on another runtime or in another kernel mode")
        this.clicked.connect(lambda: self.other_edit.setText(self.bridge.info.path if self.bridge.info else ""))
        self.other_backend = QtWidgets.QComboBox()
        for label, key in (("auto", "auto"), ("torch (float)", "torch"), ("llama.cpp (as stored)", "llama.cpp")):
            self.other_backend.addItem(label, key)
        self.other_backend.setToolTip("The runtime of the other side: the torch engine dequantizes the file, "
                                      "llama.cpp runs its quantized blocks as they are")
        self._loaded_kernels = ""  # the loaded model's kernel mode the other side's choice last followed
        self.other_kernels = QtWidgets.QComboBox()
        for mode in KERNEL_MODES:
            self.other_kernels.addItem(f"{mode} kernels", mode)
            self.other_kernels.setItemData(self.other_kernels.count() - 1, KERNEL_MODES[mode],
                                           QtCore.Qt.ItemDataRole.ToolTipRole)
        self.other_kernels.setCurrentIndex(self.other_kernels.findData("fast"))
        self.other_kernels.setToolTip("How the other side computes on torch (llama.cpp runs the file's blocks as "
                                      "they are, whatever this says); set to fast when the loaded model runs exact, "
                                      "so that comparing this file shows what the fast kernels cost")
        self.other_backend.currentIndexChanged.connect(
            lambda _i: self.other_kernels.setEnabled(self.other_backend.currentData() != "llama.cpp"))
        self.compare_prompt = QtWidgets.QLineEdit(DEFAULT_PROMPT)
        self.compare_steps = spin_box(1, 256, 16, "Greedy steps compared")
        self.compare_chat = QtWidgets.QCheckBox("chat")
        self.corpus_edit = QtWidgets.QLineEdit()
        self.corpus_edit.setPlaceholderText("a text file: compare over it in windows instead of the prompt")
        self.corpus_edit.setToolTip("As llama-perplexity --kl-divergence judges a quant: both sides teacher-forced "
                                    "over the text, every position's next-token distribution compared")
        corpus_browse = QtWidgets.QPushButton("…")
        corpus_browse.setToolTip("Pick the corpus text file")
        corpus_browse.clicked.connect(self._browse_corpus)
        self.corpus_window = spin_box(4, 4096, CORPUS_WINDOW, "Tokens per window; the first half of each is "
                                      "context only, the rest is scored")
        self.corpus_tokens = spin_box(4, 1 << 20, CORPUS_MAX_TOKENS, "The corpus's tokens compared at most "
                                      "(whole windows): the run's time grows with it")
        self.corpus_lens = QtWidgets.QCheckBox("per layer")
        self.corpus_lens.setToolTip("Also the KL of the two sides' logit-lens distributions at every layer, at the "
                                    "last position of each step (each costs one LM head per layer)")
        return self._form([("other model", self._row(self.other_edit, browse, this)),
                           ("runs on", self._row(self.other_backend, self.other_kernels, QtWidgets.QLabel("steps"),
                                                 self.compare_steps, self.compare_chat)),
                           ("prompt", self.compare_prompt),
                           ("or corpus", self._row(self.corpus_edit, corpus_browse, QtWidgets.QLabel("window"),
                                                   self.corpus_window, QtWidgets.QLabel("tokens"),
                                                   self.corpus_tokens, self.corpus_lens))])

    def _browse_corpus(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self, "A text to compare the two sides over", "",
                                                        "Text files (*.txt *.md *.rst);;All files (*)")
        if path:
            self.corpus_edit.setText(path)

    def _browse_other(self) -> None:
        path, _ = QtWidgets.QFileDialog.getOpenFileName(self, "Another file of the loaded model", "",
                                                        "GGUF files (*.gguf);;All files (*)")
        if path:
            self.other_edit.setText(path)

    def _heads_view(self) -> QtWidgets.QWidget:
        self.heads_plots = pg.GraphicsLayoutWidget()
        self.heads_plots.setBackground(BACKGROUND)
        self.heads_items: dict[str, pg.PlotItem] = {}
        self.heads_images: dict[str, pg.ImageItem] = {}
        self.heads_boxes: dict[str, QtWidgets.QGraphicsRectItem] = {}
        for col, (key, label) in enumerate(SCORES):
            pi = self.heads_plots.addPlot(row=0, col=col, title=label)
            style_plot(pi, left=("layer", None) if col == 0 else None, bottom=("head", None), grid=(False, False),
                       mouse=False)
            pi.titleLabel.setText(label, size=f"{FONT_PT}pt", color=FOREGROUND)
            vb = pi.getViewBox()
            vb.invertY(True)
            img = pg.ImageItem(axisOrder="row-major")
            img.setColorMap(HEADS_CMAP)
            pi.addItem(img)
            box = QtWidgets.QGraphicsRectItem(0, 0, 1, 1)
            box.setPen(pg.mkPen(ACCENT, width=2))
            box.setVisible(False)
            pi.addItem(box)
            self.heads_items[key], self.heads_images[key], self.heads_boxes[key] = pi, img, box
        self.heads_bar = pg.ColorBarItem(values=(0, 1), colorMap=HEADS_CMAP, interactive=False, width=10)
        self.heads_bar.setImageItem(list(self.heads_images.values()))
        self.heads_plots.addItem(self.heads_bar, row=0, col=len(SCORES))
        self.heads_note = placeholder(self.heads_items["previous_token"])
        self.heads_plots.scene().sigMouseClicked.connect(self._on_heads_clicked)
        self.definitions = QtWidgets.QLabel()
        self.definitions.setWordWrap(True)
        self.definitions.setTextFormat(QtCore.Qt.TextFormat.RichText)
        reserve_lines(self.definitions, len(SCORES))
        return self._above(self.heads_plots, self.definitions)

    def _ablate_view(self) -> QtWidgets.QWidget:
        w = QtWidgets.QWidget()
        outer = QtWidgets.QVBoxLayout(w)
        outer.setContentsMargins(0, 0, 0, 0)
        lay = QtWidgets.QHBoxLayout()
        outer.addLayout(lay, 1)
        self.ablate_tables: dict[str, QtWidgets.QTableWidget] = {}
        for side, label in (("before", "before"), ("after", "after the ablation")):
            box = QtWidgets.QVBoxLayout()
            title = QtWidgets.QLabel(f"<b>{label}</b>: the next token's top 5")
            table = QtWidgets.QTableWidget(5, 3)
            table.setHorizontalHeaderLabels(["token", "id", "p"])
            table.verticalHeader().setVisible(False)
            table.setEditTriggers(QtWidgets.QAbstractItemView.EditTrigger.NoEditTriggers)
            table.horizontalHeader().setSectionResizeMode(0, QtWidgets.QHeaderView.ResizeMode.Stretch)
            box.addWidget(title)
            box.addWidget(table, 1)
            lay.addLayout(box, 1)
            self.ablate_tables[side] = table
        self.branch_button = QtWidgets.QPushButton("Continue as a branch")
        self.branch_button.setToolTip("Generate from the same prompt with the same parts ablated in every step, as a "
                                      "new run (Branches panel), with the current sampling settings and max tokens")
        self.branch_button.clicked.connect(lambda: self.continue_branch())
        outer.addWidget(self.branch_button, 0, QtCore.Qt.AlignmentFlag.AlignLeft)
        return w

    def _patch_view(self) -> QtWidgets.QWidget:
        self.patch_plot = pg.GraphicsLayoutWidget()
        self.patch_plot.setBackground(BACKGROUND)
        pi = self.patch_item = self.patch_plot.addPlot(row=0, col=0)
        style_plot(pi, left=("stream after n layers", None), bottom=("position: clean token, corrupted below", None),
                   grid=(False, False))
        pi.getAxis("bottom").setHeight(48)  # two lines of tick text where the prompts differ
        pi.getViewBox().invertY(True)
        self.patch_image = pg.ImageItem(axisOrder="row-major")
        self.patch_image.setColorMap(DIVERGING)
        pi.addItem(self.patch_image)
        self.patch_note = placeholder(pi)
        hi = self.patch_heads_item = pg.PlotItem()  # in the layout only when a result has per-head patching
        style_plot(hi, left=("layer", None), bottom=("head", None), grid=(False, False))
        hi.setTitle("each head's output patched", size=f"{FONT_PT}pt", color=FOREGROUND)
        hi.getViewBox().invertY(True)
        self.patch_heads_image = pg.ImageItem(axisOrder="row-major")
        self.patch_heads_image.setColorMap(DIVERGING)
        hi.addItem(self.patch_heads_image)
        ai = self.patch_atp_item = pg.PlotItem()  # in the layout only beside an exact grid (the toggle's "both")
        style_plot(ai, left=None, bottom=("position", None), grid=(False, False))
        ai.setTitle("AtP's estimate", size=f"{FONT_PT}pt", color=FOREGROUND)
        ai.getViewBox().invertY(True)
        ai.getViewBox().setXLink(pi.getViewBox())
        ai.getViewBox().setYLink(pi.getViewBox())
        self.patch_atp_image = pg.ImageItem(axisOrder="row-major")
        self.patch_atp_image.setColorMap(DIVERGING)
        ai.addItem(self.patch_atp_image)
        self.patch_outlines: dict[str, list[QtWidgets.QGraphicsRectItem]] = {}  # the cells where AtP and exact part
        for name, item in (("main", pi), ("atp", ai)):
            rects = []
            for _ in range(OUTLINED):
                r = QtWidgets.QGraphicsRectItem(0, 0, 1, 1)
                r.setPen(pg.mkPen(ACCENT, width=2))
                r.setVisible(False)
                item.addItem(r)
                rects.append(r)
            self.patch_outlines[name] = rects
        self.patch_bar = pg.ColorBarItem(values=(-1, 1), colorMap=DIVERGING, interactive=False, width=10)
        self.patch_bar.setImageItem([self.patch_image, self.patch_heads_image, self.patch_atp_image])
        self.patch_plot.addItem(self.patch_bar, row=0, col=1)
        for item in (pi, ai):  # side by side, the stretch factors alone share the width (not the axes' sizes)
            item.setPreferredWidth(10)
        self._patch_placed: tuple[str, ...] = ()  # the grids laid out beside the main one: "atp", "heads"
        self._patch_cells: list[tuple[pg.PlotItem, str]] = []  # (plot, the result's key) of each grid drawn
        self.patch_plot.scene().sigMouseMoved.connect(self._on_patch_hover)
        self.patch_plot.scene().sigMouseClicked.connect(self._on_patch_clicked)
        self.patch_hover = QtWidgets.QLabel(" ")
        return self._above(self.patch_plot, self.patch_hover)

    def _attribute_view(self) -> QtWidgets.QWidget:
        self.attr_view = QtWidgets.QTextBrowser()
        self.attr_legend = QtWidgets.QLabel(
            f"<span style='background:{blend(ERROR_COLOR, 1)}'>&nbsp;raises&nbsp;</span> "
            f"<span style='background:{blend(DECODE_COLOR, 1)}'>&nbsp;lowers&nbsp;</span> the target's "
            "log-probability; hover a token for its score")
        return self._above(self.attr_view, self.attr_legend)

    def _dla_view(self) -> QtWidgets.QWidget:
        """One plot: the heads' map (layers × heads), each layer's MLP in a column beside it and the embeddings in a
        cell below that column, on one diverging colour scale symmetric about 0."""
        self.dla_plot = pg.GraphicsLayoutWidget()
        self.dla_plot.setBackground(BACKGROUND)
        pi = self.dla_item = self.dla_plot.addPlot(row=0, col=0)
        style_plot(pi, left=("layer", None), bottom=("head", None), grid=(False, False), mouse=False)
        pi.getViewBox().invertY(True)
        self.dla_images = {part: pg.ImageItem(axisOrder="row-major") for part in ("heads", "mlp", "embeddings")}
        for img in self.dla_images.values():
            img.setColorMap(DIVERGING)
            pi.addItem(img)
        self.dla_box = QtWidgets.QGraphicsRectItem(0, 0, 1, 1)
        self.dla_box.setPen(pg.mkPen(ACCENT, width=2))
        self.dla_box.setVisible(False)
        pi.addItem(self.dla_box)
        self.dla_bar = pg.ColorBarItem(values=(-1, 1), colorMap=DIVERGING, interactive=False, width=10)
        self.dla_bar.setImageItem(list(self.dla_images.values()))
        self.dla_plot.addItem(self.dla_bar, row=0, col=1)
        self.dla_note = placeholder(pi)
        self.dla_plot.scene().sigMouseMoved.connect(self._on_dla_hover)
        self.dla_plot.scene().sigMouseClicked.connect(self._on_dla_clicked)
        self.dla_hover = QtWidgets.QLabel(" ")
        return self._above(self.dla_plot, self.dla_hover)

    def _compare_view(self) -> QtWidgets.QWidget:
        self.compare_plot = pg.PlotWidget(background=BACKGROUND)
        pi = self.compare_plot.getPlotItem()
        style_plot(pi, left=("divergence", None), bottom=("layer", None))
        legend = pi.addLegend(offset=(-10, 10), labelTextColor=FOREGROUND, labelTextSize=f"{FONT_PT}pt")
        self.kl_curve = pi.plot([], [], pen=pg.mkPen(PREFILL_COLOR, width=2), symbol="o", symbolSize=5,
                                symbolBrush=PREFILL_COLOR, symbolPen=None, name="KL of the lens (nats)")
        self.js_curve = pi.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=2), symbol="s", symbolSize=5,
                                symbolBrush=DECODE_COLOR, symbolPen=None, name="attention JS distance (bits)")
        legend.setVisible(True)
        self.compare_note = placeholder(pi)
        self.flips_label = QtWidgets.QLabel()
        self.flips_label.setWordWrap(True)
        self.flips_label.setTextFormat(QtCore.Qt.TextFormat.RichText)
        reserve_lines(self.flips_label, 2)
        w = self._above(self.compare_plot, self.flips_label)
        self.compare_pages = QtWidgets.QStackedWidget()  # 0: one prompt, layer by layer; 1: a corpus
        self.compare_pages.addWidget(w)
        self.compare_pages.addWidget(self._corpus_view())
        return self.compare_pages

    def _corpus_view(self) -> QtWidgets.QWidget:
        """Each position's KL and Δp, sorted (the quantile curves a corpus result carries), and its statistics."""
        self.corpus_plots = pg.GraphicsLayoutWidget()
        self.corpus_plots.setBackground(BACKGROUND)
        self.corpus_kl_plot = self.corpus_plots.addPlot(row=0, col=0)
        self.corpus_dp_plot = self.corpus_plots.addPlot(row=0, col=1)
        style_plot(self.corpus_kl_plot, left=("nats", None), bottom=("positions, sorted (%)", None),
                   log=(False, True))
        style_plot(self.corpus_dp_plot, left=("%", None), bottom=("positions, sorted (%)", None))
        self.corpus_kl_plot.setTitle("KL(a ‖ b) at each position", color=FOREGROUND, size=f"{FONT_PT}pt")
        self.corpus_dp_plot.setTitle("Δp = p_b − p_a of the actual next token", color=FOREGROUND,
                                     size=f"{FONT_PT}pt")
        self.corpus_kl_curve = self.corpus_kl_plot.plot([], [], pen=pg.mkPen(PREFILL_COLOR, width=2))
        self.corpus_dp_curve = self.corpus_dp_plot.plot([], [], pen=pg.mkPen(DECODE_COLOR, width=2))
        self.corpus_dp_plot.addLine(y=0, pen=pg.mkPen(MUTED, width=1, style=QtCore.Qt.PenStyle.DashLine))
        self.corpus_lens_plot = pg.PlotItem()  # in the layout only while a result carries the lens
        style_plot(self.corpus_lens_plot, left=("nats", None), bottom=("layer", None), log=(False, True))
        self.corpus_lens_plot.setTitle("KL of the logit lens per layer", color=FOREGROUND, size=f"{FONT_PT}pt")
        self.corpus_lens_curve = self.corpus_lens_plot.plot([], [], pen=pg.mkPen(PREFILL_COLOR, width=2),
                                                            symbol="o", symbolSize=5, symbolBrush=PREFILL_COLOR,
                                                            symbolPen=None)
        self.corpus_label = QtWidgets.QLabel()
        self.corpus_label.setWordWrap(True)
        self.corpus_label.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.corpus_label.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        reserve_lines(self.corpus_label, 3)
        return self._above(self.corpus_plots, self.corpus_label)

    # ---- modes and requests --------------------------------------------------------------------------------------
    def mode(self) -> str:
        return str(self.mode_combo.currentData())

    def set_mode(self, kind: str) -> None:
        """Show the mode of a result's kind: attribution patching's is the patch mode with its toggle on AtP, or on
        both when the toggle shows exact."""
        if kind == "atp":
            if self.patch_method.currentData() == "exact":
                self.patch_method.setCurrentIndex(self.patch_method.findData("both"))
            kind = "patch"
        self.mode_combo.setCurrentIndex(MODE_KINDS.index(kind))

    def _on_mode(self, index: int) -> None:
        view = index
        if MODE_KINDS[index] == "gallery":  # the chosen experiment's result in its own experiment's view
            shown = self.gallery_results.get(self.gallery.name())
            view = MODE_KINDS.index(shown["result"]["kind"]) if shown is not None else index
        for stack, page in ((self.inputs, index), (self.views, view)):
            stack.setCurrentIndex(page)
            for i in range(stack.count()):  # a stack is as tall as its tallest page: count the shown one only
                ignored, preferred = QtWidgets.QSizePolicy.Policy.Ignored, QtWidgets.QSizePolicy.Policy.Preferred
                policy = preferred if i == page else ignored
                stack.widget(i).setSizePolicy(policy, policy)
            stack.adjustSize()
        layout = self.layout()
        if layout is not None:  # adjustSize shrank the stacks to their hints: lay them out again now, not at the
            layout.invalidate()  # next event (an export or a picture can come first)
            layout.activate()
        self.mark_dirty()

    def shown(self, view: str | None = None) -> dict | None:
        """The result entry drawn in the view of experiment kind `view` (default: the shown mode's view): the
        gallery's chosen experiment's in gallery mode; in patch mode the exact or the AtP result, by the toggle."""
        mode = self.mode()
        if mode == "gallery":
            g = self.gallery_results.get(self.gallery.name())
            if g is None or (view is not None and g["result"]["kind"] != view):
                return None
            r = g["result"]
            return {"kind": r["kind"], "params": r["params"], "result": r["result"], "seconds": g["seconds"],
                    "model": g["model"], "gallery": r}
        view = view or mode
        if view == "patch" and self.patch_method.currentData() != "exact":
            return self.results.get("atp")
        return self.results.get(view)

    def _kind_to_run(self) -> str:
        """The kind of experiment Run sends from the shown mode (the patch toggle's AtP or both: "atp")."""
        mode = self.mode()
        if mode == "patch" and self.patch_method.currentData() != "exact":
            return "atp"
        return mode

    def params(self) -> object:
        """The shown mode's request from the inputs; ValueError with one sentence when they are not usable."""
        kind, info = self.mode(), self.bridge.info
        if kind == "heads":
            return HeadsParams(repeat=self.repeat_spin.value(), seed=self.seed_spin.value())
        if kind == "ablate":
            prompt = self.ablate_prompt.text()
            heads = parse_heads(self.ablate_heads.text())
            attn, mlp = parse_layers(self.ablate_attn.text()), parse_layers(self.ablate_mlp.text())
            if not prompt.strip():
                raise ValueError("type a prompt to ablate on")
            if not (heads or attn or mlp):
                raise ValueError("name what to ablate: heads as layer:head, or attention or MLP layers")
            if info is not None:
                for layer, head in heads:
                    if layer >= info.n_layers or head >= info.n_heads:
                        raise ValueError(f"head {layer}:{head} is out of range: {info.name} has layers "
                                         f"0–{info.n_layers - 1} and heads 0–{info.n_heads - 1}")
                for layer in (*attn, *mlp):
                    if layer >= info.n_layers:
                        raise ValueError(f"layer {layer} is out of range: {info.name} has layers "
                                         f"0–{info.n_layers - 1}")
            pair = (self.diff_a.text(), self.diff_b.text())
            tokens = (self._one_token(pair[0]), self._one_token(pair[1])) if all(pair) else None
            return AblateParams(prompt=prompt, heads=heads, attn_layers=attn, mlp_layers=mlp,
                                mean=self.mean_box.isChecked(), chat=self.ablate_chat.isChecked(), tokens=tokens)
        if kind == "patch":
            fields = [e.text() for e in (self.clean_edit, self.corrupt_edit, self.answer_edit, self.wrong_edit)]
            if not all(f.strip() for f in fields):
                raise ValueError("patching needs a clean and a corrupted prompt, an answer and a wrong answer")
            method = self.patch_method.currentData()
            if method != "exact":
                return AtpParams(*fields, heads=self.patch_heads_box.isChecked(), exact=method == "both",
                                 ig_steps=self.ig_steps.value())
            return PatchParams(*fields, heads=self.patch_heads_box.isChecked())
        if kind == "dla":
            prompt, answer, wrong = (e.text() for e in (self.dla_prompt, self.dla_answer, self.dla_wrong))
            if not prompt.strip():
                raise ValueError("type a prompt to attribute the logit difference on")
            if not (answer and wrong):
                raise ValueError("name the two tokens whose logit difference is split (one token each)")
            return DlaParams(prompt, answer, wrong, step=self.dla_step.value(), chat=self.dla_chat.isChecked())
        if kind == "gallery":
            return GalleryParams(self.gallery.name())
        if kind == "attribute":
            if not self.attr_prompt.text().strip():
                raise ValueError("type a prompt to attribute")
            return AttributeParams(prompt=self.attr_prompt.text(), method=str(self.method_combo.currentData()),
                                   steps=self.steps_spin.value(), chat=self.attr_chat.isChecked())
        other = self.other_edit.text().strip()
        if not other:
            raise ValueError("choose the other file of the model to compare with")
        corpus = self.corpus_edit.text().strip()
        if corpus:
            if self.corpus_tokens.value() < self.corpus_window.value():
                raise ValueError(f"{self.corpus_tokens.value()} tokens make no whole window of "
                                 f"{self.corpus_window.value()}")
            return CompareParams(other=other, prompt=self.compare_prompt.text(), corpus=corpus,
                                 window=self.corpus_window.value(), max_tokens=self.corpus_tokens.value(),
                                 backend=str(self.other_backend.currentData()),
                                 kernels=str(self.other_kernels.currentData()), lens=self.corpus_lens.isChecked())
        if not self.compare_prompt.text().strip():
            raise ValueError("type a prompt to compare on (or choose a corpus)")
        return CompareParams(other=other, prompt=self.compare_prompt.text(), steps=self.compare_steps.value(),
                             backend=str(self.other_backend.currentData()), chat=self.compare_chat.isChecked(),
                             kernels=str(self.other_kernels.currentData()))

    def _one_token(self, text: str) -> int:
        """The loaded tokenizer's id of `text` as one token; ValueError naming its pieces otherwise."""
        tok = self.bridge.tokenizer
        if tok is None:
            raise ValueError("load a model first")
        t = tok.encode(text, add_special=False)
        if len(t.ids) != 1:
            raise ValueError(f"{text!r} is {len(t.ids)} tokens ({', '.join(map(repr, t.pieces))}), not one: a "
                             "logit difference compares two single tokens")
        return int(t.ids[0])

    def run(self) -> bool:
        """Send the shown mode's experiment to the engine; False (and a sentence) when it cannot be sent."""
        kind = self.mode()
        if self.running is not None:
            return False
        try:
            if self.bridge.info is None:
                raise ValueError("load a model first")
            params = self.params()
        except ValueError as e:
            self._status, self._status_kind = str(e), kind
            self.mark_dirty()
            return False
        self._status, self._status_kind = "", ""
        self._progress = (0.0, "starting")
        self._running_kind = kind
        self.running = self.bridge.run_experiment(params)
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.mark_dirty()
        return True

    def continue_branch(self) -> bool:
        """Generate from the shown ablation's prompt with the same parts ablated in every forward pass, as a new
        run named after them, with the current sampling settings and max tokens; False (and a sentence) when it
        cannot start now. A backend that cannot keep an ablation on (a server) refuses in the engine
        process, and its sentence shows here."""
        entry, info = self.results.get("ablate"), self.bridge.info
        try:
            if entry is None:
                raise ValueError("run an ablation first, then continue from it")
            if info is None:
                raise ValueError("load a model first")
            if entry.get("model") and entry["model"] != info.name:
                raise ValueError(f"this ablation ran on {entry['model']}: run it again on {info.name} first")
            if self.bridge.state != "idle" or self.branch_label is not None:
                raise ValueError("wait for the running generation to end")
            prompt, chat, ablated = ablation_of(entry)
        except ValueError as e:
            self._status, self._status_kind = str(e), "ablate"
            self.mark_dirty()
            return False
        gen = self._generation_panel()
        req = GenerateRequest(
            text=prompt, chat=chat, max_new_tokens=gen.max_tokens.value() if gen is not None else 64,
            params=self.bridge.params, ignore_eos=bool(gen.ignore_eos) if gen is not None else False,
            ablation=ablated, **({"capture": gen.capture_for(prompt, chat)} if gen is not None else {}))
        store = store_for(self.bridge)
        if store is not None:  # parent -1 is no run: a run of its own, named after what it runs without
            store.expect_fork(-1, 0, -1, ablated.label)
        self.branch_label = ablated.label
        self._status, self._status_kind = "", ""
        self.bridge.generate(req)
        self.mark_dirty()
        return True

    def _generation_panel(self):
        return getattr(self.window(), "panels", {}).get("generation")

    @QtCore.Slot(str)
    def _on_failed(self, message: str) -> None:
        if self.branch_label is not None:  # the engine refused the ablated generation (it starts no run)
            self.branch_label = None
            self._status, self._status_kind = f"Cannot continue as a branch: {message}", "ablate"
            self.mark_dirty()

    @QtCore.Slot(object)
    def _on_model_loaded(self, info: ModelInfo) -> None:
        """The other side's kernel mode follows the loaded model's when that changes: fast against exact (one click
        shows what the fast kernels cost), else exact (what the loaded mode costs against the model's own numbers);
        a choice the user made stands while the mode stays."""
        self._atp_refusal = ""  # another model, perhaps on another runtime: its own answer comes with its first run
        if info.kernels == self._loaded_kernels:
            return
        self._loaded_kernels = info.kernels
        self.other_kernels.setCurrentIndex(self.other_kernels.findData("fast" if info.kernels == "exact" else "exact"))

    @QtCore.Slot(object)
    def _on_run_started(self, _ev: object) -> None:
        if self.branch_label is not None:
            self._branch_started, self.branch_label = self.branch_label, None
            self.mark_dirty()

    def cancel(self) -> None:
        if self.running is not None:
            self.bridge.cancel_experiment()
            self._progress = (self._progress[0], "cancelling…")
            self.mark_dirty()

    @QtCore.Slot(float, str)
    def _on_progress(self, fraction: float, message: str) -> None:
        if self.running is not None:
            self._progress = (float(fraction), str(message))
            self.mark_dirty()

    @QtCore.Slot(object)
    def _on_done(self, done: ExperimentDone) -> None:
        if done.request_id != self.running:
            return  # an earlier panel's, or one the engine answered after the app gave up on it
        self.running = None
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        mode = mode_of(done.kind)
        if done.kind == "atp":  # the toggle says what this runtime cannot, until another model is loaded
            self._atp_refusal = done.failure if done.unsupported else ""
        if done.result is not None:
            try:
                check_result(done.kind, done.result)
            except ResultError as e:
                self._status, self._status_kind = f"the engine's {done.kind} result cannot be drawn: {e}", mode
            else:
                info = self.bridge.info
                entry = {"kind": done.kind, "params": _plain(done.params), "result": done.result,
                         "seconds": float(done.seconds), "model": info.name if info else ""}
                if done.kind == "gallery":
                    self.gallery_results[done.result["name"]] = entry
                    self._gallery_ran()
                else:
                    self.results[done.kind] = entry
                self._status, self._status_kind = "", ""
        elif done.cancelled:
            self._status = f"Cancelled after {done.seconds:.1f} s: nothing of that run is kept."
            self._status_kind = mode
        else:
            self._status, self._status_kind = done.failure or "the experiment failed", mode
        if mode == self.mode():
            self._on_mode(self.mode_combo.currentIndex())  # a gallery result shows in its experiment's view
        self.mark_dirty()

    def _gallery_ran(self) -> None:
        self.gallery.set_ran({name: f"{e['seconds']:.1f} s" + (f" on {e['model']}" if e.get("model") else "")
                              for name, e in self.gallery_results.items()})

    # ---- sessions and exports -----------------------------------------------------------------------------------
    def saved_results(self) -> list[dict]:
        """The newest result of each kind and of each gallery experiment, as plain data for a session file."""
        return ([self.results[k] for k in KINDS if k in self.results]
                + [self.gallery_results[n] for n in GALLERY_NAMES if n in self.gallery_results])

    def restore_results(self, saved: object) -> str:
        """Show the results a session holds (replacing the panel's); returns "" or one sentence on what could not
        be read (a damaged or foreign file: that part is skipped)."""
        self.results.clear()
        self.gallery_results.clear()
        self._status, self._status_kind = "", ""
        problems = []
        for entry in saved if isinstance(saved, list) else []:
            kind = entry.get("kind") if isinstance(entry, dict) else None
            try:
                if kind not in KINDS and kind != "gallery":
                    raise ResultError("it names no experiment")
                check_result(kind, entry.get("result"))
                seconds = entry.get("seconds", 0.0)
                params = entry.get("params", {})
                model = entry.get("model", "")
                kept = {"kind": kind, "params": params if isinstance(params, dict) else {},
                        "result": entry["result"],
                        "seconds": float(seconds) if isinstance(seconds, (int, float)) else 0.0,
                        "model": model if isinstance(model, str) else ""}
                if kind == "gallery":
                    self.gallery_results[entry["result"]["name"]] = kept
                else:
                    self.results[kind] = kept
            except ResultError as e:
                problems.append(f"a saved {kind if isinstance(kind, str) else 'why'} result is skipped: {e}")
        if saved is not None and not isinstance(saved, list):
            problems.append("the session's why results are not a list")
        self._gallery_ran()
        shown = next((k for k in KINDS if k in self.results), None)
        if shown is not None and self.mode() not in self.results:
            self.set_mode(shown)
        elif shown is None and self.gallery_results:  # only gallery results: the gallery, on the first of them
            self.gallery.choose(next(n for n in GALLERY_NAMES if n in self.gallery_results))
            self.set_mode("gallery")
        if problems:
            self._status, self._status_kind = "; ".join(problems), self.mode()
        self.mark_dirty()
        return "; ".join(problems)

    def export_rows(self, kind: str | None = None) -> list[dict]:
        """The shown mode's result as rows of plain values (CSV / JSON export); [] when there is none."""
        entry = self.shown() if kind is None else self.results.get(kind)
        if entry is None:
            return []
        kind, r = entry["kind"], entry["result"]
        if kind == "dla":
            m = np.asarray(r["heads"], dtype=float)
            rows = [{"component": f"L{layer}H{head}", "layer": layer, "head": head,
                     "contribution": float(m[layer, head])}
                    for layer in range(m.shape[0]) for head in range(m.shape[1])]
            rows += [{"component": f"MLP{layer}", "layer": layer, "head": "", "contribution": float(v)}
                     for layer, v in enumerate(r["mlp"])]
            return [*rows, {"component": "embeddings", "layer": "", "head": "", "contribution": float(r["embeddings"])}]
        if kind == "atp":
            a, texts = np.asarray(r["atp"], dtype=float), pieces(r["tokens"])
            e = np.asarray(r["restored"], dtype=float) if r.get("restored") is not None else None
            return [{"layer": layer, "position": pos, "token": texts[pos], "atp": float(a[layer, pos]),
                     **({"exact": float(e[layer, pos])} if e is not None else {})}
                    for layer in range(a.shape[0]) for pos in range(a.shape[1])]
        if kind == "heads":
            rows = []
            for key, _ in SCORES:
                m = np.asarray(r["scores"][key], dtype=float)
                rows += [{"score": key, "layer": layer, "head": head, "value": float(m[layer, head])}
                         for layer in range(m.shape[0]) for head in range(m.shape[1])]
            return rows
        if kind == "ablate":
            return [{"distribution": side, "rank": i + 1, "token_id": int(ids[i]) if i < len(ids) else -1,
                     "token": r[side]["tokens"][i], "p": float(r[side]["probs"][i])}
                    for side in ("before", "after") for ids in [list(r[side].get("ids", []))]
                    for i in range(len(r[side]["tokens"]))]
        if kind == "patch":
            m, texts = np.asarray(r["restored"], dtype=float), pieces(r["tokens"])
            return [{"layer": layer, "position": pos, "token": texts[pos], "restored": float(m[layer, pos])}
                    for layer in range(m.shape[0]) for pos in range(m.shape[1])]
        if kind == "attribute":
            return [{"position": i, "token": t, "score": float(s), "method": r.get("method", ""),
                     "target": target_piece(r)} for i, (t, s) in enumerate(zip(pieces(r["tokens"]), r["scores"],
                                                                                    strict=True))]
        if r.get("mode") == "corpus":
            return corpus_rows(r)
        kl, js = compare_curves(r)
        names = r.get("layers") if isinstance(r.get("layers"), list) and len(r["layers"]) == len(kl) else None
        return [{"point": str(names[i]) if names else i, "kl_nats": float(kl[i]), "attention_js_bits": float(js[i])}
                for i in range(len(kl))]

    # ---- clicks --------------------------------------------------------------------------------------------------
    def head_at(self, scene_pos: QtCore.QPointF) -> tuple[str, int, int] | None:
        """(score, layer, head) of the heatmap cell under a scene position, or None."""
        entry = self.shown("heads")
        if entry is None:
            return None
        for key, pi in self.heads_items.items():
            vb = pi.getViewBox()
            if not vb.sceneBoundingRect().contains(scene_pos):
                continue
            p = vb.mapSceneToView(scene_pos)
            layer, head = int(math.floor(p.y())), int(math.floor(p.x()))
            shape = np.shape(entry["result"]["scores"][key])
            if 0 <= layer < shape[0] and 0 <= head < shape[1]:
                return key, layer, head
        return None

    def _on_heads_clicked(self, event) -> None:
        if event.button() != QtCore.Qt.MouseButton.LeftButton:
            return
        hit = self.head_at(event.scenePos())
        if hit is not None:
            self.select_head(hit[1], hit[2])

    def select_head(self, layer: int, head: int) -> None:
        """Frame this head in every heatmap and ask for it in the Attention panel."""
        self._selected_head = (int(layer), int(head))
        self.mark_dirty()
        self.sig_show_head.emit(int(layer), int(head))

    def patch_cell_at(self, scene_pos: QtCore.QPointF) -> tuple[str, int, int] | None:
        """(the result's key, row, column) of the patching cell under a scene point, or None: ("restored" or "atp",
        stream row, position) or ("restored_heads" or "atp_heads", layer, head)."""
        entry = self.shown("patch")
        if entry is None:
            return None
        r = entry["result"]
        for item, key in self._patch_cells:
            vb = item.getViewBox()
            if r.get(key) is None or item.scene() is None or not vb.sceneBoundingRect().contains(scene_pos):
                continue
            p = vb.mapSceneToView(scene_pos)
            row, col = int(math.floor(p.y())), int(math.floor(p.x()))
            shape = np.shape(r[key])
            if len(shape) == 2 and 0 <= row < shape[0] and 0 <= col < shape[1]:
                return key, row, col
        return None

    def _on_patch_hover(self, pos: QtCore.QPointF) -> None:
        hit = self.patch_cell_at(pos)
        if hit is None:
            return
        key, row, col = hit
        r = self.shown("patch")["result"]
        value = float(np.asarray(r[key], dtype=float)[row, col])
        heads = key.endswith("_heads")
        where = (f"head {row}:{col}'s output (click: its attention)" if heads else
                 f"the stream after {row} layer{'s' if row != 1 else ''}, position {col} ({patch_labels(r)[col]})")
        what = "AtP estimates" if key.startswith("atp") else "exact patching restores"
        other = {"atp": "restored", "restored": "atp", "atp_heads": "restored_heads",
                 "restored_heads": "atp_heads"}[key]
        beside = ""
        if r.get(other) is not None and np.shape(r[other]) == np.shape(r[key]):
            v = float(np.asarray(r[other], dtype=float)[row, col])
            beside = f" (exact {v:+.3f})" if key.startswith("atp") else f" (AtP {v:+.3f})"
        self.patch_hover.setText(f"{where}: {what} {value:+.3f} of the logit difference{beside}")

    def _on_patch_clicked(self, event) -> None:
        if event.button() != QtCore.Qt.MouseButton.LeftButton:
            return
        hit = self.patch_cell_at(event.scenePos())
        if hit is not None and hit[0].endswith("_heads"):  # a head's cell: its attention in the Attention panel
            self.select_head(hit[1], hit[2])

    def dla_cell_at(self, scene_pos: QtCore.QPointF) -> tuple[str, int, int] | None:
        """("head", layer, head), ("mlp", layer, -1) or ("embeddings", -1, -1) under a scene point in the logit
        attribution map, or None."""
        entry = self.shown("dla")
        vb = self.dla_item.getViewBox()
        if entry is None or not vb.sceneBoundingRect().contains(scene_pos):
            return None
        L, H = np.shape(entry["result"]["heads"])
        p = vb.mapSceneToView(scene_pos)
        x, y = p.x(), p.y()
        if 0 <= x < H and 0 <= y < L:
            return "head", int(math.floor(y)), int(math.floor(x))
        if H + DLA_GAP <= x < H + DLA_GAP + 1:
            if 0 <= y < L:
                return "mlp", int(math.floor(y)), -1
            if L + DLA_GAP <= y < L + DLA_GAP + 1:
                return "embeddings", -1, -1
        return None

    def _on_dla_hover(self, pos: QtCore.QPointF) -> None:
        hit = self.dla_cell_at(pos)
        if hit is None:
            return
        part, layer, head = hit
        r = self.shown("dla")["result"]
        if part == "head":
            value, where = float(r["heads"][layer][head]), f"head {layer}:{head} (click: its attention)"
        elif part == "mlp":
            value, where = float(r["mlp"][layer]), f"layer {layer}'s MLP"
        else:
            value, where = float(r["embeddings"]), "the embeddings"
        share = f", {value / r['sum']:.0%} of the sum" if r["sum"] else ""
        self.dla_hover.setText(f"{where}: {value:+.4f} to the logit difference{share}")

    def _on_dla_clicked(self, event) -> None:
        if event.button() != QtCore.Qt.MouseButton.LeftButton:
            return
        hit = self.dla_cell_at(event.scenePos())
        if hit is not None and hit[0] == "head":
            self.select_head(hit[1], hit[2])

    # ---- drawing -------------------------------------------------------------------------------------------------
    def summary_html(self) -> str:
        kind = self.mode()
        parts = []
        if self.running is not None:
            what = dict(MODES)[self._running_kind]
            parts.append(f"<span style='color:{MUTED}'>{html.escape(what)} running: "
                         f"{html.escape(self._progress[1])}</span>")
        if self._status and self._status_kind == kind:
            parts.append(f"<span style='color:{ERROR_COLOR}'>{html.escape(self._status)}</span>")
        if kind == "patch" and self._kind_to_run() == "atp" and self._atp_refusal and self._atp_refusal != (
                self._status if self._status_kind == kind else ""):
            parts.append(f"<span style='color:{ERROR_COLOR}'>{html.escape(self._atp_refusal)}</span>")
        entry = self.shown()
        if entry is None:
            if not parts:
                what = (f"“{self.gallery.entry().title}”" if kind == "gallery" else
                        "attribution patching" if self._kind_to_run() == "atp" else dict(MODES)[kind].lower())
                parts.append(f"<span style='color:{MUTED}'>Run {html.escape(what)} to see what it shows.</span>")
            return "<br>".join(parts)
        parts.append(self._result_line(entry["kind"], entry))
        if kind == "ablate" and self._branch_started:
            parts.append(f"<span style='color:{MUTED}'>Continued as the run “{html.escape(self._branch_started)}” "
                         "(Branches panel).</span>")
        return "<br>".join(parts)

    def _result_line(self, kind: str, entry: dict) -> str:
        r = entry["result"]
        took = f"{entry['seconds']:.1f} s" + (f" on {entry['model']}" if entry.get("model") else "")
        if kind == "heads":
            best = []
            for key, label in SCORES:
                m = np.asarray(r["scores"][key], dtype=float)
                if m.size and np.isfinite(m).any():
                    layer, head = np.unravel_index(int(np.nanargmax(m)), m.shape)
                    best.append(f"{label} <b>{layer}:{head}</b> ({m[layer, head]:.2f})")
            n = r.get("repeat", entry["params"].get("repeat", "?"))
            line = f"Strongest heads (layer:head) on {n} random tokens repeated once, {took}: " + " · ".join(best)
            ab = r.get("ablation")  # the gallery's induction run switches its top induction heads off
            if isinstance(ab, dict) and all(isinstance(ab.get(k), (int, float)) for k in ("loss", "loss_ablated",
                                                                                           "loss_control")):
                heads = ", ".join(f"{h.get('layer')}:{h.get('head')}" for h in ab.get("heads", [])
                                  if isinstance(h, dict))
                line += (f"<br>Second copy's loss {ab['loss']:.3f} nats; with the induction heads {html.escape(heads)}"
                         f" off <b>{ab['loss_ablated']:.3f}</b>; with as many other heads off "
                         f"{ab['loss_control']:.3f}")
            return line
        if kind == "dla":
            pair = f"{_piece(r['answer']['token'])!r} − {_piece(r['wrong']['token'])!r}"
            at = f"step {r.get('step', 0)}" + (f" (after {_piece(''.join(r['generated']))!r})"
                                               if r.get("generated") else "")
            top = ", ".join(f"{c['component']} {c['contribution']:+.2f}" for c in r.get("top", [])[:4])
            return html.escape(f"logit difference {pair} at {at}: {r['logit_diff']:+.3f}; the parts sum to "
                               f"{r['sum']:+.3f} (frozen-norm error {r['logit_diff'] - r['sum']:+.1e}); embeddings "
                               f"{r['embeddings']:+.2f}; largest: {top} · {took}", quote=False)
        if kind == "atp":
            def esc(text: str) -> str:
                return html.escape(text, quote=False)

            k = r.get("ig_steps") if isinstance(r.get("ig_steps"), int) else 0
            how = (f"AtP along the path, {k} steps ({2 + k} forwards, {k} backwards)" if k else
                   "AtP (2 forwards, 1 backward)")
            parts = [esc(f"{how} for {_piece(r['answer']['token'])!r} over {_piece(r['wrong']['token'])!r}")]
            if r.get("restored") is None:
                m = np.asarray(r["atp"], dtype=float)
                if m.size and np.isfinite(m).any():
                    layer, pos = np.unravel_index(int(np.nanargmax(m)), m.shape)
                    parts.append(esc(f"largest estimate {m[layer, pos]:+.2f} after {layer} layers at position {pos} "
                                     f"({patch_labels(r)[pos]})"))
                parts.append("no exact grid: set the toggle to both to see where AtP parts from it")
            else:
                pr, pc = r.get("pearson"), r.get("pearson_changed")
                parts.append(f"Pearson r with the exact grid <b>{'n/a' if pr is None else f'{pr:.3f}'}</b> over "
                             f"every cell, {'n/a' if pc is None else f'{pc:.3f}'} over the "
                             f"{esc(str(r.get('changed_cells', '?')))} whose activations differ")
                if isinstance(r.get("pearson_heads"), (int, float)):
                    parts.append(f"per head {r['pearson_heads']:.3f}")
                far = r.get("disagree") or []
                if far:
                    d = far[0]
                    apart = sum(isinstance(c.get("difference"), (int, float)) and abs(c["difference"]) >= PART
                                for c in far[:OUTLINED] if isinstance(c, dict))
                    parts.append(esc(f"most apart: after {d['layer']} layers at {_piece(d['token'])!r}, AtP "
                                     f"{d['atp']:+.2f} against exact {d['exact']:+.2f} (outlined: the {apart} "
                                     f"cells most apart, by {PART} or more)"))
            return " · ".join([*parts, esc(took)])
        if kind == "ablate":
            b, a = r["before"], r["after"]
            parts = []
            if isinstance(r.get("kl"), (int, float)):
                parts.append(f"KL(before ‖ after) <b>{float(r['kl']):.4g}</b> nats")
            if b["tokens"] and a["tokens"]:
                change = (f"<span style='color:{ERROR_COLOR}'>changed</span>" if r.get("top1_changed") else
                          "unchanged")
                parts.append(f"top-1 {html.escape(repr(_piece(b['tokens'][0])), quote=False)} → "
                             f"{html.escape(repr(_piece(a['tokens'][0])), quote=False)} ({change})")
            d = r.get("logit_diff")
            if isinstance(d, dict) and isinstance(d.get("pieces"), list) and len(d["pieces"]) == 2 and all(
                    isinstance(d.get(k), (int, float)) for k in ("before", "after")):
                a, b = (html.escape(repr(_piece(str(p))), quote=False) for p in d["pieces"])
                parts.append(f"logit {a} − {b}: {d['before']:+.3f} → <b>{d['after']:+.3f}</b>")
            return " · ".join([*parts, took])
        if kind == "patch":
            m = np.asarray(r["restored"], dtype=float)
            extra = [f"{k.replace('_', ' ')} {v:.4g}" for k, v in r.items() if isinstance(v, float)]
            best = ""
            if m.size and np.isfinite(m).any():
                layer, pos = np.unravel_index(int(np.nanargmax(m)), m.shape)
                best = (f"largest restore {m[layer, pos]:+.2f}: the stream after {layer} layers at position {pos} "
                        f"({patch_labels(r)[pos]})")
            return html.escape(" · ".join([s for s in [best, *extra, took] if s]), quote=False)
        if kind == "attribute":
            scores = np.asarray(r["scores"], dtype=float)
            label = dict((v, k) for k, v in METHODS).get(str(r.get("method")), str(r.get("method", "")))
            top = int(np.nanargmax(np.abs(scores))) if scores.size and np.isfinite(scores).any() else None
            most = (f" · most: {_piece(pieces(r['tokens'])[top])!r} ({scores[top]:+.3g})" if top is not None else "")
            target = _piece(target_piece(r))
            gap = r.get("completeness", {}).get("gap") if isinstance(r.get("completeness"), dict) else None
            if isinstance(gap, (int, float)):
                most += f" · completeness gap {gap:+.2g}"
            return html.escape(f"{label} for the next token {target!r}, sum {np.nansum(scores):+.4g}{most} · {took}",
                               quote=False)
        if r.get("mode") == "corpus":
            return corpus_summary(r, took)
        kl, _js = compare_curves(r)
        worst = (f"largest KL {np.nanmax(kl):.3g} nats at {point_name(r, int(np.nanargmax(kl)))}"
                 if kl.size and np.isfinite(kl).any() else "")
        flips = _flip_steps(r.get("top1_flips"))
        steps = r.get("steps", entry["params"].get("steps", "?"))
        sides = []
        labels, nbytes, tpot = r.get("labels"), r.get("bytes_per_token"), r.get("tpot_s")
        for i, side in enumerate("ab"):
            name = labels[i] if isinstance(labels, list) and len(labels) == 2 else side
            text = f"{side}: {name}"
            if isinstance(nbytes, list) and len(nbytes) == 2 and isinstance(nbytes[i], (int, float)):
                text += f", {fmt_bytes(nbytes[i])} of weights per token"
            if isinstance(tpot, list) and len(tpot) == 2 and isinstance(tpot[i], (int, float)):
                text += f", TPOT {1e3 * tpot[i]:.1f} ms"
            sides.append(html.escape(text, quote=False))
        line = " · ".join(s for s in [worst, f"top-1 differs at {len(flips)} of {steps} steps", took] if s)
        return "<br>".join([*sides, html.escape(line, quote=False)])

    def draw(self) -> None:
        running = self.running is not None
        self.progress_bar.setValue(int(1000 * self._progress[0]) if running else 0)
        self.progress_bar.setFormat(f"{100 * self._progress[0]:.0f}%" if running else "")
        self.summary.setText(self.summary_html())
        entry = self.shown()
        view = entry["kind"] if entry is not None else self.mode()
        view = "patch" if view == "atp" else view
        if view != "gallery":  # the gallery without a result shows its note
            getattr(self, f"_draw_{view}")(entry)

    def _draw_heads(self, entry: dict | None) -> None:
        defs = entry["result"].get("definitions") if entry is not None else None
        lines, exact = [], []
        for key, label in SCORES:
            lines.append(f"<b>{html.escape(label)}</b>: {html.escape(DEFINITIONS[key])}")
            if isinstance(defs, dict) and isinstance(defs.get(key), str):  # the engine's exact words, on hover
                exact.append(f"{label}: {defs[key]}")
        self.definitions.setText("<br>".join(lines))
        self.definitions.setToolTip("\n".join(exact))
        sel = self._selected_head
        for key, _label in SCORES:
            img, pi, box = self.heads_images[key], self.heads_items[key], self.heads_boxes[key]
            if entry is None:
                img.clear()
                box.setVisible(False)
                pi.getAxis("bottom").setTicks(None)
                continue
            m = np.asarray(entry["result"]["scores"][key], dtype=float)
            img.setImage(np.nan_to_num(m), levels=(0.0, 1.0), autoLevels=False)
            pi.getViewBox().setRange(xRange=(0, m.shape[1]), yRange=(0, m.shape[0]), padding=0)
            hstep = max(1, m.shape[1] // 6)  # whole heads under their columns (a 4-head model showed 0.5, 1, 1.5)
            pi.getAxis("bottom").setTicks([[(h + 0.5, str(h)) for h in range(0, m.shape[1], hstep)]])
            if sel is not None and sel[0] < m.shape[0] and sel[1] < m.shape[1]:
                box.setRect(sel[1], sel[0], 1, 1)
                box.setVisible(True)
            else:
                box.setVisible(False)
        if entry is None:
            show_empty(self.heads_items["previous_token"], self.heads_note,
                       "Run to score every head\n(layers × heads)", (0, 4), (0, 8))
        else:
            self.heads_note.setVisible(False)

    def _draw_ablate(self, entry: dict | None) -> None:
        self.branch_button.setEnabled(entry is not None and self.branch_label is None)
        for side, table in self.ablate_tables.items():
            d = entry["result"][side] if entry is not None else {"tokens": [], "probs": [], "ids": []}
            tokens, probs, ids = d["tokens"], d["probs"], list(d.get("ids", []))
            table.setRowCount(len(tokens))
            top = entry["result"]["before"]["tokens"][0] if entry is not None and entry["result"]["before"][
                "tokens"] else None
            for i, t in enumerate(tokens):
                item = table.item(i, 0)
                if item is None:  # setItem on an item the table already holds only warns
                    item = QtWidgets.QTableWidgetItem()
                    table.setItem(i, 0, item)
                item.setText(_piece(t))
                item.setForeground(QtGui.QColor(ACCENT if t == top else FOREGROUND))
                set_number_cell(table, i, 1, str(ids[i]) if i < len(ids) else "")
                set_number_cell(table, i, 2, f"{float(probs[i]):.4f}")

    def _draw_patch(self, entry: dict | None) -> None:
        """The exact grid, AtP's (by the toggle), or both side by side with the cells where they part outlined; a
        result's per-head grid beside it (not in both)."""
        pi, hi, ai = self.patch_item, self.patch_heads_item, self.patch_atp_item
        r = entry["result"] if entry is not None else {}
        atp = entry is not None and entry["kind"] == "atp"
        both = atp and self.patch_method.currentData() == "both" and r.get("restored") is not None
        main_key = "atp" if atp and not both else "restored"
        heads_key = None if both else ("atp_heads" if atp else "restored_heads")
        if heads_key is not None and r.get(heads_key) is None:
            heads_key = None
        placed = (("atp",) if both else ()) + (("heads",) if heads_key else ())
        if placed != self._patch_placed:
            items = {"atp": ai, "heads": hi}
            for name in self._patch_placed:
                self.patch_plot.removeItem(items[name])
            self.patch_plot.removeItem(self.patch_bar)
            for col, name in enumerate(placed, start=1):
                self.patch_plot.addItem(items[name], row=0, col=col)
            self.patch_plot.addItem(self.patch_bar, row=0, col=len(placed) + 1)
            layout = self.patch_plot.ci.layout
            stretch = {0: 3 if "heads" in placed else 1, **{c: 1 for c in range(1, len(placed) + 1)}}
            for col in range(4):
                layout.setColumnStretchFactor(col, stretch.get(col, 0))
            layout.invalidate()  # now, not at the next event: a picture taken at once shows the new columns
            layout.activate()
            self._patch_placed = placed
        self._patch_cells = ([(pi, main_key)] + ([(ai, "atp")] if both else [])
                             + ([(hi, heads_key)] if heads_key else []))
        pi.setTitle(("exact patching" if both else "AtP's estimate") if atp else None, size=f"{FONT_PT}pt",
                    color=FOREGROUND)
        hi.setTitle("AtP's estimate per head" if atp else "each head's output patched", size=f"{FONT_PT}pt",
                    color=FOREGROUND)
        if heads_key is not None:
            h = np.asarray(r[heads_key], dtype=float)
            self.patch_heads_image.setImage(np.nan_to_num(h), levels=(-1.0, 1.0), autoLevels=False)
            hi.getViewBox().setRange(xRange=(0, h.shape[1]), yRange=(0, h.shape[0]), padding=0)
            hstep, lstep = max(1, h.shape[1] // 12), max(1, h.shape[0] // 8)  # whole heads and layers, centred
            hi.getAxis("bottom").setTicks([[(j + 0.5, str(j)) for j in range(0, h.shape[1], hstep)]])
            hi.getAxis("left").setTicks([[(j + 0.5, str(j)) for j in range(0, h.shape[0], lstep)]])
        else:
            self.patch_heads_image.clear()
        far = [d for d in (r.get("disagree") if both and isinstance(r.get("disagree"), list) else [])
               if isinstance(d, dict) and isinstance(d.get("difference"), (int, float))
               and abs(d["difference"]) >= PART]
        for name in ("main", "atp"):
            for i, rect in enumerate(self.patch_outlines[name]):
                d = far[i] if i < len(far) else None
                if d is not None:
                    rect.setRect(float(d.get("position", 0)), float(d.get("layer", 0)), 1, 1)
                rect.setVisible(d is not None)
        if entry is None:
            self.patch_image.clear()
            pi.getAxis("bottom").setTicks(None)
            pi.getAxis("left").setTicks(None)
            show_empty(pi, self.patch_note, "Patch to see how much of the clean answer\neach layer and position "
                       "restores", (0, 12), (0, 8))
            return
        self.patch_note.setVisible(False)
        m = np.asarray(r[main_key], dtype=float)
        self.patch_image.setImage(np.nan_to_num(m), levels=(-1.0, 1.0), autoLevels=False)
        pi.getViewBox().setRange(xRange=(0, m.shape[1]), yRange=(0, m.shape[0]), padding=0)
        ticks = [[(i + 0.5, t) for i, t in enumerate(patch_labels(r, "\n"))]]
        pi.getAxis("bottom").setTicks(ticks)
        step = max(1, m.shape[0] // 8)
        rows = [[(j + 0.5, str(j)) for j in range(0, m.shape[0], step)]]
        pi.getAxis("left").setTicks(rows)
        if both:
            self.patch_atp_image.setImage(np.nan_to_num(np.asarray(r["atp"], dtype=float)), levels=(-1.0, 1.0),
                                          autoLevels=False)
            ai.getAxis("bottom").setTicks(ticks)
            ai.getAxis("left").setTicks(rows)
        else:
            self.patch_atp_image.clear()

    def _draw_dla(self, entry: dict | None) -> None:
        pi = self.dla_item
        if entry is None:
            for img in self.dla_images.values():
                img.clear()
            self.dla_box.setVisible(False)
            pi.getAxis("bottom").setTicks(None)
            pi.getAxis("left").setTicks(None)
            show_empty(pi, self.dla_note, "Run to split the logit difference of two tokens\ninto what each head, "
                       "MLP and the embeddings wrote", (0, 10), (0, 8))
            return
        self.dla_note.setVisible(False)
        r = entry["result"]
        heads = np.asarray(r["heads"], dtype=float)
        mlp = np.asarray(r["mlp"], dtype=float)[:, None]
        emb = np.array([[float(r["embeddings"])]])
        L, H = heads.shape
        top = float(np.nanmax(np.abs(np.concatenate([heads.ravel(), mlp.ravel(), emb.ravel()]))))
        top = top if np.isfinite(top) and top > 0 else 1.0
        for part, values, rect in (("heads", heads, (0, 0, H, L)), ("mlp", mlp, (H + DLA_GAP, 0, 1, L)),
                                   ("embeddings", emb, (H + DLA_GAP, L + DLA_GAP, 1, 1))):
            img = self.dla_images[part]
            img.setImage(np.nan_to_num(values), levels=(-top, top), autoLevels=False)
            img.setRect(QtCore.QRectF(*rect))
        self.dla_bar.setLevels((-top, top))
        pi.getViewBox().setRange(xRange=(0, H + DLA_GAP + 1), yRange=(0, L + DLA_GAP + 1), padding=0)
        hstep = max(1, H // 12)
        pi.getAxis("bottom").setTicks([[(h + 0.5, str(h)) for h in range(0, H, hstep)] + [(H + DLA_GAP + 0.5, "MLP")]])
        step = max(1, L // 10)
        pi.getAxis("left").setTicks([[(j + 0.5, str(j)) for j in range(0, L, step)] + [(L + DLA_GAP + 0.5, "emb")]])
        sel = self._selected_head
        if sel is not None and sel[0] < L and sel[1] < H:
            self.dla_box.setRect(sel[1], sel[0], 1, 1)
            self.dla_box.setVisible(True)
        else:
            self.dla_box.setVisible(False)

    def _draw_attribute(self, entry: dict | None) -> None:
        if entry is None:
            self.attr_view.setHtml(f"<span style='color:{MUTED}'>Attribute to colour the prompt's tokens by how much "
                                   "each drove the next token.</span>")
            return
        r = entry["result"]
        self.attr_view.setHtml(attribution_html(pieces(r["tokens"]), np.asarray(r["scores"], dtype=float)))

    def _draw_compare(self, entry: dict | None) -> None:
        corpus = entry is not None and entry["result"].get("mode") == "corpus"
        self.compare_pages.setCurrentIndex(1 if corpus else 0)
        if corpus:
            self._draw_corpus(entry["result"])
            return
        pi = self.compare_plot.getPlotItem()
        if entry is None:
            self.kl_curve.setData([], [])
            self.js_curve.setData([], [])
            self.flips_label.setText("")
            show_empty(pi, self.compare_note, "Compare two files of one model:\nper layer, how far they part",
                       (0, 30), (0, 1))
            return
        self.compare_note.setVisible(False)
        r = entry["result"]
        kl, js = compare_curves(r)
        x = np.arange(len(kl), dtype=float)
        self.kl_curve.setData(x, kl)
        finite = np.isfinite(js)
        self.js_curve.setData(x[finite], js[finite])
        step = max(1, len(kl) // 10)
        pi.getAxis("bottom").setTicks([[(i, "emb" if i == 0 else str(i)) for i in range(0, len(kl), step)]])
        both = np.concatenate([kl, js])
        top = float(np.nanmax(both)) if np.isfinite(both).any() else 1.0
        pi.getViewBox().setRange(xRange=(-0.5, max(len(kl) - 0.5, 0.5)), yRange=(0, max(top * 1.1, 1e-6)),
                                 padding=0)
        listed = _flip_text(r.get("top1_flips"))
        self.flips_label.setText(f"<b>top-1 flips</b>: {html.escape(listed)}" if listed else
                                 f"<span style='color:{OK_COLOR}'>no step's greedy token differs</span>")

    def _draw_corpus(self, r: dict) -> None:
        kl, dp = (np.asarray(r[k], dtype=float) for k in ("kl_quantiles", "delta_p_quantiles"))
        x = np.linspace(0.0, 100.0, len(kl))
        positive = kl > 0  # the log scale has no place for a position where the two agree exactly
        self.corpus_kl_curve.setData(x[positive], kl[positive])
        self.corpus_dp_curve.setData(x, 100 * dp)
        lens = corpus_lens(r)
        shown = self.corpus_lens_plot.scene() is not None
        if lens is not None and not shown:
            self.corpus_plots.addItem(self.corpus_lens_plot, row=0, col=2)
        elif lens is None and shown:
            self.corpus_plots.removeItem(self.corpus_lens_plot)
        if lens is not None:
            positive = lens > 0
            self.corpus_lens_curve.setData(np.arange(len(lens), dtype=float)[positive], lens[positive])
        for plot in (self.corpus_kl_plot, self.corpus_dp_plot, self.corpus_lens_plot):
            plot.enableAutoRange()
        self.corpus_label.setText(corpus_stats_html(r))


CORPUS_NUMBERS = ("ppl", "kl_stats", "delta_p", "same_top", "kl_quantiles", "delta_p_quantiles")


def check_corpus_result(r: dict) -> None:
    """ResultError unless a corpus comparison has its statistics (engine.why.compare.compare_corpus)."""
    missing = [k for k in CORPUS_NUMBERS if k not in r]
    if missing:
        raise ResultError(f"its corpus comparison lacks {', '.join(missing)}")
    if len(_vector(r["ppl"], "perplexities")) != 2:
        raise ResultError("it does not have one perplexity per side")
    if len(_vector(r["kl_quantiles"], "KL quantiles")) != len(_vector(r["delta_p_quantiles"], "Δp quantiles")):
        raise ResultError("its KL and Δp quantiles differ in number")
    for key in ("kl_stats", "delta_p"):
        d = r[key]
        if not isinstance(d, dict) or not all(v is None or isinstance(v, (int, float)) for v in d.values()):
            raise ResultError(f"its {key} is not a table of numbers")
    if not isinstance(r["same_top"], (int, float)):
        raise ResultError("its same-top share is not a number")


def corpus_lens(r: dict) -> np.ndarray | None:
    """A corpus comparison's lens KL per residual point (0: the embeddings), or None when it has none."""
    lens = r.get("lens")
    if not isinstance(lens, dict):
        return None
    try:
        return _vector(lens.get("kl"), "lens KL")
    except ResultError:
        return None


def _stat(d: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    v = d.get(key)
    return format(scale * v, fmt) if isinstance(v, (int, float)) else "?"


def corpus_stats_html(r: dict) -> str:
    """A corpus comparison's statistics, llama-perplexity's in its order: perplexities, KL, Δp, same top."""
    kl, dp = r["kl_stats"], r["delta_p"]
    se = f" ± {_stat(kl, 'mean_se', '.2g')}" if isinstance(kl.get("mean_se"), (int, float)) else ""
    ppl = f"PPL a <b>{r['ppl'][0]:.4g}</b>, b <b>{r['ppl'][1]:.4g}</b>"
    if isinstance(r.get("ln_ppl_ratio"), (int, float)):
        ppl += f" (ln ratio {r['ln_ppl_ratio']:+.4f})"
    lines = [ppl + f" · same top token at <b>{100 * r['same_top']:.2f} %</b> of {r.get('positions', '?')} positions",
             f"KL nats: mean <b>{_stat(kl, 'mean', '.4g')}</b>{se} · median {_stat(kl, 'median', '.3g')} · "
             f"p99 {_stat(kl, 'p99', '.3g')} · p99.9 {_stat(kl, 'p99_9', '.3g')} · max {_stat(kl, 'max', '.3g')}",
             f"Δp: RMS <b>{_stat(dp, 'rms', '.3f', 100)} %</b> · mean {_stat(dp, 'mean', '+.3f', 100)} % · "
             + " · ".join(f"p{q} {_stat(dp, 'p' + q.replace('.', '_'), '+.2f', 100)} %"
                          for q in ("1", "5", "10", "25", "50", "75", "90", "95", "99"))]
    return "<br>".join(html.escape(line, quote=False).replace("&lt;b&gt;", "<b>").replace("&lt;/b&gt;", "</b>")
                       for line in lines)


def corpus_summary(r: dict, took: str) -> str:
    """The summary line of a corpus comparison: the two sides, the corpus and the headline numbers."""
    labels = r.get("labels")
    sides = [html.escape(f"{side}: {labels[i] if isinstance(labels, list) and len(labels) == 2 else side}",
                         quote=False) for i, side in enumerate("ab")]
    kl = r["kl_stats"]
    line = (f"{r.get('corpus') or 'the corpus'}: {r.get('tokens', '?')} tokens in {r.get('windows', '?')} windows of "
            f"{r.get('window', '?')} · PPL {r['ppl'][0]:.4g} → {r['ppl'][1]:.4g} · mean KL "
            f"{_stat(kl, 'mean', '.3g')} nats · same top {100 * r['same_top']:.1f} % · {took}")
    return "<br>".join([*sides, html.escape(line, quote=False)])


def corpus_rows(r: dict) -> list[dict]:
    """A corpus comparison's statistics as rows (statistic, value)."""
    rows = [{"statistic": "positions", "value": r.get("positions")},
            {"statistic": "ppl_a", "value": r["ppl"][0]}, {"statistic": "ppl_b", "value": r["ppl"][1]},
            {"statistic": "ln_ppl_ratio", "value": r.get("ln_ppl_ratio")}]
    rows += [{"statistic": f"kl_{k}", "value": v} for k, v in r["kl_stats"].items()]
    rows += [{"statistic": f"delta_p_{k}", "value": v} for k, v in r["delta_p"].items()]
    rows.append({"statistic": "same_top", "value": r["same_top"]})
    lens = corpus_lens(r)
    if lens is not None:
        rows += [{"statistic": f"lens_kl_{point_name(r['lens'], i).replace(' ', '_')}", "value": float(v)}
                 for i, v in enumerate(lens)]
    return rows


def compare_curves(r: dict) -> tuple[np.ndarray, np.ndarray]:
    """(KL per residual point, attention JS at the same x): point 0 is the embeddings, point ℓ the stream after
    layer ℓ, whose attention is layer ℓ's (so JS has no value at 0); NaN where there is none."""
    kl = np.asarray(r["kl"], dtype=float)
    js = np.full(len(kl), np.nan)
    if r.get("attention_js") is not None:
        a = np.asarray(r["attention_js"], dtype=float)
        js[len(kl) - len(a):] = a
    return kl, js


def point_name(r: dict, i: int) -> str:
    names = r.get("layers")
    if isinstance(names, list) and len(names) > i and isinstance(names[i], str):
        return names[i]
    return "the embeddings" if i == 0 else f"layer {i}"


def patch_labels(r: dict, sep: str = "/") -> list[str]:
    """Each position's token; where the two prompts differ there, the clean one, `sep`, the corrupted one."""
    t = r["tokens"]
    corrupt = pieces(t)
    clean = t.get("clean") if isinstance(t, dict) else None
    if not isinstance(clean, list) or len(clean) != len(corrupt) or not all(isinstance(c, str) for c in clean):
        return [_piece(c) for c in corrupt]
    return [_piece(a) if a == b else f"{_piece(a)}{sep}{_piece(b)}" for a, b in zip(clean, corrupt, strict=True)]


def target_piece(r: dict) -> str:
    """The attributed token's text: {"id", "piece", …} or a plain id or text."""
    t = r.get("target")
    if isinstance(t, dict):
        return str(t.get("piece", t.get("id", "?")))
    return str(t) if t is not None else "?"


def _flip_steps(flips: Any) -> list[int]:
    """The step numbers of a compare result's top1_flips (a list of steps, or of {"step": …} records)."""
    out = []
    for f in flips if isinstance(flips, list) else []:
        step = f.get("step") if isinstance(f, dict) else f
        if isinstance(step, int) and not isinstance(step, bool):
            out.append(step)
    return out


def _flip_text(flips: Any) -> str:
    items = []
    for f in flips if isinstance(flips, list) else []:
        if isinstance(f, dict):
            a, b = f.get("a_piece"), f.get("b_piece")
            change = f": {_piece(a)!r} → {_piece(b)!r}" if isinstance(a, str) and isinstance(b, str) else ""
            items.append(f"step {f.get('step', '?')}{change}")
        elif isinstance(f, int):
            items.append(f"step {f}")
    return "; ".join(items)


def ablation_of(entry: dict) -> tuple[str, bool, Ablated]:
    """The prompt, chat flag and ablated parts of an ablation result (the engine's own `ablated` description, so a
    result reopened from a session continues too); ValueError in one sentence when the result lacks them."""
    params, ab = entry.get("params"), entry.get("result", {}).get("ablated")
    try:
        prompt, chat = params["prompt"], bool(params.get("chat", False))
        heads = tuple((int(h[0]), int(h[1])) for h in ab["heads"] if len(h) == 2)
        ablated = Ablated(heads, tuple(int(i) for i in ab["attn_layers"]), tuple(int(i) for i in ab["mlp_layers"]),
                          bool(ab["mean"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"this ablation result does not say what was ablated ({e})") from None
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("this ablation result has no prompt")
    return prompt, chat, ablated


def _plain(params: object) -> dict:
    """An experiment's params as plain data (a session file holds no foreign dataclass)."""
    try:
        return asdict(params)
    except TypeError:
        return {}


PANEL = WhyPanel
