#!/usr/bin/env bash
# The main job on a fresh machine: install, then load the committed default model (models/spike-whale-demo: 10.4M
# parameters, every Byrne mechanism on, trained by the project on 64 MB of English; see its README.md) in a fresh
# process through AutoModelForCausalLM/AutoTokenizer (trust_remote_code=True) and generate. Nothing is trained at
# set-up; `spike-whale init-tiny OUT_DIR` builds new small models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL=${1:-models/spike-whale-demo}
.venv/bin/spike-whale generate "$MODEL" -p "${PROMPT:-To open a file in Python, you}" \
  --max-new-tokens "${MAX_NEW_TOKENS:-60}" --seed 0
echo
