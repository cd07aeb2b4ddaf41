#!/usr/bin/env bash
# Build a tiny model, load the committed one as remote code and generate (tests/compat_check.py) on transformers
# releases across setup.cfg's range: the suite runs only on the range's two ends (.ci/run), and releases in the
# middle broke the config and the model in ways the ends did not show.
# usage: scripts/compat.sh [VERSION...]
#   default: the newest patch release of each minor line that setup.cfg's transformers requirement admits.
# Each release gets a fresh venv (what a user's install of it resolves to; a release installed over another keeps
# packages the other pulled in, which broke older releases' imports), sharing one CPU torch install through a .pth
# file; it is removed after its check.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=.venv-transformers-compat
PY=${PYTHON:-python3}
RANGE=$(sed -n 's/^ *transformers\([<>=!~][^ ]*\) *$/\1/p' setup.cfg)
[ -n "$RANGE" ] || { echo "no 'transformers>=X,...' line in setup.cfg" >&2; exit 1; }
[ -x "$ROOT/torch/bin/python" ] || "$PY" -m venv "$ROOT/torch" || exit 1
"$ROOT/torch/bin/python" -m pip install -q torch==2.13.0 packaging || exit 1
site_dir() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
TORCH_SITE=$(site_dir "$ROOT/torch") || exit 1
if [ $# -gt 0 ]; then
  VERSIONS=("$@")
else
  mapfile -t VERSIONS < <("$ROOT/torch/bin/python" - "$RANGE" <<'EOF'
import subprocess
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version

listed = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True,
                        text=True, check=True).stdout
line = next(l for l in listed.splitlines() if l.startswith("Available versions:"))
admitted = [v for v in map(Version, line.split(":", 1)[1].split(",")) if v in SpecifierSet(sys.argv[1])]
newest = {}
for v in admitted:
    newest[v.release[:2]] = max(v, newest.get(v.release[:2], v))
print("\n".join(str(v) for v in sorted(newest.values(), reverse=True)))
EOF
  )
  [ ${#VERSIONS[@]} -gt 0 ] || { echo "pip lists no transformers release in $RANGE" >&2; exit 1; }
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
HF_HOMES=$(mktemp -d)
trap 'rm -rf "$HF_HOMES"' EXIT
FAILED=()
for VERSION in "${VERSIONS[@]}"; do
  echo "compat: transformers $VERSION"
  VENV=$ROOT/$VERSION
  rm -rf "$VENV"
  if ! { "$PY" -m venv "$VENV" && echo "$TORCH_SITE" > "$(site_dir "$VENV")/compat-torch.pth" &&
         "$VENV/bin/python" -m pip install -q "transformers==$VERSION" -e .; }; then
    FAILED+=("$VERSION (install)")
  else
    HF_HOME="$HF_HOMES/$VERSION" "$VENV/bin/python" tests/compat_check.py || FAILED+=("$VERSION")
  fi
  rm -rf "$VENV"
done
[ ${#FAILED[@]} -eq 0 ] || echo "compat: failed on transformers ${FAILED[*]}" >&2
echo "compat: $((${#VERSIONS[@]} - ${#FAILED[@]})) passed, ${#FAILED[@]} failed"
[ ${#FAILED[@]} -eq 0 ]
