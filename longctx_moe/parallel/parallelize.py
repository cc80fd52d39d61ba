"""parallelize(model, dims): apply parallelism to a Transformer built on one device.

One readable sequence, as in torchtitan: TP, then CP, then EP (DP needs nothing here: the
trainer reduces gradients over the groups parameters name). TP: tensor_parallel.py; with TP > 1
the dispatchers split the TP peers' shared tokens, so experts see each token once. CP:
context_parallel.py (cp_attention's planner and ring / ulysses / hierarchical executors).

EP: every MoE layer keeps its slice of the experts (shard_experts), swaps its LocalDispatcher
for the configured expert-parallel dispatcher, and its expert parameters are tagged
`reduce_axis = "edp"` so the trainer reduces them over EDP (dense ones stay on dp_cp).

`parallel.aux_loss_scope=global_batch` sums the router statistics over the whole data-parallel
batch (expert_parallel.apply_global_batch_aux), after CP has made them global to a micro-batch.

`model.grad_norm_fn(max_norm) -> norm` is attached for the trainer: the global gradient norm over
the mesh (and clipping), where a local norm would desynchronise the replicas.
"""

from __future__ import annotations

import functools

from torch import nn

from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.context_parallel import apply_context_parallel
from longctx_moe.parallel.dispatch import build_dispatcher
from longctx_moe.parallel.expert_parallel import apply_global_batch_aux, shard_experts
from longctx_moe.parallel.grad_reduce import clip_grad_norm, split_params
from longctx_moe.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, dims, cfg: ParallelConfig | None = None) -> nn.Module:
    """Apply TP, CP and EP of `dims` (a built ParallelDims) to `model`, in place; returns it."""
    cfg = cfg or dims.config or ParallelConfig(tp=dims.tp, cp=dims.cp, ep=dims.ep, etp=dims.etp)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims)
    if dims.cp > 1:
        apply_context_parallel(model, dims)
    apply_expert_parallel(model, dims, cfg)
    if cfg.aux_loss_scope == "global_batch":
        apply_global_batch_aux(model, dims)
    # The trainer's clipping hook: a local norm would differ per EP/TP rank (see grad_reduce).
    model.grad_norm_fn = functools.partial(clip_grad_norm, *split_params(model), dims)
    return model


def apply_expert_parallel(model: nn.Module, dims, cfg: ParallelConfig) -> None:
    """Shard every MoE layer's experts over the EP group and give it the EP dispatcher."""
    ep_rank = dims.rank_in("ep") if dims.ep > 1 else 0
    for layer in model.moe_layers():
        num_experts = layer.experts.num_local_experts
        if dims.ep > 1:
            shard_experts(layer.experts, ep_rank, dims.ep)
        layer.dispatcher = build_dispatcher(dims, cfg, num_experts)
        for p in layer.experts.parameters():
            p.reduce_axis = "edp"
