"""Expert parallelism on a built model: keep this rank's slice of every expert weight.

GroupedExperts (longctx_moe.model.moe) holds each expert weight as one [E, ...] parameter and
exposes `num_local_experts` / `expert_offset`; EP rank r of R keeps experts [r*E/R, (r+1)*E/R).

Expert tensor parallelism (ETP, `shard_expert_hidden`) splits each expert's hidden units over
the P ranks of the etp group, Megatron's way: gate/up column-parallel, down row-parallel, so a
rank computes a partial output that the dispatcher sums over ETP (dispatch.py). Each stored
piece is one contiguous block of the whole tensor, tagged `etp_dim` (ETP rank p holds the p-th
slice along it), the one description checkpoints, the gradient norm and export read:

    w_down     [L, F, D]:  rows [p u, (p+1) u) of the hidden dim (u = F/P)      etp_dim = 1
    w_gate_up  [L, D, 2F]: columns [p 2u, (p+1) 2u) of [gate | up]              etp_dim = 2

A contiguous block of [gate | up] pairs no gate column with its up column (for P = 2, rank 0
stores every gate column, rank 1 every up column), while the SwiGLU of hidden units
[p u, (p+1) u) needs gate and up columns of exactly those units. `GluShardLayout` moves them
there once per forward: one all-to-all over ETP of the stored block's columns, in the compute
dtype; its backward is the reverse all-to-all, so every stored column's gradient comes home
exactly. It costs L x D x 2u x (P-1)/P weight entries each way per MoE layer and micro-batch,
and keeps the checkpoint contract of one block per rank and tensor (a layout storing
[gate_p | up_p] itself would need two blocks per tensor in the checkpoint index).

Legend: L local experts, D model dim, F expert hidden, P ETP size, u = F/P hidden units per
ETP rank, C = 2u stored gate/up columns per rank.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx_moe.parallel.comm import all_to_all_rows


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


class GluShardLayout:
    """Stored w_gate_up block [L, D, C] of ETP rank p -> [gate | up] of hidden units
    [p u, (p+1) u) (Megatron's column-parallel layout), by one all-to-all over ETP.

    Column j of the whole [gate | up] (0 <= j < 2F) serves hidden unit j mod F, computed by ETP
    rank (j mod F) // u. Sent columns are grouped by that rank (a stable sort of the block's
    columns, which keeps gate before up); what arrives, in source-rank order, is ascending in
    j, which is gate then up of the rank's units: the target layout needs no second sort."""

    def __init__(self, rank: int, size: int, hidden: int, group):
        u, c = hidden // size, 2 * hidden // size
        dest_C = (torch.arange(rank * c, (rank + 1) * c) % hidden) // u
        self.order_C = torch.argsort(dest_C, stable=True)
        self.send = torch.bincount(dest_C, minlength=size).tolist()
        mine = {j for j in range(2 * hidden) if (j % hidden) // u == rank}
        self.recv = [sum(j in mine for j in range(q * c, (q + 1) * c)) for q in range(size)]
        self.group = group

    def __call__(self, w_LDC: torch.Tensor) -> torch.Tensor:
        L, D, C = w_LDC.shape
        cols_CX = w_LDC.permute(2, 0, 1).reshape(C, L * D)  # X = L * D: one row per column
        sent_CX = cols_CX.index_select(0, self.order_C.to(w_LDC.device))
        got_CX = all_to_all_rows(sent_CX, self.send, self.recv, self.group)
        return got_CX.view(C, L, D).permute(1, 2, 0).contiguous()


@torch.no_grad()
def shard_expert_hidden(experts: nn.Module, etp_rank: int, etp_size: int, group) -> nn.Module:
    """Keep this ETP rank's block of every expert's hidden units (in place): w_down's rows and a
    contiguous block of w_gate_up's columns, tagged `etp_dim`, and the layout that turns the
    latter into [gate | up] of the rank's units (module doc)."""
    w_gate_up, w_down = experts.w_gate_up, experts.w_down
    hidden = w_down.shape[1]
    if w_gate_up.shape[2] != 2 * hidden:
        raise ValueError(f"w_gate_up has shape {tuple(w_gate_up.shape)} and w_down "
                         f"{tuple(w_down.shape)}; expected [L, D, 2F] and [L, F, D]")
    if hidden % etp_size:
        raise ValueError(f"expert_hidden_size={hidden} is not divisible by etp={etp_size}; "
                         "choose etp dividing it")
    if getattr(w_down, "etp_dim", None) is not None:
        raise ValueError("experts are already split over etp; shard a freshly built model once")
    u = hidden // etp_size
    _keep(experts, "w_down", 1, etp_rank * u, u)
    _keep(experts, "w_gate_up", 2, etp_rank * 2 * u, 2 * u)
    experts.gate_up_layout = GluShardLayout(etp_rank, etp_size, hidden, group)
    return experts


def _keep(experts: nn.Module, name: str, dim: int, start: int, size: int) -> None:
    p = getattr(experts, name)
    piece = nn.Parameter(p.narrow(dim, start, size).clone(), requires_grad=p.requires_grad)
    piece.etp_dim = dim  # global size = etp x local along `dim`; ETP rank p holds the p-th slice
    setattr(experts, name, piece)
