"""The GUI process never imports torch: torch lives in the engine process (app.bridge starts it).

Like tests/engine/test_layering.py for Qt: every app module imports with torch made unavailable, and the headless
app runs a whole generation (events, funnels, the sampling panel's re-funnel) with torch blocked in its process.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCK = r"""
import sys, traceback
ATTEMPTS = []  # every try, even one a caller catches and shrugs off
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            ATTEMPTS.append("".join(traceback.format_stack(limit=6)))
            raise ImportError(f"the GUI process must not import {name}")
        return None
sys.meta_path.insert(0, Block())
"""

IMPORT_ALL = BLOCK + r"""
import importlib, pkgutil
import app
for m in pkgutil.walk_packages(app.__path__, "app."):
    if m.name != "app.__main__":
        importlib.import_module(m.name)
print("ok", "torch" in sys.modules, len(ATTEMPTS))
print("".join(ATTEMPTS[:1]))
"""

RUN_APP = BLOCK + r"""
from app.main import main
rc = main(sys.argv[1:])
print("".join(ATTEMPTS[:1]))
print("torch" in sys.modules, len(ATTEMPTS), rc)
sys.exit(rc)
"""


def test_every_app_module_imports_without_torch() -> None:
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok False 0"), r.stdout


def test_the_app_generates_with_torch_blocked_in_its_process(tiny_dir, tmp_path) -> None:
    shot = tmp_path / "shot.png"
    r = subprocess.run(
        [sys.executable, "-c", RUN_APP, "--model", str(tiny_dir.gguf), "--prompt", "hello world",
         "--max-new-tokens", "4", "--greedy", "--seed", "3", "--screenshot", str(shot)],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("False 0 0"), r.stdout[-3000:]  # not even a try, caught or not
    assert shot.stat().st_size > 10_000


def test_startup_benchmark_runs_and_reports_no_torch(tmp_path) -> None:
    import json
    import os

    r = subprocess.run([sys.executable, "-m", "benchmarks.startup"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env={**os.environ, "INFERENCE_LAB_SETTINGS": str(tmp_path / "s.ini")})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["torch_loaded"] is False and out["gui_max_rss_mb"] > 0 and out["total_s"] > 0
