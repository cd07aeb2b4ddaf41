"""Every path of issue 12 in one run: spike_whale 114M (random weights) next to the in-library `LlamaForCausalLM`
anchor with the same per-token shape (48 layers), interleaved round by round, medians.

    python benchmarks/bench_speed.py            # prompt 256, 128 new tokens, batch 1 and 8, 2 rounds, every row
    python benchmarks/bench_speed.py --quick    # 32 new tokens, 1 round, batch 1 compiles, no 4096 prefill
    python benchmarks/bench_speed.py --new-tokens 64 --compile-batch-sizes 1   # every row, ~15 min on 2 idle cores

Rows (`--rows` picks a subset):
  eager          float32 `generate()`, no opt-in (Llama: its DynamicCache), decode tok/s at each batch size
  compiled       float32 through transformers' `compile_config` (Llama: static cache + compile_config)
  bf16           `dtype=torch.bfloat16` eager, batch 1
  bf16_compiled  the same through `compile_config`, batch 1
  int8           torchao int8 weight-only through `from_pretrained(..., quantization_config=TorchAoConfig(...))`,
                 decode tok/s at batch 1 against spike_whale's own float32 eager row, top-1 agreement and
                 max |Δlogit| of the prompt's logits against float32 (skipped with the reason if torchao is absent)
  int8_bf16      the same loaded with `dtype=torch.bfloat16` (bf16 activations), eager: its one-row products can take
                 `_weight_int8pack_mm` where `FewRowsKernel` times it faster than torchao's own product
  int8_compiled  the same loaded with `dtype=torch.bfloat16`, through `compile_config`: the walk multiplies each
                 int8 weight by `_weight_int8pack_mm` or, for one row, its float32 reduction, whichever
                 `FewRowsKernel` times faster (the count of each is reported)
  prefill        forward tok/s over a 512-token prompt, float32 and bf16, the Memory-Cache branch's share, and
                 where each model's forward spends its time (`prefill_breakdown`: products, Memory Cache, norms,
                 the attention's and FFN's other work, the rest)
  prefill_long   the same at 4096 tokens (both models get a 4096+ context window; parameters are unchanged)
  compile_cost   the first compiled decode step in a fresh process loading the same model, after this one
                 compiled it (torch's persistent compile caches)
  roofline       stream-style copy bandwidth, and bytes read per decoded token x tok/s as a fraction of it
  cache          whether the loop's weight reuse is served from cache here: the rate at which the model's own
                 one-row product (`linear_forward`, float32 and bf16, [2048, 768] weights) streams distinct weights
                 from working sets of 16 MB to 1 GB (the reported L3 may be shared: this is the part a process gets),
                 and the time of each loop pass of a batch-1 eager decode step, float32 and bf16 (passes 2 and 3 re-read
                 pass 1's blocks, so they are faster only where those stay cached)

The script runs under glibc malloc with fixed thresholds (`STEADY_MALLOC`, set in the environment before the process
starts: it re-runs itself once); `--glibc-defaults` measures under glibc's dynamic ones instead. Under the dynamic
ones, a freed block above the mmap threshold (at most 32 MiB) goes back to the kernel and the next one is faulted in
afresh, so a long prefill's time depends on what ran before it in the process: at 4096 tokens, float32, the Llama
anchor alone faulted in 9.6-11 GB a forward, and 0 when it ran after spike_whale, which faulted in 3.3 GB.

Decode tok/s = generated tokens / time between the first and the last decode step of greedy `generate` (prefill
excluded, generate's per-step overhead included). Compile time (the first steps of a compiled twin) is reported
separately and excluded. Where other processes share the machine, absolute numbers are skewed; the ratios of
rows run back to back in the same round are the fair comparison. Output: a table and JSON
(default benchmarks/results/speed.json; --quick: speed_quick.json).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from _common import build_models, cpu_info, median_rows, n_params, time_generate
from spike_whale import SpikeWhaleForCausalLM
from spike_whale.accel.compile import compiled_owners
from spike_whale.accel.kernels import compiled_kinds

ROOT = Path(__file__).resolve().parents[1]
ALL_ROWS = ("eager", "compiled", "bf16", "bf16_compiled", "int8", "int8_bf16", "int8_compiled", "prefill",
            "prefill_long", "compile_cost", "roofline", "cache")
QUICK_ROWS = ("eager", "compiled", "bf16", "int8", "prefill", "compile_cost", "roofline")
# glibc malloc keeps freed blocks up to 1 GiB in its heap for the next tensor, and returns heap memory to the kernel
# only above 4 GiB free: every model's large tensors reuse pages instead of faulting in fresh ones.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
TARGETS = {"eager": 1.0, "compiled": 1.3, "bf16": 1.5, "bf16_compiled": 1.5, "int8": 2.0, "int8_bf16": 2.0,
           "int8_compiled": 2.0, "prefill": 0.9,
           "prefill_long": 0.9, "mc_share": 0.15, "compile_cost_s": 10.0}


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Stream-style copy: bytes read + written per second (best of `repeats`) for a buffer far larger than L3."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def streaming_rates(dtype: torch.dtype, sizes_mb=(16, 64, 128, 256, 512, 1024), shape=(2048, 768)) -> dict:
    """GB/s at which `linear_forward` (the model's one-row product, `FewRowsKernel` included) reads distinct weights of
    `shape` cycled over each working-set size (the best of several passes, so the kernel's first-call trials of other
    products do not count)."""
    from spike_whale.accel.kernels import linear_forward

    per = shape[0] * shape[1] * torch.finfo(dtype).bits // 8
    rates = {}
    with torch.no_grad():
        x = torch.randn(1, shape[1]).to(dtype)
        for mb in sizes_mb:
            weights = [torch.randn(shape).to(dtype) for _ in range(max(1, mb * 10**6 // per))]
            for w in weights * 2:
                linear_forward(x, w)
            best = float("inf")
            for _ in range(max(3, 2048 // mb)):
                t = time.perf_counter()
                for w in weights:
                    linear_forward(x, w)
                best = min(best, time.perf_counter() - t)
            rates[mb] = len(weights) * per / best / 1e9
            del weights
    return rates


def pass_times(model, ids: torch.Tensor, steps: int) -> list[float]:
    """Median ms of each run of the loop plan (`walk_run`: the loop passes) over `steps` batch-1 eager decode steps."""
    import spike_whale.modeling_spike_whale as msw

    walk, runs = msw.walk_run, []

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = walk(*args, **kwargs)
        runs[-1].append(1000 * (time.perf_counter() - t))
        return out

    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        msw.walk_run = timed
        try:
            for _ in range(steps):
                runs.append([])
                token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        finally:
            msw.walk_run = walk
    return [statistics.median(step[i] for step in runs) for i in range(len(runs[0]))]


def bytes_per_token(model, context: int) -> int:
    """Bytes a batch-1 decode step reads: each block's weights once per loop pass (here they do not stay in the
    cache between passes unless L3 holds them), the LM head, the other weights once, the K/V of `context`
    positions in every slot. Embedding rows (token, Engram tables) are a few KB and left out, as are MTP heads."""
    cfg = model.config
    spike = isinstance(model, SpikeWhaleForCausalLM)
    passes = cfg.num_loop_slots / cfg.num_hidden_layers if spike else 1
    slots = cfg.num_loop_slots if spike else cfg.num_hidden_layers
    total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "lookup.tables" in name or "mtp" in name or "loop_pass_embed" in name:
            continue
        total += size * passes if ".layers." in name else size
    kv_item = next(p for n, p in model.named_parameters() if ".layers." in n).element_size()
    total += slots * 2 * cfg.num_key_value_heads * cfg.head_dim * context * kv_item
    if spike and cfg.use_memory_cache:
        total += slots * cfg.mc_num_heads * cfg.mc_head_dim * (cfg.mc_head_dim + 1) * 4  # running M and z, float32
    return int(total)


# spike_whale runs with the CPU layer applied (`spike_whale.accel.optimize_for_cpu`, the command line's default)
# unless --no-cpu-accel.
CPU_ACCEL = True


def accelerated(model):
    """`model` with the CPU layer applied where this run uses it (spike_whale models only)."""
    if CPU_ACCEL and isinstance(model, SpikeWhaleForCausalLM):
        from spike_whale.accel import optimize_for_cpu

        optimize_for_cpu(model)
    return model


def twin(model, dtype=None):
    """A second model with the same weights (a compiled twin re-stores weights, so it must not be the eager row's),
    built in `dtype` through transformers' `_from_config(dtype=...)` (which keeps the float32 modules float32)."""
    cls = type(model)
    copy = cls._from_config(model.config, dtype=dtype or model.dtype).eval()
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    return accelerated(copy)


def compile_kwargs(model) -> dict:
    """generate's kwargs for transformers' compile switch. Llama, as transformers runs it fastest: a static cache, and
    `CompileConfig._compile_all_devices` (generate compiles in-library models on accelerators only otherwise)."""
    from transformers import CompileConfig

    config = CompileConfig()
    if isinstance(model, SpikeWhaleForCausalLM):
        return {"compile_config": config}
    config._compile_all_devices = True
    return {"compile_config": config, "cache_implementation": "static"}


# Module kinds of the prefill breakdown, by class name: the products (each Linear called as a module; the
# Memory Cache's own projections are in its row), the Memory-Cache branch, the norms (the QK-norms too), then what
# the attention and FFN modules do themselves (softmax attention, applying RoPE, depth attention, XSA; the
# activation), and the rest of the forward (Hyper-Connections, residuals, embeddings, RoPE tables, Engram).
BREAKDOWN_KINDS = {"FewRowsLinear": "products", "Linear": "products", "FrozenLinear": "products",
                   "MemoryCacheBranch": "memory cache", "SpikeWhaleRMSNorm": "norms", "LlamaRMSNorm": "norms",
                   "SpikeWhaleAttention": "attention, other", "LlamaAttention": "attention, other",
                   "SpikeWhaleMLP": "ffn, other", "LlamaMLP": "ffn, other", "SiLUActivation": "ffn, other"}


def prefill_breakdown(model, ids: torch.Tensor) -> dict[str, float]:
    """Where one prefill forward's wall time goes: each module's own time (its forward minus its hooked children's),
    summed by `BREAKDOWN_KINDS` ("rest": every other module's, and time outside modules), as fractions of the
    forward; "memory cache" is the Memory-Cache share of issue 12's target. The hooks cost some time of their own,
    counted where they run: two calls per module call, 905 module calls in a forward of the 114M preset (the
    anchor: 630)."""
    spent, stack, hooks = collections.Counter(), [], []

    def pre(module, args):
        stack.append([time.perf_counter(), 0.0])

    def post(module, args, out):
        start, children = stack.pop()
        took = time.perf_counter() - start
        spent[BREAKDOWN_KINDS.get(type(module).__name__, "rest")] += took - children
        if stack:
            stack[-1][1] += took

    for module in model.modules():
        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            t = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            total = time.perf_counter() - t
    finally:
        for h in hooks:
            h.remove()
    spent["rest"] += total - sum(spent.values())
    return {kind: spent[kind] / total for kind in (*dict.fromkeys(BREAKDOWN_KINDS.values()), "rest")}


def time_prefill(model, ids: torch.Tensor) -> float:
    """Prompt tokens per second of one forward (no cache, last logits only)."""
    with torch.no_grad():
        t = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
    return ids.numel() / (time.perf_counter() - t)


def int8_compile_kwargs() -> dict:
    """compile_config for the int8 row: transformers' default (compile_decode picks the int8 products)."""
    from transformers import CompileConfig

    return {"compile_config": CompileConfig()}


def int8_model(folder: str, dtype: torch.dtype | None = None):
    """The saved float32 model loaded through transformers' torchao route (activations in `dtype`), or
    (None, reason)."""
    if importlib.util.find_spec("torchao") is None:
        return None, "torchao is not installed (pip install 'spike_whale[int8]')"
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    quant = TorchAoConfig(Int8WeightOnlyConfig())
    model = SpikeWhaleForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=dtype).eval()
    return accelerated(model), None


def first_compiled_step_in_fresh_process(folder: str, prompt: int, threads: int) -> dict:
    """A new interpreter loads the saved model and generates through compile_config: its slowest decode step is
    where the step is traced and compiled, from the persistent caches this process filled."""
    code = textwrap.dedent(f"""
        import json, sys, time
        t0 = time.perf_counter()
        import torch
        torch.set_num_threads({threads})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from _common import time_generate
        from transformers import CompileConfig
        from spike_whale import SpikeWhaleForCausalLM
        model = SpikeWhaleForCausalLM.from_pretrained({folder!r}).eval()
        if {CPU_ACCEL}:
            from spike_whale.accel import optimize_for_cpu
            optimize_for_cpu(model)
        ids = torch.randint(10, 16000, (1, {prompt}), generator=torch.Generator().manual_seed(1))
        ids[:, 0] = 2
        ready = time.perf_counter()
        first = time_generate(model, ids, 4, compile_config=CompileConfig())["step_s"]
        after = time_generate(model, ids, 4, compile_config=CompileConfig())["step_s"]
        print(json.dumps({{"first_compiled_step_s": max(first), "steps_first_generate_s": first,
                          "steps_second_generate_s": after, "load_s": ready - t0}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="32 new tokens, 1 round, batch-1 compiles, no 4096 prefill")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=None, help="default 128; quick 32")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds, medians reported (default 2; quick 1)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="eager rows (compiled: --compile-batch-sizes)")
    p.add_argument("--compile-batch-sizes", type=int, nargs="+", default=None, help="default: --batch-sizes; quick 1")
    p.add_argument("--prefill", type=int, nargs="+", default=[512], help="prefill lengths of the prefill row")
    p.add_argument("--prefill-long", type=int, default=4096, help="the prefill_long row's length")
    p.add_argument("--long-repeats", type=int, default=2,
                   help="rounds that include the prefill_long row (default 2: one round of it scattered 0.83-0.97x)")
    p.add_argument("--rows", nargs="+", choices=ALL_ROWS, default=None, help=f"default all; quick {' '.join(QUICK_ROWS)}")
    p.add_argument("--also", nargs="+", choices=ALL_ROWS, default=[], help="rows added to the defaults")
    p.add_argument("--out", default=None)
    p.add_argument("--glibc-defaults", action="store_true",
                   help="glibc malloc's dynamic thresholds (default: STEADY_MALLOC for both models)")
    p.add_argument("--no-cpu-accel", dest="cpu_accel", action="store_false",
                   help="the plain Hub model (default: spike_whale.accel.optimize_for_cpu applied, as the CLI does)")
    args = p.parse_args(argv)
    global CPU_ACCEL
    CPU_ACCEL = args.cpu_accel
    glibc = platform.libc_ver()[0] == "glibc"
    env = {k: v for k, v in os.environ.items() if k not in STEADY_MALLOC}
    if not args.glibc_defaults:
        env.update(STEADY_MALLOC)
    if glibc and env != dict(os.environ):  # glibc reads them as the process starts: run again (once) with them set
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)
    allocator = ("glibc malloc, " + ("dynamic thresholds (its defaults)" if args.glibc_defaults else
                                     ", ".join(f"{k}={v}" for k, v in STEADY_MALLOC.items()))
                 if glibc else "not glibc (STEADY_MALLOC does not apply)")
    new = args.new_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 2)
    rows_on = set(args.rows or (QUICK_ROWS if args.quick else ALL_ROWS)) | set(args.also)
    compile_bs = args.compile_batch_sizes or ([1] if args.quick else args.batch_sizes)
    out_path = Path(args.out or ROOT / "benchmarks" / "results" / ("speed_quick.json" if args.quick else "speed.json"))
    torch.set_num_threads(args.threads)

    prefill_lengths = list(args.prefill) if "prefill" in rows_on else []
    if "prefill_long" in rows_on:
        prefill_lengths.append(args.prefill_long)
    context = max([1024, args.prompt + new + 8] + [n + 8 for n in prefill_lengths])
    spike, llama = build_models(max_position_embeddings=context if context > 1024 else None)
    spike = accelerated(spike)
    cpu = cpu_info()
    load_before = os.getloadavg()
    print(f"spike_whale {n_params(spike):,} parameters ({spike.config.num_hidden_layers} layers, "
          f"{spike.config.num_loop_slots} loop slots); Llama anchor {n_params(llama):,} parameters, 48 layers")
    print(f"CPU {cpu['model']}: avx512_bf16 {cpu['avx512_bf16']}, amx_bf16 {cpu['amx_bf16']}, L3 {cpu['l3']}; "
          f"{torch.get_num_threads()} torch threads of {os.cpu_count()} CPUs, load average {load_before[0]:.2f}")
    print(f"allocator: {allocator}")
    print(f"prompt {args.prompt}, {new} new tokens, {repeats} interleaved round(s), rows: {' '.join(sorted(rows_on))}",
          flush=True)

    def prompt_ids(batch: int, length: int | None = None) -> torch.Tensor:
        ids = torch.randint(10, 16000, (batch, length or args.prompt), generator=torch.Generator().manual_seed(batch))
        ids[:, 0] = 2
        return ids

    # (row, batch) -> (spike model, its generate kwargs, anchor name, anchor model, its kwargs)
    pairs: dict[tuple[str, int], tuple] = {}
    compile_s: dict[str, float] = {}
    skipped: dict[str, str] = {}
    notes: dict[str, object] = {"cpu_accel": CPU_ACCEL}
    if "eager" in rows_on:
        for batch in args.batch_sizes:
            pairs[("eager", batch)] = (spike, {}, "llama", llama, {})

    def compiled_pair(row: str, sw, ll, batches):
        sw_c, ll_c = twin(sw), twin(ll)
        for batch in batches:
            for name, m in (("spike_whale", sw_c), ("llama", ll_c)):
                t = time.perf_counter()
                # as many new tokens as the timed rows: a static cache of another length would compile again there
                time_generate(m, prompt_ids(batch), new, **compile_kwargs(m))
                compile_s[f"{row}/{name}/b{batch}"] = time.perf_counter() - t
                print(f"{row}: {name} batch {batch} first generate (tracing + compiling, once) "
                      f"{compile_s[f'{row}/{name}/b{batch}']:.0f} s", flush=True)
            pairs[(row, batch)] = (sw_c, compile_kwargs(sw_c), "llama", ll_c, compile_kwargs(ll_c))

    tmp = tempfile.TemporaryDirectory(prefix="bench_speed_")
    folder = os.path.join(tmp.name, "spike_whale")
    if rows_on & {"int8", "int8_bf16", "int8_compiled", "compile_cost"}:
        spike.save_pretrained(folder)

    if "compiled" in rows_on:
        compiled_pair("compiled", spike, llama, compile_bs)
    spike_bf = llama_bf = None
    if rows_on & {"bf16", "bf16_compiled", "prefill", "prefill_long"}:
        spike_bf, llama_bf = twin(spike, torch.bfloat16), twin(llama, torch.bfloat16)
    if "bf16" in rows_on:
        pairs[("bf16", 1)] = (spike_bf, {}, "llama", llama_bf, {})
    if "bf16_compiled" in rows_on:
        compiled_pair("bf16_compiled", spike_bf, llama_bf, [1])
    int8 = None
    if "int8" in rows_on:
        int8, reason = int8_model(folder)
        if int8 is None:
            skipped["int8"] = reason
            print(f"int8: skipped, {reason}", flush=True)
        else:
            pairs[("int8", 1)] = (int8, {}, "spike_whale_fp32", spike, {})
            ids = prompt_ids(1)
            with torch.no_grad():
                ref, q = spike(ids, use_cache=False).logits, int8(ids, use_cache=False).logits
            notes["int8_top1_agreement"] = (ref.argmax(-1) == q.argmax(-1)).float().mean().item()
            notes["int8_max_abs_dlogit"] = (ref - q).abs().max().item()
            notes["int8_max_abs_logit_fp32"] = ref.abs().max().item()
            print(f"int8 vs float32 on a {args.prompt}-token prompt: top-1 agreement "
                  f"{notes['int8_top1_agreement']:.4f}, max |Δlogit| {notes['int8_max_abs_dlogit']:.4f} "
                  f"(max |logit| {notes['int8_max_abs_logit_fp32']:.2f})", flush=True)
    if "int8_bf16" in rows_on:
        int8_b, reason = int8_model(folder, dtype=torch.bfloat16)
        if int8_b is None:
            skipped["int8_bf16"] = reason
        else:
            pairs[("int8_bf16", 1)] = (int8_b, {}, "spike_whale_fp32", spike, {})
    if "int8_compiled" in rows_on:
        int8_c, reason = int8_model(folder, dtype=torch.bfloat16)
        if int8_c is None:
            skipped["int8_compiled"] = reason
        else:
            t = time.perf_counter()
            try:  # the row reports why the compiled step refuses a quantized model instead of ending the run
                time_generate(int8_c, prompt_ids(1), new, **int8_compile_kwargs())
            except Exception as e:  # noqa: BLE001
                skipped["int8_compiled"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                print(f"int8_compiled: skipped, {skipped['int8_compiled']}", flush=True)
            else:
                compile_s["int8_compiled/spike_whale/b1"] = time.perf_counter() - t
                taken = collections.Counter(compiled_kinds(o)[0] for o in compiled_owners(int8_c))
                notes["int8_compiled_products"] = dict(taken)
                print(f"int8_compiled: one-row products of the walk {dict(taken)}", flush=True)
                pairs[("int8_compiled", 1)] = (int8_c, int8_compile_kwargs(), "spike_whale_fp32", spike, {})

    # warm-up of the eager models (allocator, first-call paths), those the prefill rows time included: with only
    # prefill rows on, the first timed forward of each model was its first call
    prefill_models = [(spike, None, None, llama, None), (spike_bf, None, None, llama_bf, None)] if prefill_lengths else []
    for sw, _, _, ll, _ in [*pairs.values(), *prefill_models]:
        for m in (sw, ll):
            if not getattr(m, "_bench_warm", False):
                time_generate(m, prompt_ids(1, 16), 2)
                m._bench_warm = True

    runs: dict[tuple, list[dict]] = {}
    prefill_runs: dict[tuple, list[float]] = {}
    for r in range(repeats):
        for (row, batch), (sw, sw_kw, anchor, ll, ll_kw) in pairs.items():
            ids = prompt_ids(batch)
            order = [("spike_whale", sw, sw_kw), (anchor, ll, ll_kw)]
            for name, m, kw in order if r % 2 == 0 else order[::-1]:
                res = time_generate(m, ids, new, **kw)
                runs.setdefault((row, batch, name), []).append(res)
                print(f"  round {r + 1}: {row:14s} b{batch} {name:17s} {res['decode_tok_s']:8.2f} tok/s "
                      f"({res['ms_per_step']:.0f} ms/step)", flush=True)
        for length in prefill_lengths:
            if "prefill_long" in rows_on and length == args.prefill_long and r >= args.long_repeats:
                continue
            ids = prompt_ids(1, length)
            for dtype, sw, ll in (("float32", spike, llama), ("bfloat16", spike_bf, llama_bf)):
                order = [("spike_whale", sw), ("llama", ll)]
                for name, m in order if r % 2 == 0 else order[::-1]:
                    tok_s = time_prefill(m, ids)
                    prefill_runs.setdefault((length, dtype, name), []).append(tok_s)
                    print(f"  round {r + 1}: prefill {length} {dtype:8s} {name:11s} {tok_s:8.1f} tok/s", flush=True)

    for length in prefill_lengths:
        for dtype, sw, ll in (("float32", spike, llama), ("bfloat16", spike_bf, llama_bf)):
            for name, m in (("spike_whale", sw), ("llama", ll)):
                notes[f"breakdown_prefill{length}_{dtype}_{name}"] = prefill_breakdown(m, prompt_ids(1, length))
            if length == max(prefill_lengths):
                share = notes[f"mc_share_prefill{length}_{dtype}"] = (
                    notes[f"breakdown_prefill{length}_{dtype}_spike_whale"]["memory cache"])
                print(f"Memory-Cache branch share of a {length}-token prefill, {dtype}: {100 * share:.1f}%", flush=True)

    if "compile_cost" in rows_on:
        if "compiled" not in rows_on or 1 not in compile_bs:  # the fresh process reads what this compile stored
            warm = twin(spike)
            time_generate(warm, prompt_ids(1), new, **compile_kwargs(warm))
        res = first_compiled_step_in_fresh_process(folder, args.prompt, args.threads)
        notes["compile_cost_fresh_process"] = res
        print(f"compile cost, fresh process: {res}", flush=True)

    bandwidth = copy_bandwidth() if "roofline" in rows_on else None
    if "cache" in rows_on:
        for dtype, model in (("float32", spike), ("bfloat16", twin(spike, torch.bfloat16))):
            notes[f"cache_pass_ms_{dtype}"] = pass_times(model, prompt_ids(1), 32)
            notes[f"cache_streaming_gb_s_{dtype}"] = streaming_rates(getattr(torch, dtype))
    load_after = os.getloadavg()
    tmp.cleanup()

    medians = {k: median_rows(v) for k, v in runs.items()}
    table = []

    def add(path, measure, sw, ll, target=None, anchor="Llama"):
        ratio = sw / ll if sw is not None and ll else None
        table.append({"path": path, "measure": measure, "spike_whale": sw, "anchor": ll, "anchor_name": anchor,
                      "ratio": ratio, "target": target})

    for (row, batch), (_, _, anchor, _, _) in pairs.items():
        sw, ll = medians[(row, batch, "spike_whale")], medians[(row, batch, anchor)]
        label = {"eager": "float32 eager", "compiled": "float32 compile_config", "bf16": "bf16 eager",
                 "bf16_compiled": "bf16 compile_config", "int8": "int8 weight-only eager",
                 "int8_bf16": "int8 weight-only eager (bf16 activations)",
                 "int8_compiled": "int8 weight-only compile_config"}[row]
        add(f"{label}, batch {batch}", "decode tok/s", sw["decode_tok_s"], ll["decode_tok_s"], TARGETS[row],
            "spike_whale float32 eager" if row.startswith("int8") else "Llama")
    for length in prefill_lengths:
        for dtype in ("float32", "bfloat16"):
            sw = statistics.median(prefill_runs[(length, dtype, "spike_whale")])
            ll = statistics.median(prefill_runs[(length, dtype, "llama")])
            add(f"prefill {length}, {dtype}", "tok/s", sw, ll, TARGETS["prefill"])
    if bandwidth:
        for row, batch in (("eager", 1), ("compiled", 1), ("bf16", 1), ("bf16_compiled", 1)):
            if (row, batch) not in pairs:
                continue
            sw_m, _, _, ll_m, _ = pairs[(row, batch)]
            for name, m in (("spike_whale", sw_m), ("llama", ll_m)):
                b = bytes_per_token(m, args.prompt + new // 2)
                tok_s = medians[(row, batch, name)]["decode_tok_s"]
                notes[f"roofline_{row}_b{batch}_{name}"] = {"bytes_per_token": b, "fraction": b * tok_s / bandwidth}

    print()
    if table:
        print(f"{'path':<40}{'measure':>14}{'spike_whale':>13}{'anchor':>11}{'ratio':>8}{'target':>8}")
    for t in table:
        print(f"{t['path']:<40}{t['measure']:>14}{t['spike_whale']:>13.2f}{t['anchor']:>11.2f}"
              f"{t['ratio']:>7.2f}x{'≥ ' + format(t['target'], '.2g') + 'x' if t['target'] else '':>8}"
              + ("" if t["anchor_name"] == "Llama" else f"  (anchor: {t['anchor_name']})"))
    for key in sorted(k for k in notes if k.startswith("mc_share")):
        print(f"{key}: {100 * notes[key]:.1f}% (target ≤ 15% at 4096)")
    for key in sorted(k for k in notes if k.startswith("breakdown_prefill")):
        print(f"{key}: " + ", ".join(f"{kind} {100 * share:.0f}%" for kind, share in notes[key].items()))
    if "int8_top1_agreement" in notes:
        print(f"int8 vs float32 logits: top-1 agreement {notes['int8_top1_agreement']:.4f}, "
              f"max |Δlogit| {notes['int8_max_abs_dlogit']:.4f}")
    for key, why in skipped.items():
        print(f"{key}: skipped ({why})")
    for key, s in compile_s.items():
        print(f"compile (first generate of a compiled twin, this process): {key} {s:.0f} s")
    if "compile_cost_fresh_process" in notes:
        res = notes["compile_cost_fresh_process"]
        if "first_compiled_step_s" in res:
            print(f"compile cost: first compiled decode step in a fresh process {res['first_compiled_step_s']:.1f} s "
                  f"(a compiled step after it {1000 * min(res['steps_second_generate_s']):.0f} ms; target ≤ 10 s)")
        else:
            print(f"compile cost: fresh process failed: {res.get('error')}")
    if bandwidth:
        print(f"stream copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); L3 {cpu['l3']}")
        for key in sorted(k for k in notes if k.startswith("roofline_")):
            v = notes[key]
            print(f"{key}: {v['bytes_per_token'] / 1e6:.0f} MB read per token, {100 * v['fraction']:.0f}% of the "
                  "copy-bandwidth roofline")
    for dtype in ("float32", "bfloat16"):
        if f"cache_pass_ms_{dtype}" in notes:
            passes = notes[f"cache_pass_ms_{dtype}"]
            rates = notes[f"cache_streaming_gb_s_{dtype}"]
            print(f"cache, {dtype}: loop passes of a batch-1 eager decode step "
                  + " / ".join(f"{ms:.1f}" for ms in passes) + " ms (median of 32 steps); one-row products stream "
                  + ", ".join(f"{rate:.0f} GB/s at {mb} MB" for mb, rate in rates.items()) + f" (reported L3 {cpu['l3']})")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")

    result = {
        "benchmark": "issue 12: every path, spike_whale 114M vs Llama 48L anchor, interleaved, medians",
        "machine": {"platform": platform.platform(), "cpu": cpu, "torch_threads": torch.get_num_threads(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__,
                    "torchao": getattr(sys.modules.get("torchao"), "__version__", None),
                    "loadavg_before": load_before, "loadavg_after": load_after,
                    "copy_bandwidth_bytes_s": bandwidth},
        "settings": {"prompt": args.prompt, "new_tokens": new, "repeats": repeats, "batch_sizes": args.batch_sizes,
                     "compile_batch_sizes": compile_bs, "prefill_lengths": prefill_lengths, "rows": sorted(rows_on),
                     "quick": args.quick, "context_window": context, "allocator": allocator},
        "params": {"spike_whale": n_params(spike), "llama": n_params(llama)},
        "table": table,
        "runs": [dict(row=k[0], batch=k[1], model=k[2], **v) for k, v in medians.items()],
        "prefill_runs": [{"length": k[0], "dtype": k[1], "model": k[2], "tok_s": v} for k, v in prefill_runs.items()],
        "compile_s": compile_s,
        "notes": notes,
        "skipped": skipped,
        "targets": TARGETS,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
