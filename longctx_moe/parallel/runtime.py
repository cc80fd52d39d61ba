"""ParallelRuntime: the object `parallelize` returns and the trainer drives.

One optimizer step, as the trainer runs it (every rank, same calls in the same order):

    for mb in micro_batches:                       # this DP replica's PackedBatches
        shard = runtime.shard(mb, cp)              # cp: the CPGroup of this micro-batch
        out = runtime.forward(shard)               # the single-device model on this rank's tokens
        if mb is micro_batches[-1]:
            runtime.start_gradient_reduction()     # buckets launch during this backward
        loss(out).backward()
    runtime.reduce_gradients()                     # dense over dp_cp, experts over edp
    norm = runtime.clip_grad_norm(max_norm)        # global norm over the folded mesh
    optimizer.step()                               # optimizer = runtime.build_optimizer(...)

With parallel.micro_batches_in_flight=2 the trainer shards two micro-batches, runs their forwards
together (`runtime.forward_in_flight([a, b])`, interleaved around the expert all-to-alls,
interleave.py) and then their backwards one after the other, as above.

With parallel.distributed_optimizer the reduction is a reduce-scatter (each rank gets the summed
gradient of its slab of every parameter), clipping runs on the slabs, and the optimizer's step
ends with an all-gather of the updated slabs (distributed_optimizer.py).

The model is never patched: what differs per micro-batch (the CP group and plan, the executor,
the document ids global to the micro-batch, the reduction of router statistics) travels in the
DocLayout passed to `model(batch, layout)`. What is fixed for the run is applied once by
`parallelize` (TP shards and hooks, EP expert slices and dispatcher). `cp` defaults to the
static CP group of the mesh; with parallel.dynamic_cp the trainer first calls
`runtime.dynamic.reschedule(micro_batches)`, which gives each slot its own group.

Loss bookkeeping stays with the trainer (trainer.py): each rank's CE sum covers its own tokens,
so sums over dp_cp give the global batch's. With `parallel.aux_loss_scope=global_batch` the
router statistics are summed over every data-parallel rank (Megatron's global-batch aux loss),
and `forward` rescales the aux / z losses so the trainer's weighting stays exact (see
`_global_batch_scale`). TP peers return the same aux / z losses, expert counts and routes: with
sequence parallelism the MoE layers complete them over TP themselves (sequence_parallel.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from data_packing.batch import PackedBatch
from longctx_moe.model.attention import DocLayout, doc_layout
from longctx_moe.parallel.comm import all_gather_rows, host_collective
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.context_parallel import NO_CP, CPGroup, shard_for_cp
from longctx_moe.parallel.dims import Axis
from longctx_moe.parallel.distributed_optimizer import DistributedOptimizer
from longctx_moe.parallel.grad_reduce import (
    GradBuckets,
    clip_grad_norm,
    reduce_gradients,
    split_params,
    stats_reducer,
)
from longctx_moe.parallel.interleave import Turn, run_interleaved


@dataclass
class Shard:
    """One micro-batch as this rank runs it."""

    batch: PackedBatch  # this rank's tokens (the whole micro-batch without CP)
    layout: DocLayout | None  # None: the model builds the plain single-device layout
    num_targets: int  # target tokens of the whole micro-batch (before CP)
    cp: CPGroup
    plan: Any = None  # the CP plan (cp_attention.plan.CPPlan) when cp.size > 1


class ParallelRuntime:
    """Runs micro-batches of a parallelized model and reduces its gradients over the mesh.

    `model(batch, layout=None) -> ForwardOutput` (longctx_moe.model.Transformer, or any module
    with that contract); `dims` a ParallelDims whose groups are built."""

    def __init__(self, model: nn.Module, dims, cfg: ParallelConfig, dynamic=None):
        self.model, self.dims, self.cfg = model, dims, cfg
        # parallel.dynamic_cp: reschedules each step's documents onto CP sub-groups (dynamic_cp.py)
        self.dynamic = dynamic
        self.dense, self.expert = split_params(model)
        self.global_batch_aux = cfg.aux_loss_scope == "global_batch"
        self.static_cp = static_cp_group(dims)
        self.buckets = None  # parallel.grad_bucket_mb = 0: one buffer per group after backward
        self.sharded = cfg.distributed_optimizer and dims.world_size > 1
        self.optimizer: DistributedOptimizer | None = None  # built by build_optimizer
        if dims.world_size > 1 and cfg.grad_bucket_mb > 0 and not self.sharded:
            self.buckets = GradBuckets(self.dense, self.expert, dims, cfg.grad_bucket_mb)

    def build_optimizer(self, optim_cfg):
        """The optimizer the trainer steps: AdamW over every parameter, or with
        parallel.distributed_optimizer the DistributedOptimizer over this rank's slabs, which
        then also owns the gradient reduction and clipping. Call once."""
        from longctx_moe.optim import build_adamw, build_optimizer

        if not self.sharded:
            return build_optimizer(self.model, optim_cfg)
        self.optimizer = DistributedOptimizer(
            self.dense, self.expert, self.dims, self.cfg.grad_bucket_mb,
            build=lambda tensors: build_adamw(tensors, optim_cfg),
            # fused AdamW needs contiguous slabs; the host copies of optim.offload=cpu are
            contiguous_only=optim_cfg.impl == "fused" and optim_cfg.offload == "none")
        return self.optimizer

    def _sharded_optimizer(self) -> DistributedOptimizer:
        if self.optimizer is None:
            raise RuntimeError("parallel.distributed_optimizer=true: the gradients are reduced "
                               "by the optimizer; build it with runtime.build_optimizer(cfg.optim) first")
        return self.optimizer

    # ------------------------------------------------------------------ per micro-batch

    def shard(self, batch: PackedBatch, cp: CPGroup | None = None,
              replay_TLK: torch.Tensor | None = None, num_targets: int | None = None) -> Shard:
        """This rank's part of `batch` on the CP group `cp` (default: the mesh's static CP).
        `replay_TLK` (int [T, L_moe, K], -1 = route live) forces the experts of each token.
        `num_targets`: the batch's target tokens where the caller counted them already on the
        host (the trainer, once per micro-batch), else counted here."""
        cp = self.static_cp if cp is None else cp
        n = batch.num_target_tokens() if num_targets is None else num_targets
        reducer = self._stats_reducer(cp)
        if cp.size > 1:
            local, layout, plan = shard_for_cp(batch, cp, reducer, replay_TLK)
            return Shard(local, layout, n, cp, plan)
        layout = None
        if reducer is not None or replay_TLK is not None:
            replay = None if replay_TLK is None else replay_TLK.to(batch.tokens.device)
            layout = doc_layout(batch, reduce_stats=reducer, replay_TLK=replay)
        return Shard(batch, layout, n, cp)

    def forward(self, shard: Shard, head=None, turn: Turn | None = None):
        """The model's ForwardOutput on this rank's tokens (aux / z rescaled for the global-batch
        aux loss). `head`: a model.LogProbHead for per-token log-probs instead of the fused CE.
        `turn`: the shard's Turn when two micro-batches are in flight (run_interleaved), carried
        to the MoE dispatchers in the layout."""
        kwargs = {} if head is None else {"head": head}
        layout = shard.layout
        if turn is not None:
            layout = dataclasses.replace(layout or doc_layout(shard.batch), in_flight=turn)
        if layout is not None:
            kwargs["layout"] = layout
        out = self.model(shard.batch, **kwargs)
        if self.global_batch_aux:
            scale = self._global_batch_scale(shard)
            out.aux_loss, out.z_loss = out.aux_loss * scale, out.z_loss * scale
        return out

    def forward_in_flight(self, shards: list[Shard], head=None, context=contextlib.nullcontext) -> list:
        """forward() of each shard, under `context()` (the trainer's autocast); two shards run
        interleaved, one computing while the other's expert all-to-alls travel (interleave.py),
        with the same results as one after the other."""
        def job(shard):
            def run(turn):
                with context():
                    return self.forward(shard, head, turn)
            return run
        return run_interleaved([job(s) for s in shards])

    def forwards(self, items: list, shard_of, head=None, context=contextlib.nullcontext):
        """(item, shard, ForwardOutput) for each of `items`, in order: `shard_of(item)` gives
        its Shard, sharded and run parallel.micro_batches_in_flight at a time (forward_in_flight),
        so a caller's backward of one item follows the forwards of its group."""
        step = self.cfg.micro_batches_in_flight
        for start in range(0, len(items), step):
            group = items[start:start + step]
            shards = [shard_of(item) for item in group]
            yield from zip(group, shards, self.forward_in_flight(shards, head, context), strict=True)

    def gather_tokens(self, shard: Shard, x_L: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of this rank's shard [L, ...] -> the whole micro-batch's [T, ...] in
        physical order, on every rank of the CP group (identity without CP).

        Differentiable: the backward keeps this rank's own positions of the gradient. That is
        exact when every rank of the group computes the same function of the gathered tensor (a
        loss over whole sequences): each then holds the full gradient and needs only its slice,
        so no collective runs in the backward."""
        if shard.cp.size == 1:
            return x_L
        return _GatherFromCP.apply(x_L, shard.plan, shard.cp)

    def _stats_reducer(self, cp: CPGroup):
        """Sum of router statistics over the ranks that share them: every data-parallel rank for
        the global-batch aux loss, else the micro-batch's CP group (None: nothing to sum). Under
        sequence parallelism the MoE layers add the sum over TP (sequence_parallel.py)."""
        if self.global_batch_aux:
            return stats_reducer(self.dims.group_or_none(Axis.DP_CP))
        return stats_reducer(cp.group)  # None for a one-rank CPGroup

    def _global_batch_scale(self, shard: Shard) -> float:
        """The global value of micro-batch (or Dynamic-CP slot) i weighs N_i / G (N_i: the targets
        of every micro-batch run i-th over dp_cp, each counted once: every rank of its CP group,
        static or a slot's run, adds a 1/size share), while the trainer weighs this rank's share
        by n / G: scale by N_i / n. Summed on the host, where n is (a device sum read back would
        be a sync per micro-batch). A micro-batch without targets (n = 0) gets weight 0 there,
        so its share of the statistic is lost (documented approximation)."""
        n = shard.num_targets
        total = self.all_reduce_host(torch.tensor([n / shard.cp.size], dtype=torch.float64), Axis.DP_CP)
        return round(float(total[0])) / n if n else 1.0

    # ------------------------------------------------------------------ per optimizer step

    def start_gradient_reduction(self) -> None:
        """Call just before the step's last backward: gradient buckets then all-reduce from its
        hooks while the rest of the backward runs. Optional: without it `reduce_gradients` does
        the same sums after the backward."""
        if self.sharded:
            self._sharded_optimizer().arm()
        elif self.buckets is not None:
            self.buckets.arm()

    def reduce_gradients(self) -> None:
        """Sum gradients over their replicas (dense over dp_cp, experts over edp)."""
        if self.dims.world_size == 1:
            return
        if self.sharded:
            self._sharded_optimizer().reduce_gradients()
        elif self.buckets is None:
            reduce_gradients(self.dense, self.expert, self.dims)
        else:
            self.buckets.finish()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over the folded mesh, clipped to `max_norm` when > 0."""
        if self.dims.world_size == 1:
            from longctx_moe.optim import clip_grad_norm as local_clip

            return float(local_clip(self.dense + self.expert, max_norm))
        if self.sharded:
            return self._sharded_optimizer().clip_grad_norm(max_norm)
        return float(clip_grad_norm(self.dense, self.expert, self.dims, max_norm))

    def all_reduce(self, t: torch.Tensor, axis: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce `t` in place (sum, or `op`) over this rank's `axis` group; a no-op when that
        group has one rank."""
        group = self.dims.group_or_none(axis)
        if group is not None:
            dist.all_reduce(t, op=op, group=group)
        return t

    @host_collective
    def all_reduce_host(self, t: torch.Tensor, axis: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """`all_reduce` of a host tensor, by design: float64 step totals the host reads anyway
        (on a GPU run they go to gloo beside NCCL, process.py)."""
        group = self.dims.group_or_none(axis)
        if group is not None:
            dist.all_reduce(t, op=op, group=group)
        return t

    def all_gather_object(self, obj: Any, axis: str) -> list[Any]:
        """Every `axis` peer's `obj`, in the group's rank order; [obj] when that group has one
        rank (host objects: batches, records)."""
        group = self.dims.group_or_none(axis)
        if group is None:
            return [obj]
        out = [None] * self.dims.size(axis)
        dist.all_gather_object(out, obj, group=group)
        return out


def static_cp_group(dims) -> CPGroup:
    """The mesh's CP axis as a CPGroup (NO_CP when cp == 1)."""
    if dims.cp == 1:
        return NO_CP
    if dims.hierarchical:
        return CPGroup(size=dims.cp, rank=dims.rank_in(Axis.CP), backend="hierarchical",
                       group=dims.group(Axis.CP), inner=dims.group(Axis.CP_INNER),
                       outer=dims.group(Axis.CP_OUTER),
                       sizes=(dims.cp_inner, dims.cp_outer))
    return CPGroup(size=dims.cp, rank=dims.rank_in(Axis.CP), backend=dims.cp_backend,
                   group=dims.group(Axis.CP))


class _GatherFromCP(torch.autograd.Function):
    """All-gather of every CP rank's local tokens, unsharded to the micro-batch's order."""

    @staticmethod
    def forward(ctx, x_L, plan, cp: CPGroup):
        sizes = [plan.local_tokens(r) for r in range(cp.size)]
        rows = all_gather_rows(x_L.contiguous(), sizes, cp.group)  # no graph inside forward
        ctx.plan, ctx.rank = plan, cp.rank
        return plan.unshard(list(rows.split(sizes)))

    @staticmethod
    def backward(ctx, grad_T):
        return ctx.plan.shard(grad_T, ctx.rank), None, None
