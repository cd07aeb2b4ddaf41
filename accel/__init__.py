"""CPU acceleration for spike_whale models, applied explicitly: `optimize_for_cpu(model)`.

The Hub model is plain torch. This layer, which ships with the pip package only (never in a Hub folder), swaps in
same-signature drop-ins that compute the same function faster on a CPU:

- every `nn.Linear` becomes a `FewRowsLinear` (same parameters and state dict): a product of 1-16 rows on CPU runs
  through the fastest of its equal products on this machine (`kernels.FewRowsKernel`);
- each attention's and dense FFN's input projections run as one GEMM in eager no-grad eval forwards (`fusion`);
- where the model attends with SDPA, decode steps read a one-query kernel registered with transformers'
  `AttentionInterface` (`attention`; longer chunks stay SDPA's);
- `model.compile_decode` (and so `generate(..., compile_config=...)`) takes the CPU-specialised walk (`compile`).

Off CPU every drop-in is the plain module's own computation, and nothing chosen is kept on a module, so a model
moved to another device or dtype starts clean. The `spike-whale` command line applies it by default.
"""

from __future__ import annotations

import types

from torch import nn

from . import attention
from .compile import compile_decode, reset_compiled_products
from .fusion import fuse_input_projections, unfuse_input_projections
from .kernels import FEW_ROWS_KERNEL, FewRowsKernel, FewRowsLinear

__all__ = ["optimize_for_cpu", "is_optimized", "FEW_ROWS_KERNEL", "FewRowsKernel", "FewRowsLinear"]


def optimize_for_cpu(model: nn.Module, enable: bool = True) -> nn.Module:
    """Apply (or, with `enable=False`, remove) the CPU acceleration layer on a `SpikeWhaleForCausalLM`, in place;
    returns the model. Outputs are unchanged: the products are equal up to float summation order."""
    if not hasattr(model, "model") or not hasattr(model.model, "loop_plan"):
        raise TypeError(f"optimize_for_cpu() takes a SpikeWhaleForCausalLM, not {type(model).__name__}.")
    if not enable:
        if is_optimized(model):
            compile_decode(model, enable=False)
            del model.compile_decode
        if model.config._attn_implementation == attention.NAME:
            model.set_attn_implementation("sdpa")
        unfuse_input_projections(model)
        for module in model.modules():
            if type(module) is FewRowsLinear:
                module.__class__ = nn.Linear
        return model
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FewRowsLinear
    fuse_input_projections(model)
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(attention.register())
    model.compile_decode = types.MethodType(compile_decode, model)
    reset_compiled_products(model)
    return model


def is_optimized(model: nn.Module) -> bool:
    """Whether `optimize_for_cpu` is applied to `model`."""
    return "compile_decode" in vars(model)
