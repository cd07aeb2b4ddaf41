#!/usr/bin/env bash
# Create a venv (if missing) and install the project from its own files: CPU torch 2.13.0, then the package.
# usage: [VENV=DIR] [EXTRAS=test,int8] scripts/setup.sh [TRANSFORMERS_VERSION]
#   no version: VENV (default .venv, the demo's) with the newest transformers that setup.cfg's range admits;
#   a version:  .venv-transformers-VERSION with exactly that release (CI tests both ends of the range).
#   EXTRAS: setup.cfg's extras to install (default: none, the package alone).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=${1:-}
EXTRAS=${EXTRAS:-}
VENV=${VENV:-.venv}
PIN=()
if [ -n "$VERSION" ]; then
  VENV=.venv-transformers-$VERSION
  PIN=("transformers==$VERSION")
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}" "${PIN[@]}"
