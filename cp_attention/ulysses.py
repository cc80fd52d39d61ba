"""Ulysses (all-to-all) and hierarchical (all-to-all inside, ring across) CP attention.

    out_LHD, lse_HL = ulysses_attention(q_LHD, k_LHD, v_LHD, plan, group, causal=True,
                                        scale=None, backend="auto", stats=None)
    out_LHD, lse_HL = hierarchical_attention(q_LHD, k_LHD, v_LHD, plan, inner_group,
                                             outer_group, causal=True, ...)

Shapes and dtypes as ring_attention (cp_attention/ring.py): q [L, Hq, D], k [L, Hkv, D], v
[L, Hkv, Dv] in the plan's local order, heads possibly TP-sharded; out [L, Hq, Dv], lse [Hq, L];
autograd-capable. sink [Hq] (gpt-oss) as in ring_attention: each rank passes the logits of the
heads it computes to its kernel, so every row counts its head's sink once. window (sliding
window): Ulysses runs every document whole in one kernel call, so it applies the window there;
hierarchical passes it to its ring, which applies it chunk by chunk (cp_attention/window_schedule.py).

Ulysses (P = group size): one all-to-all turns "my tokens, all heads" into "every rank's tokens,
heads [r*Hq/P, (r+1)*Hq/P)"; the tokens are put back in physical order, one varlen kernel call
computes exact per-document attention, and the inverse all-to-all returns out and lse. Needs
Hq % P == 0. GQA: if Hkv % P == 0 the KV heads split like the query heads; if Hkv < P and
P % Hkv == 0 each KV head is replicated P/Hkv times before the all-to-all (each rank then receives
the one KV head its query heads use; autograd sums the replicas' gradients).

Hierarchical [inner, outer] (plan_cp(..., hierarchical_sizes=[inner, outer])): CP rank
o * inner + i holds the i-th contiguous part of outer ring rank o's layout. Ulysses inside
`inner_group` (size inner, e.g. NVLink) rebuilds ring rank o's layout for Hq/inner heads, the ring
runs across `outer_group` (size outer, e.g. across nodes) on it, and the inverse all-to-all
returns the result: all-to-all stays inside the node and only the ring crosses nodes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_attention.comm import CommStats, _gather_heads, gather_heads, scatter_heads
from cp_attention.kernels import varlen_attention
from cp_attention.kernels._common import check_window
from cp_attention.kernels.sinks import check_sink
from cp_attention.plan import CPPlan
from cp_attention.ring import RingAttention, check_local_shapes


def check_heads(hq: int, hkv: int, size: int, who: str) -> None:
    """Head counts the all-to-all can split over `size` ranks, else a one-line error."""
    if hq % size:
        raise ValueError(f"{who}: {hq} query heads do not divide over {size} ranks of the "
                         f"all-to-all group; use a group size that divides {hq}")
    if hkv % size and size % hkv:
        raise ValueError(f"{who}: {hkv} KV heads over {size} ranks: need Hkv % P == 0 or "
                         f"P % Hkv == 0 (replication); choose group size dividing or divisible by {hkv}")


def replicate_kv(k_LHD, v_LHD, size: int):
    """GQA with fewer KV heads than ranks: repeat each KV head P/Hkv times (query head h of the
    rank uses KV head h // (Hq/Hkv) either way)."""
    hkv = k_LHD.shape[1]
    if hkv >= size:
        return k_LHD, v_LHD
    return (k_LHD.repeat_interleave(size // hkv, dim=1),
            v_LHD.repeat_interleave(size // hkv, dim=1))


def _gather_lse(lse_hS, counts, group, stats) -> torch.Tensor:
    """lse [Hq/P, S] in group order -> [Hq, L] of this rank (no gradient: lse is an output only)."""
    return _gather_heads(lse_hS.t().unsqueeze(-1), counts, group, stats, "a2a_fwd")[..., 0].t()


def _head_slice(sink_H, rank: int, size: int):
    """The sink logits of the query heads rank `rank` of a size-`size` all-to-all computes."""
    if sink_H is None:
        return None
    per = sink_H.shape[0] // size
    return sink_H[rank * per:(rank + 1) * per]


def ulysses_attention(q_LHD, k_LHD, v_LHD, plan: CPPlan, group, causal: bool = True,
                      scale: float | None = None, backend: str = "auto",
                      stats: CommStats | None = None, sink=None, window: int | None = None):
    """See the module docstring. Only causal per-document attention is planned (causal=True)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != plan.cp_size:
        raise ValueError(f"ulysses_attention: group has {size} ranks but the plan is for "
                         f"cp_size={plan.cp_size}; plan with the CP group's size")
    if not causal:
        raise ValueError("ulysses_attention: causal=False is not supported; use ring_attention")
    check_local_shapes(q_LHD, k_LHD, v_LHD, plan.local_tokens(rank), "ulysses_attention")
    check_heads(q_LHD.shape[1], k_LHD.shape[1], size, "ulysses_attention")
    check_sink(sink, q_LHD.shape[1])
    counts = [plan.local_tokens(j) for j in range(size)]
    k_LHD, v_LHD = replicate_kv(k_LHD, v_LHD, size)
    # physical position of each gathered row (host plan, copied without a stream sync)
    order = torch.cat(plan.rank_index).to(q_LHD.device, non_blocking=True)
    to_phys = torch.argsort(order)  # gathered row that lands at each physical position
    to_group = torch.argsort(to_phys)
    q_S, k_S, v_S = (scatter_heads(x, counts, group, stats).index_select(0, to_phys)
                     for x in (q_LHD, k_LHD, v_LHD))
    spec = plan.full_sequence_step().to(q_LHD.device)
    out_S, lse_hS = varlen_attention(q_S, k_S, v_S, spec.cu_q, spec.cu_k, spec.max_q,
                                     spec.max_k, True, scale, backend, window,
                                     _head_slice(sink, rank, size))
    out = gather_heads(out_S.index_select(0, to_group), counts, group, stats)
    return out, _gather_lse(lse_hS.index_select(1, to_group), counts, group, stats)


def hierarchical_attention(q_LHD, k_LHD, v_LHD, plan: CPPlan, inner_group, outer_group,
                           causal: bool = True, scale: float | None = None,
                           backend: str = "auto", stats: CommStats | None = None, sink=None,
                           window: int | None = None):
    """See the module docstring. CP rank = outer_rank * inner + inner_rank."""
    inner, outer = plan.hierarchical_sizes
    got = (dist.get_world_size(inner_group), dist.get_world_size(outer_group))
    if got != (inner, outer):
        raise ValueError(f"hierarchical_attention: groups have sizes [inner, outer]={list(got)} "
                         f"but the plan was made with hierarchical_sizes={[inner, outer]}")
    if not causal:
        raise ValueError("hierarchical_attention: causal=False is not supported")
    i, o = dist.get_rank(inner_group), dist.get_rank(outer_group)
    check_local_shapes(q_LHD, k_LHD, v_LHD, plan.local_tokens(o * inner + i),
                       "hierarchical_attention")
    check_heads(q_LHD.shape[1], k_LHD.shape[1], inner, "hierarchical_attention")
    check_sink(sink, q_LHD.shape[1])
    check_window(window, causal)
    counts = [plan.local_tokens(o * inner + j) for j in range(inner)]
    k_LHD, v_LHD = replicate_kv(k_LHD, v_LHD, inner)
    q_S, k_S, v_S = (scatter_heads(x, counts, inner_group, stats) for x in (q_LHD, k_LHD, v_LHD))
    out_S, lse_hS = RingAttention.apply(q_S, k_S, v_S, _head_slice(sink, i, inner), plan.ring, o,
                                        outer_group, scale, backend, stats, window)
    out = gather_heads(out_S, counts, inner_group, stats)
    return out, _gather_lse(lse_hS, counts, inner_group, stats)
