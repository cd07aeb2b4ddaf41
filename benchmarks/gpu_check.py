"""One-command GPU check of spike_whale: the CUDA cells of the README's support matrix, in under 10 minutes.

    python benchmarks/gpu_check.py                      # CUDA, the 114M preset (random weights), fp32 and bf16
    python benchmarks/gpu_check.py --device cpu --quick # tiny configs, few tokens: tests/test_gpu_check.py runs it
    python benchmarks/gpu_check.py --only exactness,attention --budget-s 300 --out /tmp/g.json

Checks (random weights; the zero-initialised gates are opened so that every mechanism changes the output):
  1 exactness   greedy `generate` with the model's cache equals a full recompute (`use_cache=False`) of its output:
                prompt 3*mc_segment_len-5, 2*mc_segment_len new tokens (crosses Memory-Cache segments and every loop
                pass); ids reproduced by the recompute's argmax, max |Δlogit| (fp32 pass ≤ 1e-3; bf16 reported).
  2 attention   eager, sdpa, flash_attention_2 (if flash_attn imports) and flex_attention on a left-padded batch of 2:
                logits on the real positions against eager, and the padded row against the same row alone.
  3 compile     `generate(compile_config=CompileConfig(mode="reduce-overhead"), cache_implementation="static")`:
                CUDA graphs recorded, cudagraph counters, compiled vs eager decode tok/s, compiled tokens == eager.
  4 device_map  a saved folder loaded with `device_map="auto"` over 2 GPUs generates the single-device tokens.
  5 speed       decode tok/s (batch 1 and 8, prompt 128, 64 new tokens) and 512-token prefill time, next to the
                in-library Llama anchor of the same per-token shape (benchmarks/_common.py), interleaved, median of 3.

Every check runs in a child process of its own (a segfault or a poisoned CUDA context fails one row, and the rest
resume in a fresh child), and each row is "pass", "FAIL: <reason>" or "skipped: <why>". After `--budget-s` seconds
no new check starts ("skipped: time budget"); a child still running well past it is killed. The script prints the
environment, one markdown table (for docs/performance.md) and writes JSON (default benchmarks/results/gpu_check.json).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("eager", "sdpa", "flash_attention_2", "flex_attention")
GROUP_ORDER = ("exactness", "attention", "speed", "device_map", "compile")  # compile last: the slowest to start
LABELS = {"exactness": "1 exactness", "attention": "2 attention", "compile": "3 compile reduce-overhead",
          "device_map": "4 device_map 2 GPUs", "speed": "5 speed vs Llama"}
FP32_TOL = 1e-3


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:240]


def plan(quick: bool, device: str) -> list[str]:
    """Every unit, in table order: 'check[:variant]:dtype', one row each."""
    units = ["exactness:fp32", "exactness:bf16"]
    units += [f"attention:{i}:{d}" for i in IMPLS for d in ("fp32", "bf16") if (i, d) != ("flash_attention_2", "fp32")]
    units += ["compile:fp32", "device_map:fp32"]
    units += ["speed:fp32"] if quick or device != "cuda" else ["speed:fp32", "speed:bf16"]
    return units


# ------------------------------------------------------------------------------------------------ the child's side
class Ctx:
    """What the checks of one child share: the device, sizes, and the seeded float32 CPU model they copy."""

    def __init__(self, device: str, quick: bool):
        from spike_whale import SpikeWhaleConfig

        self.device, self.quick, self.cuda = torch.device(device), quick, device.startswith("cuda")
        if quick:  # 4 layers x 2 loop passes, Memory-Cache segments of 8 tokens
            self.cfg = SpikeWhaleConfig.from_preset("tiny", mc_segment_len=8, max_position_embeddings=256)
        else:  # the preset's window is 1024; the exactness check needs 3L-5 + 2L = 1275 positions
            self.cfg = SpikeWhaleConfig.from_preset("byrne-100m-ultra-mc", max_position_embeddings=2048)
        self._cpu = None
        self.cache: dict = {}

    def cpu_model(self):
        from spike_whale import SpikeWhaleForCausalLM

        if self._cpu is None:
            torch.manual_seed(0)
            model = SpikeWhaleForCausalLM(self.cfg).eval()
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():  # open the zero-init gates (Memory Cache, depth attention, HRM, pass embeddings, ...)
                for _, p in model.named_parameters():
                    if p.numel() and not bool(p.detach().any()):
                        std = 0.5 if p.numel() <= 8 else self.cfg.initializer_range
                        p.copy_(torch.randn(p.shape, generator=gen) * std)
            self._cpu = model
        return self._cpu

    def spike(self, dtype: str):
        """A fresh copy on the device in `dtype` (a cast keeps the float32 parts float32)."""
        return copy.deepcopy(self.cpu_model()).to(device=self.device, dtype=DTYPES[dtype])

    def llama(self, dtype: str):
        """The anchor of benchmarks/_common.py (with --quick: the tiny config's stack unrolled the same way)."""
        from _common import llama_config
        from transformers import LlamaForCausalLM

        c, lc = self.cfg, llama_config(self.cfg)
        if self.quick:
            lc.update(dict(hidden_size=c.hidden_size, num_hidden_layers=c.num_loop_slots, head_dim=c.head_dim,
                           num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                           intermediate_size=c.moe_intermediate_size))
        torch.manual_seed(0)
        return LlamaForCausalLM(lc).eval().to(device=self.device, dtype=DTYPES[dtype])

    def prompt(self, batch: int, length: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, self.cfg.vocab_size - 111, (batch, length), generator=g)
        ids[:, 0] = self.cfg.bos_token_id
        return ids.to(self.device)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


class SyncClock:
    """Pass-through logits processor: when each step's logits arrive (after a CUDA synchronize)."""

    def __init__(self, ctx: Ctx):
        self.ctx, self.times = ctx, []

    def __call__(self, input_ids, scores):
        self.ctx.sync()
        self.times.append(time.perf_counter())
        return scores


def greedy(model, ids: torch.Tensor, n: int, **kw):
    """Exactly `n` greedy tokens, no repetition penalty or sampling whatever generation_config.json says."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                              repetition_penalty=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)


def timed_decode(ctx: Ctx, model, ids, n: int, **kw) -> tuple[float, torch.Tensor]:
    """(decode tok/s over the steps after the prefill's logits, output ids)."""
    from transformers import LogitsProcessorList

    clock = SyncClock(ctx)
    out = greedy(model, ids, n, logits_processor=LogitsProcessorList([clock]), **kw)
    steps = len(clock.times) - 1
    return steps * ids.shape[0] / (clock.times[-1] - clock.times[0]), out


def row(result: str, numbers: str = "", **data) -> dict:
    return {"result": result, "numbers": numbers, "data": data}


def check_exactness(ctx: Ctx, dtype: str) -> dict:
    model = ctx.spike(dtype)
    L = ctx.cfg.mc_segment_len
    ids, n = ctx.prompt(1, 3 * L - 5), 2 * L
    out = greedy(model, ids, n, output_logits=True, output_scores=True, return_dict_in_generate=True)
    seq, P = out.sequences, ids.shape[1]
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    steps = getattr(out, "logits", None) or out.scores  # raw logits; scores carry min_new_tokens' -inf on <eos>
    gen_logits = torch.stack(steps, 1).float()
    with torch.no_grad():
        full = model(seq, use_cache=False).logits[:, P - 1:-1].float()
    if eos:
        gen_logits[..., eos] = full[..., eos] = float("-inf")  # min_new_tokens forbids <eos>: compare the rest
    finite = torch.isfinite(full)
    delta = (gen_logits - full).abs()[finite].max().item()
    if not bool(torch.isfinite(gen_logits[finite]).all()):
        return row("FAIL: non-finite logits in generate", f"{len(steps)} steps")
    picked = full.argmax(-1)
    same = picked == seq[:, P:]
    top2 = full.topk(2, dim=-1).values
    ties = int((~same & ((top2[..., 0] - top2[..., 1]) <= max(delta, 1e-6))).sum())  # a near-tie may flip either way
    identical, total = int(same.sum()), same.numel()
    scale = full[finite].abs().max().item()
    from spike_whale.hub_export.cache_check import tolerance

    numbers = (f"prompt {P}, {n} new: ids {identical}/{total} identical" + (f" (+{ties} near-ties)" if ties else "")
               + f", max Δlogit {delta:.2e} (max logit {scale:.2f})")
    data = dict(prompt=P, new_tokens=n, identical=identical, total=total, near_ties=ties, max_dlogit=delta,
                max_abs_logit=scale, cache_check_tol=tolerance(DTYPES[dtype], scale))
    if dtype == "bf16":
        return row("pass", numbers + " (bf16: reported only)", **data)
    if identical + ties < total:
        return row(f"FAIL: {total - identical - ties} generated ids differ from the recompute's argmax", numbers,
                   **data)
    if delta > FP32_TOL:
        return row(f"FAIL: max Δlogit {delta:.2e} > {FP32_TOL:g}", numbers, **data)
    return row("pass", numbers, **data)


def padded_batch(ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor, int]:
    pad = 11
    ids = ctx.prompt(2, ctx.cfg.mc_segment_len + 37, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    ids[0, pad] = ctx.cfg.bos_token_id
    return ids, mask, pad


def real_logits(model, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of the padded batch's real positions, row 0 run alone without padding), float32."""
    ids, mask, pad = padded_batch(ctx)
    with torch.no_grad():
        both = model(ids, attention_mask=mask, use_cache=False).logits.float()
        alone = model(ids[:1, pad:], use_cache=False).logits.float()
    return torch.cat([both[0, pad:], both[1]]), (both[0, pad:] - alone[0]).abs().max()


def with_impl(ctx: Ctx, impl: str, dtype: str):
    """(model using `impl`, how it was set, errors): `set_attn_implementation`, else a config built with it."""
    from spike_whale import SpikeWhaleForCausalLM

    errors = []
    model = ctx.spike(dtype)
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(impl)
            if model.config._attn_implementation == impl:
                return model, "set_attn_implementation", errors
            errors.append(f"set_attn_implementation left {model.config._attn_implementation!r}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"set_attn_implementation: {one_line(e)}")
    try:
        cfg = copy.deepcopy(ctx.cfg)
        cfg._attn_implementation = impl
        built = SpikeWhaleForCausalLM(cfg).eval()
        built.load_state_dict(ctx.cpu_model().state_dict())
        built = built.to(device=ctx.device, dtype=DTYPES[dtype])
        if built.config._attn_implementation == impl:
            return built, "config._attn_implementation", errors
        errors.append(f"config route left {built.config._attn_implementation!r}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"config._attn_implementation: {one_line(e)}")
    return None, None, errors


def check_attention(ctx: Ctx, impl: str, dtype: str) -> dict:
    from spike_whale import SpikeWhaleForCausalLM

    declared = getattr(SpikeWhaleForCausalLM, "_supports_flash_attn", None)
    if impl.startswith("flash"):
        if not ctx.cuda:
            return row("skipped: flash_attention_2 needs CUDA", f"model declares _supports_flash_attn={declared}")
        if importlib.util.find_spec("flash_attn") is None:
            return row("skipped: flash_attn not installed", f"model declares _supports_flash_attn={declared}")
    for dt in {"fp32", dtype}:  # eager references (bf16 is judged against its own rounding noise, eager bf16 - fp32)
        if ("eager", dt) not in ctx.cache:
            ctx.cache[("eager", dt)] = real_logits(with_impl(ctx, "eager", dt)[0], ctx)[0]
    ref = ctx.cache[("eager", dtype)]
    model, route, errors = with_impl(ctx, impl, dtype)
    if model is None:
        return row("FAIL: " + "; ".join(errors)[:300], f"model declares _supports_flash_attn={declared}")
    logits, pad_delta = real_logits(model, ctx)
    if not bool(torch.isfinite(logits).all()):
        return row("FAIL: non-finite logits on real positions")
    delta, pad_delta = (logits - ref).abs().max().item(), pad_delta.item()
    scale = ref.abs().max().item()
    if dtype == "fp32":
        tol = max(FP32_TOL, 1e-5 * scale)
    else:
        tol = max(1e-2, 2 * (ctx.cache[("eager", "bf16")] - ctx.cache[("eager", "fp32")]).abs().max().item())
    numbers = f"vs eager max Δlogit {delta:.2e}; padded row vs alone {pad_delta:.2e}; tol {tol:.1e}"
    data = dict(route=route, max_dlogit_vs_eager=delta, max_dlogit_padded_vs_alone=pad_delta, tol=tol,
                max_abs_logit=scale, errors=errors)
    if errors:  # set_attn_implementation refused, the config route bypassed it
        return row(f"FAIL: {errors[0][:200]}", numbers + f" (via {route})", **data)
    if max(delta, pad_delta) > tol:
        return row(f"FAIL: max Δlogit {max(delta, pad_delta):.2e} > tol {tol:.1e}", numbers, **data)
    return row("pass", numbers, **data)


def check_compile(ctx: Ctx, dtype: str) -> dict:
    import transformers
    from packaging import version

    if version.parse(transformers.__version__) < version.parse("5.24"):
        return row(f"skipped: transformers {transformers.__version__} < 5.24 has no compile_config for this model")
    if not ctx.cuda and not ctx.quick:
        return row("skipped: compiling the 114M preset on CPU takes minutes; --quick compiles the tiny config")
    import logging

    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    recorded, skips = [0], []
    patched = None
    if ctx.cuda:
        from torch._inductor import cudagraph_trees as trees

        patched = trees.CUDAGraphTreeManager.record_function

        def counting(self, *a, **k):
            recorded[0] += 1
            return patched(self, *a, **k)

        trees.CUDAGraphTreeManager.record_function = counting

        grab = logging.Handler()  # keep inductor's "skipping cudagraphs due to ..." messages
        grab.emit = lambda r: skips.append(r.getMessage()[:160]) if "skip" in r.getMessage().lower() else None
        with contextlib.suppress(Exception):
            torch._logging.set_logs(cudagraphs=True)
            logging.getLogger("torch._inductor").addHandler(grab)
    P, n = (16, 8) if ctx.quick else (128, 64)
    ids = ctx.prompt(1, P)
    eager, compiled = ctx.spike(dtype), ctx.spike(dtype)  # compile_decode re-stores weights: its own copy
    timed_decode(ctx, eager, ids, n)
    eager_runs = [timed_decode(ctx, eager, ids, n) for _ in range(2)]
    eager_rate, eager_ids = max(r[0] for r in eager_runs), eager_runs[0][1]
    kw = dict(compile_config=CompileConfig(mode="reduce-overhead", fullgraph=False), cache_implementation="static")
    try:
        t = time.perf_counter()
        _, first_ids = timed_decode(ctx, compiled, ids, n, **kw)
        compile_s = time.perf_counter() - t
        rates = []
        for _ in range(2):
            rate, ids_c = timed_decode(ctx, compiled, ids, n, **kw)
            rates.append(rate)
    finally:
        if patched is not None:
            trees.CUDAGraphTreeManager.record_function = patched
    cg_counters = {f"{cat}.{k}": v for cat, d in counters.items() for k, v in d.items() if "cudagraph" in k.lower()}
    print(f"  [compile] counter keys containing 'cudagraph': {cg_counters or 'none'}", flush=True)
    is_compiled = getattr(compiled.model, "_compiled_for", None) is not None
    equal = bool((ids_c == eager_ids).all()) and bool((first_ids == eager_ids).all())
    rate = max(rates)
    graphs = str(recorded[0]) if ctx.cuda else "n/a (skipped: CUDA graphs need CUDA)"
    numbers = (f"CUDA graphs recorded {graphs}; first generate {compile_s:.1f} s; decode {rate:.1f} vs eager "
               f"{eager_rate:.1f} tok/s ({rate / eager_rate:.2f}x, best of 2); tokens equal eager: "
               f"{'yes' if equal else 'NO'}")
    data = dict(cuda_graphs_recorded=recorded[0] if ctx.cuda else None, cudagraph_counters=cg_counters,
                cudagraph_skip_messages=skips[:5], compile_s=compile_s, compiled_tok_s=rate, eager_tok_s=eager_rate,
                tokens_equal=equal, decode_compiled=is_compiled, prompt=P, new_tokens=n)
    if not is_compiled:
        return row("FAIL: decode steps were not compiled (compile_config ignored)", numbers, **data)
    if not equal:
        return row("FAIL: compiled tokens differ from eager tokens", numbers, **data)
    if ctx.cuda and recorded[0] == 0:
        return row(f"FAIL: no CUDA graph recorded ({skips[0] if skips else 'cudagraph_skips ' + str(cg_counters)})",
                   numbers, **data)
    return row("pass", numbers, **data)


def check_device_map(ctx: Ctx, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    from spike_whale.hub_export.folder import save_hub_folder
    from spike_whale.hub_export.train_tokenizer import build_demo_tokenizer

    model = ctx.cpu_model()
    ids, n = ctx.prompt(1, 64 if not ctx.quick else 16).cpu(), 32 if not ctx.quick else 8
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as folder:
        save_hub_folder(copy.deepcopy(model), build_demo_tokenizer(), folder)
        single = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
        single = single.to("cuda:0")
        ref = greedy(single, ids.to("cuda:0"), n, output_logits=True, return_dict_in_generate=True)
        size = sum(p.numel() * p.element_size() for p in single.parameters())
        del single
        split = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32,
                                                     device_map="auto", max_memory={0: int(0.55 * size),
                                                                                    1: int(2 * size)})
        placed = sorted({str(p.device) for p in split.parameters()})
        out = greedy(split, ids.to("cuda:0"), n, output_logits=True, return_dict_in_generate=True)
    delta = max((a.float().cpu() - b.float().cpu()).abs().max().item() for a, b in zip(out.logits, ref.logits))
    equal = bool((out.sequences.cpu() == ref.sequences.cpu()).all())
    numbers = (f"devices {','.join(placed)}; {n} tokens equal single device: {'yes' if equal else 'NO'}; "
               f"max Δlogit {delta:.2e}")
    data = dict(devices=placed, tokens_equal=equal, max_dlogit=delta, new_tokens=n)
    if not {"cuda:0", "cuda:1"} <= set(placed):
        return row(f"FAIL: placement did not use both GPUs ({placed})", numbers, **data)
    return row("pass" if equal else "FAIL: tokens differ from the single-device run", numbers, **data)


def check_speed(ctx: Ctx, dtype: str) -> dict:
    spike, llama = ctx.spike(dtype), ctx.llama(dtype)
    P, n, prefill = (16, 8, 64) if ctx.quick else (128, 64, 512)
    batches = (1, 2) if ctx.quick else (1, 8)

    def prefill_s(model):
        ids = ctx.prompt(1, prefill, seed=2)
        ctx.sync()
        t = time.perf_counter()
        with torch.no_grad():
            model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        ctx.sync()
        return time.perf_counter() - t

    jobs = {f"decode_b{b}": (lambda m, b=b: timed_decode(ctx, m, ctx.prompt(b, P, seed=b), n)[0]) for b in batches}
    jobs[f"prefill{prefill}_s"] = prefill_s
    runs = {(job, name): [] for job in jobs for name in ("spike_whale", "llama")}
    for job, fn in jobs.items():  # warm-up of every shape
        fn(spike), fn(llama)
    for r in range(3):  # interleaved: A, B, then B, A
        for job, fn in jobs.items():
            order = [("spike_whale", spike), ("llama", llama)]
            for name, m in order if r % 2 == 0 else order[::-1]:
                runs[(job, name)].append(fn(m))
    med = {f"{name}.{job}": statistics.median(v) for (job, name), v in runs.items()}
    parts = []
    for job in jobs:
        sw, ll = med[f"spike_whale.{job}"], med[f"llama.{job}"]
        if job.startswith("decode"):
            parts.append(f"{job.replace('_', ' ')} {sw:.1f} vs {ll:.1f} tok/s ({sw / ll:.2f}x)")
        else:
            parts.append(f"prefill {prefill} {1000 * sw:.1f} vs {1000 * ll:.1f} ms ({sw / ll:.2f}x time)")
    data = {"median": med, "runs": {f"{name}.{job}": v for (job, name), v in runs.items()}, "prompt": P,
            "new_tokens": n, "prefill_tokens": prefill, "ratio": "spike_whale / llama"}
    return row("pass", "spike vs llama: " + "; ".join(parts), **data)


CHECKS = {"exactness": check_exactness, "attention": check_attention, "compile": check_compile,
          "device_map": check_device_map, "speed": check_speed}


def run_child(args) -> int:
    """Run the units in order, appending {"start": unit} and then its row to --rows-file as each finishes."""
    import transformers

    transformers.logging.set_verbosity_error()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ctx = Ctx(args.device, args.quick)
    with open(args.rows_file, "a") as f:
        for unit in args.child.split(","):
            f.write(json.dumps({"start": unit}) + "\n")
            f.flush()
            check, *variant, dtype = unit.split(":")
            t = time.perf_counter()
            if time.time() > args.deadline:
                res = row("skipped: time budget")
            else:
                try:
                    res = CHECKS[check](ctx, *variant, dtype)
                except Exception as e:  # noqa: BLE001
                    res = row(f"FAIL: {one_line(e)}")
            res.update(unit=unit, seconds=round(time.perf_counter() - t, 1))
            print(f"  [{unit}] {res['result']}  {res['numbers']}", flush=True)
            f.write(json.dumps(res, default=str) + "\n")
            f.flush()
            if "CUDA error" in res["result"] or "device-side assert" in res["result"]:
                return 3  # the context is poisoned: the parent resumes the rest in a fresh child
    return 0


# ----------------------------------------------------------------------------------------------- the parent's side
def environment(device: str) -> dict:
    import transformers

    env = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda, "device": device,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "tf32": "off in every check", "gpus": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append(f"{i}: {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB")
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except Exception as e:  # noqa: BLE001
        env["flash_attn"] = f"not importable ({type(e).__name__})"
    try:
        rev = subprocess.run(["git", "-C", str(HERE), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        env["spike_whale_git"] = rev or None
    except Exception:  # noqa: BLE001
        env["spike_whale_git"] = None
    return env


def crash_reason(rc: int, stderr: str) -> str:
    """One line: the signal or exit code, the C library's last complaint, the innermost frame of the crashed thread."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    print("  child stderr tail:\n    " + "\n    ".join(lines[-8:]), flush=True)
    reason = f"child process died ({'signal ' + signal.Signals(-rc).name if rc < 0 else f'exit {rc}'})"
    libc = [x for x in lines if x.endswith(("invalid pointer", "corruption (out)", "(unsorted)", "double free"))]
    if libc:
        reason += f"; {libc[-1]}"
    current = max((i for i, x in enumerate(lines) if x.startswith("Current thread")), default=None)
    frames = [m for x in lines[current + 1:] if (m := re.match(r'File "([^"]+)", line (\d+) in (\w+)', x))] \
        if current is not None else []
    if frames:
        path, line, fn = frames[0].groups()
        kind = "an inductor-compiled kernel, " if "torchinductor" in path else ""
        reason += f"; in {kind}{fn} ({'/'.join(Path(path).parts[-2:])}:{line})"
    return reason[:300]


def run_group(args, units: list[str], deadline: float, hard_deadline: float) -> dict[str, dict]:
    """Run `units` in child processes until each has a row; a crash fails the unit it was in and the rest resume."""
    rows, pending = {}, list(units)
    while pending:
        if time.time() > deadline:
            rows.update({u: row("skipped: time budget") for u in pending})
            break
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            rows_file, err_file = Path(tmp, "rows.jsonl"), Path(tmp, "stderr.txt")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(pending), "--rows-file",
                   str(rows_file), "--device", args.device, "--deadline", str(deadline)] + ["--quick"] * args.quick
            env = dict(os.environ, PYTHONFAULTHANDLER="1", TRANSFORMERS_VERBOSITY="error")
            why = None
            with open(err_file, "w") as err:  # a session of its own: a kill takes inductor's workers along
                proc = subprocess.Popen(cmd, stderr=err, env=env, start_new_session=True)
                try:
                    rc = proc.wait(timeout=max(1.0, hard_deadline - time.time()))
                except BaseException as e:  # the hard limit, or Ctrl-C
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    if not isinstance(e, subprocess.TimeoutExpired):
                        raise
                    rc, why = None, f"skipped: time budget (killed at the hard limit, {args.budget_s:.0f} s + grace)"
            text = rows_file.read_text() if rows_file.exists() else ""
            lines = [json.loads(x) for x in text.splitlines() if x.strip()]
            started = None
            for entry in lines:
                if "start" in entry:
                    started = entry["start"]
                else:
                    rows[entry["unit"]], started = entry, None
            if why is None and rc not in (0, 3):
                why = "FAIL: " + crash_reason(rc, err_file.read_text(errors="replace"))
            elif why is None and rc == 0 and not any(u in rows for u in pending):
                why = "FAIL: the child process ended without a row"
        if why:
            if started:
                rows[started] = row(why)
            elif not any(u in rows for u in pending):  # died before its first unit (import, setup)
                rows.update({u: row(why) for u in pending})
            if why.startswith("skipped"):
                rows.update({u: row("skipped: time budget") for u in pending if u not in rows})
        pending = [u for u in pending if u not in rows]
    return rows


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def label(unit: str) -> str:
    check, *variant, _ = unit.split(":")
    return LABELS[check] + (f": {variant[0]}" if variant else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny configs and few tokens (the smoke test)")
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_check.json"))
    ap.add_argument("--budget-s", type=float, default=480.0, help="no check starts after this many seconds")
    ap.add_argument("--only", default="", help="comma-separated checks: " + ",".join(LABELS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args)

    start = time.time()
    deadline = start + args.budget_s
    hard_deadline = deadline + max(30.0, 0.2 * args.budget_s)
    env = environment(args.device)
    print("## environment")
    for key, value in env.items():
        print(f"- {key}: {'; '.join(value) if isinstance(value, list) else value}")
    print(f"- quick: {args.quick}, budget: {args.budget_s:.0f} s", flush=True)

    units = plan(args.quick, args.device.split(":")[0])
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    rows: dict[str, dict] = {}
    for u in units:
        check = u.split(":")[0]
        if only and check not in only:
            rows[u] = row("skipped: not in --only")
        elif check == "device_map" and not args.device.startswith("cuda"):
            rows[u] = row("skipped: device_map across GPUs needs CUDA")
        elif check == "device_map" and torch.cuda.device_count() < 2:
            rows[u] = row(f"skipped: {torch.cuda.device_count()} GPU")
    for group in GROUP_ORDER:
        todo = [u for u in units if u.split(":")[0] == group and u not in rows]
        if todo:
            print(f"# {group}: {len(todo)} row(s), {time.time() - start:.0f} s elapsed", flush=True)
            rows.update(run_group(args, todo, deadline, hard_deadline))

    dev = args.device
    table = ["| check | device | dtype | result | numbers |", "|---|---|---|---|---|"]
    for u in units:
        r = rows[u]
        r.update(unit=u, check=label(u), dtype=u.rsplit(":", 1)[1],
                 device="cuda:0+1" if u.startswith("device_map") and dev.startswith("cuda") else dev)
        table.append("| " + " | ".join(cell(r[k]) for k in ("check", "device", "dtype", "result", "numbers")) + " |")
    elapsed = time.time() - start
    print("\n" + "\n".join(table))
    print(f"\n{elapsed:.0f} s in all")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"environment": env, "args": {k: v for k, v in vars(args).items() if v is not None},
              "elapsed_s": round(elapsed, 1), "rows": [rows[u] for u in units], "table_markdown": "\n".join(table)}
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
