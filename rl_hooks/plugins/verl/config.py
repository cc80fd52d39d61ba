"""The verl-side settings of the longctx_moe engine, and their translation into our Config.

verl builds an engine from three dataclasses (verl/workers/config): the HF model, the engine and
the optimizer. `LongctxMoeEngineConfig` is verl's `EngineConfig` with `strategy: longctx_moe` and
the path of our own YAML (model.*, parallel.*, train.*: the parallel layout TP x CP x DP with EP
comes from there); `LongctxMoeOptimizerConfig` is verl's `OptimizerConfig` plus the schedule
keys our optimizer has. `build_config` merges them: the HF folder becomes train.init_from (its
config.json fills model.*; a YAML value that contradicts it is refused), verl's optimizer keys
become optim.*.

verl settings with no meaning for this engine are refused at start-up (`check_engine_config`),
never accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl.workers.config import EngineConfig, OptimizerConfig

from longctx_moe.config import Config, ConfigError, load_config

STRATEGY = "longctx_moe"
SCHEDULES = ("constant", "cosine", "linear")
EXPORT_DTYPES = ("bfloat16", "float32", "float64")


@dataclass
class LongctxMoeEngineConfig(EngineConfig):
    """`strategy: longctx_moe`; `config`: our YAML; `overrides`: dotted `key=value` on top of it;
    `export_dtype`: the dtype of the weights get_per_tensor_param streams to the rollout engine."""

    strategy: str = STRATEGY
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    export_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.strategy != STRATEGY:
            raise ConfigError(f"LongctxMoeEngineConfig.strategy={self.strategy!r}: this config "
                              f"selects the {STRATEGY} engine; set strategy: {STRATEGY}")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(f"engine export_dtype={self.export_dtype!r}: choose one of "
                              f"{', '.join(EXPORT_DTYPES)}")


@dataclass
class LongctxMoeOptimizerConfig(OptimizerConfig):
    """verl's optimizer keys (lr, betas, weight_decay, clip_grad, warm-up, total steps) plus
    ours: `lr_scheduler_type` constant | cosine | linear (after the linear warm-up),
    `min_lr_ratio` (where cosine / linear end), `eps` (AdamW)."""

    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0
    eps: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        if self.lr_scheduler_type not in SCHEDULES:
            raise ConfigError(f"optim lr_scheduler_type={self.lr_scheduler_type!r}: choose one of "
                              f"{', '.join(SCHEDULES)}")


def check_engine_config(engine) -> None:
    """Refuse, in one line each, the verl engine settings this engine cannot honour."""
    refusals = {
        "use_dynamic_bsz": (engine.use_dynamic_bsz is False, "micro-batches are packed by tokens; "
                            "set use_dynamic_bsz: true and max_token_len_per_gpu"),
        "param_offload": (engine.param_offload and _on_gpu(),
                          "offloading a GPU run's parameters is not implemented; set it false"),
        "optimizer_offload": (engine.optimizer_offload and _on_gpu(),
                              "offloading a GPU run's optimizer is not implemented; set it false"),
        "router_replay.mode": (engine.router_replay.mode != "disabled",
                               "router replay through this engine is not implemented; use "
                               "PolicyTrainer with routed_experts, or set it to disabled"),
        "full_determinism": (engine.full_determinism, "the engine is deterministic on CPU and "
                             "batch-invariant by construction; set it false"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(f"engine {key}: {why}")


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _schedule_overrides(optim: OptimizerConfig) -> list[str]:
    total = int(optim.total_training_steps)
    kind = getattr(optim, "lr_scheduler_type", "constant")
    warmup = optim.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * max(total, 0))
    if total <= 0 and (kind != "constant" or warmup > 0):
        raise ConfigError(f"optim total_training_steps={total}: the {kind} schedule with {warmup} "
                          "warm-up steps needs the run's step count; set total_training_steps")
    return [f"optim.schedule={kind}", f"optim.warmup_steps={warmup}",
            f"train.steps={max(total, 1)}",
            f"optim.min_lr_ratio={getattr(optim, 'min_lr_ratio', 0.0)}"]


def optimizer_overrides(optim: OptimizerConfig) -> list[str]:
    """verl's optimizer keys as our optim.* / train.steps overrides."""
    betas = list(optim.betas)
    return [f"optim.lr={optim.lr}", f"optim.betas=[{betas[0]}, {betas[1]}]",
            f"optim.weight_decay={optim.weight_decay}", f"optim.grad_clip={optim.clip_grad}",
            f"optim.eps={getattr(optim, 'eps', 1e-8)}", *_schedule_overrides(optim)]


def build_config(model_path: str, engine: LongctxMoeEngineConfig,
                 optim: OptimizerConfig | None) -> Config:
    """Our Config: engine.config's YAML, verl's optimizer keys, the HF weights, the overrides
    (last, so a user's explicit key wins)."""
    if not engine.config:
        raise ConfigError("engine config: empty; set it to a longctx-moe YAML (the HF model's "
                          "config.json fills model.*), e.g. configs/from_pretrained.yaml")
    sets = [f"train.init_from={model_path}"]
    if optim is not None and not engine.forward_only:
        sets += optimizer_overrides(optim)
    return load_config(engine.config, sets + list(engine.overrides))
