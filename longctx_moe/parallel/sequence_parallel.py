"""Sequence parallelism (Megatron-LM): between the TP regions the residual stream is split along tokens.

With parallel.sequence_parallel the T tokens that a TP group shares are held T/tp per rank outside
attention and the dense MLPs: the norms and residual adds run on a rank's own tokens, so their
activations (kept for the backward) shrink by tp. Each TP region's conjugate pair becomes

    entry: all-gather tokens (backward: reduce-scatter)   instead of copy (backward: all-reduce)
    exit:  reduce-scatter tokens (backward: all-gather)   instead of all-reduce (backward: copy)

The vocab-parallel embedding reduce-scatters its lookup, and the final norm's output is
all-gathered for the LM head. An MoE layer runs on every token of the group (its router and the
dispatcher's TP split expect the shared tokens): its input is all-gathered and its output split,
neither with a reduction, since every TP rank computes the same MoE function and holds its
complete gradient. The norms see a rank's own tokens only: their weights' gradients are partial
per TP rank and summed over TP as well (reduce_axis = "world").

TP rank r holds tokens [r T/tp, (r+1) T/tp) of its (CP-local) micro-batch.
Shapes: T tokens of the group, n = T/tp tokens of this rank, D model dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from longctx_moe.parallel.comm import reduce_scatter_flat
from longctx_moe.parallel.dims import Axis


def _own_rows(x_TD: torch.Tensor, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    t = x_TD.shape[0]
    if t % size:
        raise ValueError(f"sequence parallelism splits this rank's {t} tokens over tp={size}; pad "
                         "every document to a multiple of tp (with CP: of 2*cp*tp) through "
                         "data.pad_multiple, or set parallel.sequence_parallel=false")
    n = t // size
    return x_TD.narrow(0, rank * n, n)


def _all_gather(x_nD: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x_nD) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x_nD.contiguous(), group=group)
    return torch.cat(parts)


def _reduce_scatter(x_TD: torch.Tensor, group) -> torch.Tensor:
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter: the same sum by an all-reduce, then this rank's rows.
        out = x_TD.contiguous().clone()
        dist.all_reduce(out, group=group)
        return _own_rows(out, group).clone()
    out = x_TD.new_empty((x_TD.shape[0] // dist.get_world_size(group), *x_TD.shape[1:]))
    reduce_scatter_flat(out, x_TD.contiguous(), group=group)
    return out


class _GatherTokens(torch.autograd.Function):
    """x_nD of every rank -> x_TD. Backward: reduce-scatter when each rank's gradient is a partial
    sum (a TP region's input), else this rank's rows of the (complete) gradient."""

    @staticmethod
    def forward(ctx, x_nD, group, reduce_grad: bool):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _all_gather(x_nD, group)

    @staticmethod
    def backward(ctx, g_TD):
        if ctx.reduce_grad:
            return _reduce_scatter(g_TD, ctx.group), None, None
        return _own_rows(g_TD, ctx.group).clone(), None, None


class _ScatterTokens(torch.autograd.Function):
    """x_TD -> this rank's x_nD: reduce-scattered when ranks hold partial sums (a TP region's
    output), else split. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x_TD, group, reduce: bool):
        ctx.group = group
        return _reduce_scatter(x_TD, group) if reduce else _own_rows(x_TD, group).clone()

    @staticmethod
    def backward(ctx, g_nD):
        return _all_gather(g_nD, ctx.group), None, None


def gather_tokens(x_nD: torch.Tensor, group, reduce_grad: bool) -> torch.Tensor:
    return _GatherTokens.apply(x_nD, group, reduce_grad)


def scatter_tokens(x_TD: torch.Tensor, group, reduce: bool) -> torch.Tensor:
    if x_TD.shape[0] % dist.get_world_size(group):
        _own_rows(x_TD, group)  # raises the one-line error before any collective
    return _ScatterTokens.apply(x_TD, group, reduce)


def add_sequence_parallel_hooks(module: nn.Module, group, sharded: bool) -> None:
    """Tokens all-gathered on entry to `module` and split again on exit. `sharded`: the module
    is TP-sharded (partial outputs: reduce-scatter; partial input gradients: reduce-scatter);
    else it is replicated over TP (plain split, rows of the complete gradient). A tuple output
    (MoE's (y, stats)) has its first element split."""
    module.register_forward_pre_hook(
        lambda m, args: (gather_tokens(args[0], group, sharded), *args[1:]))

    def exit_hook(m, args, out):
        if isinstance(out, tuple):
            return (scatter_tokens(out[0], group, sharded), *out[1:])
        return scatter_tokens(out, group, sharded)

    module.register_forward_hook(exit_hook)


def apply_sequence_parallel(model: nn.Module, group) -> None:
    """The token-split pieces around the TP regions (tensor_parallel.py adds the regions' own
    gather / reduce-scatter hooks): MoE layers, the final norm, and the norms' gradients."""
    for block in model.layers:
        if block.is_moe:
            add_sequence_parallel_hooks(block.ffn, group, sharded=False)
    model.norm.register_forward_hook(lambda m, args, out: gather_tokens(out, group, False))
    for norm in [b.attn_norm for b in model.layers] + [b.ffn_norm for b in model.layers] + [model.norm]:
        norm.weight.reduce_axis = Axis.WORLD  # own tokens only: partial per TP rank
