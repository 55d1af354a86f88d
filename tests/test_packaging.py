"""The wheel carries the engine, the app and the catalogues, read through importlib.resources."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_packages_and_resources(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("inference_lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("engine/model/transformer.py", "engine/loaders/gguf.py", "app/main.py", "app/panels/timeline.py",
                   "resources/models.json", "resources/hardware.json", "resources/inference-lab.desktop"):
        assert needed in names, needed
    assert not any(n.startswith("tests/") for n in names)
