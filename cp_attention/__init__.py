"""cp_attention: exact (context-parallel) attention over packed variable-length sequences.

    plan = plan_cp(cu_seqlens, cu_seqlens_padded, cp_size, cost_model=CostModel(per_token_pair, per_token))
    out, lse = ring_attention(plan.shard(q, r), plan.shard(k, r), plan.shard(v, r), plan, cp_group)
    out, lse = ulysses_attention(..., plan, cp_group)
    out, lse = hierarchical_attention(..., plan, inner_group, outer_group)  # plan with
                                                         # hierarchical_sizes=[inner, outer]
Single-device kernels: cp_attention.kernels.
"""

from cp_attention.comm import CommStats
from cp_attention.layout import CostModel
from cp_attention.plan import CPPlan, plan_cp
from cp_attention.ring import ring_attention
from cp_attention.ulysses import hierarchical_attention, ulysses_attention

__all__ = ["CPPlan", "CommStats", "CostModel", "hierarchical_attention", "plan_cp",
           "ring_attention", "ulysses_attention"]
