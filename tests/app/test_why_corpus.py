"""The Why panel's compare over a corpus: sent as CompareParams(corpus=…), run in the engine process, drawn as the
two sorted per-position curves (KL, Δp) with the statistics beside them, kept in a session and exported; a bad
corpus file comes back as one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from app import exports, session_io
from app.panels.why import WhyPanel, check_result
from engine import protocol as P
from tests.app.conftest import wait_loaded
from tests.tiny_model import random_hf_weights, write_gguf

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support raise")  # docks raised offscreen

TEXT = ("the cat sat on the mat and the dog sat on the log; a bird sang in the tree while the sun went down. "
        "then the rain came and the cat ran in, the dog did too, and the bird flew off to a dry nest. ") * 3


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    g = torch.Generator().manual_seed(1)
    w = {k: v + 0.08 * v.std() * torch.randn(v.shape, generator=g) for k, v in random_hf_weights(0).items()}
    return write_gguf(tmp_path_factory.mktemp("perturbed") / "tiny-perturbed.gguf", w)


def _window(qtbot, make_window, load=True):
    w = make_window(persist=False)
    w.resize(1600, 1000)
    if load:
        wait_loaded(qtbot, w)
    w.docks["why"].show()
    w.docks["why"].raise_()
    return w


def _run(qtbot, panel: WhyPanel) -> P.ExperimentDone:
    panel.set_mode("compare")
    progress = []
    panel.bridge.sig_why_progress.connect(lambda f, m: progress.append(m))
    with qtbot.waitSignal(panel.bridge.sig_why_done, timeout=120_000) as done:
        assert panel.run(), panel.summary_html()
    panel.flush()
    panel.progress_seen = progress
    return done.args[0]


def test_a_corpus_comparison_is_drawn_kept_and_exported(qtbot, make_window, perturbed, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    w = _window(qtbot, make_window)
    panel: WhyPanel = w.panels["why"]
    panel.other_edit.setText(str(perturbed))
    panel.other_backend.setCurrentIndex(panel.other_backend.findData("torch"))
    panel.corpus_edit.setText(str(corpus))
    panel.corpus_window.setValue(32)
    panel.corpus_tokens.setValue(96)
    panel.corpus_lens.setChecked(True)
    done = _run(qtbot, panel)
    assert done.ok, done.failure
    assert done.params == P.CompareParams(other=str(perturbed), prompt=panel.compare_prompt.text(), backend="torch",
                                          kernels=panel.other_kernels.currentData(), corpus=str(corpus), window=32,
                                          max_tokens=96, lens=True)
    r = done.result
    assert r["mode"] == "corpus" and r["windows"] == 3 and r["positions"] == 45
    assert "window 3 of 3: 45 positions compared" in panel.progress_seen
    w.tick_panels(flush=True)
    assert panel.compare_pages.currentIndex() == 1
    x, y = panel.corpus_kl_curve.getData()
    kl = np.asarray(r["kl_quantiles"])
    np.testing.assert_allclose(10 ** y if panel.corpus_kl_plot.ctrl.logYCheck.isChecked() else y, kl[kl > 0],
                               rtol=1e-12)
    _, dp = panel.corpus_dp_curve.getData()
    np.testing.assert_allclose(dp, 100 * np.asarray(r["delta_p_quantiles"]), rtol=1e-12)
    lens = np.asarray(r["lens"]["kl"])
    assert len(lens) == 3 and panel.corpus_lens_plot.scene() is not None
    _, y = panel.corpus_lens_curve.getData()
    np.testing.assert_allclose(10 ** y if panel.corpus_lens_plot.ctrl.logYCheck.isChecked() else y, lens[lens > 0],
                               rtol=1e-12)
    stats = panel.corpus_label.text()
    assert f"PPL a <b>{r['ppl'][0]:.4g}</b>, b <b>{r['ppl'][1]:.4g}</b>" in stats and "RMS" in stats
    assert "corpus.txt: 96 tokens in 3 windows of 32" in panel.summary.text()

    rows = panel.export_rows("compare")
    by_name = {row["statistic"]: row["value"] for row in rows}
    assert by_name["ppl_b"] == r["ppl"][1] and by_name["kl_p99_9"] == r["kl_stats"]["p99_9"]
    assert by_name["delta_p_rms"] == r["delta_p"]["rms"] and by_name["same_top"] == r["same_top"]
    assert by_name["lens_kl_layer_2"] == r["lens"]["kl"][2] and by_name["lens_kl_embedding"] == r["lens"]["kl"][0]
    assert exports.export_data_to(w, "why", str(tmp_path / "why.json")), w.last_error
    assert json.loads((tmp_path / "why.json").read_text()) == json.loads(json.dumps(rows))

    # a session keeps it and reopens on the corpus page; the prompt comparison's page comes back for a prompt result
    path = tmp_path / "corpus.ilab"
    assert session_io.save_session_to(w, path), w.last_error
    shown = _window(qtbot, make_window, load=False)
    assert session_io.open_session_from(shown, path), shown.last_error
    again: WhyPanel = shown.panels["why"]
    shown.tick_panels(flush=True)
    assert again.mode() == "compare" and again.compare_pages.currentIndex() == 1
    np.testing.assert_allclose(again.corpus_dp_curve.getData()[1], dp)
    assert exports.export_panel_to(shown, "why", str(tmp_path / "why.png")), shown.last_error


def test_a_bad_corpus_is_one_line_and_a_damaged_result_is_refused(qtbot, make_window, tmp_path, tiny_dir):
    w = _window(qtbot, make_window)
    panel: WhyPanel = w.panels["why"]
    panel.other_edit.setText(str(tiny_dir.gguf))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    panel.corpus_edit.setText(str(empty))
    done = _run(qtbot, panel)
    assert not done.ok and done.failure == "empty.txt holds no text to compare on (it is empty)"
    assert "holds no text" in panel.summary.text()
    panel.corpus_window.setValue(64)
    panel.corpus_tokens.setValue(32)
    assert not panel.run() and "32 tokens make no whole window of 64" in panel.summary_html()
    with pytest.raises(ValueError, match="lacks kl_stats"):
        check_result("compare", {"mode": "corpus", "ppl": [1.0, 1.0], "same_top": 1.0, "delta_p": {},
                                 "kl_quantiles": [], "delta_p_quantiles": []})
    with pytest.raises(ValueError, match="differ in number"):
        check_result("compare", {"mode": "corpus", "ppl": [1.0, 1.0], "same_top": 1.0, "delta_p": {},
                                 "kl_stats": {}, "kl_quantiles": [0.0], "delta_p_quantiles": []})
