#!/usr/bin/env bash
# Build the Inference Lab wheel into dist/ (run from anywhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip wheel --no-deps --no-build-isolation -w dist .
ls -l dist/*.whl
