"""The Why panel's logit attribution, its patch toggle (exact, AtP, both) and its gallery (issue 47): each request goes
to the engine process and back; what is drawn equals the engine's functions called here on the same model (DLA and
AtP are held to TransformerLens in tests/why/), clicks on a head select it in the Attention panel, llama.cpp's refusal
of gradients is one sentence beside the toggle, and results are kept in sessions. The gallery runs on the default
model and on Gemma 3 (slow), checked against what patching and DLA must give by construction."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PySide6 import QtCore

from app import exports, session_io
from app.panels.why import KINDS, MODE_KINDS, WhyPanel, check_result
from engine import protocol as P
from engine.why.gallery import GALLERY, NAMES
from tests.app.conftest import wait_loaded
from tests.app.test_why_panel import run_and_wait

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")  # docks raised offscreen

PROMPT, ANSWER, WRONG = "zq vx kj wy", "k", "j"  # tests/why/test_dla.py's, on the tiny vocabulary
CLEAN, CORRUPT = "zq vx kj wy", "zq vx kb wy"  # tests/why/test_atp.py's: 10 tokens each


@pytest.fixture
def why_window(qtbot, make_window):
    def make(model=None, load=True, timeout=180_000):
        w = make_window(model, persist=False, load=load)
        w.resize(1600, 1000)
        if load:
            wait_loaded(qtbot, w, timeout=timeout)  # a real model's first load converts it (minutes on a busy box)
        w.docks["why"].show()
        w.docks["why"].raise_()
        return w

    return make


def click(qtbot, view, scene_pos: QtCore.QPointF) -> None:
    qtbot.mouseClick(view.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=view.mapFromScene(scene_pos))


# ---- direct logit attribution ------------------------------------------------------------------------------------
def test_dla_heatmap_equals_the_engines_result_and_a_click_selects_the_head(qtbot, why_window, tiny_lm, tmp_path):
    from engine.run.session import Session
    from engine.why.dla import dla

    w = why_window()
    panel: WhyPanel = w.panels["why"]
    panel.dla_prompt.setText(PROMPT)
    w.docks["why"].setFloating(True)  # the picture at the end: the panel alone, at a readable size
    w.docks["why"].resize(1200, 800)
    panel.dla_answer.setText(ANSWER)
    panel.dla_wrong.setText(WRONG)
    done = run_and_wait(qtbot, panel, "dla")
    assert done.ok and done.kind == "dla", done.failure
    assert done.params == P.DlaParams(PROMPT, ANSWER, WRONG, step=0, chat=False)
    here = dla(Session(tiny_lm), PROMPT, ANSWER, WRONG)
    L, H = tiny_lm.cfg.n_layers, tiny_lm.cfg.n_heads
    shown = panel.dla_images["heads"].image
    assert shown.shape == (L, H) and np.ptp(shown) > 0.1
    np.testing.assert_allclose(shown, np.asarray(here["heads"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(panel.dla_images["mlp"].image[:, 0], here["mlp"], rtol=1e-5, atol=1e-6)
    assert panel.dla_images["embeddings"].image[0, 0] == pytest.approx(here["embeddings"], rel=1e-5, abs=1e-6)
    # one colour scale, symmetric about 0, so that a sign reads the same everywhere
    top = max(np.abs(here["heads"]).max(), np.abs(here["mlp"]).max(), abs(here["embeddings"]))
    assert panel.dla_images["heads"].levels == pytest.approx((-top, top), rel=1e-5)
    text = panel.summary.text()
    assert "logit difference 'k' − 'j' at step 0" in text and "frozen-norm error" in text
    assert f"on {w.bridge.info.name}" in text

    vb = panel.dla_item.getViewBox()
    # hover: the MLP column and the embeddings' cell say their values
    panel._on_dla_hover(vb.mapViewToScene(QtCore.QPointF(H + 1.0, 1.5)))
    assert f"layer 1's MLP: {here['mlp'][1]:+.4f}" in panel.dla_hover.text()
    panel._on_dla_hover(vb.mapViewToScene(QtCore.QPointF(H + 1.0, L + 1.0)))
    assert f"the embeddings: {here['embeddings']:+.4f}" in panel.dla_hover.text()
    # a real click on head 1:3 selects it in the Attention panel
    attention = w.panels["attention"]
    attention.layer_spin.setValue(0)
    attention.head_spin.setValue(0)
    w.tick_panels(flush=True)
    qtbot.wait(50)
    pos = vb.mapViewToScene(QtCore.QPointF(3.5, 1.5))
    assert panel.dla_cell_at(pos) == ("head", 1, 3)
    panel._on_dla_hover(pos)
    assert f"head 1:3 (click: its attention): {here['heads'][1][3]:+.4f}" in panel.dla_hover.text()
    with qtbot.waitSignal(panel.sig_show_head, timeout=2_000) as clicked:
        click(qtbot, panel.dla_plot, pos)
    assert clicked.args == [1, 3] and (attention.layer(), attention.head()) == (1, 3)
    w.tick_panels(flush=True)
    assert panel.dla_box.isVisible() and panel.dla_box.rect() == QtCore.QRectF(3, 1, 1, 1)
    # the MLP column is no head: a click there selects nothing
    assert panel.dla_cell_at(vb.mapViewToScene(QtCore.QPointF(H + 1.0, 0.5))) == ("mlp", 0, -1)

    rows = panel.export_rows()
    assert len(rows) == L * H + L + 1 and rows[-1]["component"] == "embeddings"
    assert rows[H + 2]["contribution"] == pytest.approx(here["heads"][1][2], rel=1e-5, abs=1e-6)
    assert exports.export_panel_to(w, "why", str(tmp_path / "dla.png")), w.last_error


def test_dla_bad_input_is_one_line(qtbot, why_window):
    w = why_window()
    panel: WhyPanel = w.panels["why"]
    panel.set_mode("dla")
    panel.dla_wrong.setText("")
    assert not panel.run()
    panel.flush()
    assert "name the two tokens" in panel.summary.text()
    panel.dla_wrong.setText("kj wy")  # two tokens: the engine says so
    done = run_and_wait(qtbot, panel, "dla")
    assert not done.ok and "must be one token" in done.failure and "\n" not in done.failure
    assert "must be one token" in panel.summary.text() and "dla" not in panel.results


# ---- attribution patching beside exact patching ------------------------------------------------------------------
def test_the_patch_toggle_runs_atp_alone_and_beside_the_exact_grid(qtbot, why_window, tiny_lm, tmp_path):
    from engine.run.session import Session
    from engine.why.atp import atp_grids
    from engine.why.patch import patch

    w = why_window()
    panel: WhyPanel = w.panels["why"]
    w.docks["why"].setFloating(True)  # the picture of both grids: the panel alone, at a readable size
    w.docks["why"].resize(1200, 800)
    here = Session(tiny_lm)
    ref_atp = atp_grids(here, CLEAN, CORRUPT, ANSWER, WRONG, heads=True)
    ref_exact = patch(here, CLEAN, CORRUPT, ANSWER, WRONG)
    panel.clean_edit.setText(CLEAN)
    panel.corrupt_edit.setText(CORRUPT)
    panel.answer_edit.setText(ANSWER)
    panel.wrong_edit.setText(WRONG)
    panel.set_mode("patch")

    # AtP alone: one backward pass, its grid and its per-head grid drawn
    panel.patch_method.setCurrentIndex(panel.patch_method.findData("atp"))
    panel.patch_heads_box.setChecked(True)
    done = run_and_wait(qtbot, panel, "patch")
    assert done.ok and done.kind == "atp", done.failure
    assert done.params == P.AtpParams(CLEAN, CORRUPT, ANSWER, WRONG, heads=True, exact=False)
    assert "restored" not in done.result and set(panel.results) == {"atp"}
    w.tick_panels(flush=True)
    np.testing.assert_allclose(panel.patch_image.image, np.asarray(ref_atp["atp"]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(panel.patch_heads_image.image, np.asarray(ref_atp["atp_heads"]), rtol=1e-4, atol=1e-6)
    assert panel._patch_placed == ("heads",) and panel.patch_heads_item.scene() is panel.patch_plot.scene()
    assert "no exact grid" in panel.summary.text()
    vb = panel.patch_item.getViewBox()
    panel._on_patch_hover(vb.mapViewToScene(QtCore.QPointF(7.5, 1.5)))
    assert f"AtP estimates {ref_atp['atp'][1][7]:+.3f}" in panel.patch_hover.text()
    # along the path between the prompts' embeddings (EAP-IG): the spin's steps reach the engine
    assert panel.ig_steps.isEnabled()
    panel.ig_steps.setValue(4)
    done = run_and_wait(qtbot, panel, "patch")
    assert done.ok and done.params.ig_steps == 4 and done.result["ig_steps"] == 4, done.failure
    w.tick_panels(flush=True)
    path = atp_grids(here, CLEAN, CORRUPT, ANSWER, WRONG, ig_steps=4)
    np.testing.assert_allclose(panel.patch_image.image, np.asarray(path["atp"]), rtol=1e-4, atol=1e-5)
    assert "AtP along the path, 4 steps (6 forwards, 4 backwards)" in panel.summary.text()
    panel.ig_steps.setValue(0)

    # both: the exact grid, AtP's beside it, their correlation and the cells where they part outlined
    panel.patch_method.setCurrentIndex(panel.patch_method.findData("both"))
    panel.patch_heads_box.setChecked(False)
    done = run_and_wait(qtbot, panel, "patch")
    assert done.ok and done.kind == "atp" and done.params.exact, done.failure
    w.tick_panels(flush=True)
    exact, est = np.asarray(ref_exact["restored"]), np.asarray(ref_atp["atp"])
    np.testing.assert_allclose(panel.patch_image.image, exact, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(panel.patch_atp_image.image, est, rtol=1e-4, atol=1e-6)
    assert panel._patch_placed == ("atp",) and panel.patch_atp_item.scene() is panel.patch_plot.scene()
    assert panel.patch_heads_item.scene() is None
    r = float(np.corrcoef(est.ravel(), exact.ravel())[0, 1])  # Pearson by numpy, not the engine's
    assert f"Pearson r with the exact grid <b>{r:.3f}</b>" in panel.summary.text()
    far = done.result["disagree"]
    gap = np.abs(est - exact)
    assert abs(far[0]["difference"]) == pytest.approx(gap.max(), abs=1e-5)
    # outlined: the engine's top cells whose two values part by at least 5 % of the clean–corrupt difference
    outlined = [(rect.rect().y(), rect.rect().x()) for rect in panel.patch_outlines["atp"] if rect.isVisible()]
    apart = int((gap >= 0.05).sum())
    assert 0 < apart < len(far) and len(outlined) == apart  # here the engine's 8 include cells that agree
    assert outlined == [(d["layer"], d["position"]) for d in far][:apart]
    assert {(int(y), int(x)) for y, x in outlined} == {
        tuple(int(v) for v in divmod(int(i), gap.shape[1])) for i in np.argsort(-gap, axis=None)[:apart]}
    assert [rect.isVisible() for rect in panel.patch_outlines["main"]] == [i < apart for i in range(len(far))]
    pos = panel.patch_atp_item.getViewBox().mapViewToScene(QtCore.QPointF(8.5, 2.5))
    assert panel.patch_cell_at(pos) == ("atp", 2, 8)
    panel._on_patch_hover(pos)
    assert f"(exact {exact[2, 8]:+.3f})" in panel.patch_hover.text()
    rows = panel.export_rows()
    assert len(rows) == exact.size and rows[8]["exact"] == pytest.approx(exact[0, 8], abs=1e-5)
    assert exports.export_panel_to(w, "why", str(tmp_path / "atp-both.png")), w.last_error

    # the toggle on exact shows the exact result, which has not run yet; exact runs PatchParams as before
    panel.patch_method.setCurrentIndex(panel.patch_method.findData("exact"))
    w.tick_panels(flush=True)
    assert panel.patch_image.image is None and panel._patch_placed == () and not panel.ig_steps.isEnabled()
    done = run_and_wait(qtbot, panel, "patch")
    assert done.ok and done.kind == "patch" and set(panel.results) == {"atp", "patch"}
    assert all(not rect.isVisible() for rect in panel.patch_outlines["main"])


def test_atp_on_llamacpp_is_refused_in_one_sentence_beside_the_toggle(qtbot, bridge, tiny_dir):
    """llama.cpp runs no backward pass: the engine refuses attribution patching with engine.backend.require's
    sentence, and the panel shows it under the toggle while AtP or both is chosen."""
    from tests.engine.test_server import Client
    from tests.requires import import_required

    import_required("llama_cpp", name="llamacpp", dist="llama-cpp-python")
    c = Client()
    try:
        c.send(P.Load(str(tiny_dir.gguf), "cpu", "float32", backend="llama.cpp"))
        loaded = c.until(lambda m: isinstance(m, (P.Loaded, P.LoadFailed)))[-1]
        assert isinstance(loaded, P.Loaded) and loaded.runtime == "llama.cpp", loaded
        for exact in (False, True):
            c.send(P.Experiment(3, P.AtpParams(CLEAN, CORRUPT, ANSWER, WRONG, exact=exact)))
            done = c.until(lambda m: isinstance(m, P.ExperimentDone))[-1]
            assert done.unsupported and done.result is None and "\n" not in done.failure
            assert done.failure.startswith("attribution patching needs gradients") and "--backend torch" in done.failure
        c.send(P.Experiment(4, P.PatchParams(CLEAN, CORRUPT, ANSWER, WRONG)))
        assert c.until(lambda m: isinstance(m, P.ExperimentDone))[-1].ok  # exact patching runs there
    finally:
        c.send(P.Quit())
        c.thread.join(30)

    panel = WhyPanel(bridge)
    qtbot.addWidget(panel)
    panel.set_mode("patch")
    panel.patch_method.setCurrentIndex(panel.patch_method.findData("both"))
    panel.running = 3
    panel._on_done(done)
    panel.flush()
    assert done.failure in panel.summary.text()
    panel._status = ""  # the failure line goes (another run); the toggle still says why
    panel.flush()
    assert done.failure in panel.summary.text()
    panel.patch_method.setCurrentIndex(panel.patch_method.findData("exact"))
    panel.flush()
    assert done.failure not in panel.summary.text()


# ---- the gallery -------------------------------------------------------------------------------------------------
def test_the_gallery_page_says_what_each_experiment_shows(qtbot, bridge):
    panel = WhyPanel(bridge)
    qtbot.addWidget(panel)
    panel.set_mode("gallery")
    assert panel.gallery.list.count() == len(GALLERY) == 4
    for e in GALLERY:
        panel.gallery.choose(e.name)
        text = panel.gallery.words()
        assert e.title in text and "What to look for" in text and len(e.shows) > 100 and len(e.look_for) > 100
        assert panel.params() == P.GalleryParams(e.name)
    assert panel.views.currentWidget() is panel.gallery_note  # nothing run yet


def test_gallery_on_the_tiny_model_runs_what_it_can_and_says_why_not_in_one_line(qtbot, why_window, tmp_path):
    """The tiny vocabulary has no names of one token: the indirect-object entry says so; induction and greater-than
    run, are drawn in their own views, are kept in a session and come back from it."""
    w = why_window()
    panel: WhyPanel = w.panels["why"]
    panel.set_mode("gallery")
    panel.gallery.choose("ioi")
    done = run_and_wait(qtbot, panel, "gallery")
    assert not done.ok and "none of the name pairs" in done.failure and "\n" not in done.failure
    assert "none of the name pairs" in panel.summary.text()

    panel.gallery.choose("induction")
    done = run_and_wait(qtbot, panel, "gallery")
    assert done.ok, done.failure
    r = done.result
    assert r["name"] == "induction" and r["kind"] == "heads" and r["params"] == {"repeat": 24, "seed": 0}
    w.tick_panels(flush=True)
    assert panel.views.currentIndex() == MODE_KINDS.index("heads")
    np.testing.assert_array_equal(panel.heads_images["induction"].image, np.asarray(r["result"]["scores"]["induction"]))
    ab = r["result"]["ablation"]
    assert len(ab["heads"]) == 2  # a quarter of the tiny model's 8 heads
    assert "Second copy's loss" in panel.summary.text() and f"{ab['loss_ablated']:.3f}" in panel.summary.text()
    assert "Result kept" in panel.gallery.words() and panel.gallery.list.item(0).text().endswith("✓")
    assert "heads" not in panel.results  # the head-roles mode keeps its own result

    panel.gallery.choose("greater-than")
    assert panel.views.currentWidget() is panel.gallery_note
    # one click more than choosing: a double-click on the entry runs it
    item = panel.gallery.list.item(2)
    at = panel.gallery.list.visualItemRect(item).center()
    with qtbot.waitSignal(w.bridge.sig_why_done, timeout=120_000) as finished:
        # a double-click as the window system sends it: a click, then the second press as a double-click
        qtbot.mouseClick(panel.gallery.list.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=at)
        qtbot.mouseDClick(panel.gallery.list.viewport(), QtCore.Qt.MouseButton.LeftButton, pos=at)
    done = finished.args[0]
    panel.flush()
    assert done.ok, done.failure
    dla = done.result["result"]
    w.tick_panels(flush=True)
    assert panel.views.currentIndex() == MODE_KINDS.index("dla")
    np.testing.assert_array_equal(panel.dla_images["heads"].image, np.asarray(dla["heads"]))
    p = done.result["params"]
    assert p["prompt"].endswith("to the year 17") and int(p["answer"]) > 5 > int(p["wrong"])  # tens digits here
    # clicking a head in the gallery's DLA view selects it too
    pos = panel.dla_item.getViewBox().mapViewToScene(QtCore.QPointF(2.5, 0.5))
    with qtbot.waitSignal(panel.sig_show_head, timeout=2_000) as clicked:
        click(qtbot, panel.dla_plot, pos)
    assert clicked.args == [0, 2]
    panel.gallery.choose("induction")
    assert panel.views.currentIndex() == MODE_KINDS.index("heads")

    saved = panel.saved_results()
    assert [e["kind"] for e in saved] == ["gallery", "gallery"]
    path = tmp_path / "gallery.ilab"
    assert session_io.save_session_to(w, path), w.last_error
    shown = why_window(load=False)
    assert session_io.open_session_from(shown, path), shown.last_error
    again: WhyPanel = shown.panels["why"]
    assert set(again.gallery_results) == {"induction", "greater-than"} and again.mode() == "gallery"
    shown.tick_panels(flush=True)
    assert again.gallery.name() == "induction"
    np.testing.assert_array_equal(again.heads_images["induction"].image,
                                  np.asarray(r["result"]["scores"]["induction"]))
    assert exports.export_data_to(shown, "why", str(tmp_path / "why.json")), shown.last_error
    rows = json.loads((tmp_path / "why.json").read_text())
    assert len(rows) == 4 * 2 * 4  # four scores × the tiny model's layers × heads


def test_damaged_gallery_and_new_results_are_refused_in_one_sentence(qtbot, bridge):
    panel = WhyPanel(bridge)
    qtbot.addWidget(panel)
    good = {"kind": "gallery", "seconds": 1.0, "params": {"name": "greater-than"},
            "result": {"name": "greater-than", "kind": "dla", "params": {},
                       "result": {"heads": [[0.5, -0.5]], "mlp": [0.1], "embeddings": 0.0, "logit_diff": 0.1,
                                  "sum": 0.1, "answer": {"token": "6"}, "wrong": {"token": "1"}}}}
    bad_kind = {"kind": "gallery", "result": {"name": "greater-than", "kind": "compare", "params": {}, "result": {}}}
    bad_name = {"kind": "gallery", "result": {"name": "rm -rf", "kind": "dla", "params": {}, "result": {}}}
    bad_atp = {"kind": "atp", "result": {"tokens": ["a"], "atp": [[1.0, 2.0]]}}
    bad_dla = {"kind": "dla", "result": {"heads": [[1.0]], "mlp": [1.0, 2.0], "embeddings": 0, "logit_diff": 0,
                                         "sum": 0}}
    problem = panel.restore_results([good, bad_kind, bad_name, bad_atp, bad_dla])
    assert set(panel.gallery_results) == {"greater-than"} and panel.mode() == "gallery"
    assert "does not say which experiment it ran" in problem and "names no experiment of the gallery" in problem
    assert "its grid and its tokens differ in width" in problem and "its heads and its MLPs differ" in problem
    for kind in (*KINDS, "gallery"):
        with pytest.raises(ValueError):
            check_result(kind, {"scores": "nope"})


# ---- the gallery on the real models --------------------------------------------------------------------------------
def _check_gallery_result(name: str, r: dict, n_layers: int, n_heads: int) -> None:
    """What each experiment must give by construction, whatever the model."""
    res = r["result"]
    if name == "induction":
        assert np.shape(res["scores"]["induction"]) == (n_layers, n_heads)
        ab = res["ablation"]
        assert ab["loss_ablated"] > ab["loss_control"] and ab["loss_ablated"] > 2 * ab["loss"], ab
    elif name == "greater-than":
        assert np.shape(res["heads"]) == (n_layers, n_heads)
        assert abs(res["frozen_norm_error"]) < 1e-3 and res["logit_diff"] > 0  # the later year is the likelier
    else:
        grid = np.asarray(res["restored"])
        assert grid.shape[0] == n_layers + 1
        # patching the last block's output at the last position hands over the clean logits: all of it restored
        assert grid[-1, -1] == pytest.approx(1.0, abs=1e-3)
        assert res["clean_logit_diff"] > 0 > res["corrupt_logit_diff"], (res["clean_logit_diff"],
                                                                        res["corrupt_logit_diff"])
        if name == "ioi":  # one position differs (the repeated name): its embedding alone restores everything
            ids = res["ids"]
            differ = [i for i, (a, b) in enumerate(zip(ids["clean"], ids["corrupt"], strict=True)) if a != b]
            assert len(differ) == 1 and grid[0, differ[0]] == pytest.approx(1.0, abs=1e-3)
            assert np.shape(res["restored_heads"]) == (n_layers, n_heads)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "gemma3"])
def test_every_gallery_experiment_runs_on_the_real_models(qtbot, why_window, model, tmp_path):
    """Each entry set up for the model and run in the app, its result drawn in its view and checked against what it
    must give by construction; a picture of the panel per entry (pytest --basetemp keeps them to look at)."""
    from tests.requires import default_model, gemma3

    w = why_window(default_model() if model == "default" else gemma3(), timeout=600_000)
    panel: WhyPanel = w.panels["why"]
    info = w.bridge.info
    dock = w.docks["why"]  # the pictures: the panel alone, at a size that a reader sees it at
    dock.setFloating(True)
    dock.resize(1400, 900)
    panel.set_mode("gallery")
    for name in NAMES:
        panel.gallery.choose(name)
        done = run_and_wait(qtbot, panel, "gallery", timeout=600_000)
        assert done.ok, f"{name}: {done.failure}"
        r = done.result
        _check_gallery_result(name, r, info.n_layers, info.n_heads)
        w.tick_panels(flush=True)
        view = "patch" if r["kind"] == "patch" else r["kind"]
        assert panel.views.currentIndex() == MODE_KINDS.index(view)
        if r["kind"] == "patch":
            np.testing.assert_array_equal(panel.patch_image.image, np.asarray(r["result"]["restored"]))
        elif r["kind"] == "dla":
            np.testing.assert_array_equal(panel.dla_images["heads"].image, np.asarray(r["result"]["heads"]))
        else:
            np.testing.assert_array_equal(panel.heads_images["induction"].image,
                                          np.asarray(r["result"]["scores"]["induction"]))
        assert f"on {info.name}" in panel.summary.text()
        png = tmp_path / f"gallery-{model}-{name}.png"
        assert exports.export_panel_to(w, "why", str(png)), w.last_error
        assert png.stat().st_size > 10_000
    assert set(panel.gallery_results) == set(NAMES) and len(panel.saved_results()) == len(NAMES)
