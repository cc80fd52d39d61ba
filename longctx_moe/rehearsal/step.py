"""One optimizer step of one rank of an N-rank job, run on `meta` tensors under torch's fake
process group: the program's own trainer, runtime, dispatchers, loss and optimizer, with the
ops a CUDA device resolves to, measured as it runs.

    report = rehearse_rank(cfg, world=64, rank=5, gpu=GPUS["h100"], lengths=[...])

What it measures, per rank (`RankReport`):
- device memory at the step's peak, by category (MemTracker's: parameters, gradients, optimizer
  state, activations and temporaries, buffers and the rest), and where in the step it peaks;
- the bytes each process group moves, by collective (DeviceRules), which also refuses what NCCL
  or a CUDA kernel would;
- the ops the device would launch, and the values the host read from device tensors;
- a modeled step time (see `cost.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections.abc import Callable

from longctx_moe.rehearsal.gpus import GIB, GPU, as_cuda_device


@dataclasses.dataclass
class RankReport:
    rank: int
    roles: dict  # axis -> this rank's coordinate
    peak_bytes: int
    host_bytes: int  # host tensors the rank holds at the step's peak (batch, host copies, totals)
    peak_split: dict  # category -> bytes at the peak
    peak_moment: str
    params: int  # this rank's parameter elements
    traffic: dict  # "group collective" -> {"calls", "payload_bytes", "bus_bytes"}
    calls: dict  # group label -> [(collective, dtype, elements), ...] in order, to compare ranks
    launches: int
    host_reads: dict  # "file:line (what)" -> count
    host_collectives: dict
    flops: float
    step_seconds: dict  # compute / memory / communication / total (modeled)
    fits: bool
    # category -> bytes at the peak before the optimizer's first step began: the forward and
    # backward's (and the distributed optimizer's gradient traffic), apart from its update
    update_free_split: dict = dataclasses.field(default_factory=dict)
    # category -> bytes at the backward's own peak (before the update began): the planner's
    # backward's-end moment (plan.memory._peak)
    backward_peak_split: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_lognormal(spec: str) -> tuple[float, float, int]:
    """(median, sigma, longest) of a `--lengths lognormal:MEDIAN,SIGMA,MAX` spec; ValueError in one
    line otherwise."""
    kind, _, values = spec.partition(":")
    try:
        median, sigma, longest = (float(v) for v in values.split(","))
    except ValueError:
        kind = ""
    if kind != "lognormal" or median <= 0 or sigma < 0 or longest < 1:
        raise ValueError(f"--lengths {spec!r}: give lognormal:MEDIAN,SIGMA,MAX, e.g. lognormal:1500,1.2,32768")
    return median, sigma, int(longest)


def lognormal_lengths(total: int, median: float, sigma: float, longest: int, seed: int = 0) -> list[int]:
    """Document lengths drawn from a lognormal (RL-like: a median of hundreds to thousands of
    tokens, a long tail) until they fill `total` tokens, each at most `longest`."""
    rng, out, left = random.Random(seed), [], total
    while left > 0:
        n = min(left, longest, max(1, int(rng.lognormvariate(math.log(median), sigma))))
        out.append(n)
        left -= n
    return out


# MemTracker's categories; "Other" holds the communication buffers (memtrack.mark_comm)
_CATEGORIES = {"PARAM": "parameters", "GRAD": "gradients", "OPT": "optimizer state", "ACT": "activations",
               "TEMP": "activations", "OTH": "communication buffers", "BUFFER": "rest"}


def _split(snapshot: dict) -> dict:
    out = {"parameters": 0, "gradients": 0, "optimizer state": 0, "activations": 0, "communication buffers": 0,
           "rest": 0}
    for key, value in snapshot.items():
        name = str(key).rsplit(".", 1)[-1]
        if name in _CATEGORIES:
            out[_CATEGORIES[name]] += int(value)
    return out


def _peak_moment(tracker, peak: int) -> str:
    """The module and phase whose snapshot reached the step's peak (the optimizer's step when no
    module's did)."""
    from longctx_moe.rehearsal.memtrack import on_device

    best, where = -1, "optimizer step"
    for stats in tracker.all_stats():
        for state, snaps in stats.snapshots.items():
            for snap in snaps:
                total = on_device(snap).get("Total", 0)
                if total > best:
                    best, where = total, f"{stats.mod_fqn} ({str(state).rsplit('.', 1)[-1].lower()})"
    return where if best >= peak else "optimizer step"


def rehearse_rank(cfg, world: int, rank: int, gpu: GPU, lengths: list[int], ops=None,
                  compute=None, warmup: bool = True, until_update: bool = False,
                  accounting: bool = True) -> RankReport:
    """Build rank `rank`'s part of `cfg` on meta and run one optimizer step of `lengths` (one
    micro-batch of this rank's documents) through the trainer; measure it. Call in a process of
    its own (one default process group per process). `ops` / `compute`: the Ops and ComputeDtype
    rehearsed (default the GPU's: fake_world.cuda_ops / gpu_compute); truth.py passes a real run's.
    `warmup`, `until_update`, `accounting`: see measure_step."""
    from data_packing.batch import pad_multiple
    from longctx_moe.precision import PARAM_DTYPES
    from longctx_moe.rehearsal.fake_world import build_rank, fake_world, gpu_compute, host_batch
    from longctx_moe.rehearsal.meta_device import cuda_kernels
    from longctx_moe.trainer import Trainer

    with fake_world(world, rank), as_cuda_device(gpu):
        dtype = PARAM_DTYPES[cfg.train.param_dtype]
        dims, runtime = build_rank(cfg, world, rank, dtype, ops=ops)
        with cuda_kernels():  # the optimizer picks its kernels as on the GPU: fused AdamW
            trainer = Trainer(cfg, runtime, "meta")
        trainer.compute = compute or gpu_compute(cfg, dtype)  # the rehearsed device's, which meta cannot answer
        batch = host_batch(lengths, pad_multiple(cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel))
        return measure_step(lambda: trainer.train_step([batch]), trainer, dims, rank, gpu, warmup, until_update,
                            accounting)


class _UpdateReached(Exception):
    """Ends a step measured until_update where its optimizer's update begins."""


def measure_step(step: Callable[[], object], trainer, dims, rank: int, gpu: GPU, warmup: bool = True,
                 until_update: bool = False, accounting: bool = True) -> RankReport:
    """Run `step()` twice on the rank `dims` and `trainer` were built for, inside its fake world:
    a warm-up (the first optimizer step creates the optimizer's state), then the measured call, a
    step of the steady state. `trainer`: the Trainer whose runtime, optimizer and compute dtype
    the step uses, built inside meta_device.cuda_kernels() (its AdamW then the GPU's fused one).
    Without `warmup` the first step is measured: it holds what a steady step holds, its
    optimizer's state made in its own update. `until_update`: the measured step stops where its
    optimizer's update begins (the report's traffic, work and time are then the forward and
    backward's). Without `accounting` the device rules count the collectives only, not each op
    (collectives.DeviceRules.accounting): the report's memory is the same, its FLOPs, launches and
    time are the collectives' alone. The planner's probes take these (update_free_split, the peak
    before the update, and peak_split) at a fraction of the cost."""
    from longctx_moe.rehearsal import standins
    from longctx_moe.rehearsal.collectives import DeviceRules
    from longctx_moe.rehearsal.cost import host_step_of, model_step_time
    from longctx_moe.rehearsal.memtrack import FastMemTracker, on_device, torch_optimizer
    from longctx_moe.rehearsal.meta_autocast import meta_autocast
    from longctx_moe.rehearsal.meta_device import cuda_kernels

    runtime, dtype = trainer.runtime, trainer.compute.dtype
    names, group_ranks = _groups(dims)
    rules = DeviceRules(rank=rank, group_names=names, accounting=accounting)
    if warmup:
        with meta_autocast(dtype), standins.standins(), cuda_kernels(), DeviceRules(rank=rank, group_names=names):
            step()
    tracker = FastMemTracker()
    tracker.track_state(runtime.model, trainer.optimizer)
    inner = torch_optimizer(trainer.optimizer)  # its step begins the update
    standins.host_reads.clear()
    _routing_reads(runtime, reset=True)
    rules.on_buffers = tracker.mark_comm
    before_update: dict = {}
    backward: dict = {}

    def peak_so_far(*_) -> None:
        if not before_update:
            before_update.update(tracker.get_tracker_snapshot("peak"))
            backward.update(tracker.backward_peak())
        if until_update:
            raise _UpdateReached

    hook = inner.register_step_pre_hook(peak_so_far)
    with meta_autocast(dtype), standins.standins(), cuda_kernels(), tracker, rules, \
            contextlib.suppress(_UpdateReached):
        step()
    hook.remove()
    snap = tracker.get_tracker_snapshot("peak")
    meta = on_device(snap)
    peak = int(meta.get("Total", 0))
    host = on_device(snap, "cpu")
    params = sum(p.numel() for p in runtime.model.parameters())
    flops = sum(w[0] for w in rules.work)  # cost.op_flops per device op
    seconds = model_step_time(flops, tracker, rules, gpu, group_ranks, host_step_of(trainer.optimizer))
    return RankReport(
        rank=rank, roles=_roles(dims), peak_bytes=peak, peak_split=_split(meta),
        peak_moment=_peak_moment(tracker, peak), params=params,
        traffic={f"{g} {c}": dataclasses.asdict(t) for (g, c), t in sorted(rules.traffic.items())},
        calls={label: [list(c) for c in seq] for label, seq in rules.calls.items()},
        launches=sum(rules.launches.values()),
        host_reads={**{f"{where} ({what})": n for (where, what), n in standins.host_reads.items()},
                    "routing counts (parallel/comm.py RoutingCounts.read)": _routing_reads(runtime)},
        host_collectives=dict(rules.host_collectives), flops=float(flops),
        step_seconds=seconds, fits=peak <= gpu.memory_bytes,
        update_free_split=_split(on_device(before_update)), backward_peak_split=_split(on_device(backward)),
        host_bytes=int(host.get("Total", 0)))


def _routing_reads(runtime, reset: bool = False) -> int:
    """Reads of the routing seam since the last reset (one per MoE layer forward with EP)."""
    seams = {id(layer.dispatcher.counts): layer.dispatcher.counts for layer in runtime.model.moe_layers()
             if hasattr(getattr(layer, "dispatcher", None), "counts")}
    total = sum(getattr(s, "reads", 0) for s in seams.values())
    for s in seams.values():
        if reset and hasattr(s, "reads"):
            s.reads = 0
    return total


def _groups(dims) -> tuple[dict, dict]:
    """(ProcessGroup.group_name -> our label: the axis and its ranks, label -> ranks) for every
    group this rank holds; the world's own group is "world"."""
    import torch.distributed as dist

    names, ranks_of = {dist.group.WORLD.group_name: "world"}, {"world": list(range(dist.get_world_size()))}
    axes = ("tp", "cp", "dp", "dp_cp", "tp_cp", "ep", "etp", "edp")
    # then the rest (hierarchical CP's inner and outer groups, Dynamic-CP's runs) where unnamed
    for axis in (*axes, *(n for n in dims.names() if n not in axes)):
        try:
            group = dims.group_or_none(axis)
        except (KeyError, ValueError, AttributeError):
            continue
        if group is not None and (axis in axes or group.group_name not in names):
            ranks = dist.get_process_group_ranks(group)
            label = f"{axis}[{ranks[0]}..{ranks[-1]}]"
            names[group.group_name], ranks_of[label] = label, ranks
    return names, ranks_of


def _roles(dims) -> dict:
    out = {}
    for axis in ("tp", "cp", "dp", "ep", "etp", "edp"):
        try:
            out[axis] = dims.rank_in(axis)
        except (KeyError, ValueError, AttributeError):
            continue
    return out


def gib(n: float) -> float:
    return n / GIB
