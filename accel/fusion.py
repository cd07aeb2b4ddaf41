"""Input projections as one GEMM: the Linears that read the same input, re-stored as the row blocks of one matrix.

`fuse_input_projections(model)` gives each attention (q_a, k, v and, for float32 weights, the Memory Cache's qkv and
gate) and each dense FFN (gate, up) an `input_projections` that runs them as one GEMM in eager no-grad eval forwards
of a few rows and in a compiled decode walk: a decode step then streams the weights in one pass instead of several
small ones. The Linears' weights become views of the fused matrix, so values, state dict and in-place updates stay
shared; anything else (gradients, autocast, many rows, weights moved or hooked since) runs the module's own
`input_projections`.
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels import FEW_ROWS_MAX, FewRowsKernel, FewRowsLinear, compiled_kind, linear_forward


class FusedLinears:
    """[x·W₁ᵀ + b₁, …, x·Wₙᵀ + bₙ] as one GEMM: the weights of nn.Linear layers that read the same input re-stored
    as the row blocks of one matrix, so a decode step streams them in one pass instead of n small ones.

    Each Linear's weight becomes a view of its block: values, state dict and in-place updates stay shared. Moving
    or re-typing a module gives its weights new storage; `intact` notices, and the owner fuses again. The fused GEMM
    stands in for the Linears' calls, so it is taken only while each would compute x·Wᵀ + b and nothing else: no
    forward hook on it (or on every module), no replaced `forward` (accelerate's hooks), no wrapper class (a PEFT
    adapter); otherwise its owner runs the Linears one by one.
    """

    def __init__(self, linears: tuple[nn.Linear, ...]):
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        # Never an inference tensor (the weights become views of it), even when re-fused in an inference-mode step;
        # no_grad innermost, since inference_mode(False) turns gradients back on.
        with torch.inference_mode(False), torch.no_grad():
            self.weight = torch.cat([linear.weight for linear in linears])
            for linear, block in zip(linears, self.weight.split(self.sizes)):
                linear.weight.data = block
        self._blocks = tuple(linear.weight.data_ptr() for linear in linears)

    @staticmethod
    def fusable(linears: tuple[nn.Linear, ...]) -> bool:
        """Plain Linears (`only_compute`) with plain tensors of one dtype and device, present: a quantized or
        tensor-parallel weight (a tensor subclass) does not concatenate, and an offloaded one (meta, loaded by
        accelerate's hook per call) is not there."""
        if not FusedLinears.only_compute(linears):
            return False
        weights = [linear.weight for linear in linears]
        return (len({(w.dtype, w.device) for w in weights}) == 1 and weights[0].device.type != "meta"
                and all(type(w.data) is torch.Tensor for w in weights))

    @staticmethod
    def only_compute(linears: tuple[nn.Linear, ...]) -> bool:
        """Whether calling each Linear would only compute x·Wᵀ + b: its class's own forward, no hooks."""
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        return all(type(linear) in (nn.Linear, FewRowsLinear) and "forward" not in vars(linear)
                   and not linear._forward_hooks and not linear._forward_pre_hooks for linear in linears)

    def intact(self) -> bool:
        """The weights are still the fused matrix's blocks, and the Linears still only compute."""
        return (all(linear.weight.data_ptr() == ptr for linear, ptr in zip(self.linears, self._blocks))
                and self.only_compute(self.linears))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = linear_forward(x, self.weight, None, compiled_kind(self, x)).split(self.sizes, -1)
        return tuple(y if linear.bias is None else y + linear.bias for y, linear in zip(parts, self.linears))


class FusedInputProjections:
    """A module's `input_projections` through one `FusedLinears` GEMM where that computes the same function (see the
    module docstring), else the module's own. Installed as an instance attribute, so `del module.input_projections`
    (`unfuse_input_projections`) restores the class's. The Linears are chosen again whenever it fuses (`refuse`):
    a cast changes which of them share a dtype."""

    def __init__(self, module: nn.Module):
        self.owner = (module,)  # a tuple: not registered as a submodule
        self.fused: FusedLinears | None = None
        self.refuse()

    def __call__(self, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        module = self.owner[0]
        if (module.training or torch.is_grad_enabled() or u.is_meta  # meta: shapes only, and no autocast to ask
                or torch.is_autocast_enabled(u.device.type)):
            return type(module).input_projections(module, u)
        if not torch.compiler.is_compiling():  # a compiled walk: no test of its (symbolic) row count
            if u.numel() > FEW_ROWS_MAX * u.shape[-1]:
                return type(module).input_projections(module, u)
            if self.fused is None or not self.fused.intact():
                self.refuse()
        if self.fused is None:
            return type(module).input_projections(module, u)
        return self.fused(u)

    def refuse(self) -> None:
        """Fuse (again) the Linears `input_linears` names now, where they can be (else None): after the weights were
        given new storage (moved, re-typed, loaded), or once hooks that kept them apart are gone."""
        if self.fused is not None:  # the old matrix's prepacked copy goes with it
            FewRowsKernel.packed.pop(self.fused.weight, None)
        linears = input_linears(self.owner[0])
        self.fused = FusedLinears(linears) if FusedLinears.fusable(linears) else None


def input_linears(module: nn.Module) -> tuple[nn.Linear, ...]:
    """The Linears reading an attention's or dense FFN's input: q_a, k, v (plus the Memory Cache's qkv and gate where
    the weights are float32, as the branch computes), or gate and up."""
    if hasattr(module, "q_a_proj"):
        linears = (module.q_a_proj, module.k_proj, module.v_proj)
        if module.mc is not None and module.q_a_proj.weight.dtype == torch.float32:
            linears += (module.mc.qkv_proj, module.mc.gate_proj)
        return linears
    return module.gate_proj, module.up_proj


def fusable_modules(model: nn.Module) -> list[nn.Module]:
    """Every attention and dense FFN of the decoder."""
    modules = []
    for layer in model.model.layers:
        modules.append(layer.attn)
        if hasattr(layer.ffn, "gate_proj") and not hasattr(layer.ffn, "experts"):
            modules.append(layer.ffn)
    return modules


def fuse_input_projections(model: nn.Module, modules=None) -> None:
    """Install `FusedInputProjections` on the attention and FFN modules of `model` (all, or those in `modules`)."""
    for module in fusable_modules(model):
        if modules is None or module in modules:
            module.input_projections = FusedInputProjections(module)


def unfuse_input_projections(model: nn.Module, modules=None) -> None:
    """Back to each module's own `input_projections` (the weights keep their fused storage until moved)."""
    for module in fusable_modules(model):
        if (modules is None or module in modules) and "input_projections" in vars(module):
            del module.input_projections


def fused(module: nn.Module) -> FusedLinears | None:
    """The module's fused GEMM as it stands now (fused again first where its weights moved), or None."""
    projections = vars(module).get("input_projections")
    if not isinstance(projections, FusedInputProjections):
        return None
    if projections.fused is not None and not projections.fused.intact():
        projections.refuse()
    return projections.fused
