"""Parallelism for longctx_moe: the folded mesh and everything that talks across ranks.

    config.py           ParallelConfig (degrees, CP backend, dispatcher, payload dtype, capacity)
    dims.py             ParallelDims: validation, group tables, the ONLY place creating groups
    plan_groups.py      `longctx-moe plan-groups`: print a layout's groups, no process started
    comm.py             autograd variable-size all-to-all / all-gather, bf16 / fp8 payload codecs
    dispatch.py         AllToAllDispatcher, AllGatherDispatcher, build_dispatcher
    expert_parallel.py  shard_experts: keep this EP rank's slice of GroupedExperts
    tensor_parallel.py  Megatron-style TP of attention and dense MLPs on a built model
    parallelize.py      parallelize(model, dims): TP, then (CP: not yet), then EP
    grad_reduce.py      gradient / count reductions and the global gradient norm over the mesh
"""
