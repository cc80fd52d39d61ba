"""Routing on one rank: top-k choices flattened into (token, expert) assignments, the capacity's
drops, the kept assignments sorted by expert, and the weighted combine back to tokens.

Legend: T local tokens, K top-k, E experts, N assignments (T*K before drops, the kept ones after).

Everything here runs on the tokens' device with shapes known on the host: how many assignments
an expert keeps is a device value (Assignments.counts_E); the one number that sizes a tensor, the
kept total, comes from the host routing table that the dispatcher reads (comm.RoutingCounts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longctx_moe.model.losses import id_counts


@dataclass
class Routing:
    """Kept assignments sorted by expert (ties in token order)."""

    token_N: torch.Tensor  # int64 local token index
    expert_N: torch.Tensor  # int64 global expert id
    weight_N: torch.Tensor  # combine weight, differentiable
    counts_E: torch.Tensor  # int64 kept assignments per expert, on the tokens' device


@dataclass
class Assignments:
    """All T*K (token, expert) choices of this rank in token order, on the device: shapes known
    on the host (N = T*K), which of them are kept is not."""

    expert_N: torch.Tensor  # int64 global expert id
    token_N: torch.Tensor  # int64 local token index
    weight_N: torch.Tensor  # combine weight, differentiable
    keep_N: torch.Tensor | None  # bool: within the expert's capacity (None: dropless)
    counts_E: torch.Tensor  # int64 [E] kept assignments per expert


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments one expert accepts from one rank's `num_tokens` tokens."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def check_inputs(x_TD, topk_idx_TK, topk_weight_TK):
    """Shapes and dtypes only (host metadata). The expert ids' range is not checked: that would
    read two device values back per MoE layer (min and max, a GPU sync each). The router cannot
    give an id outside [0, E) (top-k over E scores; replayed routes are checked on the host where
    they enter, rl_hooks' RolloutBatch), and an id outside it fails in the dispatch's count
    (id_counts: an index error on the host, a device-side assert on a GPU)."""
    if x_TD.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x_TD.shape)}; flatten the batch first")
    if topk_idx_TK.shape != topk_weight_TK.shape or topk_idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"topk_idx {tuple(topk_idx_TK.shape)} and topk_weight "
                         f"{tuple(topk_weight_TK.shape)} must both be [T={x_TD.shape[0]}, K]")
    if topk_idx_TK.dtype.is_floating_point:
        raise ValueError(f"topk_idx must be an integer tensor, got {topk_idx_TK.dtype}")


def _capacity_keep(expert_N, weight_N, counts_E, cap: int, policy: str) -> torch.Tensor:
    """Bool mask [N] on the assignments' device: the first `cap` assignments of each expert in
    policy order ("probs": highest weight first, "position": token order)."""
    n, dev = expert_N.numel(), expert_N.device
    # Policy order first (stable, so ties keep token order), then group by expert (stable).
    pre = torch.argsort(-weight_N.detach(), stable=True) if policy == "probs" else torch.arange(n, device=dev)
    order = pre[torch.argsort(expert_N[pre], stable=True)]
    starts = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.arange(n, device=dev) - starts[expert_N[order]]
    return torch.zeros(n, dtype=torch.bool, device=dev).index_put_((order,), rank_in_expert < cap)


def assign(topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor, num_experts: int,
           capacity: int | None = None, drop_policy: str = "probs") -> Assignments:
    """Flatten the top-k choices and decide, on the device, which fit the per-expert `capacity`
    (assignments one expert keeps from this rank; None: all)."""
    T, K = topk_idx_TK.shape
    expert_N = topk_idx_TK.reshape(-1).long()
    token_N = torch.arange(T, device=expert_N.device).repeat_interleave(K, output_size=T * K)
    weight_N = topk_weight_TK.reshape(-1)
    counts_E = id_counts(expert_N, num_experts)
    if capacity is None:
        return Assignments(expert_N, token_N, weight_N, None, counts_E)
    keep_N = _capacity_keep(expert_N, weight_N, counts_E, capacity, drop_policy)
    return Assignments(expert_N, token_N, weight_N, keep_N, counts_E.clamp(max=capacity))


def sort_kept(a: Assignments, kept: int) -> Routing:
    """The kept assignments sorted by expert (ties in token order): the first `kept` (a host
    int, the sum of the kept counts) of a stable sort that puts the dropped ones last."""
    key_N = a.expert_N if a.keep_N is None else torch.where(a.keep_N, a.expert_N, a.counts_E.numel())
    order = torch.argsort(key_N, stable=True)[:kept]
    return Routing(a.token_N[order], a.expert_N[order], a.weight_N[order], a.counts_E)


class _AddRows(torch.autograd.Function):
    """[T, D] zeros with src_ND[i] added to row token_N[i]. Backward: the rows gathered back.
    Autograd's own index_add keeps the whole source ([N, D], for its shape) until the backward;
    this keeps the index only."""

    @staticmethod
    def forward(ctx, src_ND, token_N, num_tokens: int):
        ctx.save_for_backward(token_N)
        return src_ND.new_zeros((num_tokens, src_ND.shape[1])).index_add_(0, token_N, src_ND)

    @staticmethod
    def backward(ctx, g_TD):
        (token_N,) = ctx.saved_tensors
        return g_TD.index_select(0, token_N), None, None


def combine(y_ND: torch.Tensor, routing: Routing, num_tokens: int) -> torch.Tensor:
    """y_TD[t] = sum of weight * y over the assignments of token t (zeros for unrouted tokens)."""
    w_N1 = routing.weight_N.unsqueeze(1).to(y_ND.dtype)
    return _AddRows.apply(y_ND * w_N1, routing.token_N, num_tokens)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i, on perm's device."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
