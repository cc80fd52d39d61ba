"""Gradient and statistics reductions over the folded mesh.

Loss convention (docs/ARCHITECTURE.md): each rank's loss is a SUM over its tokens divided by a
global count computed once per step, so the global loss is the plain sum of the per-rank losses
over DP x CP (TP peers hold the same tokens and compute the same loss). Hence gradients are
SUMMED, never averaged:

- dense parameters: all-reduce over `dp_cp`; TP-sharded or TP-replicated, each rank already holds
  the gradient of its own shard for its DP x CP slice of tokens.
- expert parameters (inside GroupedExperts, duck-typed by `num_local_experts`): the dispatcher
  already summed over the tokens of the EP group; all-reduce over `edp` then covers every rank
  once. With TP > 1 the dispatchers from `build_dispatcher` split the TP peers' shared tokens,
  so each token reaches its experts once.
- router statistics of the aux / z losses (stats_reducer, run inside the model through
  DocLayout.reduce_stats): over the micro-batch's CP group, or `dp_cp` for the global-batch aux
  loss; never over TP, whose peers already hold every token.
- expert-bias load counts: the trainer sums them over `dp_cp`, so every rank applies the same
  bias update.
- the gradient norm for clipping: dense once, expert shards summed over `ep` (clip_grad_norm).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from longctx_moe.parallel.dims import Axis


def is_expert_module(module: nn.Module) -> bool:
    """GroupedExperts (or a stand-in): holds [E_local, ...] weights sharded by EP."""
    return hasattr(module, "num_local_experts") and hasattr(module, "expert_offset")


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) trainable parameters of `model`, each listed once, in module order."""
    expert_ids = {id(p) for m in model.modules() if is_expert_module(m) for p in m.parameters()}
    dense, expert, seen = [], [], set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            (expert if id(p) in expert_ids else dense).append(p)
    return dense, expert


def _all_reduce_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of `params` over `group`, one flat buffer per dtype."""
    for p in params:
        # Every rank must contribute the same buffers: a parameter without gradient (an expert
        # that got no token) contributes zeros.
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group_params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group_params])
        if group is not None:
            dist.all_reduce(flat, group=group)
        offset = 0
        for p in group_params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def reduce_gradients(dense: list[nn.Parameter], expert: list[nn.Parameter], dims) -> None:
    """Sum dense gradients over dp_cp (or the group a parameter's `reduce_axis` names) and expert
    gradients over edp."""
    by_axis: dict[str, list[nn.Parameter]] = {}
    for p in dense:
        by_axis.setdefault(getattr(p, "reduce_axis", Axis.DP_CP), []).append(p)
    for axis, params in by_axis.items():
        _all_reduce_grads(params, dims.group_or_none(axis))
    _all_reduce_grads(expert, dims.group_or_none(Axis.EDP))


def clip_grad_norm(dense: list[nn.Parameter], expert: list[nn.Parameter], dims,
                   max_norm: float) -> torch.Tensor:
    """Global L2 norm of the reduced gradients over the folded mesh (float64 scalar), and the
    torch.nn.utils.clip_grad_norm_ scaling to `max_norm` when `max_norm > 0`.

    A local norm is wrong under EP: each rank holds different expert shards, so local norms and
    clip factors would differ and the replicated dense weights would drift apart. After
    `reduce_gradients`, replicated dense gradients are identical everywhere and count once;
    TP-sharded ones (`tp_sharded`) are summed over `tp`, expert shards over `ep` (EDP replicas
    are identical and count once).
    """
    sharded = [p for p in dense if getattr(p, "tp_sharded", False)]
    replicated = [p for p in dense if not getattr(p, "tp_sharded", False)]
    norm_sq = (_sum_sq(replicated) + _sum_sq_over(sharded, dims, Axis.TP)
               + _sum_sq_over(expert, dims, Axis.EP))
    norm = norm_sq.sqrt()
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))  # torch's clip_grad_norm_ rule
        if coef < 1.0:
            for p in dense + expert:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm


def _sum_sq(params: list[nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries, float64 on the host."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            total += p.grad.double().square().sum().cpu()
    return total


def _sum_sq_over(params: list[nn.Parameter], dims, axis: str) -> torch.Tensor:
    """`_sum_sq` of shards summed over the `axis` group (collective on the gradients' device)."""
    local = _sum_sq(params)
    group = dims.group_or_none(axis)
    if group is None:
        return local
    device = params[0].device if params else torch.device("cpu")
    local = local.to(device)
    dist.all_reduce(local, group=group)
    return local.cpu()


def stats_reducer(group):
    """`DocLayout.reduce_stats` for the ranks of `group` that split one micro-batch's tokens (or
    the whole data-parallel batch): sums no-grad statistics (int64 counts, any shape) over them.
    None when `group` is None (one rank: nothing to reduce).

    Never over TP: TP peers route the same tokens, and a tp-fold count sum would be normalised by
    a tp-fold token total while each rank's score sums stay local (its share would be 1/tp)."""
    if group is None:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    return reduce
