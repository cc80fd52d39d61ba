"""parallelize(model, dims) -> ParallelRuntime: apply parallelism to a model built on one device.

One readable sequence, as in torchtitan: TP, then EP, then hand the model to the runtime that
runs CP per micro-batch. What is fixed for the whole run is applied here, once:

- TP (tensor_parallel.py): attention heads (KV heads replicated when tp > num_kv_heads), dense
  MLPs and the vocabulary (embedding and LM head) sharded, Megatron's conjugate all-reduce pair
  as module hooks; with parallel.sequence_parallel the tokens are split between the TP regions
  (sequence_parallel.py) and each MoE layer runs on its TP rank's own tokens. Without SP the
  dispatchers split the TP peers' shared tokens. Either way experts see each token once.
- EP: every MoE layer keeps its slice of the experts (shard_experts) and gets the configured
  dispatcher (capacity factor, drop policy, payload dtype): also on one rank, where it is the
  local path with the same capacity rules. The dispatchers read their routing counts through
  `counts` (comm.RoutingCounts: from the device), the one place that reads them.
- ETP: with parallel.etp > 1 every expert's hidden units are also split over the etp group
  (shard_expert_hidden: gate/up column-parallel, down row-parallel) and the dispatcher sums the
  partial outputs over it.

What changes per micro-batch (the CP group and plan, router-statistics reductions) is an
argument of the runtime's calls (runtime.py), never state patched onto the model. DP needs
nothing here: the runtime reduces gradients over the groups the parameters belong to.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx_moe.parallel.comm import RoutingCounts
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import Axis, ParallelDims
from longctx_moe.parallel.dispatch import build_dispatcher
from longctx_moe.parallel.expert_parallel import shard_expert_hidden, shard_experts
from longctx_moe.parallel.runtime import ParallelRuntime
from longctx_moe.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, dims=None, cfg: ParallelConfig | None = None,
                capacity_tokens: int = 0, counts: RoutingCounts | None = None) -> ParallelRuntime:
    """Apply TP and EP of `dims` (a ParallelDims with built groups; None: one process) to `model`
    in place and return the runtime that trains it. `capacity_tokens`: Dynamic-CP's per-rank
    token capacity when parallel.max_tokens_per_rank is 0. `counts`: where the dispatchers' routing
    counts come from (RoutingCounts(), the device, by default; a rehearsal passes an assumption).
    Raises ValueError (one line) for a layout this code cannot run."""
    if dims is None:
        dims = ParallelDims.from_config(cfg or ParallelConfig(), 1)
        dims.build_groups(0)
    cfg = cfg or dims.config or ParallelConfig(tp=dims.tp, cp=dims.cp, ep=dims.ep, etp=dims.etp)
    check_supported(dims, cfg)
    check_attention_features(model, dims, cfg)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims, cfg.sequence_parallel)
    if hasattr(model, "moe_layers"):
        apply_expert_parallel(model, dims, cfg, counts)
    return ParallelRuntime(model, dims, cfg, _dynamic_cp(model, dims, cfg, capacity_tokens))


def _dynamic_cp(model: nn.Module, dims, cfg: ParallelConfig, capacity_tokens: int):
    """The Dynamic-CP scheduler of this layout, or None without parallel.dynamic_cp."""
    if not cfg.dynamic_cp:
        return None
    from longctx_moe.parallel.dynamic_cp import DynamicCP

    capacity = cfg.max_tokens_per_rank or capacity_tokens
    if capacity < 1:
        raise ValueError("parallel.dynamic_cp=true needs parallel.max_tokens_per_rank (or "
                         "data.micro_batch_tokens) >= 1")
    cost = dynamic_cp_cost(model.cfg, cfg, a2a_size(cfg, dims.cp_inner))
    return DynamicCP(dims, capacity, cost, cfg.dynamic_max_cp, cfg.cp_backend, cfg.sequence_parallel)


def dynamic_cp_cost(m, cfg: ParallelConfig, a2a_size: int):
    """The cost model Dynamic-CP schedules a model `m` (ModelConfig) by: its attention's shapes and
    the parallel.dcp_* constants."""
    from cp_attention.dynamic_cost import DynamicCPCost
    from longctx_moe.model.flops import active_matmul_params

    heads, kv_heads, qk_dim, v_dim = m.attention_dims()
    return DynamicCPCost.from_model(
        num_layers=m.num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=qk_dim,
        v_head_dim=v_dim, active_params_per_token=active_matmul_params(m),
        flops_per_s=cfg.dcp_tflops * 1e12, bandwidth=cfg.dcp_bandwidth_gbps * 1e9,
        ring_latency=cfg.dcp_ring_latency_us * 1e-6, attn_half_tokens=cfg.dcp_attn_half_tokens,
        a2a_size=a2a_size,
        window_layers=sum(m.window_of(i) is not None for i in range(m.num_layers)),
        window=m.sliding_window)


def a2a_size(cfg: ParallelConfig, cp_inner: int) -> int:
    """The most ranks of a Dynamic-CP run that exchange heads by all-to-all (DynamicCP._cp_group):
    none under ring CP, the whole run under Ulysses, `cp_inner` under hierarchical CP."""
    return {"ring": 1, "ulysses": cfg.dynamic_max_cp, "hierarchical": cp_inner}[cfg.cp_backend]


def check_attention_features(model: nn.Module, dims, cfg: ParallelConfig) -> None:
    """Sliding windows need a kernel backend that can apply them, and under ring or hierarchical
    CP one that can also move the window's alignment (the zigzag blocks' offsets, see
    kernels.offset_backend): refused here, at start-up, rather than by the first forward."""
    windows = [layer.attn.window for layer in getattr(model, "layers", [])
               if getattr(layer.attn, "window", None) is not None]
    if not windows:
        return
    from cp_attention.kernels import check_window_support, offset_backend, resolve_backend

    # the run's device, for which the ops were resolved (the model may still be on meta, to be
    # filled by a sharded loader)
    backend, device = model.ops.attention.backend, torch.device(model.ops.device)
    if backend != "auto":
        check_window_support(backend, device)
    if (dims.cp > 1 or cfg.dynamic_cp) and cfg.cp_backend != "ulysses":
        check_window_support(offset_backend(resolve_backend(backend, device), device), device)


def check_supported(dims, cfg: ParallelConfig) -> None:
    """Settings that the mesh accepts but this runtime cannot honour are refused, not ignored."""
    if cfg.sequence_parallel and dims.tp == 1:
        raise ValueError("parallel.sequence_parallel=true splits tokens over the TP ranks but "
                         "parallel.tp=1; set tp > 1 or sequence_parallel=false")
    if cfg.micro_batches_in_flight == 2 and (dims.ep == 1 or cfg.dispatcher != "alltoall"):
        raise ValueError("parallel.micro_batches_in_flight=2 hides the expert all-to-all of one micro-batch "
                         f"behind the other's compute, but ep={dims.ep}, dispatcher={cfg.dispatcher}; "
                         "use ep > 1 with dispatcher=alltoall, or micro_batches_in_flight=1")
    if cfg.ep_spare_slots and (dims.ep == 1 or dims.etp > 1 or cfg.dispatcher != "alltoall"):
        raise ValueError(f"parallel.ep_spare_slots={cfg.ep_spare_slots} lends overloaded experts between "
                         f"EP ranks, but ep={dims.ep}, etp={dims.etp}, dispatcher={cfg.dispatcher}; use "
                         "ep > 1, etp = 1 and dispatcher=alltoall, or ep_spare_slots=0")


def apply_expert_parallel(model: nn.Module, dims, cfg: ParallelConfig,
                          counts: RoutingCounts | None = None) -> None:
    """Shard every MoE layer's experts over the EP group (and their hidden units over the ETP
    group) and give it the configured dispatcher, reading its routing counts through `counts`."""
    ep_rank = dims.rank_in(Axis.EP) if dims.ep > 1 else 0
    for layer in model.moe_layers():
        num_experts = layer.experts.num_local_experts
        if dims.ep > 1:
            shard_experts(layer.experts, ep_rank, dims.ep)
        if dims.etp > 1:
            shard_expert_hidden(layer.experts, dims.rank_in(Axis.ETP), dims.etp)
        layer.dispatcher = build_dispatcher(dims, cfg, num_experts, layer.ops.permute, counts)
