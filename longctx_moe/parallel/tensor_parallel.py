"""Tensor parallelism (Megatron style) applied to a built Transformer, without editing model code.

Attention: wq / wk / wv keep this rank's heads (column-parallel), wo keeps the matching input
columns (row-parallel). Dense SwiGLU MLPs (first_k_dense layers, shared experts): w_gate / w_up
column-parallel, w_down row-parallel. Each sharded module gets Megatron's conjugate pair as hooks:
`copy` on its input (identity forward, all-reduce of the gradient over TP backward) and `reduce`
on its output (all-reduce forward, identity backward), so parameter names stay unchanged.

Replicated parameters fed by local heads only (the per-head q/k RMSNorm weights) get partial
gradients on each TP rank: they are tagged reduce_axis = "world" (TP x CP x DP). Sharded ones are
tagged `tp_sharded = True` (the gradient norm sums their squares over TP). Embedding, final norm,
LM head, routers and experts stay replicated over TP with complete gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from longctx_moe.parallel.dims import Axis


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _add_tp_hooks(module: nn.Module, group) -> None:
    module.register_forward_pre_hook(lambda m, args: (_CopyToTP.apply(args[0], group), *args[1:]))
    module.register_forward_hook(lambda m, args, out: _ReduceFromTP.apply(out, group))


@torch.no_grad()
def _keep(linear: nn.Linear, dim: int, start: int, stop: int) -> None:
    """Keep rows (dim 0: output features) or columns (dim 1: input features) [start, stop)."""
    w = linear.weight.narrow(dim, start, stop - start).clone()
    linear.weight = nn.Parameter(w, requires_grad=linear.weight.requires_grad)
    linear.weight.tp_sharded = True
    linear.weight.tp_dim = dim  # the dimension to all-gather along for a whole weight (export)
    if dim == 0:
        linear.out_features = stop - start
    else:
        linear.in_features = stop - start


def shard_attention(attn: nn.Module, rank: int, size: int, group) -> None:
    """Heads [rank*H/size, (rank+1)*H/size) and their kv heads; GQA grouping is preserved."""
    h, g, r = attn.num_heads, attn.num_kv_heads, attn.head_dim
    hq, hk = h // size, g // size
    _keep(attn.wq, 0, rank * hq * r, (rank + 1) * hq * r)
    _keep(attn.wk, 0, rank * hk * r, (rank + 1) * hk * r)
    _keep(attn.wv, 0, rank * hk * r, (rank + 1) * hk * r)
    _keep(attn.wo, 1, rank * hq * r, (rank + 1) * hq * r)
    for norm in (attn.q_norm, attn.k_norm):
        for p in norm.parameters() if norm is not None else ():
            p.reduce_axis = Axis.WORLD  # partial per TP rank: sums over TP as well as DP x CP
    _add_tp_hooks(attn, group)


def shard_swiglu(mlp: nn.Module, rank: int, size: int, group) -> None:
    """Hidden units [rank*F/size, (rank+1)*F/size) of a dense SwiGLU."""
    f = mlp.w_gate.out_features
    lo, hi = rank * f // size, (rank + 1) * f // size
    _keep(mlp.w_gate, 0, lo, hi)
    _keep(mlp.w_up, 0, lo, hi)
    _keep(mlp.w_down, 1, lo, hi)
    _add_tp_hooks(mlp, group)


def _dense_mlps(block: nn.Module) -> list[nn.Module]:
    if not block.is_moe:
        return [block.ffn]
    return [block.ffn.shared] if block.ffn.shared is not None else []


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """One-line errors for shapes TP over `size` ranks cannot split (before any sharding)."""
    for block in model.layers:
        h, g = block.attn.num_heads, block.attn.num_kv_heads
        if h % size or g % size:
            raise ValueError(f"tensor parallelism over {size} ranks needs num_heads={h} and "
                             f"num_kv_heads={g} divisible by tp (KV-head replication is not "
                             "implemented); choose tp dividing num_kv_heads")
        for mlp in _dense_mlps(block):
            if mlp.w_gate.out_features % size:
                raise ValueError(f"a dense MLP of hidden size {mlp.w_gate.out_features} cannot "
                                 f"be split over tp={size}; choose tp dividing dense_hidden_size "
                                 "and shared_expert_hidden_size")


def apply_tensor_parallel(model: nn.Module, dims) -> None:
    """Shard every attention and dense MLP of `model` over dims' TP group."""
    check_tensor_parallel(model, dims.tp)
    rank, size, group = dims.rank_in(Axis.TP), dims.tp, dims.group(Axis.TP)
    for block in model.layers:
        shard_attention(block.attn, rank, size, group)
        for mlp in _dense_mlps(block):
            shard_swiglu(mlp, rank, size, group)
