"""Expert parallelism on a built model: keep this rank's slice of every expert weight; and the
global-batch aux loss (balance statistics over the whole data-parallel batch).

GroupedExperts (longctx_moe.model.moe) holds each expert weight as one [E, ...] parameter and
exposes `num_local_experts` / `expert_offset`; EP rank r of R keeps experts [r*E/R, (r+1)*E/R).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from longctx_moe.parallel.grad_reduce import stats_reducer


@torch.no_grad()
def shard_experts(experts: nn.Module, ep_rank: int, ep_size: int) -> nn.Module:
    """Slice every [E, ...] parameter of `experts` (in place) to this EP rank's experts."""
    E = experts.num_local_experts
    if experts.expert_offset != 0:
        raise ValueError(f"experts are already sharded (expert_offset={experts.expert_offset}); "
                         "shard a freshly built model once")
    if E % ep_size:
        raise ValueError(f"num_experts={E} is not divisible by ep={ep_size}; choose ep dividing it")
    local = E // ep_size
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.shape[0] != E:
            raise ValueError(f"expert parameter {name!r} has shape {tuple(p.shape)}; expected "
                             f"dim 0 = num_experts = {E}")
        piece = p[ep_rank * local:(ep_rank + 1) * local].clone()
        setattr(experts, name, nn.Parameter(piece, requires_grad=p.requires_grad))
    experts.num_local_experts, experts.expert_offset = local, ep_rank * local
    return experts


def apply_global_batch_aux(model: nn.Module, dims) -> None:
    """Megatron's global-batch aux loss: each MoE layer's switch / z statistics are summed over
    dp_cp (the i-th micro-batches of every replica form one global micro-batch), so each rank's
    ForwardOutput aux / z loss is its share of the global micro-batch's value.

    The trainer weighs a rank's aux loss by its replica's target tokens n (loss_mb = ... +
    aux * n / G); the global value of micro-batch i weighs N_i / G (N_i: targets summed over dp).
    model.forward therefore returns share * N_i / n, and the trainer's sum is exact. A replica
    micro-batch without targets (n = 0) gets weight 0 there: its share is lost (not exact)."""
    for layer in model.moe_layers():
        layer.reduce_stats = stats_reducer(dims, global_batch=True)
    inner = model.forward
    group = dims.group("dp") if dims.size("dp") > 1 else None

    def forward(batch):
        out = inner(batch)
        n = batch.num_target_tokens()
        total = torch.tensor(n, dtype=torch.int64, device=batch.tokens.device)
        if group is not None:
            dist.all_reduce(total, group=group)
        scale = int(total) / n if n else 1.0
        out.aux_loss, out.z_loss = out.aux_loss * scale, out.z_loss * scale
        return out

    model.forward = forward  # instance attribute: nn.Module.__call__ dispatches to it
