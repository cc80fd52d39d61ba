"""Gradient and statistics reductions over the folded mesh.

Loss convention (docs/ARCHITECTURE.md): each rank's loss is a SUM over its tokens divided by a
global count computed once per step, so the global loss is the plain sum of the per-rank losses
over DP x CP (TP peers hold the same tokens and compute the same loss). Hence gradients are
SUMMED, never averaged:

- dense parameters: all-reduce over `dp_cp` (in buckets launched from the last backward's hooks
  with parallel.grad_bucket_mb > 0: GradBuckets); TP-sharded or TP-replicated, each rank already holds
  the gradient of its own shard for its DP x CP slice of tokens. Replicated parameters that see only
  a TP rank's heads or tokens (q/k norms; norms and routers under sequence parallelism) hold partial
  gradients and name `world` as their `reduce_axis`.
- expert parameters (inside GroupedExperts, duck-typed by `num_local_experts`): the dispatcher
  already summed over the tokens of the EP group; all-reduce over `edp` then covers every rank
  once. With TP > 1 the dispatchers from `build_dispatcher` split the TP peers' shared tokens
  (under sequence parallelism each TP rank routes its own), so each token reaches its experts once.
- router statistics of the aux / z losses (stats_reducer, run inside the model through
  DocLayout.reduce_stats): over the micro-batch's CP group, or `dp_cp` for the global-batch aux
  loss; over TP as well only under sequence parallelism, where each TP rank routes its own tokens
  (sequence_parallel.py); without it TP peers route the same tokens.
- expert-bias load counts: the trainer sums them over `dp_cp`, so every rank applies the same
  bias update.
- the gradient norm for clipping: dense once, expert shards summed over `ep` (clip_grad_norm).

bf16 gradients (train.param_dtype=bf16) are summed in an fp32 buffer (`reduce_dtype`): a bf16 sum
over R ranks would round R-1 times; the replicated optimizer's result is rounded back onto the
bf16 gradient once (the distributed optimizer keeps it in fp32 on the masters).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from longctx_moe.parallel.dims import Axis
from longctx_moe.parallel.sharding import split_dim


def is_expert_module(module: nn.Module) -> bool:
    """GroupedExperts (or a stand-in): holds [E_local, ...] weights sharded by EP."""
    return hasattr(module, "num_local_experts") and hasattr(module, "expert_offset")


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) trainable parameters of `model`, each listed once, in module order."""
    expert_ids = {id(p) for m in model.modules() if is_expert_module(m) for p in m.parameters()}
    dense, expert, seen = [], [], set()
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            (expert if id(p) in expert_ids else dense).append(p)
    return dense, expert


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients of `dtype` are summed in across ranks."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _all_reduce_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of `params` over `group`, one flat buffer per dtype."""
    for p in params:
        # Every rank must contribute the same buffers: a parameter without gradient (an expert
        # that got no token) contributes zeros.
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group_params in by_dtype.values():
        dtype = reduce_dtype(group_params[0].grad.dtype)
        flat = torch.cat([p.grad.reshape(-1).to(dtype) for p in group_params])
        if group is not None:
            with record_function("comm.grad"):  # profiler label (bench/moe_overlap.py)
                dist.all_reduce(flat, group=group)
        offset = 0
        for p in group_params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def replica_axes(dense: list[nn.Parameter], expert: list[nn.Parameter]) -> list[tuple[str, list[nn.Parameter]]]:
    """[(axis, params)]: the group each parameter is replicated over, whose gradients are summed
    over it: dense parameters over dp_cp (or the axis their `reduce_axis` names), expert
    parameters over edp; the same list on every rank."""
    by_axis: dict[str, list[nn.Parameter]] = {}
    for p in dense:
        by_axis.setdefault(getattr(p, "reduce_axis", Axis.DP_CP), []).append(p)
    by_axis.setdefault(Axis.EDP, []).extend(expert)
    return list(by_axis.items())


def reduction_groups(dense: list[nn.Parameter], expert: list[nn.Parameter], dims) -> list:
    """[(group or None, params)] of `replica_axes`."""
    return [(dims.group_or_none(axis), params) for axis, params in replica_axes(dense, expert)]


def reduce_gradients(dense: list[nn.Parameter], expert: list[nn.Parameter], dims) -> None:
    """Sum dense gradients over dp_cp (or the group a parameter's `reduce_axis` names) and expert
    gradients over edp, one buffer per group and dtype."""
    for group, params in reduction_groups(dense, expert, dims):
        _all_reduce_grads(params, group)


class _Bucket:
    """Parameters of one group and dtype whose gradients are all-reduced as one flat buffer."""

    def __init__(self, group, params: list[nn.Parameter]):
        self.group, self.params = group, params
        self.ready: set[int] = set()  # ids of the parameters whose gradient is final
        self.flat: torch.Tensor | None = None
        self.work = None

    def launch(self) -> None:
        for p in self.params:  # as in _all_reduce_grads: every rank contributes every buffer
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dtype = reduce_dtype(self.params[0].grad.dtype)
        self.flat = torch.cat([p.grad.reshape(-1).to(dtype) for p in self.params])
        with record_function("comm.grad_launch"):
            self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        with record_function("comm.grad_wait"):
            self.work.wait()
        offset = 0
        for p in self.params:
            n = p.grad.numel()
            p.grad.copy_(self.flat[offset:offset + n].view_as(p.grad))
            offset += n
        self.flat, self.work = None, None
        self.ready.clear()


def _make_buckets(group, params: list[nn.Parameter], cap_bytes: float, bucket_cls) -> list:
    """Consecutive runs of `params` in reverse order (the order the backward finishes them), one
    dtype each, closed once they pass `cap_bytes`."""
    buckets, run, size = [], [], 0
    for p in reversed(params):
        if run and (size >= cap_bytes or p.dtype != run[-1].dtype):
            buckets.append(bucket_cls(group, run))
            run, size = [], 0
        run.append(p)
        size += p.numel() * p.element_size()
    return buckets + ([bucket_cls(group, run)] if run else [])


def _weak_hook(buckets: GradBuckets) -> Callable[[nn.Parameter], None]:
    ref = weakref.ref(buckets)

    def on_grad(p: nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live._on_grad(p)

    return on_grad


class GradBuckets:
    """Gradients all-reduced in buckets launched from the backward (as DDP does).

    `arm()` before the last micro-batch's backward; each parameter's post-accumulate-grad hook
    then marks it final, and a bucket launches (asynchronously) once all its gradients are final
    and every earlier bucket has launched: the launch order is fixed, so it is the same on every
    rank even where a parameter gets no gradient on some rank (it launches at `finish`, zeros).
    `finish()` launches what is left, waits and writes the sums back; without `arm()` it is the
    plain bucketed reduction after the backward. Earlier micro-batches' backwards only accumulate.
    `bucket_cls(group, params)` makes a bucket: `_Bucket` all-reduces; the distributed
    optimizer's ShardedBucket reduce-scatters instead, from the same hooks.
    """

    def __init__(self, dense: list[nn.Parameter], expert: list[nn.Parameter], dims,
                 bucket_mb: float, bucket_cls=_Bucket):
        self.buckets: list = []
        for group, params in reduction_groups(dense, expert, dims):
            if group is not None:
                self.buckets += _make_buckets(group, params, bucket_mb * 2**20, bucket_cls)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.armed, self.next = False, 0  # next: the first bucket not launched yet
        # The hooks hold this object weakly: a parameter's hook lives in C++, where the garbage
        # collector cannot see a cycle parameter -> hook -> buckets -> parameter, so a strong one
        # kept every model (and its process groups) alive until the interpreter's exit.
        on_grad = _weak_hook(self)
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(on_grad)

    def arm(self) -> None:
        self.armed = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        bucket = self._bucket_of[id(p)]
        if bucket.work is not None:
            raise RuntimeError(f"a parameter of shape {tuple(p.shape)} got a gradient after its "
                               "bucket was all-reduced; call start_gradient_reduction() only "
                               "before the last backward of the step")
        bucket.ready.add(id(p))
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if len(b.ready) < len(b.params):
                break
            b.launch()
            self.next += 1

    def finish(self) -> None:
        """Launch the buckets the backward did not, wait for all, write the sums to .grad."""
        for b in self.buckets[self.next:]:
            b.launch()
        for b in self.buckets:
            b.finish()
        self.armed, self.next = False, 0


def clip_grad_norm(dense: list[nn.Parameter], expert: list[nn.Parameter], dims,
                   max_norm: float) -> torch.Tensor:
    """Global L2 norm of the reduced gradients over the folded mesh (float64 scalar), and the
    torch.nn.utils.clip_grad_norm_ scaling to `max_norm` when `max_norm > 0`.

    A local norm is wrong under EP: each rank holds different expert shards, so local norms and
    clip factors would differ and the replicated dense weights would drift apart. After
    `reduce_gradients`, replicated gradients are identical everywhere and count once; shards
    are summed over the axes that split them (`norm_axes`).
    """
    items = [(norm_axes(p, False, dims), p.grad) for p in dense]
    items += [(norm_axes(p, True, dims), p.grad) for p in expert]
    norm = global_norm(items, dims)
    clip_(items, norm, max_norm)
    return norm


def norm_axes(p: nn.Parameter, is_expert: bool, dims) -> tuple[str, ...]:
    """The axes over which a reduced gradient's square sum is summed for the global norm: those
    that split the parameter (experts over ep, and over etp where an `etp` split is declared;
    TP-sharded weights over tp: sharding.py). A replicated parameter counts once."""
    if is_expert:
        split = dims.etp > 1 and split_dim(p, Axis.ETP) is not None
        return (Axis.EP, Axis.ETP) if split else (Axis.EP,)
    return (Axis.TP,) if split_dim(p, Axis.TP) is not None else ()


def global_norm(items: list[tuple[tuple[str, ...], torch.Tensor | None]], dims) -> torch.Tensor:
    """sqrt of the sum of squared entries of every gradient, each gradient's square sum summed
    over its axes (collectives on the gradients' device, in the same order on every rank);
    float64 scalar on the host."""
    by_axes: dict[tuple[str, ...], torch.Tensor] = {}
    device = next((g.device for _, g in items if g is not None), torch.device("cpu"))
    for axes, grad in items:
        total = by_axes.setdefault(tuple(axes), torch.zeros((), dtype=torch.float64, device=device))
        if grad is not None:
            total += grad.double().square().sum()
    norm_sq = torch.zeros((), dtype=torch.float64, device=device)
    for axes in sorted(by_axes):
        total = by_axes[axes]
        for axis in axes:
            group = dims.group_or_none(axis)
            if group is not None:
                dist.all_reduce(total, group=group)
        norm_sq += total
    return norm_sq.sqrt().cpu()


def clip_(items: list[tuple[tuple[str, ...], torch.Tensor | None]], norm: torch.Tensor,
          max_norm: float) -> None:
    """Scale the gradients by torch's clip_grad_norm_ rule when `max_norm > 0`."""
    if max_norm <= 0:
        return
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    if coef < 1.0:
        for _, grad in items:
            if grad is not None:
                grad.mul_(coef)


def stats_reducer(group):
    """`DocLayout.reduce_stats` for the ranks of `group` that split one micro-batch's tokens (or
    the whole data-parallel batch): sums no-grad statistics (int64 counts, any shape) over them.
    None when `group` is None (one rank: nothing to reduce).

    `group` must not repeat tokens: over TP peers that route the same tokens, a tp-fold count sum
    would be normalised by a tp-fold token total while each rank's score sums stay local (its
    share would be 1/tp). Under sequence parallelism TP ranks route distinct tokens, and the MoE
    layer's own-rows layout adds the sum over TP (sequence_parallel.own_rows_layout)."""
    if group is None:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    return reduce
