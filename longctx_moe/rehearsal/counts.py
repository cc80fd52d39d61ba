"""What one rehearsed training step would make a CUDA device do, op by op: kernel launches, the
bytes copies and casts move, and the host-device syncs, each filed under the innermost module
running when it happened.

    with count_ops(runtime) as counts:
        trainer.train_step([batch])
    counts.report()  # {"launches_per_step": ..., "by_op": ..., "by_module": ..., "layers": [...]}

The rules:
- a launch is an op with a device tensor among its inputs or outputs that is not a view,
  metadata op or bare allocation (collectives' table of views, which DeviceRules uses too): a
  fill or an arange on the device launches though no input is there; our Triton and custom ops
  count as any aten op does, those of several kernels as many (kernels.LAUNCHES_PER_CALL).
  Host-device copies are memcpys, not kernels: counted as `h2d`;
- copy bytes are the bytes read plus written by the ops that only move or convert data:
  `_to_copy` (casts, device moves), `copy_` and `_foreach_copy_`, `clone` (what `.contiguous()`
  runs), `cat` and `stack` (always data movement), `repeat`, `expand_copy`. Gathers and scatters
  by index (the routing's token permutation) are the algorithm's work and are not counted;
- a host sync is a point where the host waits for the device: a read of a device value on the
  host (standins' `.item()` / `.tolist()` / `.cpu()` / `bool()`), the routing counts' read
  (the program's RoutingCounts seam), an op whose output size depends on device values
  (`nonzero`, `masked_select`, `unique`, `repeat_interleave` without an output size), a
  blocking host-to-device copy (CUDA waits for the stream before copying pageable memory) and a
  device-to-host copy.

A module is named by its path below the root ("layers.3.moe.experts"); in the backward the
module is the one whose forward produced the gradient's tensors (torch's ModuleTracker: an
approximation at module boundaries), "step" where no module runs (the loss's glue, the
optimizer). `layers` sums each `layers.N` subtree.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.module_tracker import ModuleTracker

from longctx_moe.rehearsal.collectives import _VIEWS, launches_of, program_line

COPY_OPS = frozenset({"_to_copy", "copy_", "_foreach_copy_", "clone", "cat", "stack", "repeat", "expand_copy",
                      "_copy_from"})
SYNC_OPS = frozenset({"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                      "unique_dim"})
KEYS = ("launches", "copy_bytes", "host_syncs", "h2d")
_LAYER = re.compile(r"^layers\.(\d+)(\.|$)")


def _name(func) -> str:
    """aten.copy_ / longctx.swiglu: the op without its overload."""
    return f"{func.namespace}.{func.__name__.split('.')[0]}"


def is_sync(func, kwargs) -> bool:
    """An op whose result size the host must read from the device."""
    base = func.__name__.split(".")[0]
    if base in SYNC_OPS:
        return True
    # repeat_interleave(repeats) sizes its output from the repeats' values unless told the size
    return func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None


class OpCounts(TorchDispatchMode):
    """The dispatch mode that counts (see the module docstring). `device`: the type standing for
    the GPU's tensors."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = device
        self.tracker = ModuleTracker()
        self.by_op: dict = collections.defaultdict(collections.Counter)
        self.by_module: dict = collections.defaultdict(collections.Counter)
        self.syncs: collections.Counter = collections.Counter()  # "file:line (what)" -> count
        self.root = ""

    def __enter__(self):
        self.tracker.__enter__()  # the modules' hooks, for the block the mode counts
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.tracker.__exit__(*exc)

    # ---- where

    def module(self) -> str:
        """The innermost running module below the root, or "step"."""
        names = [n for n in self.tracker.parents if n != "Global"]
        if not names:
            return "step"
        inner = max(names, key=lambda n: n.count("."))
        _, _, rest = inner.partition(".")
        return rest or "model"

    def add(self, op: str, key: str, n: int = 1) -> None:
        self.by_op[op][key] += n
        self.by_module[self.module()][key] += n

    def sync(self, what: str, where: str | None = None) -> None:
        self.add(what, "host_syncs")
        self.syncs[f"{where or program_line()} ({what})"] += 1

    # ---- every op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == self.device]
        written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == self.device]
        name, base = _name(func), func.__name__.split(".")[0]
        launches = launches_of(func, tensors, written, self.device)
        if not launches:
            if (on_device or written) and not _VIEWS[func]:  # a copy between host and device memory
                self._host_copy(name, kwargs, to_device=bool(written))
            return out
        # with no device input: a fill, an arange; an operator of several kernels: each
        self.add(name, "launches", launches)
        if base in COPY_OPS:
            self.add(name, "copy_bytes", _moved_bytes(on_device, out))
        if is_sync(func, kwargs):
            self.sync(name)
        return out

    def _host_copy(self, name: str, kwargs: dict, to_device: bool) -> None:
        """A copy between host and device memory: a memcpy, not a kernel; the host waits for
        the stream unless the copy is non-blocking, and always when it reads device memory."""
        if to_device:
            self.add(name + " (h2d)", "h2d")
            if not kwargs.get("non_blocking", False):
                self.sync(f"{name} h2d, blocking")
        else:
            self.sync(f"{name} d2h")

    # ---- the whole step

    def report(self) -> dict:
        total = collections.Counter()
        for c in self.by_op.values():
            total.update(c)
        layers: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for mod, c in self.by_module.items():
            m = _LAYER.match(mod)
            if m:
                layers[int(m.group(1))].update(c)
        row = lambda c: {k: int(c.get(k, 0)) for k in KEYS}  # noqa: E731
        return {"launches_per_step": int(total["launches"]), "copy_bytes_per_step": int(total["copy_bytes"]),
                "host_syncs_per_step": int(total["host_syncs"]), "h2d_copies_per_step": int(total["h2d"]),
                "layers": [row(layers[i]) for i in sorted(layers)],
                "by_op": {op: row(c) for op, c in sorted(self.by_op.items())},
                "by_module": {m: row(c) for m, c in sorted(self.by_module.items())},
                "host_syncs": dict(sorted(self.syncs.items()))}


def _moved_bytes(tensors: list, out) -> int:
    """Bytes read and written: every device input (a tensor read twice counts twice), and every
    output that is not one of the inputs (an in-place copy's destination is counted once)."""
    ins = {id(t) for t in tensors}
    outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and id(o) not in ins]
    return sum(t.numel() * t.element_size() for t in tensors + outs)


def _routing_seams(runtime) -> list:
    """The MoE layers' routing-count seams (one object may serve several layers)."""
    seams = {id(layer.dispatcher.counts): layer.dispatcher.counts for layer in runtime.model.moe_layers()
             if hasattr(getattr(layer, "dispatcher", None), "counts")}
    return list(seams.values())


@contextlib.contextmanager
def count_ops(runtime, device: str = "meta") -> Iterator[OpCounts]:
    """OpCounts for the block, with the module tracker, standins' host reads and the routing
    seam's reads (rehearsal.routing.AssumedRouting) counted as syncs where they happen."""
    from longctx_moe.rehearsal import standins

    counts = OpCounts(device)
    restore = []
    for seam in _routing_seams(runtime):
        read = seam.read

        def counted(table, spec, read=read):
            counts.sync("routing counts read", "parallel/comm.py (RoutingCounts.read)")
            return read(table, spec)

        seam.read, restore = counted, [*restore, seam]
    standins.on_read.append(counts.sync)
    try:
        with counts:
            yield counts
    finally:
        standins.on_read.remove(counts.sync)
        for seam in restore:
            del seam.read


def count_step(cfg, lengths: list[int], world: int = 1, rank: int = 0) -> dict:
    """OpCounts' report of one steady-state optimizer step of rank `rank` of `cfg` on the
    rehearsed CUDA path (step.rehearse_rank's build, ops and autocast), one micro-batch of
    documents of `lengths`; a warm-up step first creates the optimizer's state. Call in a
    process of its own (one default process group per process)."""
    from data_packing.batch import pad_multiple
    from longctx_moe.precision import PARAM_DTYPES
    from longctx_moe.rehearsal import standins
    from longctx_moe.rehearsal.collectives import DeviceRules
    from longctx_moe.rehearsal.fake_world import build_rank, fake_world, gpu_compute, host_batch
    from longctx_moe.rehearsal.gpus import GPUS, as_cuda_device
    from longctx_moe.rehearsal.meta_autocast import meta_autocast
    from longctx_moe.rehearsal.meta_device import cuda_kernels
    from longctx_moe.trainer import Trainer

    with fake_world(world, rank), as_cuda_device(GPUS["h200"]):
        dtype = PARAM_DTYPES[cfg.train.param_dtype]
        _, runtime = build_rank(cfg, world, rank, dtype)
        with cuda_kernels():  # the optimizer picks its kernels as on the GPU: fused AdamW
            trainer = Trainer(cfg, runtime, "meta")
        trainer.compute = gpu_compute(cfg, dtype)
        batch = host_batch(lengths, pad_multiple(cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel))
        report = None
        for counted in (False, True):
            with (meta_autocast(trainer.compute.dtype), standins.standins(), cuda_kernels(), DeviceRules(rank=rank),
                  count_ops(runtime) if counted else contextlib.nullcontext() as counts):
                trainer.train_step([batch])
            report = counts.report() if counted else None
        return report
