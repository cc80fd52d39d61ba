"""The distributed optimizer: AdamW state sharded over the replicas of each parameter.

Legend: R ranks in a parameter's replica group (dense parameters: dp_cp, experts: edp; the
groups grad_reduce.reduction_groups names), S elements in one rank's segment of a bucket, N
parameters in a bucket.

A replicated AdamW keeps exp_avg and exp_avg_sq of every parameter on every replica: twice the
weights' bytes, on every rank. Here rank i of a replica group owns one slab of each parameter
(`Slab`: a range of indices along one dim) and keeps AdamW state for its slabs only, 1/R of the
replicated bytes. One optimizer step (the scheme of Megatron-Core's distributed optimizer and
ZeRO stage 1):

    reduce-scatter   each rank receives the gradient of its slabs, summed over the group
    clip             the global norm from the slabs (each element counted once)
    AdamW            on the slabs: views of the parameters, which are the fp32 master weights
    all-gather       every rank's updated slabs back into the whole parameters

With bf16 parameters (train.param_dtype=bf16) the optimizer is optim.MasterAdamW over the slabs:
each rank holds fp32 masters of its slabs only. The gradients are reduce-scattered in fp32 (each
bf16 gradient widened as it is packed) straight into the masters' gradients: a sum over R ranks
in bf16 would round R-1 times, and the fp32 buffer lives only for the step, as Megatron-Core's
default with bf16 parameters. The step rounds the updated masters into the bf16 slabs, and the
all-gather moves bf16: half the bytes.

The arithmetic is the replicated optimizer's: each gradient element is the same sum over the
group, and AdamW is elementwise (tests/parallel/test_distributed_optimizer.py holds both to
1e-10 in float64 over 5 steps). The full gradient of a parameter is freed once its bucket is
sent, so a rank holds reduced gradients for its slabs only between backward and step.

Slabs are rectangular, so a checkpoint stores each rank's AdamW state as a global slice of the
parameter (checkpoint/sharded_state.py): a checkpoint written with R replicas loads under any other R,
or into the replicated optimizer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from longctx_moe.parallel.comm import all_gather_flat, reduce_scatter_flat
from longctx_moe.parallel.grad_reduce import (
    GradBuckets,
    clip_,
    global_norm,
    norm_axes,
    reduce_dtype,
    replica_axes,
)


@dataclass
class Slab:
    """This rank's part of a parameter for the optimizer: indices [start, start + sizes[rank])
    along `dim`, out of R parts of `sizes` (torch.tensor_split's split: the first ones larger).
    `data` is a view of the parameter, so updating it updates the weight."""

    param: nn.Parameter
    dim: int
    sizes: list[int]
    rank: int
    data: torch.Tensor = field(init=False)
    # The fp32 master the optimizer updates for a bf16 slab (optim.MasterAdamW); None: `data`.
    master: torch.Tensor | None = None

    def __post_init__(self):
        self.data = self.param.detach().narrow(self.dim, self.start, self.sizes[self.rank])

    @property
    def home(self) -> torch.Tensor:
        """What the optimizer updates and where its reduced gradient goes."""
        return self.data if self.master is None else self.master

    @property
    def start(self) -> int:
        return sum(self.sizes[:self.rank])

    def shape(self, j: int) -> list[int]:
        """Shape of part j."""
        shape = list(self.param.shape)
        shape[self.dim] = self.sizes[j]
        return shape

    def numel(self, j: int) -> int:
        return math.prod(self.shape(j))


def slab_dim(shape: tuple[int, ...], parts: int, contiguous_only: bool) -> int:
    """The dim to split into `parts`: dim 0 when it divides evenly (contiguous slabs), else the
    first dim that does (even but strided slabs), else dim 0 (uneven)."""
    if contiguous_only or shape[0] % parts == 0:
        return 0
    return next((d for d, n in enumerate(shape) if n % parts == 0), 0)


def make_slab(param: nn.Parameter, rank: int, parts: int, contiguous_only: bool) -> Slab:
    if param.ndim == 0:
        raise ValueError("parallel.distributed_optimizer=true splits parameters along a dim, but the "
                         "model has a 0-dim parameter; make it 1-D or set distributed_optimizer=false")
    dim = slab_dim(tuple(param.shape), parts, contiguous_only)
    return Slab(param, dim, split_sizes(param.shape[dim], parts), rank)


def split_sizes(n: int, parts: int) -> list[int]:
    """torch.tensor_split's sizes of `n` indices in `parts` sections: the first n % parts one
    longer (computed, not split: a bucket of a 1,024-way group asks it of every parameter)."""
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


class ShardedBucket:
    """Parameters of one replica group and dtype whose gradients are reduce-scattered as one
    buffer [R, S] (row j: rank j's slabs of every parameter, zero padded) and whose updated
    slabs are all-gathered back. Takes the place of grad_reduce's all-reduce bucket in
    GradBuckets, so it launches from the same backward hooks."""

    def __init__(self, group, params: list[nn.Parameter], contiguous_only: bool = False):
        self.group, self.params = group, params
        self.parts, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.slabs = [make_slab(p, self.rank, self.parts, contiguous_only) for p in params]
        # numel_RN[j, i]: elements of parameter i's part j (its size along the slab's dim times
        # the elements of one index there); as arrays, for groups of a thousand ranks
        sizes_RN = np.array([s.sizes for s in self.slabs], dtype=np.int64).T.reshape(self.parts, -1)
        numel_RN = sizes_RN * np.array([s.param.numel() // max(1, s.param.shape[s.dim]) for s in self.slabs],
                                       dtype=np.int64)
        # starts[j][i]: where parameter i's part j begins in row j of the buffer
        starts_RN = np.cumsum(numel_RN, axis=1) - numel_RN
        self.starts = starts_RN.tolist()
        self.segment = int(numel_RN.sum(axis=1).max())  # S
        # runs[i]: parameter i's parts as runs of consecutive rows j0..j1 where they have one size
        # and one offset; each run moves between the parameter and the rows in one strided copy,
        # not one a part (a GPU launch each: R x parameters of them a step otherwise). An even
        # split in an evenly split bucket is one run; tensor_split's uneven one (the first parts
        # one longer) two, and two more for each uneven parameter before it in the bucket.
        self.runs = [self._runs_of(starts_RN[:, i], sizes_RN[:, i]) for i in range(len(self.slabs))]
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.work = None
        # bf16 gradients are summed in fp32 (the module docstring says why)
        self.reduce_dtype = reduce_dtype(params[0].dtype)

    def _row(self, buffer_S: torch.Tensor, j: int, i: int) -> torch.Tensor:
        """Parameter i's part j inside rank j's row of a buffer, flat."""
        return buffer_S[self.starts[j][i]:self.starts[j][i] + self.slabs[i].numel(j)]

    @staticmethod
    def _runs_of(starts_R: np.ndarray, sizes_R: np.ndarray) -> list[tuple[int, int, int]]:
        """(first row, rows, offset along the slab's dim) of each run of a parameter's parts,
        given where each part starts in its row and its size."""
        new_R = np.ones(len(sizes_R), dtype=bool)
        new_R[1:] = (starts_R[1:] != starts_R[:-1]) | (sizes_R[1:] != sizes_R[:-1])
        first = np.flatnonzero(new_R)
        rows = np.diff(np.append(first, len(sizes_R)))
        offsets = (np.cumsum(sizes_R) - sizes_R)[first]
        return [(int(j), int(n), int(o)) for j, n, o in zip(first, rows, offsets, strict=True)]

    def _run_pairs(self, i: int, buffer_RS: torch.Tensor, t: torch.Tensor):
        """(rows of the buffer [n, *part shape], the same parts of `t` [n, *part shape]) per run of
        parameter i's parts (views; `t`'s strided where the slab's dim is not 0)."""
        slab, d = self.slabs[i], self.slabs[i].dim
        for j0, n, offset in self.runs[i]:
            size = slab.sizes[j0]
            if size == 0:
                continue
            start, shape = self.starts[j0][i], slab.shape(j0)
            rows = buffer_RS[j0:j0 + n, start:start + math.prod(shape)].view(n, *shape)
            part = t.narrow(d, offset, n * size)
            lead = list(part.shape)
            yield rows, part.reshape(*lead[:d], n, size, *lead[d + 1:]).movedim(d, 0)

    def launch(self) -> None:
        """Pack the gradients, free them, and start the reduce-scatter."""
        p0 = self.params[0]
        send_RS = torch.zeros(self.parts, self.segment, dtype=self.reduce_dtype, device=p0.device)
        for i, p in enumerate(self.params):
            if p.grad is None:  # e.g. an expert no token reached on this rank: zeros
                continue
            for rows, parts in self._run_pairs(i, send_RS, p.grad):
                rows.copy_(parts)
            p.grad = None
        self.flat = torch.empty(self.segment, dtype=self.reduce_dtype, device=p0.device)
        with record_function("comm.grad_launch"):
            self.work = reduce_scatter_flat(self.flat, send_RS.view(-1), group=self.group,
                                            async_op=True)

    def finish(self) -> None:
        """Wait; each slab's `home.grad` is then its summed gradient (views of one buffer)."""
        with record_function("comm.grad_wait"):
            self.work.wait()
        for i, slab in enumerate(self.slabs):
            slab.home.grad = self._row(self.flat, self.rank, i).view(slab.shape(self.rank))
        self.flat, self.work = None, None
        self.ready.clear()

    def _all_gather(self, local: list[torch.Tensor | None], dtype: torch.dtype | None = None) -> torch.Tensor:
        """[R, S]: every rank's row of the bucket, given this rank's slab-shaped tensors
        (`None`: zeros), one per parameter; in `dtype` (default the parameters')."""
        p0 = self.params[0]
        dtype = dtype or p0.dtype
        send_S = torch.zeros(self.segment, dtype=dtype, device=p0.device)
        for i, t in enumerate(local):
            if t is not None:
                self._row(send_S, self.rank, i).copy_(t.reshape(-1))
        recv_RS = torch.empty(self.parts, self.segment, dtype=dtype, device=p0.device)
        with record_function("comm.param_gather"):
            all_gather_flat(recv_RS.view(-1), send_S, group=self.group)
        return recv_RS

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the updated slabs into every rank's whole parameters."""
        recv_RS = self._all_gather([slab.data for slab in self.slabs])
        for i, slab in enumerate(self.slabs):
            # this rank's own part is copied onto itself: the values it sent
            for rows, parts in self._run_pairs(i, recv_RS, slab.param.detach()):
                parts.copy_(rows)

    @torch.no_grad()
    def gather_grads(self) -> list[torch.Tensor]:
        """Each parameter's whole reduced gradient, all-gathered from the slabs (for tests and
        debugging; the step never needs them)."""
        recv_RS = self._all_gather([slab.home.grad for slab in self.slabs], self.reduce_dtype)
        return [torch.cat([self._row(recv_RS[j], j, i).view(slab.shape(j)) for j in range(self.parts)],
                          slab.dim) for i, slab in enumerate(self.slabs)]


class DistributedOptimizer:
    """AdamW over this rank's slab of every parameter whose replica group has > 1 rank, and over
    the whole of the others. Driven by ParallelRuntime: `arm` / `reduce_gradients` reduce-scatter
    the gradients (in buckets launched from the backward's hooks, as the all-reduce buckets are),
    `clip_grad_norm` clips the slabs, `step` updates them and all-gathers.

    To the trainer and the LR schedule it is a torch optimizer: `param_groups`, `state`, `step`,
    `zero_grad`, `state_dict`, `load_state_dict`; `slab_of` tells checkpoints which slice of a
    parameter an optimizer tensor is."""

    def __init__(self, dense: list[nn.Parameter], expert: list[nn.Parameter], dims,
                 bucket_mb: float, build, contiguous_only: bool = False):
        """`build(tensors) -> torch.optim.Optimizer` over the slabs' views and whole parameters
        (optim.build_adamw); `contiguous_only`: split along dim 0 only (fused AdamW needs it)."""
        self.dims = dims
        cap = bucket_mb if bucket_mb > 0 else math.inf  # 0: one bucket per group and dtype
        make = functools.partial(ShardedBucket, contiguous_only=contiguous_only)
        self.buckets = GradBuckets(dense, expert, dims, cap, bucket_cls=make)
        self.slabs = [s for b in self.buckets.buckets for s in b.slabs]
        sharded = {id(s.param) for s in self.slabs}
        expert_ids = {id(p) for p in expert}
        # The axes a gradient's square sum is summed over for the global norm: the replica group
        # for a slab (slabs partition the parameter), then those sharding the parameter itself.
        self._norm_axes: dict[int, tuple[str, ...]] = {}
        self.whole: list[nn.Parameter] = []  # replica group of one: nothing to split
        for axis, params in replica_axes(dense, expert):
            for p in params:
                own = norm_axes(p, id(p) in expert_ids, dims)
                self._norm_axes[id(p)] = ((axis,) + own) if id(p) in sharded else own
                if id(p) not in sharded:
                    self.whole.append(p)
        self._slab_of = {id(s.data): s for s in self.slabs}
        self.optimizer = build([s.data for s in self.slabs] + self.whole)
        master_of = getattr(self.optimizer, "master_of", None)  # optim.MasterAdamW: bf16 slabs
        for s in self.slabs:
            if master_of is not None and master_of(s.data) is not s.data:
                s.master = master_of(s.data)

    # ------------------------------------------------------------------ the runtime's calls

    def arm(self) -> None:
        self.buckets.arm()

    def reduce_gradients(self) -> None:
        """Finish every reduce-scatter; each slab's `home.grad` then holds its summed gradient."""
        self.buckets.finish()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the reduced gradients from the slabs; clipped to `max_norm` when > 0.
        A slab's square sum is summed over its replica group first: the slabs partition the
        parameter (grad_reduce.global_norm)."""
        items = [(self._norm_axes[id(p)], grad) for p, grad in self._param_grads()]
        norm = global_norm(items, self.dims)
        clip_(items, norm, max_norm)
        return float(norm)

    def _param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
        return [(s.param, s.home.grad) for s in self.slabs] + [(p, p.grad) for p in self.whole]

    def gather_grads(self) -> dict[int, torch.Tensor]:
        """{id(parameter): its whole reduced gradient} (collective; tests and debugging)."""
        out = {id(p): p.grad for p in self.whole}
        for bucket in self.buckets.buckets:
            out.update({id(p): g for p, g in zip(bucket.params, bucket.gather_grads(), strict=True)})
        return out

    # ------------------------------------------------------------------ torch optimizer surface

    @property
    def param_groups(self) -> list[dict]:
        # The inner optimizer's current list: its load_state_dict replaces the list it had.
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for bucket in self.buckets.buckets:
            bucket.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for s in self.slabs:
            s.data.grad = None
            s.param.grad = None
        for p in self.whole:
            p.grad = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def slab_of(self, t: torch.Tensor) -> Slab | None:
        """The slab an optimizer tensor is (None: a whole parameter); a master: `param_of` it first."""
        return self._slab_of.get(id(t))

    def param_of(self, t: torch.Tensor) -> torch.Tensor:
        """The model's tensor (a slab's view or a whole parameter) an optimizer tensor updates."""
        return getattr(self.optimizer, "param_of", lambda t: t)(t)
