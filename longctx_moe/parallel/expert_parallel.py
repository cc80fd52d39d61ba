"""Expert parallelism on a built model: keep this rank's slice of every expert weight.

GroupedExperts (longctx_moe.model.moe) holds each expert weight as one [E, ...] parameter and
exposes `num_local_experts` / `expert_offset`; EP rank r of R keeps experts [r*E/R, (r+1)*E/R).

Expert tensor parallelism (ETP, `shard_expert_hidden`) splits each expert's hidden units over
the P ranks of the etp group, Megatron's way: gate/up column-parallel, down row-parallel, so a
rank computes a partial output that the dispatcher sums over ETP (dispatch.py). Each stored
piece is one rectangular slice of the whole tensor, tagged `etp_dim` (ETP rank p holds the p-th
slice along it), the one description checkpoints, the gradient norm and export read:

    w_down     [L, F, D]:     rows [p u, (p+1) u) of the hidden dim (u = F/P)     etp_dim = 1
    w_gate_up  [L, D, 2, F]:  the same hidden units, gate and up alike            etp_dim = 3

With expert biases (model.expert_proj_bias): b_gate_up [L, 2, F] follows its units (etp_dim =
2); b_down [L, D] must reach each row's sum once, so it is split along D instead (etp_dim = 1):
rank p adds its D/P columns to its partial output (zeros elsewhere), the sum over ETP holds the
whole bias once, and each rank's slice gets the whole gradient of its columns.

Because gate and up are their own dim, rank p's slice viewed as [L, D, 2u] is [gate | up] of
its own units, the layout the SwiGLU needs: no weight moves between ranks.

Legend: L local experts, D model dim, F expert hidden, P ETP size, u = F/P hidden units per
ETP rank.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx_moe.parallel.sharding import carry_splits, declare_split, split_dim


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
        piece = nn.Parameter(p[ep_rank * local:(ep_rank + 1) * local].clone(), requires_grad=p.requires_grad)
        carry_splits(p, piece)
        declare_split(piece, "ep", 0, ep_size, ep_rank)
        setattr(experts, name, piece)
    experts.num_local_experts, experts.expert_offset = local, ep_rank * local
    return experts


@torch.no_grad()
def shard_expert_hidden(experts: nn.Module, etp_rank: int, etp_size: int) -> nn.Module:
    """Keep this ETP rank's hidden units of every expert (in place): w_down's rows and
    w_gate_up's gate and up columns of those units, with an `etp` split declared (module doc)."""
    w_gate_up, w_down = experts.w_gate_up, experts.w_down
    hidden = w_down.shape[1]
    if tuple(w_gate_up.shape[2:]) != (2, hidden):
        raise ValueError(f"w_gate_up has shape {tuple(w_gate_up.shape)} and w_down "
                         f"{tuple(w_down.shape)}; expected [L, D, 2, F] and [L, F, D]")
    if hidden % etp_size:
        raise ValueError(f"expert_hidden_size={hidden} is not divisible by etp={etp_size}; "
                         "choose etp dividing it")
    if split_dim(w_down, "etp") is not None:
        raise ValueError("experts are already split over etp; shard a freshly built model once")
    _keep(experts, "w_down", 1, etp_rank, etp_size)
    _keep(experts, "w_gate_up", 3, etp_rank, etp_size)
    if getattr(experts, "b_down", None) is not None:
        dim = experts.b_down.shape[1]
        if dim % etp_size:
            raise ValueError(f"model.expert_proj_bias: the down bias is split over etp={etp_size} "
                             f"along hidden_size={dim}; choose etp dividing hidden_size")
        _keep(experts, "b_gate_up", 2, etp_rank, etp_size)
        _keep(experts, "b_down", 1, etp_rank, etp_size)
        experts.down_bias_offset = etp_rank * (dim // etp_size)
    return experts


def _keep(experts: nn.Module, name: str, dim: int, etp_rank: int, etp_size: int) -> None:
    p = getattr(experts, name)
    u = p.shape[dim] // etp_size
    piece = nn.Parameter(p.narrow(dim, etp_rank * u, u).clone(), requires_grad=p.requires_grad)
    carry_splits(p, piece)
    declare_split(piece, "etp", dim, etp_size, etp_rank)  # global size = etp x local along `dim`
    setattr(experts, name, piece)
