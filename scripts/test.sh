#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. pytest's "no tests collected" (exit 5) is a failure.
# usage: scripts/test.sh [--transformers VERSION|floor] [pytest args...]
#   --transformers floor  tests the lowest release setup.cfg admits (CI runs the suite on both ends of the range).
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION=
if [ "${1:-}" = "--transformers" ]; then
  VERSION=${2:?"--transformers needs a version or 'floor'"}
  shift 2
  if [ "$VERSION" = floor ]; then
    VERSION=$(sed -n 's/^ *transformers>=\([0-9.]*\),.*/\1/p' setup.cfg)
    [ -n "$VERSION" ] || { echo "no 'transformers>=X,<Y' line in setup.cfg" >&2; exit 1; }
  fi
fi
# With the int8 extra (torchao), so that the int8 weight-only tests run rather than skip; in a venv of their own, so
# that the demo's .venv keeps the package alone.
VENV=.venv-test
[ -z "$VERSION" ] || VENV=.venv-transformers-$VERSION
VENV=$VENV EXTRAS=test,int8 bash scripts/setup.sh $VERSION || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HOME="${HF_HOME:-$(mktemp -d)}"
echo "testing with $("$VENV/bin/python" -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)')"
# Two workers (the CI machine has 2 cores; the tests run single-threaded), whole files per worker so that module
# fixtures are built once.
"$VENV/bin/python" -m pytest tests -q -n 2 --dist loadfile "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
