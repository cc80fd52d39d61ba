"""Parallelism for longctx_moe: the folded mesh and everything that talks across ranks.

    config.py            ParallelConfig (degrees, CP backend, dispatcher, payload dtype, capacity)
                         and its validate(): the closed sets of the parallel.* values
    dims.py              ParallelDims: degree validation, the group table (cached), the Axis
                         names, the ONLY place creating process groups; group_or_none(axis)
    plan_groups.py       `longctx-moe plan-groups`: print a layout's groups, no process started
    comm.py              autograd variable-size all-to-all / all-gather, bf16 / fp8 payload codecs
    dispatch.py          AllToAllDispatcher, AllGatherDispatcher, build_dispatcher
    expert_parallel.py   shard_experts: keep this EP rank's slice of GroupedExperts
    tensor_parallel.py   Megatron-style TP of attention and dense MLPs on a built model
    sequence_parallel.py tokens split over TP between the TP regions; MoE layers on own tokens
    context_parallel.py  CPGroup (a micro-batch's CP group and executor) and shard_for_cp (plan a
                         micro-batch, keep this rank's tokens and their DocLayout)
    dynamic_cp.py        DynamicCP: each step's documents rescheduled on power-of-two CP
                         sub-groups and moved to their runs' ranks (parallel.dynamic_cp)
    runtime.py           ParallelRuntime, the object parallelize returns and the trainer drives:
                         shard, forward, reduce gradients, clip
    parallelize.py       parallelize(model, dims, cfg): TP, then EP, on a built model
    grad_reduce.py       gradient / count reductions and the global gradient norm over the mesh
"""
