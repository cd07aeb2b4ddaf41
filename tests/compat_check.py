"""Does the installed transformers release build, load and decode spike_whale models? (`scripts/compat.sh`)

The suite runs on the two ends of setup.cfg's transformers range; releases between them broke the config and the
model in ways the ends do not show, so this short check runs on one release of each minor line. It is a script,
not a pytest module (pytest collects only test_*.py): `python tests/compat_check.py`.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "spike-whale-demo")
NEW_TOKENS = 4
PROMPT = "The whale"


def check_cached_decode(model, what: str) -> None:
    """Greedy decode with the cache; each step's raw logits must equal one full forward over the same tokens."""
    import torch

    prompt = torch.tensor([[2, 300, 301, 302, 303, 304]])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True)
        cached = torch.stack(out.logits, dim=1)
        full = model(out.sequences, use_cache=False).logits[:, prompt.shape[1] - 1 : -1]
    if cached.shape[1] < 1 or not torch.allclose(cached, full[:, : cached.shape[1]], atol=1e-4, rtol=1e-4):
        diff = (cached - full[:, : cached.shape[1]]).abs().max().item()
        raise SystemExit(f"{what}: cached decode != full recompute (max |logit difference| {diff:.3g})")


def main() -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from spike_whale import SpikeWhaleConfig, SpikeWhaleForCausalLM
    from spike_whale.hub_export.cli import main as cli

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Built from a config (tied embeddings, MoE on), then the committed model loaded as remote code.
    built = SpikeWhaleForCausalLM(SpikeWhaleConfig.from_preset("tiny", use_moe=True)).eval()
    check_cached_decode(built, "tiny preset")
    loaded = AutoModelForCausalLM.from_pretrained(DEMO, trust_remote_code=True, dtype=torch.float32).eval()
    check_cached_decode(loaded, DEMO)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = cli(["generate", DEMO, "-p", PROMPT, "--greedy", "--max-new-tokens", str(NEW_TOKENS)])
    text = printed.getvalue().strip()
    if rc != 0 or len(text) <= len(PROMPT):
        raise SystemExit(f"spike-whale generate exited {rc} and printed {text!r}")
    print(f"transformers {transformers.__version__}: ok (cached decode == full recompute, generate printed {text!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
