"""Expert parallelism on a built model: keep this rank's slice of every expert weight.

GroupedExperts (longctx_moe.model.moe) holds each expert weight as one [E, ...] parameter and
exposes `num_local_experts` / `expert_offset`; EP rank r of R keeps experts [r*E/R, (r+1)*E/R).
"""

from __future__ import annotations

import torch
from torch import nn


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
