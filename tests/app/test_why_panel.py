"""The Why panel: each experiment goes to the engine process as one Experiment and comes back as one ExperimentDone,
with progress on the way and Cancel; results are drawn (head-role heatmaps whose click selects the head in the
Attention panel, the patching grid, ablation's two top-5s, attribution colours, the comparison's curves), kept in
sessions and exported."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from PySide6 import QtCore

from app import exports, session_io
from app.panels.why import KINDS, SCORES, WhyPanel, check_result, parse_heads, parse_layers
from engine import protocol as P
from tests.app.conftest import wait_loaded

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")  # docks raised offscreen


@pytest.fixture
def why_window(qtbot, make_window):
    """A window on the tiny model with the Why panel shown in front."""

    def make(**kw):
        w = make_window(persist=False, **kw)
        w.resize(1600, 1000)
        if kw.get("load", True):
            wait_loaded(qtbot, w)
        w.docks["why"].show()
        w.docks["why"].raise_()
        return w

    return make


def run_and_wait(qtbot, panel: WhyPanel, kind: str, timeout: int = 120_000) -> P.ExperimentDone:
    panel.set_mode(kind)
    progress: list[tuple[float, str]] = []
    panel.bridge.sig_why_progress.connect(lambda f, m: progress.append((f, m)))
    with qtbot.waitSignal(panel.bridge.sig_why_done, timeout=timeout) as done:
        assert panel.run(), panel.summary_html()
    panel.flush()
    panel.progress_seen = progress
    return done.args[0]


# ---- inputs -----------------------------------------------------------------------------------------------------
def test_heads_and_layers_are_read_as_typed():
    assert parse_heads("3:1, 5:0 3:1") == ((3, 1), (5, 0))
    assert parse_layers("0, 4 7") == (0, 4, 7)
    for bad in ("3", "3:", "a:1", "3:1:2"):
        with pytest.raises(ValueError, match="layer:head"):
            parse_heads(bad)
    with pytest.raises(ValueError, match="not a layer"):
        parse_layers("1, x")


def test_bad_input_is_one_line_in_the_panel_and_nothing_is_sent(qtbot, bridge, tiny_lm):
    bridge.replay(P.Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    panel = WhyPanel(bridge)
    qtbot.addWidget(panel)
    panel.set_mode("ablate")
    panel.ablate_heads.setText("2:0")  # the tiny model has layers 0–1
    assert not panel.run() and panel.running is None
    panel.flush()
    assert "head 2:0 is out of range" in panel.summary.text() and "layers 0–1 and heads 0–3" in panel.summary.text()
    panel.ablate_heads.setText("")
    assert not panel.run()
    panel.flush()
    assert "name what to ablate" in panel.summary.text()


def test_help_prices_the_scan_and_the_patching_grid_in_the_models_numbers(qtbot, bridge, tiny_lm):
    bridge.replay(P.Loaded(tiny_lm.info, tiny_lm.tokenizer, tiny_lm.cfg))
    panel = WhyPanel(bridge)
    qtbot.addWidget(panel)
    # the tiny model: 2 layers × 4 heads = 8 heads; a 12-token grid has (2 + 1) × 12 = 36 cells
    assert "2 layers of 4 query heads" in panel.help_text and "scores 8 heads" in panel.help_text
    assert "(2 + 1) × 12 = 36 cells" in panel.help_text
    assert "attention" in panel.help_text.lower() and "integrated gradients" in panel.help_text


# ---- the round trip through the engine process ----------------------------------------------------------------
def test_head_roles_round_trip_paints_the_heatmaps_and_a_click_shows_the_head(qtbot, why_window, tiny_lm):
    from engine.run.session import Session
    from engine.why.heads import head_roles

    w = why_window()
    panel: WhyPanel = w.panels["why"]
    panel.repeat_spin.setValue(20)
    panel.seed_spin.setValue(3)
    done = run_and_wait(qtbot, panel, "heads")
    assert done.ok and done.kind == "heads" and not done.cancelled and done.failure == ""
    assert done.params == P.HeadsParams(repeat=20, seed=3)
    assert panel.progress_seen, "no progress arrived"
    assert all(0.0 <= f <= 1.0 for f, _ in panel.progress_seen)
    # the engine process's scores are the ones the same call gives in this process on the same model
    here = head_roles(Session(tiny_lm), repeat=20, seed=3)
    for key, _ in SCORES:
        np.testing.assert_allclose(done.result["scores"][key], here["scores"][key], rtol=1e-5, atol=1e-6)
        shown = panel.heads_images[key].image
        np.testing.assert_allclose(shown, np.asarray(here["scores"][key]), rtol=1e-5, atol=1e-6)
        assert shown.shape == (tiny_lm.cfg.n_layers, tiny_lm.cfg.n_heads)
    assert "Strongest heads" in panel.summary.text() and panel.run_button.isEnabled()
    assert f"on {w.bridge.info.name}" in panel.summary.text()  # what the result was measured on
    assert not panel.cancel_button.isEnabled()

    # a real click on the induction map's cell (layer 1, head 2) selects that head in the Attention panel
    attention = w.panels["attention"]
    attention.layer_spin.setValue(0)
    attention.head_spin.setValue(0)
    w.tick_panels(flush=True)
    qtbot.wait(50)
    pi = panel.heads_items["induction"]
    view = panel.heads_plots
    scene_pos = pi.getViewBox().mapViewToScene(QtCore.QPointF(2.5, 1.5))
    assert panel.head_at(scene_pos) == ("induction", 1, 2), pi.getViewBox().sceneBoundingRect()
    with qtbot.waitSignal(panel.sig_show_head, timeout=2_000) as clicked:
        qtbot.mouseClick(view.viewport(), QtCore.Qt.MouseButton.LeftButton,
                         pos=view.mapFromScene(scene_pos))
    assert clicked.args == [1, 2]
    assert (attention.layer(), attention.head()) == (1, 2) and attention.tabs.currentIndex() == 0
    w.tick_panels(flush=True)
    assert panel.heads_boxes["induction"].isVisible()
    assert panel.heads_boxes["induction"].rect() == QtCore.QRectF(2, 1, 1, 1)


def test_ablate_patch_attribute_and_compare_round_trips_are_drawn(qtbot, why_window, tiny_lm, tiny_dir):
    """Each mode's request reaches the engine process and its result comes back unchanged (the same call in this
    process on the same model gives the same numbers), and is drawn."""
    from engine.run.session import Session
    from engine.why.ablate import ablate
    from engine.why.attribute import attribute
    from engine.why.patch import patch

    w = why_window()
    panel: WhyPanel = w.panels["why"]
    here = Session(tiny_lm)

    panel.ablate_prompt.setText("the cat sat on the")
    panel.ablate_heads.setText("1:2, 0:1")
    panel.ablate_mlp.setText("0")
    panel.diff_a.setText(" c")
    panel.diff_b.setText(" m")
    done = run_and_wait(qtbot, panel, "ablate")
    assert done.ok, done.failure
    assert done.params.heads == ((1, 2), (0, 1)) and done.params.mlp_layers == (0,) and done.params.tokens == (288, 271)
    ref = ablate(here, "the cat sat on the", heads=((1, 2), (0, 1)), mlp_layers=(0,), tokens=(288, 271))
    for side in ("before", "after"):
        assert done.result[side]["ids"] == ref[side]["ids"]
        np.testing.assert_allclose(done.result[side]["probs"], ref[side]["probs"], rtol=1e-5)
        table = panel.ablate_tables[side]
        assert table.rowCount() == 5, panel.summary_html()
        assert [table.item(i, 1).text() for i in range(5)] == [str(i) for i in ref[side]["ids"]]
    assert done.result["kl"] == pytest.approx(ref["kl"], rel=1e-4, abs=1e-9)
    text = panel.summary.text()
    assert "KL(before ‖ after)" in text and "logit '·c' − '·m'" in text
    assert ("changed" if ref["top1_changed"] else "unchanged") in text

    panel.clean_edit.setText("the cat sat on the")
    panel.corrupt_edit.setText("the mat sat on the")
    panel.answer_edit.setText(" c")
    panel.wrong_edit.setText(" m")
    panel.patch_heads_box.setChecked(True)
    done = run_and_wait(qtbot, panel, "patch")
    assert done.ok, done.failure
    ref = patch(here, "the cat sat on the", "the mat sat on the", " c", " m", heads=True)
    np.testing.assert_allclose(done.result["restored"], ref["restored"], rtol=1e-4, atol=1e-5)
    grid = panel.patch_image.image
    assert grid.shape == (tiny_lm.cfg.n_layers + 1, 9)
    np.testing.assert_allclose(grid, np.asarray(ref["restored"]), rtol=1e-4, atol=1e-5)
    assert panel.patch_heads_item.scene() is panel.patch_plot.scene()
    assert panel.patch_heads_image.image.shape == (tiny_lm.cfg.n_layers, tiny_lm.cfg.n_heads)
    ticks = [label for _x, label in panel.patch_item.getAxis("bottom")._tickLevels[0]]
    assert ticks[:4] == ["t", "he", "·c\n·m", "at"] and len(ticks) == 9, ticks
    assert "largest restore" in panel.summary.text()
    # a real click on the per-head grid's cell (layer 1, head 3) shows that head in the Attention panel
    attention = w.panels["attention"]
    w.tick_panels(flush=True)
    qtbot.wait(50)
    scene_pos = panel.patch_heads_item.getViewBox().mapViewToScene(QtCore.QPointF(3.5, 1.5))
    assert panel.patch_cell_at(scene_pos) == ("restored_heads", 1, 3)
    view = panel.patch_plot
    with qtbot.waitSignal(panel.sig_show_head, timeout=2_000) as clicked:
        qtbot.mouseClick(view.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=view.mapFromScene(scene_pos))
    assert clicked.args == [1, 3] and (attention.layer(), attention.head()) == (1, 3)
    grid_pos = panel.patch_item.getViewBox().mapViewToScene(QtCore.QPointF(2.5, 1.5))
    assert panel.patch_cell_at(grid_pos) == ("restored", 1, 2)

    panel.attr_prompt.setText("the cat sat on the")
    panel.method_combo.setCurrentIndex(panel.method_combo.findData("grad-input"))
    done = run_and_wait(qtbot, panel, "attribute")
    assert done.ok, done.failure
    ref = attribute(here, "the cat sat on the", method="grad-input")
    np.testing.assert_allclose(done.result["scores"], ref["scores"], rtol=1e-4, atol=1e-6)
    assert panel.attr_view.toPlainText() == "the·cat·sat·on·the"
    assert "gradient × input for the next token" in panel.summary.text()

    # the same weights from the Hugging Face folder: nothing changes, layer by layer
    panel.other_edit.setText(str(tiny_dir.hf_dir))
    panel.compare_prompt.setText("the cat sat on the")
    panel.compare_steps.setValue(4)
    panel.other_backend.setCurrentIndex(panel.other_backend.findData("torch"))
    done = run_and_wait(qtbot, panel, "compare")
    assert done.ok, done.failure
    # the other side's kernel mode defaults to fast against an exact model; float weights have no quantized forms, so
    # it computes exactly as the loaded model does, and says so
    assert done.params == P.CompareParams(other=str(tiny_dir.hf_dir), prompt="the cat sat on the", steps=4,
                                          backend="torch", kernels="fast")
    assert done.result["kernels"] == ["exact", "exact"] and "fast kernels" not in panel.summary.text()
    kl = np.asarray(done.result["kl"])
    assert kl.shape == (tiny_lm.cfg.n_layers + 1,) and np.all(np.abs(kl) < 1e-6)
    x, y = panel.kl_curve.getData()
    np.testing.assert_array_equal(y, kl)
    assert done.result["top1_flips"] == [] and "no step's greedy token differs" in panel.flips_label.text()
    assert "top-1 differs at 0 of 4 steps" in panel.summary.text()
    assert set(panel.results) == {"ablate", "patch", "attribute", "compare"}


def _hf_ablated_greedy(hf_dir, ids: list[int], heads, mlp_layers, n: int) -> tuple[np.ndarray, list[int]]:
    """By hand on Hugging Face transformers' Llama: the first step's probabilities and `n` greedy tokens with the
    heads' outputs (o_proj's input slices) and the MLPs' outputs zeroed in every forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hd = hf.config.hidden_size // hf.config.num_attention_heads
    hooks = []
    for layer, head in heads:
        def zero_head(_m, args, head=head):
            x = args[0].clone()
            x[..., head * hd:(head + 1) * hd] = 0.0
            return (x,)
        hooks.append(hf.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero_head))
    for layer in mlp_layers:
        hooks.append(hf.model.layers[layer].mlp.register_forward_hook(lambda _m, _a, out: torch.zeros_like(out)))
    seq, first = list(ids), None
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq]), use_cache=False).logits[0, -1].double()
            if first is None:
                first = torch.softmax(logits, -1).numpy()
            seq.append(int(logits.argmax()))
    for h in hooks:
        h.remove()
    return first, seq[len(ids):]


def test_an_ablation_continues_as_a_labelled_branch_from_the_ablated_model(qtbot, why_window, tiny_dir):
    """Continue as a branch generates from the ablation's prompt with the same parts ablated in every step: its first
    token's distribution is the result's `after`, and its greedy tokens are those of the same ablation done by hand
    on transformers' Llama, not those of the intact model; the run is named after what it lacks."""
    w = why_window()
    panel: WhyPanel = w.panels["why"]
    gen = w.panels["generation"]
    gen.max_tokens.setValue(4)
    gen.ignore_eos = True
    w.bridge.set_params(P.SamplingParams.greedy_params())
    assert not panel.continue_branch() and "run an ablation first" in panel._status

    # zeroing heads 1:2 and 0:1 and layer 0's MLP changes the tiny model's top-1 after this prompt
    panel.ablate_prompt.setText("the cat sat on the")
    panel.ablate_heads.setText("1:2, 0:1")
    panel.ablate_mlp.setText("0")
    panel.diff_a.setText("")  # no logit difference asked for
    done = run_and_wait(qtbot, panel, "ablate")
    assert done.ok and done.result["top1_changed"], done.result
    w.tick_panels(flush=True)
    assert panel.branch_button.isEnabled()

    store = w.run_store
    with qtbot.waitSignal(store.sig_finished, timeout=60_000):
        qtbot.mouseClick(panel.branch_button, QtCore.Qt.MouseButton.LeftButton)
    run = store.run(store.recording)
    assert run.name == "ablated 1:2, 0:1, MLP 0" and run.parent is None
    ids = [int(i) for i in run.prompt.ids]
    tokens = [t.token_id for t in run.tokens]
    assert len(tokens) == 4 and tokens[0] == done.result["after"]["ids"][0] != done.result["before"]["ids"][0]
    f = run.tokens[0].funnel
    after = dict(zip(done.result["after"]["ids"], done.result["after"]["probs"], strict=True))
    np.testing.assert_allclose([float(f.p_raw[list(f.ids).index(i)]) for i in after], list(after.values()),
                               rtol=1e-4, atol=1e-7)
    first, greedy = _hf_ablated_greedy(tiny_dir.hf_dir, ids, ((1, 2), (0, 1)), (0,), 4)
    assert tokens == greedy
    np.testing.assert_allclose(f.p_raw, first[f.ids], rtol=1e-3, atol=1e-6)
    w.tick_panels(flush=True)
    assert "ablated 1:2, 0:1, MLP 0" in panel.summary.text()
    tree = w.panels["branches"].tree
    assert [tree.topLevelItem(i).text(0) for i in range(tree.topLevelItemCount())] == ["ablated 1:2, 0:1, MLP 0"]

    # the same prompt without the ablation: the intact model's greedy tokens, which differ from the branch's
    with qtbot.waitSignal(store.sig_finished, timeout=60_000):
        w.bridge.generate(P.GenerateRequest("the cat sat on the", chat=False, max_new_tokens=4,
                                            params=P.SamplingParams.greedy_params(), ignore_eos=True))
    plain = [t.token_id for t in store.run(store.recording).tokens]
    assert plain[0] == done.result["before"]["ids"][0] and plain != tokens
    assert store.run(store.recording).name.startswith("run ")


def test_continue_as_a_branch_runs_on_llamacpp(tiny_dir, tiny_lm):
    """llama.cpp keeps the ablation on through its graph callback (engine.backends.llamacpp_seam.Writes): the branch
    runs, and its greedy tokens equal the torch engine's with the same parts ablated."""
    from engine.events import Failed, Finished
    from engine.run.session import Session
    from engine.why.ablate import Ablation, ablation
    from tests.engine.test_server import Client

    ref = Session(tiny_lm)
    ids = ref.tokenize("the cat sat on the").ids
    with ablation(ref, Ablation(mlp_layers=(0,)), ids):
        want = list(ref.generate(ids, P.SamplingParams.greedy_params(), 4, ignore_eos=True))[-1].ids.tolist()
    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32", backend="llama.cpp"))
        loaded = c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1]
        assert isinstance(loaded, P.Loaded) and loaded.runtime == "llama.cpp", loaded
        c.send(P.Generate(P.GenerateRequest("the cat sat on the", chat=False, max_new_tokens=4, ignore_eos=True,
                                            params=P.SamplingParams.greedy_params(),
                                            ablation=P.Ablated(mlp_layers=(0,)))))
        got = c.until(lambda m: isinstance(m, (Finished, Failed)))
        assert isinstance(got[-1], Finished), got[-1]
        assert got[-1].ids.tolist() == want
    finally:
        c.send(P.Quit())
        c.thread.join(30)


def test_a_failure_comes_back_as_one_line(qtbot, why_window):
    w = why_window()
    panel: WhyPanel = w.panels["why"]
    panel.repeat_spin.setValue(200)  # 2 · 200 tokens do not fit the tiny model's 256 positions
    done = run_and_wait(qtbot, panel, "heads")
    assert not done.ok and not done.cancelled and done.failure and "\n" not in done.failure
    assert "context" in done.failure
    assert "context" in panel.summary.text() and "heads" not in panel.results and panel.run_button.isEnabled()


def test_cancel_stops_a_long_experiment_midway_and_the_panel_says_so(qtbot, why_window, tiny_lm):
    """Integrated gradients with 1,024 points over a long prompt: hundreds of forward and backward passes, each
    reporting progress. Cancel after the first report stops it between two passes; nothing of it is kept."""
    w = why_window()
    panel: WhyPanel = w.panels["why"]
    prompt = "the cat sat on the mat and " * 20
    n = len(tiny_lm.tokenizer.encode(prompt).ids)
    assert 150 < n < tiny_lm.cfg.context_length
    panel.attr_prompt.setText(prompt)
    panel.method_combo.setCurrentIndex(panel.method_combo.findData("ig"))
    panel.steps_spin.setValue(1024)
    panel.set_mode("attribute")
    seen: list[float] = []
    w.bridge.sig_why_progress.connect(lambda f, _m: seen.append(f))
    assert panel.run()
    qtbot.waitUntil(lambda: any(f > 0 for f in seen), timeout=120_000)
    with qtbot.waitSignal(w.bridge.sig_why_done, timeout=120_000) as done:
        qtbot.mouseClick(panel.cancel_button, QtCore.Qt.MouseButton.LeftButton)
    outcome = done.args[0]
    assert outcome.cancelled and outcome.result is None and outcome.failure == ""
    assert 0 < max(seen) < 1, "the run was not stopped midway"
    panel.flush()
    assert "Cancelled after" in panel.summary.text() and "attribute" not in panel.results
    assert panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()
    assert panel.progress_bar.value() == 0


def test_cancel_before_the_engine_starts_an_experiment(qtbot, why_window):
    """An experiment queued behind a generation and cancelled meanwhile never runs."""
    w = why_window()
    panel: WhyPanel = w.panels["why"]
    panel.set_mode("heads")
    w.bridge.generate(P.GenerateRequest("the cat", chat=False, max_new_tokens=200, ignore_eos=True,
                                        params=P.SamplingParams.greedy_params()))
    with qtbot.waitSignal(w.bridge.sig_why_done, timeout=120_000) as done:
        assert panel.run()
        panel.cancel()
    assert done.args[0].cancelled and done.args[0].result is None
    qtbot.waitUntil(lambda: w.bridge.state == "idle", timeout=60_000)


@pytest.mark.qt_log_ignore("This plugin does not support")
def test_an_engine_that_dies_mid_experiment_ends_it_with_the_cause(qtbot, why_window):
    """SIGKILL during a long attribution: the panel learns why in one sentence and can run again."""
    import os
    import signal

    w = why_window()
    panel: WhyPanel = w.panels["why"]
    panel.attr_prompt.setText("the cat sat on the mat and " * 20)
    panel.method_combo.setCurrentIndex(panel.method_combo.findData("ig"))
    panel.steps_spin.setValue(1024)
    panel.set_mode("attribute")
    seen: list[float] = []
    w.bridge.sig_why_progress.connect(lambda f, _m: seen.append(f))
    assert panel.run()
    qtbot.waitUntil(lambda: bool(seen), timeout=120_000)
    with qtbot.waitSignal(w.bridge.sig_why_done, timeout=60_000) as done:
        os.kill(w.bridge.process.pid, signal.SIGKILL)
    outcome = done.args[0]
    assert not outcome.ok and not outcome.cancelled and "SIGKILL" in outcome.failure
    panel.flush()
    assert "SIGKILL" in panel.summary.text() and panel.run_button.isEnabled() and panel.running is None
    wait_loaded(qtbot, w, timeout=120_000)  # the new engine has the model again: the panel runs on it
    qtbot.waitUntil(lambda: w.bridge.info is not None and w.bridge.engine_running, timeout=120_000)
    assert run_and_wait(qtbot, panel, "heads").ok


def test_a_session_with_a_result_reopens_showing_it_and_exports_it(qtbot, why_window, tmp_path):
    live = why_window()
    panel: WhyPanel = live.panels["why"]
    done = run_and_wait(qtbot, panel, "heads")
    assert done.ok
    path = tmp_path / "why.ilab"
    assert session_io.save_session_to(live, path), live.last_error

    shown = why_window(load=False)  # no model in this window
    assert shown.bridge.info is None
    assert session_io.open_session_from(shown, path), shown.last_error
    again: WhyPanel = shown.panels["why"]
    assert again.mode() == "heads" and set(again.results) == {"heads"}
    shown.tick_panels(flush=True)
    for key, _ in SCORES:
        np.testing.assert_array_equal(again.heads_images[key].image, np.asarray(done.result["scores"][key]))
    assert "Strongest heads" in again.summary.text() and f"on {live.bridge.info.name}" in again.summary.text()

    # CSV and JSON: one row per score, layer and head
    for ext in (".csv", ".json"):
        assert exports.export_data_to(shown, "why", str(tmp_path / f"why{ext}")), shown.last_error
    rows = json.loads((tmp_path / "why.json").read_text())
    n_layers, n_heads = np.shape(done.result["scores"]["sink"])
    assert len(rows) == len(SCORES) * n_layers * n_heads
    sink = {(r["layer"], r["head"]): r["value"] for r in rows if r["score"] == "sink"}
    assert sink[(1, 3)] == pytest.approx(done.result["scores"]["sink"][1][3])
    with open(tmp_path / "why.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    assert exports.export_panel_to(shown, "why", str(tmp_path / "why.png")), shown.last_error
    assert exports.export_panel_to(shown, "why", str(tmp_path / "why.svg")), shown.last_error


def test_a_damaged_saved_result_is_skipped_with_a_sentence(qtbot, bridge):
    panel = WhyPanel(bridge)
    qtbot.addWidget(panel)
    good = {"kind": "attribute", "params": {}, "seconds": 1.0,
            "result": {"tokens": ["a", "b"], "scores": [0.5, -0.25], "method": "ig"}}
    bad = {"kind": "patch", "result": {"tokens": ["a"], "restored": [[1.0, 2.0]]}}
    problem = panel.restore_results([good, bad, {"kind": "rm -rf"}, "x"])
    assert set(panel.results) == {"attribute"} and panel.mode() == "attribute"
    assert "patch result is skipped: its grid and its tokens differ in width" in problem
    assert "names no experiment" in problem
    panel.flush()
    assert "skipped" in panel.summary.text()
    for kind in KINDS:
        with pytest.raises(ValueError):
            check_result(kind, {"scores": "nope"})


# ---- the engine's side of the seam, headless -------------------------------------------------------------------
def _outcome(client, params) -> P.ExperimentDone:
    client.send(P.Experiment(7, params))
    return client.until(lambda m: isinstance(m, P.ExperimentDone))[-1]


def test_the_engine_says_in_one_line_what_a_runtime_cannot_or_what_is_missing(tiny_dir):
    from tests.engine.test_server import Client

    c = Client()
    try:
        done = _outcome(c, P.HeadsParams())
        assert done.request_id == 7 and done.failure == "load a model first" and not done.unsupported
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32", backend="llama.cpp"))
        loaded = c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1]
        assert isinstance(loaded, P.Loaded) and loaded.runtime == "llama.cpp", loaded
        done = _outcome(c, P.AttributeParams("the cat sat on the", method="ig"))
        assert done.unsupported and done.result is None and "gradients" in done.failure and "\n" not in done.failure
        done = _outcome(c, P.AttributeParams("the cat sat on the", method="occlusion"))
        assert done.ok, done.failure  # occlusion needs forward passes only: llama.cpp runs it
        assert len(done.result["scores"]) == len(done.result["tokens"]["ids"])
        done = _outcome(c, P.CompareParams(other=str(tiny_dir.gguf) + ".missing", prompt="the cat"))
        assert not done.ok and not done.unsupported and "\n" not in done.failure and done.failure
        assert done.failure.startswith("cannot load the other model: model file not found")
    finally:
        c.send(P.Quit())
        c.thread.join(30)
