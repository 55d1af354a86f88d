"""Branches: how sure the model was of each token, what it could have said instead, and forks from there.

The output of the shown run is coloured by each token's probability (or by its step's entropy), with a legend.
Hovering a token lists the step's top alternatives with their raw and final probabilities; clicking a token opens
the same list as a menu, and choosing an alternative forks the generation at that step with that token
(engine: GenerateRequest.prompt_ids + forced, which reuses the KV cache of the shared prefix). Every run and fork
is kept in a tree; selecting a branch shows it in every panel again, and two branches can be compared side by side.

The branches are the runs of the window's run store (app.run_store): this panel keeps no events of its own. While
a run grows, its new tokens are appended to the text (a draw costs the same at step 8,000 as at step 8); the page is
rebuilt only when another branch is shown, the colouring changes or the prompt's scores arrive.
"""

from __future__ import annotations

import html
import math

import numpy as np
from PySide6 import QtCore, QtGui, QtWidgets

from app import theme
from app.bridge import Bridge, GenerateRequest
from app.panels.base import Panel
from app.run_store import Run, RunStore
from engine.events import PromptScored, PromptTokenized, TokenSampled

ALTERNATIVES = 5
BINS = 10  # colour steps of the legend


def confidence_color(x: float) -> QtGui.QColor:
    """x in [0, 1] (1 = sure) → red … amber … green, dark enough for white text."""
    x = min(1.0, max(0.0, x))
    hue = 0.0 + 0.33 * x  # red (0) → green (0.33)
    return QtGui.QColor.fromHsvF(hue, 0.75, 0.55)


def token_entropy_bits(ev: TokenSampled) -> float | None:
    """Entropy of the step's raw distribution in bits, from the captured logits (None when not captured)."""
    if ev.logits is None:
        return None
    x = np.asarray(ev.logits, dtype=np.float64)
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    nz = p[p > 0]
    return float(-(nz * np.log2(nz)).sum())


def token_prob(ev: TokenSampled) -> tuple[float | None, float | None]:
    """(raw, final) probability of the chosen token at its step, from the funnel (None when not captured)."""
    f = ev.funnel
    if f is None:
        return None, None
    hit = np.flatnonzero(f.ids == ev.token_id)
    if not hit.size:
        return None, None
    return float(f.p_raw[hit[0]]), float(f.p_final[hit[0]])


class Confidence:
    """A run's chosen-token probabilities summed as its tokens arrive, so that its summary late in a long run costs
    the tokens added since the last one, not the run (summing them all held the GUI thread at a long run's end)."""

    def __init__(self) -> None:
        self.tokens = 0  # tokens read so far
        self.n = 0  # of them with a probability (their step's funnel was captured)
        self.sum_p = 0.0
        self.sum_log_p = 0.0

    def add(self, tokens: list[TokenSampled]) -> Confidence:
        for t in tokens:
            p = token_prob(t)[0]
            if p is not None:
                self.n += 1
                self.sum_p += p
                self.sum_log_p += math.log(max(p, 1e-12))
        self.tokens += len(tokens)
        return self

    def summary(self, run: Run) -> str:
        """Tokens, mean probability, perplexity and timing of `run`, whose first `tokens` tokens were added."""
        parts = [f"{run.n_tokens} tokens"]
        if self.n:
            parts.append(f"mean p {self.sum_p / self.n:.2f}")
            parts.append(f"perplexity {math.exp(-self.sum_log_p / self.n):.2f}")
        fin = run.finished
        if fin is not None:
            parts.append(f"TTFT {1e3 * fin.ttft_s:.0f} ms · TPOT {1e3 * fin.tpot_s:.1f} ms")
        return " · ".join(parts)


def run_summary(run: Run) -> str:
    """Tokens, mean probability, perplexity and timing of a run, in one line."""
    return Confidence().add(run.tokens).summary(run)


def token_look(t: TokenSampled, mode: str, tokenizer=None) -> tuple[str, str] | None:
    """(text, background colour) of a token in the branch's text, or None when it shows no text."""
    text = t.text or (t.piece if tokenizer is not None and tokenizer.is_special(t.token_id) else "")
    if not text:
        return None
    if mode == "entropy":
        h = token_entropy_bits(t)
        x = None if h is None else 1.0 - min(1.0, h / 8.0)  # 0 bits sure … 8 bits and more unsure
    else:
        x = token_prob(t)[0]
    return text, confidence_color(x).name() if x is not None else theme.SURFACE_ALT


def branch_html(branch: Run, mode: str, tokenizer=None) -> str:
    """The branch's prompt (muted) and its tokens, each an anchor coloured by confidence."""
    out = ["<div style='white-space: pre-wrap; font-family: monospace;'>"]
    p = branch.prompt
    if p is not None:
        out.append(prompt_html(p, branch.scores))
    for t in branch.tokens:
        look = token_look(t, mode, tokenizer)
        if look is None:
            continue
        deco = "underline" if t.forced else "none"  # a forced token (a fork's first) is underlined
        out.append(f"<a href='step:{t.step}' style='color:#ffffff; text-decoration:{deco}; background:{look[1]};'>"
                   f"{html.escape(look[0])}</a>")
    out.append("</div>")
    return "".join(out)


def append_tokens(view: QtWidgets.QTextBrowser, tokens: list[TokenSampled], mode: str, tokenizer=None) -> None:
    """Add tokens at the end of a branch's text as branch_html draws them: anchors coloured by confidence."""
    cursor = QtGui.QTextCursor(view.document())
    cursor.movePosition(QtGui.QTextCursor.MoveOperation.End)
    for t in tokens:
        look = token_look(t, mode, tokenizer)
        if look is None:
            continue
        fmt = QtGui.QTextCharFormat()
        fmt.setAnchor(True)
        fmt.setAnchorHref(f"step:{t.step}")
        fmt.setForeground(QtGui.QColor("#ffffff"))
        fmt.setBackground(QtGui.QColor(look[1]))
        fmt.setFontUnderline(bool(t.forced))
        fmt.setFontFixedPitch(True)
        fmt.setFontFamilies(["monospace"])
        cursor.insertText(look[0], fmt)


def prompt_html(p: PromptTokenized, scores: PromptScored | None) -> str:
    """The prompt, muted; with scores, each scored token coloured by its probability (an anchor for hovering)."""
    if scores is None:
        return f"<span style='color:{theme.MUTED}'>{html.escape(p.text)}</span>"
    out, done = [], 0
    for k, (a, b) in enumerate(np.asarray(p.offsets).reshape(-1, 2).tolist()):
        a = max(a, done)
        if b <= a:
            continue
        if a > done:
            out.append(f"<span style='color:{theme.MUTED}'>{html.escape(p.text[done:a])}</span>")
        i = k - scores.first
        piece = html.escape(p.text[a:b])
        if 0 <= i < len(scores.probs):
            bg = confidence_color(float(scores.probs[i])).name()
            out.append(f"<a href='prompt:{k}' style='color:#ffffff; text-decoration:none; background:{bg};'>"
                       f"{piece}</a>")
        else:
            out.append(f"<span style='color:{theme.MUTED}'>{piece}</span>")
        done = b
    if done < len(p.text):
        out.append(f"<span style='color:{theme.MUTED}'>{html.escape(p.text[done:])}</span>")
    return "".join(out)


def alternatives_text(ev: TokenSampled, n: int = ALTERNATIVES) -> str:
    f = ev.funnel
    head = f"step {ev.step} · chose {ev.piece!r} (id {ev.token_id}){' · forced' if ev.forced else ''}"
    if f is None:
        return head + "\n(no funnel captured for this step)"
    order = np.argsort(-f.p_raw)[:n]
    rows = [f"{f.pieces[i]!r:>14}  raw {f.p_raw[i]:.3f}  final {f.p_final[i]:.3f}" for i in order]
    return head + "\n" + "\n".join(rows)


class BranchesPanel(Panel):
    title = "Branches"
    object_name = "panel_branches"
    shortcut = "Alt+0"
    subscriptions = {}  # its data come from the run store (attach_store)
    help_text = (
        "How sure the model was of each token, and what else it could have said. Each generated token is "
        "coloured by its probability under the model (raw softmax, before the sampling settings) or by the "
        "entropy of its step (in bits: how spread the distribution was); red is unsure, green sure. Hover a token "
        "for its step's top alternatives with raw and final (after temperature, top-k, top-p, min-p) "
        "probabilities. Click a token and pick an alternative to fork: the generation continues from that step "
        "with that token and the current settings, reusing the KV cache of the shared prefix. Every run and fork "
        "is a branch in the tree; select one to show it in every panel, tick two and press Compare to see them "
        "side by side. 'Score the prompt' keeps the prefill's logits at every position (one forward pass, as "
        "always) and colours each prompt token by its probability given the tokens before it; hover for its "
        "surprise, −log₂ p bits."
    )

    sig_fork_requested = QtCore.Signal(int, int)
    """A fork was asked for: (step, token id) of the shown branch."""

    def __init__(self, bridge: Bridge, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(bridge, parent)
        self.store: RunStore | None = None
        self._confidence: dict[int, tuple[int, Confidence]] = {}  # run id → (which run: id of its events, its sums)
        self._page: tuple | None = None  # what the text shows (run, mode, tokenizer, prompt, scores) and its tokens
        self._page_tokens = 0
        self._build()
        self.mark_dirty()

    def _build(self) -> None:
        self.mode = QtWidgets.QComboBox()
        self.mode.addItem("colour by probability", "prob")
        self.mode.addItem("colour by entropy", "entropy")
        self.mode.currentIndexChanged.connect(lambda _i: (self._set_legend(), self.mark_dirty()))
        self.legend = QtWidgets.QLabel()
        self.legend.setTextFormat(QtCore.Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)  # the panel shares a row of the window: its legend wraps, not widens it
        self._set_legend()
        self.score_box = QtWidgets.QCheckBox("Score the prompt")
        self.score_box.setToolTip("Next generation: colour each prompt token by its probability under the model")
        self.score_box.toggled.connect(self._on_score_toggled)
        top = QtWidgets.QHBoxLayout()
        top.addWidget(self.mode)
        top.addWidget(self.score_box)
        top.addWidget(self.legend, 1)

        self.view = QtWidgets.QTextBrowser()
        self.view.setOpenLinks(False)
        self.view.setMouseTracking(True)
        self.view.highlighted.connect(self._on_hover)
        self.view.anchorClicked.connect(self._on_anchor)
        self.view.setPlaceholderText("Generate to see each token's confidence; click a token to fork.")

        self.tree = QtWidgets.QTreeWidget()
        self.tree.setHeaderLabels(["branch", "tokens · confidence · timing"])
        self.tree.itemClicked.connect(self._on_tree_clicked)
        self.compare_btn = QtWidgets.QPushButton("Compare ticked")
        self.compare_btn.setToolTip("Tick two branches in the tree, then compare them side by side")
        self.compare_btn.clicked.connect(self.compare_ticked)
        right = QtWidgets.QWidget()
        rl = QtWidgets.QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(self.tree, 1)
        rl.addWidget(self.compare_btn)

        split = QtWidgets.QSplitter(QtCore.Qt.Orientation.Horizontal)
        split.addWidget(self.view)
        split.addWidget(right)
        split.setSizes([500, 300])
        layout = QtWidgets.QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(split, 1)

    @QtCore.Slot(bool)
    def _on_score_toggled(self, on: bool) -> None:
        self.bridge.options.set_score_prompt(on)

    # ---- the runs ----
    def attach_store(self, store: RunStore) -> None:
        """Show the runs of `store` (the window's, app.session_io.install)."""
        self.store = store
        store.sig_runs_changed.connect(self._on_runs_changed)
        store.sig_run_updated.connect(self._on_run_updated)
        self._on_runs_changed()

    @property
    def branches(self) -> list[Run]:
        return self.store.runs if self.store is not None else []

    @property
    def shown(self) -> int | None:
        """Index of the shown branch in `branches`."""
        return self.store.index(self.store.shown) if self.store is not None else None

    @QtCore.Slot()
    def _on_runs_changed(self) -> None:
        self._rebuild_tree()
        self.mark_dirty()

    @QtCore.Slot(int)
    def _on_run_updated(self, run_id: int) -> None:
        run = self.store.run(run_id) if self.store is not None else None
        if run is not None:
            self._confidence_of(run)  # the new token's probability, now rather than all of them at the run's end
        if self.store is not None and run_id == self.store.shown:
            self.mark_dirty()

    # ---- forking ----
    def fork(self, step: int, token: int) -> bool:
        """Fork the shown branch at `step` with `token`; False when it cannot start now."""
        gen = self._generation_panel()
        if self.store is None or self.shown is None or self.bridge.state != "idle" or self.bridge.info is None:
            return False
        b = self.branches[self.shown]
        p = b.prompt
        if p is None:
            return False
        prefix = tuple(int(i) for i in p.ids) + tuple(t.token_id for t in b.tokens[:step])
        max_new = gen.max_tokens.value() if gen is not None else 64
        capture = gen.capture_for("", False) if gen is not None else None
        req = GenerateRequest(
            text=f"fork of {b.name} at step {step}", chat=False, max_new_tokens=max_new, params=self.bridge.params,
            ignore_eos=bool(getattr(gen, "ignore_eos", False)), prompt_ids=prefix, forced=((0, int(token)),),
            **({"capture": capture} if capture is not None else {}),
        )
        piece = self.bridge.tokenizer.piece(int(token)) if self.bridge.tokenizer is not None else str(token)
        self.store.expect_fork(b.id, step, int(token), f"fork @ {step}: {piece!r}")
        self.bridge.generate(req)
        self.sig_fork_requested.emit(step, int(token))
        return True

    def _generation_panel(self):
        w = self.window()
        panels = getattr(w, "panels", {})
        return panels.get("generation")

    # ---- switching and comparing ----
    def show_branch(self, index: int) -> None:
        """Show branch `index` in every panel: its events go through the bridge again, in slices of the GUI
        thread's event loop with progress in the status bar (app.session_io.Replay)."""
        if not 0 <= index < len(self.branches) or self.bridge.state != "idle":
            return
        from app import session_io

        run = self.branches[index]
        self.store.show(run.id)
        window = self.window()
        if hasattr(window, "replay_job"):  # the app's window: in slices, with progress, Esc cancels
            session_io.replay_run(window, run.kept_events(), f"Showing {run.name}")
        else:
            session_io.replay_events(self.bridge, run.kept_events(), self.store)

    def compare_ticked(self) -> QtWidgets.QDialog | None:
        ticked = [int(self._item(i).data(0, QtCore.Qt.ItemDataRole.UserRole))
                  for i in range(self.tree.topLevelItemCount())
                  if self._item(i).checkState(0) == QtCore.Qt.CheckState.Checked]
        if len(ticked) != 2:
            QtWidgets.QToolTip.showText(QtGui.QCursor.pos(), "Tick exactly two branches to compare.")
            return None
        return self.compare(*ticked)

    def compare(self, a: int, b: int) -> QtWidgets.QDialog:
        dialog = QtWidgets.QDialog(self)
        dialog.setWindowTitle(f"{self.branches[a].name}  ↔  {self.branches[b].name}")
        dialog.setAttribute(QtCore.Qt.WidgetAttribute.WA_DeleteOnClose)
        grid = QtWidgets.QGridLayout(dialog)
        mode = self.mode.currentData()
        for col, i in enumerate((a, b)):
            br = self.branches[i]
            title = QtWidgets.QLabel(f"<b>{html.escape(br.name)}</b><br>{html.escape(run_summary(br))}")
            title.setTextFormat(QtCore.Qt.TextFormat.RichText)
            view = QtWidgets.QTextBrowser()
            view.setHtml(branch_html(br, mode, self.bridge.tokenizer))
            grid.addWidget(title, 0, col)
            grid.addWidget(view, 1, col)
        dialog.resize(1000, 500)
        dialog.show()
        self.compare_dialog = dialog
        return dialog

    def _item(self, i: int) -> QtWidgets.QTreeWidgetItem:
        return self.tree.topLevelItem(i)

    def _confidence_of(self, run: Run) -> Confidence:
        """The run's Confidence, brought up to its newest token."""
        which, conf = self._confidence.get(run.id, (None, None))
        if conf is None or which != id(run.events) or conf.tokens > run.n_tokens:  # another run under this id
            conf = Confidence()
            self._confidence[run.id] = (id(run.events), conf)
        if conf.tokens < run.n_tokens:
            conf.add(run.tokens_from(conf.tokens))
        return conf

    def _summary(self, run: Run) -> str:
        return self._confidence_of(run).summary(run)

    def _rebuild_tree(self) -> None:
        ticked = {i for i in range(self.tree.topLevelItemCount())
                  if self._item(i).checkState(0) == QtCore.Qt.CheckState.Checked}
        self.tree.clear()
        shown = self.shown
        live = {b.id for b in self.branches}
        self._confidence = {k: v for k, v in self._confidence.items() if k in live}
        for i, b in enumerate(self.branches):
            depth, p = 0, self.store.run(b.parent)
            while p is not None:
                depth, p = depth + 1, self.store.run(p.parent)
            item = QtWidgets.QTreeWidgetItem([("  " * depth) + ("└ " if depth else "") + b.name, self._summary(b)])
            item.setData(0, QtCore.Qt.ItemDataRole.UserRole, i)
            item.setCheckState(0, QtCore.Qt.CheckState.Checked if i in ticked else QtCore.Qt.CheckState.Unchecked)
            if i == shown:
                f = item.font(0)
                f.setBold(True)
                item.setFont(0, f)
                item.setFont(1, f)
            self.tree.addTopLevelItem(item)
        self.tree.resizeColumnToContents(0)

    @QtCore.Slot(QtWidgets.QTreeWidgetItem, int)
    def _on_tree_clicked(self, item: QtWidgets.QTreeWidgetItem, column: int) -> None:
        if column == 0 and item.checkState(0) == QtCore.Qt.CheckState.Checked:
            return  # a tick, not a switch
        index = item.data(0, QtCore.Qt.ItemDataRole.UserRole)
        if index is not None and index != self.shown:
            self.show_branch(int(index))

    # ---- hover and click ----
    def _prompt_tip(self, s: str) -> str:
        b = self.branches[self.shown] if self.shown is not None else None
        sc = b.scores if b is not None else None
        if sc is None:
            return ""
        i = int(s.removeprefix("prompt:")) - sc.first
        if not 0 <= i < len(sc.ids):
            return ""
        tok = self.bridge.tokenizer
        piece = tok.piece(int(sc.ids[i])) if tok is not None else str(int(sc.ids[i]))
        top = tok.piece(int(sc.top_ids[i])) if tok is not None else str(int(sc.top_ids[i]))
        return (f"prompt token {sc.first + i} {piece!r}: p = {sc.probs[i]:.4f} · surprise "
                f"{sc.surprise_bits[i]:.2f} bits\nentropy there {sc.entropy_bits[i]:.2f} bits · "
                f"the model expected {top!r} most")

    def _token_at(self, url: QtCore.QUrl | str) -> TokenSampled | None:
        s = url.toString() if isinstance(url, QtCore.QUrl) else str(url)
        if not s.startswith("step:") or self.shown is None:
            return None
        step = int(s.removeprefix("step:"))
        return next((t for t in self.branches[self.shown].tokens if t.step == step), None)

    @QtCore.Slot(QtCore.QUrl)
    def _on_hover(self, url: QtCore.QUrl) -> None:
        if url.toString().startswith("prompt:"):
            tip = self._prompt_tip(url.toString())
            if tip:
                QtWidgets.QToolTip.showText(QtGui.QCursor.pos(), tip, self.view)
            return
        t = self._token_at(url)
        if t is None:
            QtWidgets.QToolTip.hideText()
            return
        QtWidgets.QToolTip.showText(QtGui.QCursor.pos(), alternatives_text(t), self.view)

    @QtCore.Slot(QtCore.QUrl)
    def _on_anchor(self, url: QtCore.QUrl) -> None:
        t = self._token_at(url)
        if t is None:
            return
        self.bridge.select_step(t.step)
        menu = self.alternatives_menu(t)
        if menu is not None:
            menu.popup(QtGui.QCursor.pos())

    def alternatives_menu(self, t: TokenSampled) -> QtWidgets.QMenu | None:
        f = t.funnel
        if f is None:
            return None
        menu = QtWidgets.QMenu(self)
        menu.addSection(f"step {t.step}: fork with another token")
        for i in np.argsort(-f.p_raw)[:ALTERNATIVES]:
            tok = int(f.ids[i])
            label = f"{f.pieces[i]!r}   raw {f.p_raw[i]:.3f} · final {f.p_final[i]:.3f}"
            action = menu.addAction(label + ("   (chosen)" if tok == t.token_id else ""))
            action.setEnabled(tok != t.token_id)
            action.triggered.connect(lambda _c=False, s=t.step, k=tok: self.fork(s, k))
        self.last_menu = menu
        return menu

    # ---- drawing ----
    def _set_legend(self) -> None:
        """The colour key of the shown mode; set when the panel is made (so its room is known before any run, and the
        window is not laid out again when the first run is drawn) and when the mode changes."""
        swatches = "".join(
            f"<span style='background:{confidence_color((i + 0.5) / BINS).name()}'>&nbsp;&nbsp;&nbsp;</span>"
            for i in range(BINS))
        ends = ("p 0", "p 1") if self.mode.currentData() == "prob" else ("≥ 8 bits", "0 bits")
        self.legend.setText(f"{ends[0]} {swatches} {ends[1]} "
                            f"<span style='color:{theme.MUTED}'>· underlined: forced · hover: alternatives · "
                            f"click: fork</span>")

    def draw(self) -> None:
        mode = self.mode.currentData()
        if self.shown is None:
            self.view.clear()
            self._page = None
            return
        bar = self.view.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        run, tok = self.branches[self.shown], self.bridge.tokenizer
        page = (run.id, mode, id(tok), run.prompt is not None, run.scores is not None)
        n = run.n_tokens
        if page != self._page or n < self._page_tokens:  # another page: drawn whole once
            self.view.setHtml(branch_html(run, mode, tok))
            self._page = page
        elif n > self._page_tokens:  # the same run, grown: append its new tokens only
            append_tokens(self.view, run.tokens_from(self._page_tokens), mode, tok)
        self._page_tokens = n
        if at_end:
            bar.setValue(bar.maximum())


PANEL = BranchesPanel
