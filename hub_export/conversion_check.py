"""The conversion check: a written Hub folder, loaded in a fresh Python process the way a user loads it, must hold
exactly the source's tensors and reproduce its logits (used by convert / from-gguf / widen; the `verify` command,
which checks the cache, is `verify.py`).

The child process loads the folder with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and
`AutoTokenizer`, hashes every tensor of the loaded model's state dict, encodes a fixed prompt and runs it
(`use_cache=False`). The parent compares: the set of names, dtype, shape and bytes of every tensor (bit-identical
to the source), the prompt ids, and the logits (equal to the source model's). A fresh process is required:
classes registered in this process would otherwise shadow the folder's remote code.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .output_paths import die_with_parent, discard, verify_temp_dir

# Fixed verification prompt: prose, a ChatML turn (special tokens) and non-ASCII bytes.
VERIFY_PROMPT = "The harbour was quiet before dawn.<|im_start|>user\nWhy is the sea salty? Ça va, 港.<|im_end|>\n"

_CHILD = r"""
import hashlib, json, sys
import torch
folder, out_dir, prompt, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(threads)
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
ids = tok(prompt, return_tensors="pt")["input_ids"][:, : model.config.max_position_embeddings]
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits
def digest(t):
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
tensors = {k: {"sha256": digest(v), "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in model.state_dict().items()}
tied = model.lm_head.weight is model.model.embed_tokens.weight
torch.save({"logits": logits.float()}, out_dir + "/logits.pt")
json.dump({"model_class": type(model).__module__ + "." + type(model).__qualname__,
           "tokenizer_class": type(tok).__module__ + "." + type(tok).__qualname__,
           "tensors": tensors, "ids": ids[0].tolist(), "tied": tied, "vocab_size": len(tok)},
          open(out_dir + "/report.json", "w"))
"""


@dataclass
class VerificationResult:
    tensors: int  # tensors stored in the folder (the tied head is stored once, as the embedding)
    mismatches: list[str]
    logits_max_abs_diff: float
    prompt_tokens: int
    model_class: str
    tokenizer_class: str
    tied_head: bool = True

    @property
    def summary(self) -> str:
        tied = " (and the tied lm_head.weight)" if self.tied_head else ""
        return (f"{self.tensors} tensors, {len(self.mismatches)} mismatches{tied}; logits max |Δ| "
                f"{self.logits_max_abs_diff:.3g} on a {self.prompt_tokens}-token prompt")

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "tied_head_checked": self.tied_head, "mismatches": len(self.mismatches),
                "logits_max_abs_diff": self.logits_max_abs_diff, "prompt_tokens": self.prompt_tokens,
                "loaded_as": self.model_class, "tokenizer": self.tokenizer_class,
                "method": "fresh process: AutoModelForCausalLM/AutoTokenizer.from_pretrained(trust_remote_code=True)"}


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def reference_logits(model, tokenizer) -> tuple[torch.Tensor, list[int]]:
    """The source model's logits on the fixed prompt (computed in this process)."""
    ids = tokenizer(VERIFY_PROMPT, return_tensors="pt")["input_ids"][:, : model.config.max_position_embeddings]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return logits.float(), ids[0].tolist()


def verify_folder(
    folder: str | os.PathLike,
    expected: dict[str, torch.Tensor],
    ref_logits: torch.Tensor,
    ref_ids: list[int],
    expect_tied: bool = True,
    logits_atol: float = 0.0,
    timeout: float = 1800,
) -> VerificationResult:
    """Load `folder` in a fresh process and check it holds exactly `expected` and reproduces `ref_logits`.

    Raises `RuntimeError` (one line, listing the first offending names) on any difference.
    """
    tmp = verify_temp_dir()
    try:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                   HF_MODULES_CACHE=str(Path(tmp) / "modules"), TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-c", _CHILD, str(Path(folder).resolve()), tmp, VERIFY_PROMPT, str(torch.get_num_threads())]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp,
                                  preexec_fn=die_with_parent())
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"verification: loading {folder} in a fresh process timed out after {timeout:.0f}s") from err
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            raise RuntimeError(f"verification: loading the written folder in a fresh process failed: "
                               f"{lines[-1] if lines else 'exit code ' + str(proc.returncode)}")
        report = json.loads((Path(tmp) / "report.json").read_text())
        logits = torch.load(Path(tmp) / "logits.pt", weights_only=True)["logits"]
    finally:
        discard(tmp)
    got = report["tensors"]
    mismatches = [f"missing {k}" for k in sorted(set(expected) - set(got))]
    mismatches += [f"unexpected {k}" for k in sorted(set(got) - set(expected))]
    for name in sorted(set(expected) & set(got)):
        t, g = expected[name], got[name]
        if str(t.dtype) != g["dtype"] or list(t.shape) != g["shape"]:
            mismatches.append(f"{name} ({g['dtype']} {g['shape']} vs {t.dtype} {list(t.shape)})")
        elif tensor_digest(t) != g["sha256"]:
            mismatches.append(name)
    if not report["model_class"].startswith("transformers_modules."):
        mismatches.append(f"model loaded as {report['model_class']}, not through the folder's remote code")
    if expect_tied and not report["tied"]:
        mismatches.append("lm_head.weight is not tied to model.embed_tokens.weight after loading")
    if mismatches:
        raise RuntimeError(f"verification failed: {len(expected)} tensors, {len(mismatches)} mismatches: {mismatches[:8]}")
    if report["ids"] != list(ref_ids):
        raise RuntimeError(f"verification failed: AutoTokenizer encodes the prompt to {report['ids'][:12]}... "
                           f"instead of {list(ref_ids)[:12]}...")
    if logits.shape != ref_logits.shape:
        raise RuntimeError(f"verification failed: logits shape {tuple(logits.shape)} vs {tuple(ref_logits.shape)}")
    if not bool(torch.isfinite(ref_logits).all()):
        raise RuntimeError("verification failed: the source model's own logits contain NaN or inf (the weights are "
                           "finite); the checkpoint does not compute a usable function")
    diff = float((logits - ref_logits).abs().max())
    if not diff <= logits_atol:
        raise RuntimeError(f"verification failed: logits differ from the source model's (max |Δ| {diff:.3g})")
    tied = expect_tied and "lm_head.weight" in expected
    return VerificationResult(len(expected) - int(tied), [], diff, len(ref_ids), report["model_class"],
                              report["tokenizer_class"], tied)
