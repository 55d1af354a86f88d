"""The memory benchmark (benchmarks.cycles) runs end to end through the real window, its keyboard and its autosave:
a short run past the store's cap on runs (the full 150 cycles are `python -m benchmarks.cycles`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from app.run_store import MAX_RUNS

ROOT = Path(__file__).resolve().parents[2]


def test_generate_stop_cycles_keep_at_most_the_cap_of_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT), QT_QPA_PLATFORM="offscreen")
    env.pop("INFERENCE_LAB_SETTINGS", None)  # the benchmark uses a temporary settings file of its own
    r = subprocess.run([sys.executable, "-m", "benchmarks.cycles", "--cycles", str(MAX_RUNS + 6)], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["cycles"] == MAX_RUNS + 6 and d["runs_kept"] == MAX_RUNS
    assert d["growth_after_10"] < 0.10, d
