"""The engine never imports Qt: importing every engine module with PySide6 and pyqtgraph made unavailable works."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, pkgutil, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("PySide6", "shiboken6", "pyqtgraph", "app"):
            raise ImportError(f"engine must not import {name}")
        return None

sys.meta_path.insert(0, Block())
import engine
for m in pkgutil.walk_packages(engine.__path__, "engine."):
    importlib.import_module(m.name)
print("ok", len(sys.modules))
"""


def test_engine_imports_without_qt():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


def test_engine_sources_name_no_qt():
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for bad in ("import PySide6", "from PySide6", "import pyqtgraph", "from pyqtgraph", "from app"):
            assert bad not in text, f"{path} contains {bad!r}"
