#!/usr/bin/env bash
# Build the Inference Lab wheel into dist/ (run from anywhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# setuptools reuses build/lib: a module deleted from the tree would linger there and ship in the wheel
rm -rf build/lib build/bdist.* dist/inference_lab-*.whl
"$PY" -m pip wheel --no-deps --no-build-isolation -w dist .
ls -l dist/*.whl
