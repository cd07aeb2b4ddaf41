#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. pytest's "no tests collected" (exit 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HOME="${HF_HOME:-$(mktemp -d)}"
.venv/bin/python -m pytest tests -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
