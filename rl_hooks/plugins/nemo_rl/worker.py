"""longctx-moe as a NeMo-RL policy worker.

NeMo-RL's `Policy` (nemo_rl/models/policy/lm_policy.py, commit 7ea279a) builds one Ray actor per
rank from a worker class it is given by name (`worker_extension_cls_fqn=
"rl_hooks.plugins.nemo_rl.LongctxMoePolicyWorker"`), hands each data-parallel rank its own shard
of the batch (`BatchedDataDict.shard_by_batch_size`), and reads back what its GRPO loop reads:

    get_logprobs(data)              -> {"logprobs": [B, S]}, position 0 and padding 0
    get_reference_policy_logprobs   -> {"reference_logprobs": [B, S]} (the weights at start-up)
    train(data, loss_fn, gbs=...)   -> {"global_loss": [G], "grad_norm", "all_mb_metrics": {k: [G]}}
    prepare_refit_info()            -> {HF name: (global shape, dtype)} of the weight stream
    stream_weights(bucket_bytes)    -> buckets of (HF name, tensor): our bucketed export

G is the number of global batches (optimizer steps). `loss_fn` is NeMo-RL's ClippedPGLossFn (or
its config): its settings become our PolicyLossConfig (rl_hooks/plugins/nemo_rl/loss.py), and the
gradient is NeMo-RL's. all_mb_metrics holds one entry per global batch in NeMo-RL's convention:
the loop sums most keys over entries and takes min / max / mean of the rest.

The parallel layout (TP x CP x DP with EP) comes from our YAML, `policy.longctx_moe.config`;
NeMo-RL's `dtensor_cfg` sizes, which decide how its Policy shards the batch, must name the same TP
and CP. Micro-batches are packed by tokens (`dynamic_batching.train_mb_tokens`); settings that this
worker cannot honour are refused in one line at construction. What needs a GPU (CUDA-IPC and NCCL
weight transfer to vLLM) is refused on CPU with the call to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from longctx_moe.config import Config, ConfigError, load_config
from rl_hooks.adapters.nemo_rl import from_nemo_rl, logprobs_to_nemo_rl, real_tokens
from rl_hooks.losses import make_loss
from rl_hooks.plugins.nemo_rl.loss import loss_config_from_nemo_rl

PRECISIONS = {"float32": "none", "bfloat16": "bf16", "float64": "none"}


def _section(cfg: Mapping, key: str) -> Mapping:
    value = cfg.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"policy.{key}: expected a mapping, got {type(value).__name__}")
    return value


def optimizer_overrides(policy: Mapping) -> list[str]:
    """NeMo-RL's `optimizer` (torch.optim.AdamW and its kwargs) and `max_grad_norm` as optim.*."""
    sets = []
    opt = _section(policy, "optimizer")
    if opt:
        name = opt.get("name", "torch.optim.AdamW")
        if name not in ("torch.optim.AdamW", "AdamW"):
            raise ConfigError(f"policy.optimizer.name={name!r}: this worker trains with AdamW; "
                              "set torch.optim.AdamW")
        kwargs = dict(opt.get("kwargs") or {})
        for key, ours in (("lr", "lr"), ("weight_decay", "weight_decay"), ("eps", "eps")):
            if key in kwargs:
                sets.append(f"optim.{ours}={float(kwargs.pop(key))}")
        if "betas" in kwargs:
            b1, b2 = kwargs.pop("betas")
            sets.append(f"optim.betas=[{float(b1)}, {float(b2)}]")
        for key in ("foreach", "fused"):  # implementation choices, not the update
            kwargs.pop(key, None)
        if kwargs:
            raise ConfigError(f"policy.optimizer.kwargs.{sorted(kwargs)[0]}: no counterpart in "
                              "longctx-moe's AdamW; remove it")
    if "max_grad_norm" in policy:
        clip = policy["max_grad_norm"]
        sets.append(f"optim.grad_clip={0.0 if clip is None else float(clip)}")
    return sets


def _refuse_unsupported(policy: Mapping) -> None:
    if _section(policy, "megatron_cfg").get("enabled"):
        raise ConfigError("policy.megatron_cfg.enabled=true selects NeMo-RL's Megatron worker; set "
                          "it false (the longctx_moe worker takes its layout from its own YAML)")
    if policy.get("scheduler"):
        raise ConfigError("policy.scheduler: the longctx_moe worker follows its YAML's schedule "
                          "(optim.schedule, optim.warmup_steps, train.steps); remove policy.scheduler")
    gen = _section(policy, "generation")
    top_k, top_p = gen.get("top_k"), gen.get("top_p", 1.0)
    if (top_k not in (None, -1, 0)) or (top_p is not None and top_p < 1.0):
        raise ConfigError(f"policy.generation top_k={top_k}, top_p={top_p}: log-probs under a "
                          "filtered distribution are not implemented; sample with top_k=-1, top_p=1")
    if not (_section(policy, "dynamic_batching").get("enabled")
            or _section(policy, "sequence_packing").get("enabled")):
        raise ConfigError("policy.dynamic_batching.enabled=false: the longctx_moe worker packs "
                          "micro-batches by tokens; enable it and set train_mb_tokens")


def build_config(policy: Mapping) -> Config:
    """Our Config for NeMo-RL's `policy` section: `policy.longctx_moe.config` (our YAML, required),
    the HF weights of `model_name`, the optimizer and precision keys, then
    `policy.longctx_moe.overrides` (dotted key=value, last: a user's explicit key wins)."""
    _refuse_unsupported(policy)
    ours = _section(policy, "longctx_moe")
    if not ours.get("config"):
        raise ConfigError("policy.longctx_moe.config: empty; set it to a longctx-moe YAML (its "
                          "model.* must match the HF model), e.g. configs/tiny_cpu.yaml")
    sets = [f"train.init_from={policy['model_name']}"] if policy.get("model_name") else []
    precision = policy.get("precision", "float32")
    if precision not in PRECISIONS:
        raise ConfigError(f"policy.precision={precision!r}: choose one of {', '.join(PRECISIONS)}")
    sets.append(f"train.autocast_dtype={PRECISIONS[precision]}")
    if precision == "float64":
        sets.append("train.param_dtype=fp64")
    sets += optimizer_overrides(policy)
    return load_config(ours["config"], sets + list(ours.get("overrides") or []))


def _check_layout(policy: Mapping, cfg: Config) -> None:
    """NeMo-RL shards the batch over DP = world / (TP x CP x PP) of its dtensor_cfg: that must be
    our DP, or ranks of one replica would receive different shards."""
    dt = _section(policy, "dtensor_cfg")
    if not dt.get("enabled"):
        return
    for key, ours in (("tensor_parallel_size", cfg.parallel.tp),
                      ("context_parallel_size", cfg.parallel.cp)):
        if int(dt.get(key, 1)) != ours:
            raise ConfigError(f"policy.dtensor_cfg.{key}={dt.get(key, 1)} but the longctx_moe YAML "
                              f"has {ours}: NeMo-RL shards the batch by it; make them equal")


class LongctxMoePolicyWorker:
    """NeMo-RL's policy-worker calls over rl_hooks.PolicyTrainer (see the module docstring)."""

    def __init__(self, config: Mapping, tokenizer: Any = None, processor: Any = None,
                 weights_path: str | None = None, optimizer_path: str | None = None,
                 init_optimizer: bool = True, init_reference_model: bool = True, **kwargs: Any):
        from rl_hooks.api import PolicyTrainer

        self.policy_cfg = config
        self.cfg = build_config(config)
        _check_layout(config, self.cfg)
        self.policy = PolicyTrainer(self.cfg, sharded=True)
        batching = _section(config, "dynamic_batching")
        cp = self.policy.dims.cp  # NeMo-RL's token budgets are per GPU; ours per CP group
        self.train_budget = int(batching.get("train_mb_tokens") or self.policy.budget // cp) * cp
        self.logprob_budget = int(batching.get("logprob_mb_tokens") or self.train_budget // cp) * cp
        self.temperature = float(_section(config, "generation").get("temperature", 1.0))
        if weights_path:
            self.load_checkpoint(weights_path, optimizer_path)
        self.reference = self._snapshot() if init_reference_model else None

    # ------------------------------------------------------------------ data

    def _batch(self, data: Mapping, *, scoring: bool):
        """Our RolloutBatch of this rank's shard. Scoring needs only the tokens: a missing
        token_mask is all ones over the real tokens."""
        fields = dict(data.items()) if hasattr(data, "items") else data
        if scoring and fields.get("token_mask") is None:
            fields = {**fields, "token_mask": real_tokens(fields).long()}
        if scoring:  # the loss fields play no part in log-probs
            fields = {k: fields[k] for k in ("input_ids", "input_lengths", "token_mask")}
        return from_nemo_rl(fields), fields

    def _score(self, data: Mapping) -> torch.Tensor:
        batch, fields = self._batch(data, scoring=True)
        self.policy.budget = self.logprob_budget
        out = self.policy.compute_logprobs(batch, self.temperature)
        return logprobs_to_nemo_rl(out, fields)

    def get_logprobs(self, data: Mapping, micro_batch_size: int | None = None):
        """{"logprobs": [B, S]}: log p(input_ids[:, t] | < t) at t, 0 at t = 0 and padding."""
        self.policy.runtime.model.eval()
        return _batched({"logprobs": self._score(data)})

    def get_reference_policy_logprobs(self, data: Mapping, micro_batch_size: int | None = None,
                                      timer: Any = None):
        """{"reference_logprobs": [B, S]} under the weights the worker started from."""
        if self.reference is None:
            raise ConfigError("get_reference_policy_logprobs: the worker was built with "
                              "init_reference_model=False; build it with True")
        current = self._snapshot()
        self._restore(self.reference)
        try:
            logp = self.get_logprobs(data)["logprobs"]
        finally:
            self._restore(current)
        return _batched({"reference_logprobs": logp})

    # ------------------------------------------------------------------ training

    def train(self, data: Mapping, loss_fn: Any, eval_mode: bool = False, gbs: int | None = None,
              mbs: int | None = None, timer: Any = None) -> dict[str, Any]:
        """Optimizer steps over this rank's shard, one per global batch of `gbs` sequences
        (policy.train_global_batch_size when None), with NeMo-RL's loss."""
        if eval_mode:
            raise ConfigError("train(eval_mode=True): a validation loss without an update is not "
                              "implemented by the longctx_moe worker; call get_logprobs")
        loss_cfg = loss_config_from_nemo_rl(loss_fn)
        batch, _ = self._batch(data, scoring=False)
        steps = self._global_batches(batch.num_seqs, gbs)
        self.policy.budget = self.train_budget
        self.policy.runtime.model.train()
        res = self.policy.train_step(batch, make_loss(loss_cfg), mini_batches=steps,
                                     temperature=self.temperature)
        f64 = dict(dtype=torch.float64)  # float32 would round the loss NeMo-RL logs
        return {"global_loss": torch.tensor([s["policy_loss"] for s in res["steps"]], **f64),
                "grad_norm": torch.tensor(res["steps"][-1]["grad_norm"], **f64),
                "all_mb_metrics": _nemo_metrics(res["steps"], loss_cfg),
                "rank": self.policy.ctx.rank, "model_dtype": _param_dtype(self.policy)}

    def _global_batches(self, local_seqs: int, gbs: int | None) -> int:
        gbs = int(gbs or self.policy_cfg.get("train_global_batch_size") or 0)
        dp = self.policy.dims.dp
        if gbs <= 0 or gbs % dp:
            raise ConfigError(f"train_global_batch_size={gbs}: must be a positive multiple of the "
                              f"data-parallel size {dp}")
        local = gbs // dp
        if local_seqs % local:
            raise ConfigError(f"train: this rank holds {local_seqs} sequences, not a multiple of "
                              f"train_global_batch_size / dp = {local}; NeMo-RL shards whole "
                              "global batches: pass a multiple of train_global_batch_size")
        return local_seqs // local

    # ------------------------------------------------------------------ weights

    def prepare_refit_info(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
        """{HF name: (global shape, dtype)} of every tensor stream_weights sends."""
        return {s.name: (torch.Size(s.shape), s.dtype) for s in self.policy.weights_spec(dtype)}

    def stream_weights(self, buffer_size_bytes: int = 512 << 20, dtype: torch.dtype = torch.bfloat16):
        """Buckets of (HF name, tensor) of at most buffer_size_bytes (collective over the ranks:
        each iterates to the end), for a rollout engine's load_weights."""
        return self.policy.export_weights(buffer_size_bytes, dtype)

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int = 0, kv_scales: Any = None):
        """NeMo-RL's colocated vLLM refit: CUDA IPC handles over ZMQ, through NeMo-RL's own
        sender (nemo_rl.models.policy.utils) fed by our export."""
        if not torch.cuda.is_available():
            raise ConfigError("stream_weights_via_ipc_zmq sends CUDA IPC handles; on CPU use "
                              "stream_weights() and the rollout engine's load_weights")
        if kv_scales is not None:
            raise ConfigError("stream_weights_via_ipc_zmq(kv_scales=...): FP8 KV-cache scales are "
                              "not produced by the longctx_moe worker; pass None")
        from nemo_rl.models.policy.utils import stream_weights_via_ipc_zmq_impl

        pairs = (pair for bucket in self.stream_weights(buffer_size_bytes or 512 << 20)
                 for pair in bucket)
        stream_weights_via_ipc_zmq_impl(params_generator=pairs, buffer_size_bytes=buffer_size_bytes,
                                        zmq_socket=self.zmq_socket, rank=self.policy.ctx.rank,
                                        worker_name=repr(self))

    def broadcast_weights_for_collective(self, *args: Any, **kwargs: Any):
        raise ConfigError("broadcast_weights_for_collective (NCCL to a non-colocated vLLM) is not "
                          "implemented by the longctx_moe worker; use stream_weights()")

    # ------------------------------------------------------------------ modes, state

    # Colocated generation, as NeMo-RL's DTensor worker moves memory around its GRPO loop:
    # offload_before_refit sends the optimizer state to the host (the weights stay for the
    # refit), offload_after_refit everything; scoring brings the parameters back, training all.
    # On a CPU run nothing moves (PolicyTrainer.offload says so once).

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self._onload(params=True, grads=True, optimizer=True)
        self.policy.runtime.model.train()

    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        self._onload(params=True, grads=False, optimizer=False)
        self.policy.runtime.model.eval()

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to release: the optimizer step already ran inside train()."""

    def offload_before_refit(self) -> None:
        """The optimizer state (and any gradients) to host memory; the weights stay for the refit."""
        self.policy.offload(params=False)

    def offload_after_refit(self) -> None:
        """Everything the trainer holds on its device to host memory, for the generation."""
        self.policy.offload()

    def _onload(self, **parts: bool) -> None:
        """Bring back the chosen parts that are away."""
        chosen = {p: on and p in self.policy.offloaded for p, on in parts.items()}
        if any(chosen.values()):
            self.policy.onload(**chosen)

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None,
                        tokenizer_path: str | None = None, **kwargs: Any) -> None:
        """Model, optimizer and schedule in our sharded format under weights_path (one folder:
        the optimizer state is inside it; optimizer_path, when given, records where)."""
        self.policy.save(weights_path)
        if optimizer_path and self.policy.ctx.rank == 0:
            Path(optimizer_path).mkdir(parents=True, exist_ok=True)
            (Path(optimizer_path) / "LONGCTX_MOE_STATE").write_text(
                f"the optimizer state is inside {Path(weights_path).resolve()}\n")

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self.policy.load(weights_path)

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> bool:
        from longctx_moe.parallel.dims import destroy_process_groups

        self.policy = None  # its ParallelDims holds the groups
        destroy_process_groups()
        return True

    # ------------------------------------------------------------------ helpers

    def _params(self):
        return list(self.policy.runtime.model.parameters())

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self._params()]

    def _restore(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self._params(), values, strict=True):
                p.copy_(v)


def _param_dtype(policy) -> torch.dtype:
    return next(policy.runtime.model.parameters()).dtype


def _batched(fields: dict[str, torch.Tensor]):
    """NeMo-RL's BatchedDataDict when NeMo-RL is importable (inside its Ray workers), else a dict
    with the same keys (it is a dict subclass with the same item access)."""
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except ImportError:
        return dict(fields)
    out = BatchedDataDict()
    out.update(fields)
    return out


# Our per-step metric -> NeMo-RL's key, where the two are defined alike.
_SAME = {"ratio_mean": "probs_ratio", "ratio_min": "probs_ratio_min",
         "ratio_max": "probs_ratio_max", "is_weight_mean": "sampling_importance_ratio"}


def _nemo_metrics(steps: list[dict[str, float]], loss_cfg) -> dict[str, list[float]]:
    """One entry per global batch in NeMo-RL's convention (its loop sums the entries of most
    keys, so each entry is that global batch's value)."""
    out: dict[str, list[float]] = {}

    def put(key, value):
        out.setdefault(key, []).append(float(value))

    for s in steps:
        put("loss", s["policy_loss"])
        put("lr", s["lr"])
        put("global_valid_toks", s["loss_tokens"])
        put("global_valid_seqs", s["sequences"])
        put("num_valid_samples", s["sequences"])
        for ours, theirs in _SAME.items():
            if ours in s and not (loss_cfg.kind == "pg" and ours.startswith("ratio")):
                put(theirs, s[ours])
        if "kl" in s and loss_cfg.agg == "token-mean":  # NeMo-RL's kl_penalty: the loss's KL mean
            put("kl_penalty", s["kl"])
    return out
