"""torch's MemTracker, with its per-op peak update made proportional to the modules active now,
and several passes of the model in one tracked step.

`MemTracker._update_peak_stats` runs after every op and walks every module it has ever tracked
to find the ones in the current forward / backward (`_mod_tracker.parents`), each step through a
weak reference (an `nn.Module.__getattr__` per module). On a full-size model that is thousands of
modules times tens of thousands of ops: most of a rehearsal's time. Here the walk goes over the
active modules only, found by name; what it records is the same.

A step may run the model more than once (Dynamic-CP's slots, accumulated micro-batches, an RL
step's scoring and update); torch's tracker refuses a second forward of the root module in one
block. Here each new pass sets the previous passes' per-module statistics aside (kept for
`all_stats`, named by their pass) and tracks the new pass afresh; the peak and its snapshot span
the whole step either way.

The tracker also keeps the peak of the backward alone (`backward_peak`): a moment of a shrink's
backward has its twin in the whole model's, with the gradients of the layers above it made and
their activations freed (the planner's backward's-end moment, plan.memory._peak).

torch's categories have none for communication buffers; `mark_comm` files a collective's output
buffers (receive buffers, gradient buckets: tensors the tracker holds as activations or
temporaries) under "Other", which this program's steps leave otherwise empty, so the rehearsal's
report can show them as their own category.
"""

from __future__ import annotations

from functools import partial

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import (
    _TOTAL_KEY,
    MemTracker,
    _MemRefType,
    _ModState,
    _UpdateType,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

COMM = _MemRefType.OTH  # the category the communication buffers are filed under


class _Categories(tuple):
    """The tracker's categories (`_MemRefType`) as a tuple that still reads like the enum. The
    tracker iterates its category class on every tensor it sees (a new device's empty snapshot,
    built whether it is needed or not), and an enum iterates in Python: a sixth of a rehearsal."""

    def __getattr__(self, name):
        return getattr(_MemRefType, name)


class FastMemTracker(MemTracker):
    def __init__(self) -> None:
        super().__init__()
        self._stats_by_fqn: dict = {}
        self._stats_seen = None
        self._earlier: list = []  # the per-module statistics of the step's earlier passes
        self._passes = 1
        self._bw_peak: dict = {}  # device -> (bytes, snapshot) at the backward's peak so far
        self._ref_class = _Categories(self._ref_class)

    def all_stats(self) -> list:
        """Every pass's per-module statistics (the current pass's last)."""
        return [*self._earlier, *self.memory_tracking.values()]

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:  # the root again: a new pass
                for stats in self.memory_tracking.values():
                    stats.mod_fqn = f"pass {self._passes}: {stats.mod_fqn}"
                    self._earlier.append(stats)
                self._passes += 1
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _active_stats(self):
        seen = (id(self.memory_tracking), len(self.memory_tracking))
        if seen != self._stats_seen:  # a module tracked for the first time, or the table reset
            self._stats_by_fqn = {s.mod_fqn: s for s in self.memory_tracking.values()}
            self._stats_seen = seen
        return [s for fqn in self._mod_tracker.parents if (s := self._stats_by_fqn.get(fqn)) is not None]

    def _update_peak_stats(self, peak_state) -> None:
        # a snapshot is {category: bytes} per device: a copy of the dict is a copy of it (torch's
        # deepcopy of it was a tenth of a probe's time)
        curr_snap = self._curr_mem_snap
        for mod_stats in self._active_stats():
            if peak_state in mod_stats.snapshots:
                for dev, dev_snap in curr_snap.items():
                    if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)
            if peak_state == _ModState.PEAK_BW and self._bw_peak.get(dev, (0,))[0] < dev_snap[_TOTAL_KEY]:
                self._bw_peak[dev] = (dev_snap[_TOTAL_KEY], dict(dev_snap))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """torch's (2.12+: the fake mode at entry), with an op's output tensors found by a loop
        over a tensor or a flat tuple / list, not a pytree map: a tenth of a probe's time went to
        pytree's machinery. Other outputs, and older torch, take torch's path."""
        if not hasattr(self, "_fake_mode_on_entry") or any(t == DTensor for t in types) \
                or func is torch.ops._c10d_functional.wait_tensor.default:
            return super().__torch_dispatch__(func, types, args, kwargs)
        res = func(*args, **kwargs or {})
        if active_fake_mode() is not self._fake_mode_on_entry:
            return res
        reftype = _MemRefType.OPT if self._in_opt else \
            _MemRefType.TEMP if self._mod_tracker.is_bw and not self._in_ac else _MemRefType.ACT
        if isinstance(res, torch.Tensor):
            self._track(reftype, res)
        elif isinstance(res, (tuple, list)) and all(isinstance(r, torch.Tensor) or r is None for r in res):
            for r in res:
                if r is not None:
                    self._track(reftype, r)
        else:
            tree_map_only(torch.Tensor, partial(self._track, reftype), res)
        self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
        return res

    def get_tracker_snapshot(self, type: str = "current") -> dict:
        """torch's, copied a dict a device rather than deep-copied (called at every module's
        forward and backward hooks)."""
        if type not in ("current", "peak"):
            raise ValueError(f"Invalid type {type}")
        snap = self._curr_mem_snap if type == "current" else self._peak_mem_snap
        return {dev: dict(values) for dev, values in snap.items()}

    def backward_peak(self) -> dict:
        """The snapshot ({device: {category: bytes}}) at the largest moment of the backwards run
        so far, per device."""
        return {dev: snap for dev, (_, snap) in self._bw_peak.items()}

    def track_state(self, model, optimizer) -> None:
        """Track what a step finds made before it: `model`'s parameters and gradients, the state
        of the torch optimizer inside ours (torch_optimizer), and the tensors it steps that are
        not `model`'s parameters (MasterAdamW's fp32 masters of bf16 weights), as optimizer state.
        torch's tracker sees an optimizer's state and a module's parameters, not the parameters of
        an optimizer over other tensors: untracked, the masters would be missing from the step."""
        inner = torch_optimizer(optimizer)
        self.track_external(model, inner)
        for t in stepped_apart(inner, model):
            self._update_and_maybe_create_winfos(t, _MemRefType.OPT)

    def mark_comm(self, tensors) -> None:
        """File the storages of `tensors` (a collective's outputs) as communication buffers, where
        the tracker holds them as activations or temporaries (not parameters or gradients)."""
        for t in tensors:
            for st in get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None and winfo.reftype in (_MemRefType.ACT, _MemRefType.TEMP):
                    old, winfo.reftype = winfo.reftype, COMM
                    self._update_snap(_UpdateType.REF, winfo, old_reftype=old)


def on_device(snapshot: dict, kind: str = "meta") -> dict:
    """The part of a tracker snapshot ({device: {category: bytes}}) on devices of type `kind`:
    meta for the rehearsed GPU's memory, cpu for the host's; {} where it holds none."""
    return next((v for dev, v in snapshot.items() if torch.device(dev).type == kind), {})


def torch_optimizer(optimizer):
    """The torch optimizer inside ours (the distributed optimizer holds one over its slabs, a
    MasterAdamW one over fp32 masters)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def stepped_apart(optimizer, model) -> list:
    """The tensors torch optimizer `optimizer` steps that share no storage with `model`'s
    parameters (MasterAdamW's fp32 masters)."""
    owned = {st for p in model.parameters() for st in get_untyped_storages(p)}
    return [t for g in optimizer.param_groups for t in g["params"] if not get_untyped_storages(t) & owned]
