"""longctx-moe as a verl training engine: `strategy: longctx_moe` in a verl engine config.

Registered in verl's `EngineRegistry` as model_type "language_model", backend "longctx_moe" for
cpu and cuda (verl imports this module through `model.external_lib: rl_hooks.plugins.verl`, or
VERL_USE_EXTERNAL_MODULES). Modelled on verl's torchtitan engine
(verl/workers/engine/torchtitan/transformer_impl.py, verl 0.9.1): verl's `TrainingWorker` calls
`initialize`, `train_mode` / `eval_mode`, `train_batch` / `infer_batch` with its no-padding
TensorDict and its loss function, `lr_scheduler_step`, `get_per_tensor_param` (the weight sync to
vLLM / SGLang; `get_per_tensor_param_shard` and its delta for verl's sharded delta sync), the
data-parallel size / rank / group and `save_checkpoint` / `load_checkpoint`.

The batch a rank receives is its data-parallel share (verl dispatches each DP rank its own chunk),
so the engine drives `PolicyTrainer(sharded=True)`: our micro-batching by tokens, the parallel
layout of our config (TP x CP x DP with EP; under Dynamic-CP the shares are gathered over DP and
scheduled whole on the DP x CP block), and global token normalisers summed over DP. verl's
own loss function runs on our per-token log-probs and entropies in verl's shifted nested layout
(rl_hooks.adapters.verl.ours_to_nested), once per micro-batch on the TensorDict rows of that
micro-batch, so every verl loss option (clip ratios, loss_agg_mode, KL type, entropy coefficient,
rollout IS weights) applies unchanged. verl scales its loss by dp_size because its FSDP engines
average gradients over DP; our gradient reduction sums, so the engine divides by dp_size.

`train_batch` is one optimizer step in one call (forward, backward, the overlapped gradient
reduction, clipping, the update). verl's split-training worker (TinkerTrainingWorker) calls
`forward_backward_batch(forward_only=False)` one or more times and then `optimizer_step`: each
call's gradients are reduced and added up (Trainer.backward), the step applies them
(Trainer.update).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.utils.metric.utils import AggregationType, Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

from longctx_moe.config import ConfigError
from longctx_moe.optim import LRSchedule, lr_at
from rl_hooks.adapters.verl import from_verl, ours_to_nested
from rl_hooks.losses import LossOutput
from rl_hooks.plugins.verl.config import STRATEGY, build_config, check_engine_config

# Fields the engine reads to rebuild the token layout (other fields go to verl's loss as they are).
LAYOUT_FIELDS = ("input_ids", "prompts", "responses", "attention_mask", "response_mask")


class LongctxMoeEngine(BaseEngine):
    """A verl engine over rl_hooks.PolicyTrainer (see the module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        check_engine_config(engine_config)
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.cfg = build_config(model_config.local_path, engine_config, optimizer_config)
        self.mode = None
        self.initialized = False
        # The model, its parallel layout and optimizer are built here, as verl's torchtitan engine
        # builds its trainer: verl asks for the DP rank before initialize().
        self._build()

    # ------------------------------------------------------------------ set-up

    def _build(self):
        from rl_hooks.api import PolicyTrainer

        self.policy = PolicyTrainer(self.cfg, sharded=True)
        self.pending_backward = False  # forward_backward_batch calls not yet stepped
        # verl advances its schedule once per train_mini_batch call, not per optimizer step.
        self.schedule = LRSchedule(self.policy.trainer.optimizer, self.cfg.optim, self.cfg.train.steps)

    def initialize(self):
        """The HF weights, a fresh optimizer and schedule (verl's reset: again from the start);
        then, as verl's FSDP and Megatron engines, what param_offload / optimizer_offload name
        goes to the host until a mode context or `to()` brings it back."""
        if self.initialized:
            self._build()
        self.initialized = True
        params = self.is_param_offload_enabled
        self._offload(model=params, optimizer=self.is_optimizer_offload_enabled, grad=params)

    @property
    def is_param_offload_enabled(self) -> bool:
        return self.engine_config.param_offload

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return self.engine_config.optimizer_offload

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """verl's manual offload: to "cpu" the chosen parts go to host memory
        (PolicyTrainer.offload: model = parameters and buffers, grad = gradients, optimizer =
        its state), to the device they come back (those that were away). On a CPU run "cpu" is
        the device itself: the parts come back, and nothing ever moves."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        here = self.policy.ctx.device.type
        if device in (here, get_device_name()):
            self._onload(model=model, optimizer=optimizer, grad=grad)
        elif device == "cpu":
            self._offload(model=model, optimizer=optimizer, grad=grad)
        else:
            raise ConfigError(f"engine.to({device!r}): the longctx_moe engine runs on {here}; "
                              "move it to that device or to 'cpu'")

    def _offload(self, model: bool, optimizer: bool, grad: bool) -> None:
        if model or optimizer or grad:
            self.policy.offload(params=model, grads=grad, optimizer=optimizer)

    def _onload(self, model: bool, optimizer: bool, grad: bool) -> None:
        """Bring back the chosen parts that are away (verl's loads are no-ops for the rest)."""
        away = self.policy.offloaded
        chosen = {"params": model, "grads": grad, "optimizer": optimizer}
        if any(chosen[p] for p in away):
            self.policy.onload(**{p: chosen[p] and p in away for p in chosen})

    @contextlib.contextmanager
    def _resident(self):
        """Everything on the device for the block, and what was away sent back after it (as
        verl's engines load the model around a checkpoint)."""
        away = self.policy.offloaded
        if away:
            self.policy.onload()
        yield
        if away:
            self.policy.offload(**{p: p in away for p in ("params", "grads", "optimizer")})

    # ------------------------------------------------------------------ parallel layout

    def get_data_parallel_size(self):
        return self.policy.dims.dp

    def get_data_parallel_rank(self):
        return self.policy.dims.rank_in("dp")

    def get_data_parallel_group(self):
        group = self.policy.dims.group_or_none("dp")
        if group is None and dist.is_initialized() and dist.get_world_size() == self.policy.dims.dp:
            return dist.group.WORLD
        return group

    def is_mp_src_rank_with_outputs(self):
        d = self.policy.dims
        return d.rank_in("tp") == 0 and d.rank_in("cp") == 0

    # ------------------------------------------------------------------ batches

    def _prepare(self, data) -> tuple[Any, float, bool]:
        """Global normalisers into `data` (as verl's engines set them); our RolloutBatch of the
        rank's share, its temperature and whether entropies are wanted. verl's budget is per GPU:
        ours is per micro-batch before the static CP split, and under Dynamic-CP what one rank
        holds in one slot of a run."""
        num = data["loss_mask"].sum().to(torch.float64)
        group = self.get_data_parallel_group()
        if group is not None:
            dist.all_reduce(num, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=int(num.item()), dp_size=self.get_data_parallel_size())
        budget = tu.get_non_tensor_data(data, "max_token_len_per_gpu", None)
        if tu.get_non_tensor_data(data, "use_dynamic_bsz", True) is False or budget is None:
            raise ConfigError("verl batch: use_dynamic_bsz=false or no max_token_len_per_gpu; the "
                              "longctx_moe engine packs micro-batches by tokens: set both")
        self.policy.budget = int(budget) * (1 if self.policy.dynamic else self.policy.dims.cp)
        batch = from_verl({k: data[k] for k in LAYOUT_FIELDS if k in data.keys()})
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        return batch, _temperature(data), entropy

    def infer_batch(self, data, loss_function=None):
        """log_probs (and entropy) [B, j] nested and shifted, as verl's engines return them."""
        batch, temperature, entropy = self._prepare(data)
        out = self.policy.compute_logprobs(batch, temperature, return_entropy=entropy)
        cu = data["input_ids"].offsets()
        model_output = {"log_probs": ours_to_nested(out.logprobs, cu)}
        if entropy:
            model_output["entropy"] = ours_to_nested(out.entropy, cu)
        losses, metrics = [], {}
        if loss_function is not None:  # verl's losses are normalised globally: one call is exact
            with torch.no_grad():
                loss, m = loss_function(model_output=model_output, data=data,
                                        dp_group=self.get_data_parallel_group())
            losses.append(float(loss))
            append_to_dict(metrics, m)
        return {"model_output": model_output, "loss": losses, "metrics": metrics}

    def train_batch(self, data, loss_function):
        """One optimizer step on the rank's share with verl's `loss_function`."""
        batch, temperature, entropy = self._prepare(data)
        loss = self._verl_loss(data, loss_function, entropy)
        lr = self.schedule.apply()
        res = self.policy.train_step(batch, loss, lr=lr, temperature=temperature)
        losses, metrics = self._every_micro_batch(loss.losses, loss.metrics)
        for key in (k for k in res if k.startswith("sequences_cp")):  # Dynamic-CP's schedule
            metrics[f"actor/{key}"] = Metric(AggregationType.SUM, res[key])
        if self.is_mp_src_rank_with_outputs():
            metrics["grad_norm"] = res["grad_norm"]
        return {"model_output": {}, "loss": losses, "metrics": metrics}

    def _verl_loss(self, data, loss_function, entropy: bool, keep_values: bool = False) -> VerlLoss:
        # The loss indexes the batch the plan covers: under Dynamic-CP, every DP share in order.
        rows, start = data, 0
        if not self.policy.plans_own_share:
            parts = self.policy.shares(data)
            rows = tu.concat_tensordict(parts)
            start = sum(p.batch_size[0] for p in parts[:self.get_data_parallel_rank()])
        return VerlLoss(rows, range(start, start + data.batch_size[0]), loss_function,
                        self.get_data_parallel_group(), self.get_data_parallel_size(), entropy,
                        keep_values)

    def _every_micro_batch(self, losses: list[float], metrics: dict) -> tuple[list, dict]:
        """Under Dynamic-CP, the loss and metrics of every micro-batch of the DP x CP block on
        every rank. A micro-batch is recorded by the first rank of the run that computed it, which
        can be any rank of the block, and the ranks lead different numbers of runs; verl reads
        outputs on the first CP rank of each replica and averages over DP per micro-batch index
        (it needs as many on every DP rank). So every rank reports all of them, the losses and the
        SUM-aggregated metrics (normalised by the global token count times DP) divided by the DP
        size: verl's mean over DP gives back the block's totals, and MEAN / MIN / MAX metrics are
        unchanged by the repetition. With a static CP group its first rank records everything."""
        if self.policy.plans_own_share:
            return losses, metrics
        parts = self.policy.runtime.all_gather_object((losses, metrics), "dp_cp")
        dp = self.get_data_parallel_size()
        losses, metrics = [x / dp for part_losses, _ in parts for x in part_losses], {}
        for _, part_metrics in parts:
            append_to_dict(metrics, part_metrics)
        for value in metrics.values():
            if isinstance(value, Metric) and value.aggregation == AggregationType.SUM:
                value.values = [x / dp for x in value.values]
        return losses, metrics

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """Split training (verl's Tinker worker): forward and backward with verl's loss, the
        gradients reduced and added to those of earlier calls until `optimizer_step`. The
        learning rate of the coming step is the engine schedule's, set at the first call after a
        step (a caller may override it in `optimizer.param_groups` before stepping). With
        `return_model_output` the rank's share's log-probs come back in verl's nested layout."""
        if forward_only:
            return self.infer_batch(data, loss_function)
        keep = bool(tu.get_non_tensor_data(data, "return_model_output", False))
        batch, temperature, entropy = self._prepare(data)
        if not self.pending_backward:
            self.schedule.apply()
        loss = self._verl_loss(data, loss_function, entropy, keep)
        self.policy.forward_backward(batch, loss, temperature)
        self.pending_backward = True
        losses, metrics = self._every_micro_batch(loss.losses, loss.metrics)
        output = {}
        if keep:
            logp_T = torch.cat(self._my_sequences(loss))
            output["log_probs"] = ours_to_nested(logp_T, data["input_ids"].offsets())
        return {"model_output": output, "loss": losses, "metrics": metrics}

    def _my_sequences(self, loss: VerlLoss) -> list[torch.Tensor]:
        """This rank's share's per-sequence log-probs, in order, from those the micro-batches
        recorded. Under Dynamic-CP a share's sequences ran on runs anywhere in the DP x CP block:
        every rank's records are gathered first."""
        every = loss.values
        if not self.policy.plans_own_share:
            every = {i: v for part in self.policy.runtime.all_gather_object(every, "dp_cp")
                     for i, v in part.items()}
        return [every[i] for i in loss.mine]

    def optimizer_zero_grad(self):
        self.policy.zero_grad()
        self.pending_backward = False

    def optimizer_step(self):
        """Clip and apply the gradients of the forward_backward_batch calls since the last
        step; the gradient norm."""
        res = self.policy.optimizer_step()
        self.pending_backward = False
        return res["grad_norm"]

    @property
    def optimizer(self):
        """The torch optimizer (verl's Tinker worker sets per-step values in its param_groups)."""
        return self.policy.trainer.optimizer

    def lr_scheduler_step(self):
        self.schedule.advance()
        return lr_at(self.schedule.step_index, self.cfg.optim, self.cfg.train.steps)

    # ------------------------------------------------------------------ weights and state

    def get_per_tensor_param(self, **kwargs):
        """(HF name, tensor) of every weight, gathered over TP / EP (collective: every rank
        iterates to the end), in engine_config.export_dtype; no PEFT config."""
        dtype = getattr(torch, self.engine_config.export_dtype)
        self._onload(model=True, optimizer=False, grad=False)  # verl offloads after the sync
        buckets = self.policy.export_weights(dtype=dtype)
        return (pair for bucket in buckets for pair in bucket), None

    def get_per_tensor_param_shard(self, **kwargs):
        """This rank's pieces of the HF tensors (PolicyTrainer.export_weight_shards, each element
        once over all ranks) in verl's shard contract: (HF name, flat piece, ShardSpec) for every
        HF tensor, in the same order on every rank (verl's delta engine gathers in lockstep). A
        piece's spec places it in its HF tensor (BlockPlacement) and gathers over the world group,
        whose first rank sends; for a tensor of which this rank has no piece, an empty one that
        does not contribute. No communication here, in engine_config.export_dtype."""
        from verl.workers.engine.spec import BlockPlacement, ShardSpec

        dtype = getattr(torch, self.engine_config.export_dtype)
        self._onload(model=True, optimizer=False, grad=False)  # verl offloads after the sync
        group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        specs = self.policy.weights_spec(dtype)
        records = self.policy.export_weight_shards(dtype)
        empty = torch.empty(0, dtype=dtype, device=self.policy.ctx.device)

        def lockstep():
            record = next(records, None)
            for spec in specs:
                if record is None or record.hf_name != spec.name:
                    yield spec.name, empty, ShardSpec(spec.shape, place=0, gather_group=group, contributes=False)
                    continue
                place = BlockPlacement(tuple(record.tensor.shape), record.offsets, spec.shape)
                yield spec.name, record.tensor.reshape(-1), ShardSpec(spec.shape, place=place, gather_group=group)
                record = next(records, None)
            if record is not None:
                raise RuntimeError(f"shard {record.hf_name} is out of the export's order; the shard "
                                   "export and weights_spec disagree")

        return lockstep(), None

    def get_per_tensor_param_delta_shard(self, **kwargs):
        """verl's delta sync (checkpoint engine `delta_sharded`): the changed elements of this
        rank's pieces since prime_delta_snapshots, in HF coordinates. Our pieces are HF tensors'
        blocks already, so verl's identity entry builder converts them."""
        from verl.workers.engine.utils import _hf_entry_identity, hf_delta_export

        self._delta_shard_snap = getattr(self, "_delta_shard_snap", {})
        gen, _ = self.get_per_tensor_param_shard()
        return hf_delta_export(gen, self._delta_shard_snap, _hf_entry_identity), None

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None,
                        **kwargs):
        _refuse_remote(hdfs_path, max_ckpt_to_keep)
        with self._resident():
            self.policy.save(local_path)
        if self.policy.ctx.rank == 0:
            state = {"schedule_step": self.schedule.step_index, "global_step": global_step}
            (Path(local_path) / "verl_engine.json").write_text(json.dumps(state) + "\n")
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        _refuse_remote(hdfs_path, None)
        with self._resident():
            self.policy.load(local_path)
        state = json.loads((Path(local_path) / "verl_engine.json").read_text())
        self.schedule.step_index = int(state["schedule_step"])


@EngineRegistry.register(model_type="language_model", backend=STRATEGY, device=["cpu", "cuda"])
class LongctxMoeEngineWithLMHead(LongctxMoeEngine):
    """The language-model engine verl's actor, reference and rollout-refit paths select."""


class VerlLoss:
    """verl's loss function on one micro-batch's sequences: a PolicyTrainer per-sequence loss.

    Called with the micro-batch's sequence indices and their per-token log-probs (and entropies)
    in our alignment; gives verl's loss function the same rows of verl's TensorDict and the values
    in verl's shifted nested layout. Records verl's per-micro-batch losses and metrics."""

    per_sequence = True

    def __init__(self, data, mine: range, loss_function, dp_group, dp_size: int, entropy: bool,
                 keep_values: bool = False):
        self.data, self.fn, self.dp_group, self.dp_size = data, loss_function, dp_group, dp_size
        self.mine = mine  # the rows of `data` that are this rank's share
        self.needs_entropy = entropy
        self.losses: list[float] = []
        self.metrics: dict[str, list] = {}
        # per sequence index, its per-token log-probs (our alignment) when `keep_values`
        self.values: dict[int, torch.Tensor] | None = {} if keep_values else None

    def __call__(self, seqs: list[int], logp_T: torch.Tensor, ent_T: torch.Tensor | None,
                 group: tuple[int, int]) -> LossOutput:
        if not seqs:  # a stand-in micro-batch: no rows, still part of the graph
            return LossOutput(logp_T.sum() * 0)
        rows = tu.index_select_tensor_dict(self.data, seqs).to(logp_T.device)
        cu = rows["input_ids"].offsets()
        if self.values is not None:
            self.values.update(zip(seqs, logp_T.detach().cpu().split(cu.diff().tolist()), strict=True))
        out = {"log_probs": ours_to_nested(logp_T, cu)}
        if ent_T is not None:
            out["entropy"] = ours_to_nested(ent_T, cu)
        loss, metrics = self.fn(model_output=out, data=rows, dp_group=self.dp_group)
        if group[0] == 0:  # every rank of the group computed this same loss: recorded once
            self.losses.append(float(loss.detach()))
            append_to_dict(self.metrics, metrics)
        return LossOutput(loss / self.dp_size)


class _ModeCtx(BaseEngineCtx):
    """verl's mode context plus the model's train / eval mode. What comes back on entry and goes
    to the host on exit is verl's choice (BaseEngineCtx._context_switch): with param_offload the
    parameters (and in train mode their gradients), with optimizer_offload the optimizer state
    in train mode; none with disable_auto_offload. verl infers the direction from the device
    name, which on a CPU run is "cpu" both ways: here entry onloads and exit offloads."""

    def _parts(self) -> dict[str, bool]:
        params, train = self.engine.is_param_offload_enabled, self.mode == "train"
        return {"model": params, "grad": params and train,
                "optimizer": self.engine.is_optimizer_offload_enabled and train}

    def __enter__(self):
        self.engine.mode = self.mode
        if not self.disable_auto_offload:
            self.engine._onload(**self._parts())
        self.engine.policy.runtime.model.train(self.mode == "train")

    def __exit__(self, exc_type, exc_value, traceback):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        if not self.disable_auto_offload:
            self.engine._offload(**self._parts())
        self.engine.mode = None


def _temperature(data) -> float:
    t = data["temperature"] if "temperature" in data.keys() else 1.0
    if torch.is_tensor(t):
        if t.numel() and bool((t != t.reshape(-1)[0]).any()):
            raise ConfigError("verl batch: per-sample temperatures differ; the longctx_moe engine "
                              "scores a batch at one temperature: split the batch by temperature")
        t = float(t.reshape(-1)[0]) if t.numel() else 1.0
    return float(t)


def _refuse_remote(hdfs_path, max_ckpt_to_keep) -> None:
    if hdfs_path is not None:
        raise ConfigError(f"checkpoint hdfs_path={hdfs_path!r}: the longctx_moe engine writes local "
                          "folders only; copy them yourself, or leave it unset")
    if max_ckpt_to_keep is not None:
        raise ConfigError(f"max_ckpt_to_keep={max_ckpt_to_keep}: each verl step folder holds one "
                          "checkpoint of this engine; prune old global_step folders outside it")
