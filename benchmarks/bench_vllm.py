"""Throughput of spike_whale served by vLLM (the `vllm_spike_whale` plugin) against transformers' batched generate of
the same folder, and against vLLM serving an in-library Llama of the same per-token compute.

Every engine gets the same work: N concurrent requests (default 32) of random token prompts, each decoding M new
tokens (default 128) greedily with EOS ignored; tok/s counts the new tokens over the wall time of the whole batch.
Each measurement runs in a fresh interpreter of the vLLM venv (scripts/test_vllm.sh builds one), every engine with
`--threads` torch threads (vLLM's CPU backend would otherwise keep one core for itself and compute on the rest).

The Llama anchor unrolls the loop: hidden size, heads and vocabulary of the folder, one layer per loop-plan slot, the
dense FFN width, tied embeddings (for the 114M preset this is `benchmarks/_common.py`'s anchor: 48 layers, hidden
768, 12/2 heads of 64, FFN 2048). Random weights: the work per token, not the text, is what is compared.

usage: python benchmarks/bench_vllm.py MODEL_DIR [--requests 32] [--new-tokens 128] [--prompt-len 64]
           [--dtype float32] [--threads 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MARK = "bench_vllm result: "

def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, min(vocab, 16000), (length,), generator=g).tolist() for _ in range(n)]


def run_vllm(model_dir: str, args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    llm = LLM(model=model_dir, trust_remote_code=True, dtype=args.dtype, max_num_seqs=args.requests,
              max_model_len=args.prompt_len + args.new_tokens, skip_tokenizer_init=True, seed=0,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.cpu_memory_fraction)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True,
                            detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(args.requests, args.prompt_len, vocab)]
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=4, detokenize=False), use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": new, "seconds": wall, "tok_s": new / wall}


def run_hf(model_dir: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=dtype).eval()
    model.generation_config = GenerationConfig(bos_token_id=2, eos_token_id=3, pad_token_id=0)
    ids = torch.tensor(prompts(args.requests, args.prompt_len, model.config.vocab_size))
    config = GenerationConfig(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              pad_token_id=0, eos_token_id=3)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]),
                       generation_config=GenerationConfig(do_sample=False, max_new_tokens=4, pad_token_id=0))
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        wall = time.perf_counter() - start
    new = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"tokens": int(new), "seconds": wall, "tok_s": new / wall}


def write_llama_anchor(model_dir: str, out_dir: str) -> str:
    """An in-library Llama with the per-token compute of the folder's model (random weights)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    sw = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    config = LlamaConfig(
        vocab_size=sw.vocab_size, hidden_size=sw.hidden_size, num_hidden_layers=sw.num_loop_slots,
        num_attention_heads=sw.num_attention_heads, num_key_value_heads=sw.num_key_value_heads, head_dim=sw.head_dim,
        intermediate_size=sw.moe_intermediate_size, max_position_embeddings=sw.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=3, pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def measure(kind: str, model_dir: str, args) -> dict:
    """One measurement in a fresh interpreter; its JSON is the line it prints after `MARK` (vLLM logs to stdout too)."""
    cmd = [sys.executable, __file__, model_dir, "--run", kind, "--requests", str(args.requests), "--new-tokens",
           str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--dtype", args.dtype,
           "--cpu-memory-fraction", str(args.cpu_memory_fraction)] + (["--enforce-eager"] if args.enforce_eager else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith(MARK)][-1][len(MARK):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every engine (OMP_NUM_THREADS)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (both vLLM runs)")
    parser.add_argument("--cpu-memory-fraction", type=float, default=0.3,
                        help="vLLM's gpu_memory_utilization, the share of host memory its CPU backend reserves")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--run", choices=["vllm", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        result = run_vllm(args.model_dir, args) if args.run == "vllm" else run_hf(args.model_dir, args)
        print(MARK + json.dumps(result), flush=True)
        return

    results = {"vllm_spike_whale": measure("vllm", args.model_dir, args),
               "transformers_spike_whale": measure("hf", args.model_dir, args)}
    with tempfile.TemporaryDirectory() as tmp:
        results["vllm_llama_anchor"] = measure("vllm", write_llama_anchor(args.model_dir, tmp), args)
    sw, hf, llama = (results[k]["tok_s"] for k in ("vllm_spike_whale", "transformers_spike_whale", "vllm_llama_anchor"))
    summary = {
        "requests": args.requests, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "dtype": args.dtype,
        "enforce_eager": args.enforce_eager, "threads": args.threads, "results": results,
        "vllm_over_transformers": sw / hf, "spike_whale_over_llama_in_vllm": sw / llama,
    }
    print(f"{'engine':<34}{'new tokens':>12}{'seconds':>10}{'tok/s':>10}")
    for name, r in results.items():
        print(f"{name:<34}{r['tokens']:>12}{r['seconds']:>10.2f}{r['tok_s']:>10.1f}")
    print(f"vLLM / transformers (spike_whale): {summary['vllm_over_transformers']:.2f}x")
    print(f"spike_whale / Llama anchor (both vLLM): {summary['spike_whale_over_llama_in_vllm']:.2f}x")
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
