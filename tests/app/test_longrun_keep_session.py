"""benchmarks/longrun.py --keep-session: the run's autosave is kept where asked (the window's clean close removes the
autosave, so it must be copied before), ready for benchmarks.reopen --open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_the_long_run_benchmark_keeps_its_session(tiny_dir, tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), QT_QPA_PLATFORM="offscreen")
    kept = tmp_path / "run.ilab"
    r = subprocess.run([sys.executable, "-m", "benchmarks.longrun", "--tokens", "12", "--after", "10", "--model",
                        str(tiny_dir.gguf), "--keep-session", str(kept)], capture_output=True, text=True, env=env,
                       cwd=root, timeout=300)
    assert r.returncode == 0, "\n".join(ln for ln in r.stderr.splitlines() if "propagateSizeHints" not in ln)[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["autosave_done_after_finished_s"] is not None
    assert d["session_file"] == str(kept) and kept.stat().st_size == round(d["session_mib"] * 2**20)
