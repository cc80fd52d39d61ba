"""`execution.fp8`: the model's GEMMs in FP8 (longctx_moe.kernels.fp8 holds the recipe and kernels).

Applied once, where the Transformer is built: each block's nn.Linear (attention and dense-MLP
projections, shared experts) is replaced by an Fp8Linear holding the same Parameter objects; the
experts take FP8 as a constructor argument (model.experts.GroupedExperts, from the Ops). Parameter names, shapes and dtypes
are unchanged, so checkpoints, the optimizer and the HF export see the same model with or
without FP8. The router, a shared expert's gate, the embedding and the LM head are left as they
are.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx_moe.kernels import fp8
from longctx_moe.model.experts import GroupedExperts
from longctx_moe.model.layers import autocast_dtype
from longctx_moe.model.moe import SharedExpert


class Fp8Linear(nn.Linear):
    """nn.Linear whose product runs in FP8 (E4M3 forward, E5M2 gradients, float32 masters),
    scaled by `fp8_recipe` (execution.fp8_recipe: tensor | block | delayed) through `fp8_scaling`,
    the recipe's object (delayed scaling's holds this layer's amax histories)."""

    fp8_recipe = "tensor"
    fp8_scaling = fp8.RECIPES["tensor"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.linear(x, self.weight, self.bias, autocast_dtype(x), self.fp8_scaling)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "tensor",
                 history: int = 16, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.fp8_recipe, self.fp8_scaling = recipe, fp8.make_recipe(recipe, history)

    @classmethod
    def taking(cls, linear: nn.Linear, recipe: str = "tensor", history: int = 16) -> Fp8Linear:
        """An Fp8Linear that holds `linear`'s own Parameter objects (built on meta: no second
        allocation)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, history,
                  device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new


def advance_fp8(model: nn.Module, skipped: bool = False) -> None:
    """An optimizer step boundary for every FP8 module with step state (execution.fp8_recipe=delayed
    freezes its scales from the amax histories and opens a new slot); nothing for the others."""
    for module in model.modules():
        advance = getattr(getattr(module, "fp8_scaling", None), "advance", None)
        if advance is not None:
            advance(skipped)


def apply_fp8(model: nn.Module, setting: str, recipe: str = "tensor", history: int = 16) -> None:
    """Replace `model`'s block projections by FP8 ones for `setting` (execution.fp8) scaled by
    `recipe` (execution.fp8_recipe, with `history` steps of amax for delayed scaling), and check
    every FP8 GEMM's widths; "none" leaves the model as it is."""
    if setting == "none":
        return
    if setting != "torch":  # te, or a bad value: the same line the start-up check gives
        raise ValueError(fp8.unavailable_reason(setting, "cuda"))
    for i, block in enumerate(model.layers):
        # a shared expert's gate ([D] -> 1 per token) is a router of sorts: it stays as it is
        gates = {id(m.gate) for m in block.modules() if isinstance(m, SharedExpert) and m.gate is not None}
        for name, module in list(block.named_modules()):
            if type(module) is nn.Linear and id(module) not in gates:
                _check_widths(f"layers.{i}.{name}", recipe, module.in_features, module.out_features)
                parent, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent), leaf, Fp8Linear.taking(module, recipe, history))
            elif isinstance(module, GroupedExperts):
                _check_widths(f"layers.{i}.{name}", recipe, *module.w_down.shape[1:])


def _check_widths(where: str, recipe: str, *widths: int) -> None:
    """cuBLAS's FP8 GEMM takes widths in multiples of 16 only, and the block recipe scales runs
    of 128: refuse the model here, in one line, rather than at its first forward on the GPU."""
    multiple = fp8.BLOCK if recipe == "block" else 16
    odd = [w for w in widths if w % multiple]
    if odd:
        what = "execution.fp8_recipe=block" if recipe == "block" else "execution.fp8=torch"
        fix = "execution.fp8_recipe=tensor" if recipe == "block" else "execution.fp8=none"
        raise ValueError(f"{what}: {where} has width {odd[0]}, and its FP8 GEMMs need multiples of {multiple}; "
                         "choose model widths (hidden_size, heads x head_dim, expert_hidden_size) that are, "
                         f"or set {fix}")
