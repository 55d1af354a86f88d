"""The GUI benchmark script runs end to end (a short smoke run on the real model, in a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_gui_smoke():
    env = dict(os.environ, PYTHONPATH=str(ROOT), QT_QPA_PLATFORM="offscreen")
    r = subprocess.run([sys.executable, "-m", "benchmarks.gui", "--smoke"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["tokens"] >= 1 and d["tpot_ms_with_gui"] > 0 and d["stall_max_ms"] >= d["stall_p99_ms"] >= 0
    assert d["keystroke_200_tokens_ms"] > 0 and d["redraws_per_s_all_panels"] > 0
    # every panel on screen (none tabbed away) and painted
    assert d["panels"] >= 10 and d["not_on_screen"] == []
    assert d["panels_on_screen"] == d["panels"] == len(d["paints_per_panel"])
    assert d["panels_painted"] == d["panels"]
    for name in ("sampling", "attention", "kv_cache", "timeline", "roofline"):  # the live ones repaint as it runs
        assert d["paints_per_panel"][name] > 0 and d["draws_per_panel"][name] > 0, name


def test_bench_gui_help_runs_nothing():
    env = dict(os.environ, PYTHONPATH=str(ROOT), QT_QPA_PLATFORM="offscreen")
    r = subprocess.run([sys.executable, "-m", "benchmarks.gui", "--help"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "--compare" in r.stdout and "tpot_ms_with_gui" not in r.stdout


def test_compare_append_keeps_the_earlier_run(tmp_path):
    from benchmarks.gui import _append_run

    path = tmp_path / "gui.json"
    path.write_text(json.dumps({"command": "old", "conditions": {"quiet": {}}}))
    _append_run(str(path), "after", {"command": "new", "conditions": {"busy": {}}})
    _append_run(str(path), "again", {"command": "newer", "conditions": {}})
    runs = json.loads(path.read_text())["runs"]
    assert [r["label"] for r in runs] == ["earlier", "after", "again"]
    assert [r["command"] for r in runs] == ["old", "new", "newer"] and runs[1]["conditions"] == {"busy": {}}
