"""`model.fp8`: the model's GEMMs in FP8 (longctx_moe.kernels.fp8 holds the recipe and kernels).

Applied once, where the Transformer is built: each block's nn.Linear (attention and dense-MLP
projections, shared experts) becomes an Fp8Linear holding the same Parameter objects, and each
block's experts are told to run their grouped GEMMs in FP8. Parameter names, shapes and dtypes
are unchanged, so checkpoints, the optimizer and the HF export see the same model with or
without FP8. The router, a shared expert's gate, the embedding and the LM head are left as they
are.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx_moe.kernels import fp8
from longctx_moe.model.layers import autocast_dtype
from longctx_moe.model.moe import GroupedExperts, SharedExpert


class Fp8Linear(nn.Linear):
    """nn.Linear whose product runs in FP8 (E4M3 forward, E5M2 gradients, float32 masters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.linear(x, self.weight, self.bias, autocast_dtype(x))

    @classmethod
    def adopt(cls, linear: nn.Linear) -> Fp8Linear:
        """The same module re-classed: it keeps its parameters, hooks and attributes."""
        linear.__class__ = cls
        return linear


def apply_fp8(model: nn.Module, setting: str) -> None:
    """Turn `model`'s block GEMMs to FP8 for `setting` (model.fp8); "none" leaves it as it is."""
    if setting == "none":
        return
    if setting != "torch":  # te, or a bad value: the same line the start-up check gives
        raise ValueError(fp8.unavailable_reason(setting, "cuda"))
    for i, block in enumerate(model.layers):
        # a shared expert's gate ([D] -> 1 per token) is a router of sorts: it stays as it is
        gates = {id(m.gate) for m in block.modules() if isinstance(m, SharedExpert) and m.gate is not None}
        for name, module in block.named_modules():
            if type(module) is nn.Linear and id(module) not in gates:
                _check_widths(f"layers.{i}.{name}", module.in_features, module.out_features)
                Fp8Linear.adopt(module)
            elif isinstance(module, GroupedExperts):
                _check_widths(f"layers.{i}.{name}", *module.w_down.shape[1:])
                module.fp8 = True


def _check_widths(where: str, *widths: int) -> None:
    """cuBLAS's FP8 GEMM takes widths in multiples of 16 only: refuse the model here, in one line,
    rather than at its first forward on the GPU."""
    odd = [w for w in widths if w % 16]
    if odd:
        raise ValueError(f"model.fp8=torch: {where} has width {odd[0]}, and FP8 GEMMs need multiples of 16; "
                         "choose model widths (hidden_size, heads x head_dim, expert_hidden_size) that are, "
                         "or set model.fp8=none")
