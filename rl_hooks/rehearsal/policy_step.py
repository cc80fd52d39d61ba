"""One PolicyTrainer step of one rank of an N-rank job, run on `meta` tensors under torch's fake
process group with a CUDA device's ops, and measured as longctx_moe.rehearsal measures a `train`
step (step.measure_step: memory split and peak moment, traffic by group, launches, host reads,
modeled time).

The step is what an RL framework asks of every trainer rank per iteration (each passes the whole
batch; the trainer gives each data-parallel rank its share):

1. `compute_logprobs` of the rank's rollouts (the old log-probs, no graph);
2. `train_step` with the GRPO loss (clipped policy ratio, group-normalised advantages given per
   token) and the old log-probs of 1, one optimizer step;
3. the weight export a rollout engine pulls after the update: `shards` (export_weight_shards,
   each rank its own pieces, no communication: an engine colocated with every rank) or
   `buckets` (export_weights, whole HF tensors gathered over TP / ETP / EP, every rank takes part);
4. `offload()` for the colocated rollout, then `onload()` for the next update: the device bytes
   alive before and after the offload (every storage on meta that a Python tensor reaches, as
   torch.cuda.memory_allocated counts a GPU's) and `offload_residual_frac`, their ratio.

Each phase's traffic and what it produced are reported beside the step's totals
(`PolicyReport.phases`), so that a phase that silently did nothing shows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
from pathlib import Path
from unittest import mock

import torch

from longctx_moe.rehearsal.collectives import DeviceRules
from longctx_moe.rehearsal.step import RankReport, _groups, measure_step
from rl_hooks.batch import RolloutBatch
from rl_hooks.losses import PolicyLossConfig, make_loss

EXPORTS = ("shards", "buckets")
# The export's dtype: what a bf16 rollout engine loads.
EXPORT_DTYPE = torch.bfloat16


@dataclasses.dataclass
class PolicyReport(RankReport):
    # phase -> {"traffic": {"group collective": calls, payload bytes}, and what it produced}
    phases: dict = dataclasses.field(default_factory=dict)


def rehearse_policy_rank(cfg, world: int, rank: int, gpu, lengths: list[int],
                         export: str = "shards", warmup: bool = True, until_update: bool = False,
                         accounting: bool = True) -> PolicyReport:
    """Build rank `rank`'s PolicyTrainer of `cfg` on meta and run one RL step in which this rank's
    share of the rollouts has `lengths` (as each DP rank's); measure it. Call in a process of its
    own. `warmup`, `until_update`, `accounting`: see rehearsal.step.measure_step."""
    from longctx_moe.rehearsal.fake_world import build_rank, cuda_ops, fake_world
    from longctx_moe.rehearsal.meta_device import cuda_kernels

    if export not in EXPORTS:
        raise ValueError(f"export={export!r}: choose one of {', '.join(EXPORTS)}")
    with fake_world(world, rank):
        dims, runtime = build_rank(cfg, world, rank, ops=cuda_ops(cfg, rl=True))
        with cuda_kernels():  # its optimizer resolves as on a GPU (fused AdamW)
            policy = _policy_on(cfg, dims, runtime, _one_micro_batch(cfg, lengths))
        # every rank passes the whole batch (the trainer splits it over DP): here one of alike
        # ranks', each holding `lengths` (the budget packs a rank's share into one micro-batch)
        batch = rollouts(lengths * dims.dp)
        phases: dict = {}
        step = lambda: phases.update(policy_step(policy, batch, export, _phase_rules(dims, rank)))  # noqa: E731
        report = measure_step(step, policy.trainer, dims, rank, gpu, warmup, until_update, accounting)
    return PolicyReport(**{f.name: getattr(report, f.name) for f in dataclasses.fields(RankReport)},
                        phases=phases)


def policy_step(policy, batch: RolloutBatch, export: str, rules) -> dict:
    """One RL iteration of `policy` on `batch` as a framework makes it; {phase: what it did}.
    `rules()`: a fresh counter per phase, whose traffic is the phase's."""
    out, passes = {}, _ModelPasses()
    with rules() as seen:
        old = policy.compute_logprobs(batch).logprobs
    out["logprobs"] = {"tokens": int(old.numel()), **_traffic(seen)}
    passes.end("logprobs")
    batch = dataclasses.replace(batch, old_logprobs=old)
    with rules() as seen:
        metrics = policy.train_step(batch, make_loss(PolicyLossConfig(kind="ppo")))
    out["update"] = {"loss_tokens": int(metrics["loss_tokens"]), "optimizer_steps": policy.trainer.step,
                     **_traffic(seen)}
    with rules() as seen:
        pieces, nbytes = _pull(policy, export)
    out[f"export {export}"] = {"pieces": pieces, "bytes": nbytes, **_traffic(seen)}
    passes.restore()
    out["offload"] = offload_round_trip(policy)
    return out


def offload_round_trip(policy) -> dict:
    """offload() then onload() of `policy` on meta; the device bytes alive before and after the
    offload. Meta holds no values to copy: the host buffers are allocated (they count as host
    bytes) and the copies either way skipped, the one seam of the offload (rl_hooks/offload.py
    _copy); the storages are freed and grown back as on a GPU."""
    from rl_hooks import offload

    before = live_device_bytes("meta")
    with mock.patch.object(offload, "_copy", lambda dst_B, src_B, host_B: None):
        sent = policy.offload()
        after = live_device_bytes("meta")
        policy.onload()
    return {"device_bytes_before": before, "device_bytes_after": after, "traffic": {},
            "host_bytes": sum(sent.values()), "offload_residual_frac": after / max(before, 1)}


def live_device_bytes(device: str) -> int:
    """Bytes of the distinct storages on `device` that a live Python tensor reaches."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device:
            storage = obj.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                total += storage.nbytes()
    return total


class _ModelPasses:
    """The step runs the model twice (scoring, then the update); torch's MemTracker takes one
    pass of a root module per tracked block. Between passes the tracker's per-module snapshots
    are set aside (named by their phase) and put back at the step's end, so that the peak moment
    is found over both passes. Nothing to do outside a tracked block (the warm-up)."""

    def __init__(self):
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        modes = _get_current_dispatch_mode_stack()
        self.tracker = next((m for m in modes if isinstance(m, MemTracker)), None)
        self.kept: list = []

    def end(self, phase: str) -> None:
        if self.tracker is None:
            return
        for stats in self.tracker.memory_tracking.values():
            stats.mod_fqn = f"{phase}: {stats.mod_fqn}"
            self.kept.append(stats)
        self.tracker.reset_mod_stats()

    def restore(self) -> None:
        if self.tracker is None:
            return
        for stats in self.kept:  # keyed by a stand-in: the module's own key is the update's
            self.tracker.memory_tracking[_Key()] = stats
        self.kept.clear()


class _Key(torch.nn.Module):
    """A key of MemTracker's per-module table for a pass set aside (the table holds its keys
    weakly: _KEYS keeps them alive for the report)."""

    def __init__(self):
        super().__init__()
        _KEYS.append(self)


_KEYS: list = []


def _pull(policy, export: str) -> tuple[int, int]:
    """(pieces, bytes) an engine pulls from this rank; each dropped once read, as a loader copies
    it into the engine's own weights."""
    pieces = nbytes = 0
    if export == "shards":
        for record in policy.export_weight_shards(EXPORT_DTYPE):
            pieces, nbytes = pieces + 1, nbytes + record.nbytes
        return pieces, nbytes
    for bucket in policy.export_weights(dtype=EXPORT_DTYPE):
        pieces += len(bucket)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return pieces, nbytes


def rollouts(lengths: list[int], prompt_share: float = 0.25) -> RolloutBatch:
    """A batch of sequences of `lengths` as a framework hands it over: the first `prompt_share`
    of each (at least one token) is the prompt, the rest the response that carries the loss;
    GRPO's advantages per token (the values do not matter on meta: every token is token 0)."""
    n = sum(lengths)
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    mask = torch.ones(n, dtype=torch.bool)
    for start, length in zip(cu[:-1].tolist(), lengths, strict=True):
        mask[start:start + max(1, int(length * prompt_share))] = False
    return RolloutBatch(tokens=torch.zeros(n, dtype=torch.int64), cu_seqlens=cu, loss_mask=mask,
                        advantages=torch.where(mask, 1.0, 0.0))


def _one_micro_batch(cfg, lengths: list[int]) -> int:
    """The token budget that packs `lengths` into one micro-batch (as `--tokens` is a train
    step's one micro-batch): each sequence padded to the layout's multiple."""
    from data_packing.batch import pad_multiple, pad_to

    multiple = pad_multiple(cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel)
    return sum(pad_to(n, multiple) for n in lengths)


def _policy_on(cfg, dims, runtime, budget: int):
    """The PolicyTrainer of `cfg` on the rehearsed rank: its own constructor, with the process's
    context, groups and parallelized model answered by the ones built on meta (a GPU run makes
    them from torchrun's environment and the device)."""
    import longctx_moe.build as build
    import longctx_moe.process as process
    from longctx_moe.process import RunContext
    from longctx_moe.rehearsal.fake_world import gpu_compute
    from rl_hooks.api import PolicyTrainer

    meta = torch.device("meta")
    ctx = RunContext(dims.rank, dims.world_size, dims.world_size, meta, Path(cfg.train.run_dir),
                     Path(cfg.train.run_dir) / "checkpoints")
    with contextlib.ExitStack() as stack:
        for module, name, value in ((process, "make_context", lambda *a, **k: ctx),
                                    (build, "build_dims", lambda *a, **k: dims),
                                    (build, "build_runtime", lambda *a, **k: runtime),
                                    (build, "resolve_ops", lambda *a, **k: runtime.model.ops)):
            stack.enter_context(mock.patch.object(module, name, value))
        policy = PolicyTrainer(cfg, micro_batch_tokens=budget)
    policy.trainer.compute = gpu_compute(cfg)  # the rehearsed GPU's, which meta cannot answer
    return policy


def _phase_rules(dims, rank: int):
    names, _ = _groups(dims)
    return lambda: _PhaseTraffic(rank=rank, group_names=names)


class _PhaseTraffic(DeviceRules):
    """A phase's collectives, counted as DeviceRules counts them. The step's own DeviceRules,
    below this one, checks every op and answers host collectives (once: this one leaves their
    values alone)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._collective(func, args)
        return func(*args, **(kwargs or {}))


def _traffic(rules) -> dict:
    totals = collections.defaultdict(lambda: {"calls": 0, "payload_bytes": 0})
    for (group, kind), t in sorted(rules.traffic.items()):
        totals[f"{group} {kind}"]["calls"] += t.calls
        totals[f"{group} {kind}"]["payload_bytes"] += t.payload_bytes
    return {"traffic": dict(totals), "host_collectives": sum(rules.host_collectives.values())}
