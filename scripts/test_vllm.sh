#!/usr/bin/env bash
# The vLLM plugin's tests (tests/test_vllm_plugin.py) in a venv of their own: vLLM's CPU build pins its own torch and
# transformers, so it never shares the test venv. Installed from the project's files: vllm_spike_whale/requirements-cpu.txt
# (the vLLM build), then this package and the plugin (vllm_spike_whale/pyproject.toml).
# usage: [VENV=DIR] [PYTHON=python3.11] scripts/test_vllm.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || exit 1
fi
"$VENV/bin/python" -m pip install -q --upgrade pip || exit 1
"$VENV/bin/python" -m pip install -q -r vllm_spike_whale/requirements-cpu.txt || exit 1
# vLLM's CPU wheel pulls CUDA builds of these, which fail to load against torch+cpu (and vLLM's audio module lets
# torchcodec's OSError escape at import); vLLM serves text models without them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
"$VENV/bin/python" -m pip install -q -e . ./vllm_spike_whale pytest || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
export HF_HOME="${HF_HOME:-$(mktemp -d)}"
echo "testing the vLLM plugin with $("$VENV/bin/python" -c 'import vllm, transformers, torch; print("vllm", vllm.__version__, "transformers", transformers.__version__, "torch", torch.__version__)')"
# The tests skip where vLLM or the plugin does not import; here that is a failure.
"$VENV/bin/python" -c "import vllm_spike_whale.model" || exit 1
"$VENV/bin/python" -m pytest tests/test_vllm_plugin.py -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
