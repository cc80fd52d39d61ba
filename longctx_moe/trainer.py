"""One optimizer step over a list of micro-batches, and its metrics (the loop is train.fit; saving
and resuming, longctx_moe.checkpoint).

Loss normalisation (docs/ARCHITECTURE.md, "Losses"): for the micro-batches of one optimizer step on every
data-parallel rank, G = the global number of target tokens (summed over DP). Each micro-batch
contributes

    loss_mb = ce_sum_mb / G + (aux_loss_mb + z_loss_mb) * n_mb / G

so the gradients summed over micro-batches and over DP x CP ranks are exactly those of one big
batch: the token-mean cross-entropy plus the token-weighted mean of the auxiliary losses. Never a
mean per micro-batch (that would overweight short micro-batches).

The trainer drives the ParallelRuntime that `parallelize` returned: each micro-batch is sharded
for its CP group and run; gradients are all-reduced (SUM) once, after the last micro-batch, by
the mesh's own rules (dense over dp_cp, experts over edp); clipping uses the global norm over the
mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from data_packing.batch import PackedBatch
from longctx_moe.config import Config
from longctx_moe.host import HeapTrim
from longctx_moe.metrics import ep_load_stats, peak_memory_mb, reset_peak_memory, step_flops
from longctx_moe.model.fp8 import advance_fp8
from longctx_moe.optim import LRSchedule
from longctx_moe.parallel.dims import Axis
from longctx_moe.parallel.runtime import ParallelRuntime, Shard
from longctx_moe.precision import resolve_compute_dtype


class NonFiniteLossError(RuntimeError):
    """train.nan_policy=stop and a step produced a NaN/inf loss or gradient norm."""


@dataclass
class MicroLoss:
    """An objective's loss on one micro-batch."""

    loss: torch.Tensor  # scalar to backward through
    reported: torch.Tensor  # this rank's share of the step loss: sums over dp_cp give the total
    # Detached scalars summed over micro-batches and dp_cp ranks; keys ending in "_max" / "_min"
    # reduce by max / min instead.
    metrics: dict[str, torch.Tensor]


class Objective(Protocol):
    """What a training step minimises (the loss seam: supervised CE and RL losses both plug in).

    `head` is passed to the model (None: the fused cross-entropy; a LogProbHead: per-token
    log-probs); `replay(i)` gives router-replay routes for micro-batch i (or None); `micro_loss`
    turns the model's output on micro-batch i into its share of the step's loss, given G, the
    step's global target-token count."""

    head: Any

    def replay(self, i: int) -> torch.Tensor | None: ...

    def micro_loss(self, i: int, out: Any, shard: Shard, g: int) -> MicroLoss: ...


class CrossEntropy:
    """The supervised objective: token-mean cross-entropy over the global batch (ce_sum / G)."""

    head = None

    def replay(self, i: int) -> None:
        return None

    def micro_loss(self, i: int, out: Any, shard: Shard, g: int) -> MicroLoss:
        ce = out.ce_sum / g
        return MicroLoss(ce, ce.detach(), {})


@dataclass
class StepResult:
    loss: float  # ce + aux + z, normalised as above and summed over the global batch
    ce_loss: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    lr: float
    num_targets: int  # global target tokens (G)
    num_tokens: int  # global real tokens (documents' lengths, no padding)
    skipped: bool
    expert_counts: torch.Tensor | None  # [L_moe, E] global token counts of this step
    flops: float | None  # model FLOPs (fwd + bwd) of the global batch; None without a FLOP model
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's, reduced globally
    cp_sizes: dict[int, int] | None = None  # Dynamic-CP: documents run at each CP size this step
    peak_memory_mb: float | None = None  # the step's peak on the busiest rank (metrics.peak_memory_mb)
    # EP > 1: the busiest EP rank's routed rows per MoE layer over an even split (metrics.ep_load_stats)
    ep_load: dict[str, list[float]] | None = None


class Trainer:
    """Owns the model's optimizer and schedule and runs optimizer steps through `runtime`.

    `runtime`: the ParallelRuntime of `parallelize(model, dims, cfg.parallel)`, whose model
    follows `model(batch, layout=None) -> ForwardOutput(ce_sum, aux_loss, z_loss,
    expert_counts [L_moe, E])`.
    """

    def __init__(self, cfg: Config, runtime: ParallelRuntime, device: torch.device | str = "cpu"):
        self.cfg, self.runtime = cfg, runtime
        self.model, self.dims = runtime.model, runtime.dims
        self.device = torch.device(device)
        self.optimizer = runtime.build_optimizer(cfg.optim)  # sharded with distributed_optimizer
        self.schedule = LRSchedule(self.optimizer, cfg.optim, cfg.train.steps)
        self.step = 0  # optimizer steps completed (including skipped ones)
        # bf16 parameters (train.param_dtype=bf16) sit beside fp32 ones (precision.cast_params)
        dtypes = [p.dtype for p in self.model.parameters()]
        param_dtype = torch.bfloat16 if torch.bfloat16 in dtypes else dtypes[0]
        self.compute = resolve_compute_dtype(cfg.train.autocast_dtype, param_dtype, self.device)
        self.heap_trim = HeapTrim(cfg.train.host_heap_trim)
        self._pending: _Pending | None = None  # backward() calls not yet applied by update()

    # ------------------------------------------------------------------ one step

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's compute dtype (self.compute, resolved once from train.autocast_dtype)."""
        return self.compute.context(self.device.type)

    def step_totals(self, micro_batches: list[PackedBatch], cp_groups: list,
                    targets: list[int]) -> tuple[int, int, float | None]:
        """(G target tokens, real tokens, model FLOPs) of this step over the DP x CP block.
        `cp_groups`: each micro-batch's CPGroup (None: the static one); `targets`: each
        micro-batch's target tokens (PackedBatch.num_target_tokens, counted once by the caller).

        Every rank of a CP group (the static one, or a Dynamic-CP run's) holds the same
        (unsharded) micro-batch: each counts a 1/size share of it, so the block's sum counts it
        once and no rank's part depends on its position in the group (one collective)."""
        shares = [1.0 / (cp or self.runtime.static_cp).size for cp in cp_groups]
        flops = [step_flops(self.cfg.model, mb.doc_lengths()) for mb in micro_batches]
        local = [sum(n * s for n, s in zip(targets, shares, strict=True)),
                 sum(sum(mb.doc_lengths()) * s for mb, s in zip(micro_batches, shares, strict=True)),
                 sum((f or 0.0) * s for f, s in zip(flops, shares, strict=True))]
        t = self.runtime.all_reduce_host(torch.tensor(local, dtype=torch.float64), Axis.DP_CP)
        return round(float(t[0])), round(float(t[1])), (None if None in flops else float(t[2]))

    def train_step(self, micro_batches: list[PackedBatch], objective: Objective | None = None,
                   lr: float | None = None, cp_groups: list | None = None) -> StepResult:
        """Forward/backward over every micro-batch, reduce, clip, and (unless non-finite) update.
        `objective` defaults to the supervised cross-entropy; `lr` overrides the schedule's
        learning rate for this step (RL frameworks set it per call); `cp_groups`: the CPGroup of
        each micro-batch where the caller placed them on Dynamic-CP runs itself (rl_hooks),
        default the static CP group, or the trainer's own Dynamic-CP schedule."""
        if self._pending is not None:
            raise RuntimeError("train_step with gradients of an earlier backward() not applied; "
                               "call update() or discard_gradients() first")
        lr = self.schedule.apply() if lr is None else self._set_lr(lr)
        res = self.backward(micro_batches, objective, cp_groups)
        grad_norm, skipped, peak_mb = self.update()  # at the lr set above
        return dataclasses.replace(res, grad_norm=grad_norm, lr=lr, skipped=skipped, peak_memory_mb=peak_mb)

    def backward(self, micro_batches: list[PackedBatch], objective: Objective | None = None,
                 cp_groups: list | None = None) -> StepResult:
        """Forward/backward over every micro-batch and the gradient reduction, without the update:
        the gradients add to those of earlier `backward` calls since the last `update` (split
        training: a framework's forward_backward calls, then one optimizer step). The result
        holds this call's losses and metrics (grad_norm nan, lr of the optimizer now)."""
        if self._pending is None:
            reset_peak_memory(self.device)
        elif self.runtime.sharded:
            raise RuntimeError("parallel.distributed_optimizer=true: gradients of several backward() "
                               "calls before one update() are not accumulated; run one backward per "
                               "update, or set parallel.distributed_optimizer=false")
        work, cp_sizes = self._work(micro_batches, objective, cp_groups)
        # Counted once, on the host batches: the step total and each micro-batch's weight use it.
        targets = [mb.num_target_tokens() for mb, _ in work]
        g, num_tokens, flops = self.step_totals([mb for mb, _ in work], [cp for _, cp in work], targets)
        if g == 0:
            raise ValueError(f"step {self.step + 1}: the global batch has no target tokens (all labels are -100); "
                             "check the data (documents of length >= 2) and data.global_batch_tokens")
        self._lent_rows()  # forget what forwards outside a step (compute_logprobs) ran
        earlier = self._stash_gradients()
        sums, counts, metrics = self._accumulate(work, targets, g, objective or CrossEntropy())
        self.runtime.reduce_gradients()
        _add_gradients(earlier)
        self.runtime.all_reduce_host(sums, Axis.DP_CP)
        if counts is not None:
            self.runtime.all_reduce_host(counts, Axis.DP_CP)
        self._pending = _Pending.add(self._pending, float(sums[0]), counts)
        return StepResult(loss=float(sums[0]), ce_loss=float(sums[1]), aux_loss=float(sums[2]),
                          z_loss=float(sums[3]), grad_norm=math.nan, lr=self.optimizer.param_groups[0]["lr"],
                          num_targets=g, num_tokens=num_tokens, skipped=False, expert_counts=counts,
                          flops=flops, metrics=self._reduce_metrics(metrics), cp_sizes=cp_sizes,
                          ep_load=self._ep_load(counts))

    def update(self, lr: float | None = None) -> tuple[float, bool, float]:
        """Clip the gradients of the backward() calls since the last update and step the
        optimizer at `lr` (default: the learning rate it holds now), unless the loss or gradient
        norm is non-finite; advance the schedule. (grad_norm, skipped, the peak memory since the
        first of those backward calls on the busiest rank.)"""
        if self._pending is None:
            raise RuntimeError("update() without a backward() since the last update: nothing to apply")
        pending, self._pending = self._pending, None
        if lr is not None:
            self._set_lr(lr)
        grad_norm = self.runtime.clip_grad_norm(self.cfg.optim.grad_clip)
        skipped = not (math.isfinite(pending.loss) and math.isfinite(grad_norm))
        if skipped:
            self._on_non_finite(pending.loss, grad_norm)
        else:
            self.optimizer.step()
            if self.cfg.model.expert_bias and pending.counts is not None:
                self.model.update_expert_bias(pending.counts.to(self.device, non_blocking=True))
        self.optimizer.zero_grad(set_to_none=True)
        advance_fp8(self.model, skipped)  # delayed FP8 scaling: freeze this step's scales
        self.schedule.advance()
        self.step += 1
        peak_mb = self._peak_memory()  # before the trim: the step's own peak
        self.heap_trim.after_step()
        return grad_norm, skipped, peak_mb

    def discard_gradients(self) -> None:
        """Forget the gradients of backward() calls not yet applied by update()."""
        self._pending = None
        self.optimizer.zero_grad(set_to_none=True)

    def _stash_gradients(self) -> list | None:
        """The reduced gradients of earlier backward() calls, taken off the parameters so that
        this call's reduction sums only its own (added back after it)."""
        if self._pending is None:
            return None
        stash = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        for p, _ in stash:
            p.grad = None
        return stash

    def _ep_load(self, counts_LE) -> dict[str, list[float]] | None:
        """EP balance of this step: by expert owner, and as run where experts were lent."""
        ran = self._lent_rows()
        if self.dims.ep == 1 or counts_LE is None:
            return None
        return ep_load_stats(counts_LE, self.dims.ep, ran)

    def _lent_rows(self) -> list | None:
        """[L_moe][ep] rows each EP rank ran since the last call, where every MoE layer lends
        (expert lending needs ep > 1; a model without `moe_layers` has nothing to lend)."""
        layers = self.model.moe_layers() if self.dims.ep > 1 and hasattr(self.model, "moe_layers") else []
        ran = [m.dispatcher.take_step_rows() for m in layers]
        return ran if ran and all(r is not None for r in ran) else None

    def _set_lr(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _work(self, micro_batches: list[PackedBatch], objective: Objective | None,
              cp_groups: list | None = None):
        """(micro-batch, CP group) pairs this rank runs, and Dynamic-CP's size histogram: the
        caller's groups, the loader's micro-batches on the static CP group, or the Dynamic-CP
        slots."""
        if cp_groups is not None:
            if len(cp_groups) != len(micro_batches):
                raise ValueError(f"train_step: {len(cp_groups)} cp_groups for {len(micro_batches)} "
                                 "micro-batches; give one CPGroup per micro-batch")
            return list(zip(micro_batches, cp_groups, strict=True)), None
        if self.runtime.dynamic is None:
            return [(mb, None) for mb in micro_batches], None
        if objective is not None and not isinstance(objective, CrossEntropy):
            raise ValueError("parallel.dynamic_cp=true reschedules documents across ranks, which "
                             "only the supervised objective supports; set parallel.dynamic_cp=false")
        slots, sizes = self.runtime.dynamic.reschedule(micro_batches, self.device)
        return [(s.batch, s.cp) for s in slots], sizes

    def _accumulate(self, work: list, targets: list[int], g: int, objective: Objective):
        """Backward every (micro-batch, CP group); return sums [loss, main, aux, z] (fp64), the
        summed expert counts [L_moe, E] (fp64) of this rank, and the objective's metrics, all on
        the host. They add up where the model computed them (float64, the same sums as on the
        host) and are read back once, after the last backward: one sync per step, not several
        per micro-batch."""
        sums = [torch.zeros((), dtype=torch.float64)] * 4  # a host zero plus a device value moves there
        counts, metrics = None, {}
        def shard_of(item):
            i, (mb, cp) = item
            return self.runtime.shard(mb.to(self.device), cp, replay_TLK=objective.replay(i),
                                      num_targets=targets[i])
        for (i, _), shard, out in self.runtime.forwards(list(enumerate(work)), shard_of, objective.head,
                                                        self.autocast):
            n = shard.num_targets
            main = objective.micro_loss(i, out, shard, g)
            aux = (out.aux_loss + out.z_loss) * (n / g)
            if i == len(work) - 1:  # gradient buckets all-reduce while this backward runs
                self.runtime.start_gradient_reduction()
            (main.loss + aux).backward()
            parts = (main.reported + aux, main.reported, out.aux_loss * (n / g), out.z_loss * (n / g))
            sums = [_add(acc, _f64(v)) for acc, v in zip(sums, parts, strict=True)]
            c = getattr(out, "expert_counts", None)
            if c is not None:
                counts = _add(counts, _f64(c, keep_shape=True))
            _merge_metrics(metrics, {**main.metrics, **_replay_metrics(out)})
        keys = sorted(metrics)
        host = _to_host([*sums, counts, *(metrics[k] for k in keys)])
        return torch.stack(host[:4]), host[4], dict(zip(keys, host[5:], strict=True))

    def _reduce_metrics(self, metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sums over dp_cp ("_max" / "_min" keys by max / min); the same keys on every rank."""
        out = {}
        for key in sorted(metrics):
            t = metrics[key].detach().to(torch.float64).cpu().reshape(1)
            op = {"_max": dist.ReduceOp.MAX, "_min": dist.ReduceOp.MIN}.get(key[-4:], dist.ReduceOp.SUM)
            out[key] = float(self.runtime.all_reduce_host(t, Axis.DP_CP, op))
        return out

    def _peak_memory(self) -> float:
        # The rank that runs out of memory first sets the limit: report the maximum over ranks.
        t = torch.tensor([peak_memory_mb(self.device)], dtype=torch.float64)
        return float(self.runtime.all_reduce_host(t, Axis.WORLD, dist.ReduceOp.MAX))

    def _on_non_finite(self, loss: float, grad_norm: float) -> None:
        what = f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} " \
               f"(loss={loss}, grad_norm={grad_norm}) at step {self.step + 1}"
        if self.cfg.train.nan_policy == "stop":
            raise NonFiniteLossError(f"{what}; lower optim.lr, check the data, or set train.nan_policy=skip")


@dataclass(frozen=True)
class _Pending:
    """What update() needs from the backward() calls since the last update."""

    loss: float  # the summed losses (a NaN / inf in any call skips the update)
    counts: torch.Tensor | None  # summed expert counts [L_moe, E] (the expert-bias update)

    @staticmethod
    def add(pending: _Pending | None, loss: float, counts: torch.Tensor | None) -> _Pending:
        if pending is None:
            return _Pending(loss, counts)
        if pending.counts is None or counts is None:  # a model without MoE layers counts nothing
            return _Pending(pending.loss + loss, pending.counts if counts is None else counts)
        return _Pending(pending.loss + loss, pending.counts + counts)


def _add_gradients(stash: list | None) -> None:
    """Add the stashed gradients of earlier backward() calls back onto the parameters."""
    for p, g in stash or ():
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def _f64(value, keep_shape: bool = False) -> torch.Tensor:
    """A detached float64 copy of `value` where it lives (a host number on the host): no
    device-to-host read. A scalar unless `keep_shape`."""
    if not torch.is_tensor(value):
        return torch.tensor(float(value), dtype=torch.float64)
    value = value.detach().to(torch.float64)
    return value if keep_shape else value.reshape(())


def _add(acc: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if acc is None else acc + value


def _to_host(values: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """`values` on the host, those on a device read back with one copy for all (one sync)."""
    away = [i for i, v in enumerate(values) if v is not None and v.device.type != "cpu"]
    if not away:
        return values
    flat = torch.cat([values[i].reshape(-1).to(values[away[0]].device) for i in away]).cpu()
    out = list(values)
    for i, part in zip(away, flat.split([values[i].numel() for i in away]), strict=True):
        out[i] = part.view(values[i].shape)
    return out


def _merge_metrics(acc: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Fold one micro-batch's metrics into `acc`, where they live (read once, see _to_host)."""
    for key, value in new.items():
        value = _f64(value)
        if key not in acc:
            acc[key] = value
        elif key.endswith("_max"):
            acc[key] = torch.maximum(acc[key], value)
        elif key.endswith("_min"):
            acc[key] = torch.minimum(acc[key], value)
        else:
            acc[key] = acc[key] + value


def _replay_metrics(out: Any) -> dict[str, torch.Tensor]:
    """Router replay's token counts (real tokens of this rank whose routes were given, and of
    those the ones live routing agreed with), device scalars where routes were replayed (read
    with the step's other sums); empty without replay (the model's counts are then host 0s)."""
    replay = getattr(out, "replay", None) or {}
    if not torch.is_tensor(replay.get("known")):
        return {}
    return {"route_known": replay["known"], "route_agree": replay["agree"]}


def iterate_steps(loader: Iterable[list[PackedBatch]], start_step: int, total_steps: int) -> Iterator[list[PackedBatch]]:
    """The loader's steps until `total_steps` optimizer steps are done (resumed runs start later)."""
    it = iter(loader)
    for _ in range(start_step, total_steps):
        yield next(it)
