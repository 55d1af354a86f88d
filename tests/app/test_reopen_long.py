"""A long run's session reopened without the model (issue 26): the Attention panel draws a step it kept, weights held to
the float64 reference, the moment the step is selected, and names the steps that were not kept; benchmarks.reopen
runs end to end on the tiny model (and rewrites an older file in the current format)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app import run_store, session_io
from tests.app.conftest import wait_loaded
from tests.app.test_recompute_panels import generate
from tests.tiny_model import reference_logits

pytestmark = pytest.mark.qt_log_ignore("This plugin does not support")  # offscreen


def test_a_reopened_long_session_draws_a_kept_step_at_once_and_names_the_dropped_ones(qtbot, make_window, tiny_dir,
                                                                                       tmp_path, monkeypatch):
    from app.panels import attention

    monkeypatch.setattr(run_store, "ATTENTION_BYTES", 64 << 10)  # small budgets, so a short run drops steps
    monkeypatch.setattr(attention, "MATRIX_BYTES", 32 << 10)
    live = make_window(persist=False)
    wait_loaded(qtbot, live)
    fin = generate(qtbot, live, "hello world, this is a test", 90)
    dropped = live.run_store.shown_run().dropped
    assert dropped is not None
    path = tmp_path / "long.ilab"
    assert session_io.save_session_to(live, path), live.last_error

    shown = make_window(persist=False, load=False)  # no model in this window
    assert session_io.open_session_from(shown, path), shown.last_error
    run = shown.run_store.shown_run()
    assert run.dropped == dropped
    att = shown.panels["attention"]
    shown.tick_panels(flush=True)
    lo, hi = dropped
    assert f"steps {lo:,}–{hi:,} were dropped to bound memory" in att.status.text()

    step = run.n_tokens - 1  # the newest step: kept by the store and by the panel
    assert att.row_held(step)
    before = att.draw_count
    shown.bridge.select_step(step)  # as a click on a token does; no draw tick runs before the checks below
    assert att.draw_count == before + 1

    ids = [int(i) for i in fin.prompt_ids] + [int(i) for i in fin.ids]
    ref: dict = {}
    reference_logits(tiny_dir.hf_weights, ids[:-1], attention=ref)
    p = len(fin.prompt_ids) + step - 1  # the step's query position
    row = att.matrix()[:, p - att.first_row(), : p + 1]
    np.testing.assert_allclose(row, ref[att.layer()][:, p, : p + 1].numpy(), atol=2e-5, rtol=0)
    drawn = np.sqrt(np.clip(row[att.head()], 0, None))  # the panel's √ scale, the heat map's row of that step
    np.testing.assert_allclose(att.image.image[p - att.first_row(), : p + 1], drawn, rtol=1e-6)

    # a dropped step: the panel does not invent it (no KV cache behind a file), and says which steps it holds
    shown.bridge.select_step((lo + hi) // 2)
    assert not att.row_held((lo + hi) // 2) and att.recomputed_row() is None and not att._asked
    assert f"steps {lo:,}–{hi:,} were dropped" in att.status.text()


def test_the_reopen_benchmark_runs_end_to_end(tiny_dir, tmp_path):
    """benchmarks/reopen.py in subprocesses on the tiny model: a short run made and a step selected, then the file
    reopened without the model: one JSON line each; benchmarks/save_stall.py saves it four times."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), QT_QPA_PLATFORM="offscreen")
    path = tmp_path / "run.ilab"
    r = subprocess.run([sys.executable, "-m", "benchmarks.reopen", "--make", str(path), "--tokens", "20", "--step",
                        "10", "--layers", "0", "--model", str(tiny_dir.gguf)], capture_output=True, text=True, env=env,
                       cwd=root, timeout=300)
    assert r.returncode == 0, "\n".join(ln for ln in r.stderr.splitlines() if "propagateSizeHints" not in ln)[-2000:]
    made = json.loads(r.stdout.strip().splitlines()[-1])
    assert made["tokens"] == 20 and path.stat().st_size == made["session_bytes"]
    assert made["cases"] and all(c["ok"] and c["painted_ms"] >= c["drawn_ms"] > 0 for c in made["cases"])
    assert [(c["step"], c["layer"], c["action"]) for c in made["cases"]] == [(10, 0, "select"), (10, 1, "layer"),
                                                                             (19, 1, "select")]
    r = subprocess.run([sys.executable, "-m", "benchmarks.reopen", "--open", str(path)], capture_output=True,
                       text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, "\n".join(ln for ln in r.stderr.splitlines() if "propagateSizeHints" not in ln)[-2000:]
    opened = json.loads(r.stdout.strip().splitlines()[-1])
    assert opened["tokens"] == 20 and opened["model"] == made["model"]  # the session's facts stand in for it
    assert opened["from_process_start_s"] > opened["open_s"] >= opened["replay_done_s"] >= opened["read_s"] > 0
    assert opened["peak_rss_mib"] >= opened["rss_window_ready_mib"] > 0
    assert opened["kept_step_selected"]["ok"] and opened["kept_step_selected"]["shown"] == "held"
    # benchmarks/save_stall.py: the same file saved through the writer, without its freeze and as the app does, then
    # while panels redraw at Python's GIL switch interval and at a shorter one
    r = subprocess.run([sys.executable, "-m", "benchmarks.save_stall", "--open", str(path)], capture_output=True,
                       text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, "\n".join(ln for ln in r.stderr.splitlines() if "propagateSizeHints" not in ln)[-2000:]
    saves = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [s["how"] for s in saves] == ["without the writer's freeze", "as the app does",
                                         "panels redrawing, as the app does",
                                         "panels redrawing, a shorter GIL switch interval"]
    assert [s["gil_switch_ms"] for s in saves] == [sys.getswitchinterval() * 1e3] * 3 + [0.5]
    assert all(s["save_s"] > 0 and s["objects_tracked"] > 0 and s["stall_p99_ms"] is not None for s in saves)
    # a file of the format before the packed one, written again in the current format: the same events
    from engine.session_file import VERSION, load_session
    from tests.engine.test_session_file import assert_same
    from tests.session_v1 import save_v1

    old, again = tmp_path / "v1.ilab", tmp_path / "again.ilab"
    save_v1(old, load_session(path))
    r = subprocess.run([sys.executable, "-m", "benchmarks.reopen", "--resave", str(old), str(again)],
                       capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    resaved = json.loads(r.stdout.strip().splitlines()[-1])
    assert resaved["version"] == VERSION == 2 and resaved["target_bytes"] == again.stat().st_size
    for a, b in zip(load_session(old).events, load_session(again).events, strict=True):
        assert_same(a, b)
