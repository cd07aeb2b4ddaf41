#!/usr/bin/env bash
# The main job on a fresh machine: install, build a tiny spike_whale + tokenizer as a Hub-style folder, then load
# it back in a fresh process through AutoModelForCausalLM/AutoTokenizer (trust_remote_code=True) and generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${1:-out/tiny-spike-whale}
.venv/bin/spike-whale init-tiny "$OUT"
.venv/bin/spike-whale generate "$OUT" -p "${PROMPT:-The whale}" --max-new-tokens "${MAX_NEW_TOKENS:-60}" --seed 0
echo
