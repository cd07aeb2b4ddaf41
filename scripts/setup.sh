#!/usr/bin/env bash
# Create .venv (if missing) and install the project from its own files: CPU torch 2.13.0, then the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
