"""Scaling out on the engines users already run, each launched as a real multi-process job on CPU/gloo:

- transformers' own tensor parallelism (`DistributedConfig(tp_size=2)` under torchrun) gives the single-process
  logits and greedy tokens, and each rank's loop-slot cache holds only its K/V heads;
- `accelerate launch --num_processes 2` of `spike-whale finetune`: the plain loop under DDP with padding-free packed
  rows (`DataCollatorWithFlattening`), and `transformers.Trainer` under transformers' own FSDP2 (decoder layers as
  the wrap unit), train to the single-process losses, and the saved folders load in a fresh process with the
  single-process model's logits.

The jobs use 2 processes (the CI machine has 2 cores), the tiny model and 3 optimizer steps.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import open_gates

from spike_whale.configuration_spike_whale import registered_tp_styles
from spike_whale.hub_export.finetune import unsupported
from spike_whale.hub_export.folder import save_hub_folder
from spike_whale.hub_export.init_tiny import build_tiny

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build",
)

TIMEOUT = 300
# Every mechanism the TP plan touches: MoE experts (learned router and hash layer), Elo per-head parameters, value
# embeddings, Engram fusion, the abstain head, two MTP heads and three HRM steps, on top of the tiny model's
# MLA + Memory Cache + Engram + depth attention + Hyper-Connections.
FULL = dict(
    use_moe=True, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, num_hash_layers=1,
    moe_intermediate_size=48, hrm_refine_steps=3, use_abstain_head=True, num_nextn_predict_layers=2, use_elo=True,
    use_value_embed=True, engram_fusion_layers=[2], engram_fusion_dim=16,
)
TEXT = (
    "The whale surfaced twice near the breakwater, then dove again. Gulls circled the harbour while the fishing "
    "boats came home. A child on the pier counted the spouts: one, two, three. By evening the water was calm and "
    "the lighthouse turned its slow beam over the bay. "
) * 4
TRAIN = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-3"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def job_env(tmp_path) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TRANSFORMERS_VERBOSITY="error",
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", ACCELERATE_USE_CPU="1")


def run_job(args: list[str], tmp_path) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, env=job_env(tmp_path), timeout=TIMEOUT,
                          cwd=str(tmp_path))
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args[:6])} ... failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc.stdout


def tiny_folder(path, **overrides) -> str:
    model, tok = build_tiny(seed=4, mc_segment_len=8, **overrides)
    open_gates(model)
    save_hub_folder(model, tok, path)
    return str(path)


TP_JOB = """
import dataclasses, sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

if "tp_size" in {f.name for f in dataclasses.fields(DistributedConfig)}:
    tp = dict(distributed_config=DistributedConfig(tp_size=2))
else:  # transformers before DistributedConfig had tp_size (5.0)
    tp = dict(tp_plan="auto", tp_size=2)
torch.manual_seed(0)
ids = torch.randint(4, 2000, (2, 21)); mask = torch.ones_like(ids); mask[0, :3] = 0
results = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **tp).eval()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                             return_dict_in_generate=True)
    slots = out.past_key_values.layers
    results[folder] = dict(
        logits=logits, sequences=out.sequences, keys=[s.keys[:, :, : s.get_seq_length()] for s in slots],
        mc_run_M=[s.mc.run_M for s in slots if s.mc is not None],
    )
torch.save(results, f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
# Leave the group explicitly: a gloo thread still running at interpreter exit aborts the rank (SIGABRT).
dist.barrier()
dist.destroy_process_group()
"""


def test_tensor_parallel_matches_single_process(tmp_path):
    from spike_whale import SpikeWhaleForCausalLM

    # The tiny model's one-token decode steps take the fused decode path; FULL and DERF take the general one.
    folders = [tiny_folder(tmp_path / "tiny"), tiny_folder(tmp_path / "full", **FULL),
               tiny_folder(tmp_path / "derf", use_derf=True)]
    script = tmp_path / "tp_job.py"
    script.write_text(TP_JOB)
    run_job([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", free_port(),
             str(script), str(tmp_path), *folders], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    ids = torch.randint(4, 2000, (2, 21)); mask = torch.ones_like(ids); mask[0, :3] = 0
    for folder in folders:
        ref = SpikeWhaleForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            logits = ref(ids, attention_mask=mask).logits
            out = ref.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                               return_dict_in_generate=True)
        kv_heads = ref.config.num_key_value_heads
        # Where transformers has no `local_params` style, DERF/Elo attention stays whole (see `base_model_tp_plan`).
        split = "layers.*.attn.k_proj" in ref.config.base_model_tp_plan
        assert split or "local_params" not in registered_tp_styles(), folder
        for rank, results in enumerate(ranks):
            tp = results[folder]
            assert (tp["logits"] - logits).abs().max().item() <= 1e-5, folder
            assert torch.equal(tp["sequences"], out.sequences), folder
            share = slice(rank * kv_heads // 2, (rank + 1) * kv_heads // 2) if split else slice(None)
            slots = out.past_key_values.layers
            assert len(tp["keys"]) == len(slots)
            for got, slot in zip(tp["keys"], slots):  # this rank's heads only, equal to the reference's
                want = slot.keys[:, share, : slot.get_seq_length()]
                assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-5
            # The Memory-Cache branch is replicated: every rank holds every head of its state.
            want_mc = [s.mc.run_M for s in slots if s.mc is not None]
            assert len(tp["mc_run_M"]) == len(want_mc) > 0
            assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(tp["mc_run_M"], want_mc))


CHECK_JOB = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from spike_whale.hub_export import finetune

folder, text_file, out_dir, packed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "packed"
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
rows = finetune.token_rows(tok, open(text_file).read(), 32)
batches = finetune.global_batches(rows.shape[0], 3, 4, 0)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
model, losses = finetune.train_loop(model, rows, batches, lr=1e-3, packed=packed)
loaded, info = AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True, output_loading_info=True)
with torch.no_grad():
    want, got = model(rows[:2]).logits, loaded.eval()(rows[:2]).logits
print("REPORT" + json.dumps(dict(losses=losses, rel=((got - want).abs().max() / want.abs().max()).item(),
                                 missing=sorted(info["missing_keys"]), unexpected=sorted(info["unexpected_keys"]))))
"""


def finetune_matches_single_process(tmp_path, packed: bool, flags: list[str]) -> None:
    """`accelerate launch --num_processes 2 -m spike_whale finetune ... FLAGS` gives the losses of the same steps on
    one process (plain torch), and its saved folder loads in a fresh process with that model's logits."""
    folder = tiny_folder(tmp_path / "tiny")
    text, out_dir, log = tmp_path / "text.txt", tmp_path / "trained", tmp_path / "losses.json"
    text.write_text(TEXT)
    run_job([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu", "--main_process_port", free_port(),
             "-m", "spike_whale", "finetune", folder, str(out_dir), "--text", str(text), *TRAIN,
             "--losses-json", str(log), *(["--packed"] if packed else []), *flags], tmp_path)
    summary = json.loads(log.read_text())
    assert summary["processes"] == 2 and summary["distributed_type"] == "DistributedType.MULTI_CPU", summary
    out = run_job([sys.executable, "-c", textwrap.dedent(CHECK_JOB), folder, str(text), str(out_dir),
                   "packed" if packed else "rows"], tmp_path)
    single = json.loads(out.split("REPORT", 1)[1])
    assert len(summary["losses"]) == len(single["losses"]) == 3
    rel = max(abs(a - b) / abs(b) for a, b in zip(summary["losses"], single["losses"]))
    assert rel <= 1e-5, (summary["losses"], single["losses"])
    assert single["rel"] <= 1e-5 and single["missing"] == [] and single["unexpected"] == [], single


def test_ddp_packed_rows_finetune_matches_single_process(tmp_path):
    """The plain loop under DDP, fed padding-free packed rows (`DataCollatorWithFlattening`)."""
    finetune_matches_single_process(tmp_path, packed=True, flags=[])


@pytest.mark.skipif(unsupported(trainer=True, fsdp_size=2) is not None,
                    reason=str(unsupported(trainer=True, fsdp_size=2)))
def test_trainer_fsdp2_finetune_matches_single_process(tmp_path):
    """`transformers.Trainer` under transformers' own FSDP2 (decoder layers as the wrap unit, each resharded
    after every one of the loop's reuses)."""
    finetune_matches_single_process(tmp_path, packed=False, flags=["--trainer", "--fsdp-size", "2"])


def test_accelerate_fsdp_on_cpu_is_refused_not_run_as_ddp(tmp_path):
    """accelerate turns FSDP on only on accelerator devices; on CPU `finetune` says so instead of training DDP."""
    folder = tiny_folder(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    env = dict(job_env(tmp_path), ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    proc = subprocess.run([sys.executable, "-m", "spike_whale", "finetune", folder, str(tmp_path / "out"), "--text",
                           str(text), *TRAIN], capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "accelerate turns FSDP on only on accelerator devices" in proc.stderr and "--fsdp-size" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_ddp_finetune_rows_of_one_memory_cache_segment(tmp_path):
    """Rows no longer than a Memory-Cache segment read no finished segment; every parameter must still take part
    (DDP raises on a parameter that "was not used in producing loss")."""
    folder = tiny_folder(tmp_path / "tiny")  # mc_segment_len = 8
    text, log = tmp_path / "text.txt", tmp_path / "losses.json"
    text.write_text(TEXT)
    run_job([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu", "--main_process_port", free_port(),
             "-m", "spike_whale", "finetune", folder, str(tmp_path / "trained"), "--text", str(text), "--steps", "2",
             "--batch-size", "4", "--seq-len", "8", "--losses-json", str(log)], tmp_path)
    summary = json.loads(log.read_text())
    assert summary["processes"] == 2 and len(summary["losses"]) == 2, summary
