#!/usr/bin/env bash
# The main job on a fresh machine: install, build a tiny spike_whale + tokenizer as a Hub-style folder (fitted to
# the built-in demo corpus, ~1-2 minutes on 2 cores), then load it back in a fresh process through
# AutoModelForCausalLM/AutoTokenizer (trust_remote_code=True) and generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${1:-out/tiny-spike-whale}
.venv/bin/spike-whale init-tiny "$OUT" --train-steps "${TRAIN_STEPS:-400}"
.venv/bin/spike-whale generate "$OUT" -p "${PROMPT:-The harbour was}" --max-new-tokens "${MAX_NEW_TOKENS:-60}" --seed 0
echo
