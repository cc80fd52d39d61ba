"""AdamW with fp32 master weights, the learning-rate schedule, and gradient clipping.

The parameters themselves are the master weights (fp32, or fp64 in exactness tests); bf16 exists
only inside autocast, so there is no separate master copy to keep in sync.
"""

from __future__ import annotations

import math

import torch

from longctx_moe.config import OptimConfig


def decay_groups(tensors: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """Decay matrices only: norms' gains, biases and the expert bias are 1-D and are not decayed.
    (A slab of the distributed optimizer keeps its parameter's ndim, so the rule holds for it.)"""
    decay = [t for t in tensors if t.ndim >= 2]
    no_decay = [t for t in tensors if t.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _impl_kwargs(impl: str, params: list[torch.Tensor]) -> dict:
    """Pick torch AdamW's implementation: fused (one kernel over all tensors) where available.

    Fused AdamW runs on CPU since torch 2.4 and on CUDA; when a dtype/device is unsupported the
    constructor raises and build_adamw falls back to foreach. It silently computes wrong updates
    for non-contiguous tensors (seen on torch 2.13 CPU), which the distributed optimizer's strided
    slabs are: "auto" takes foreach for those.
    """
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "for_loop":
        return {"foreach": False}
    devices = {p.device.type for p in params}
    fused_ok = devices <= {"cpu", "cuda"} and all(p.is_contiguous() for p in params)
    return {"fused": True} if fused_ok else {"foreach": True}


def build_adamw(tensors: list[torch.Tensor], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch AdamW over `tensors` (fp32/fp64 master weights, state in that dtype)."""
    groups = decay_groups(tensors, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, **kwargs, **_impl_kwargs(cfg.impl, tensors))
    except (RuntimeError, ValueError, TypeError):
        if cfg.impl != "auto":
            raise
        return torch.optim.AdamW(groups, **kwargs, foreach=True)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """The replicated optimizer: AdamW over every trainable parameter of `model`."""
    return build_adamw([p for p in model.parameters() if p.requires_grad], cfg)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then the schedule.

    Warmup reaches `cfg.lr` at step `warmup_steps - 1`; cosine/linear decay to
    `cfg.lr * min_lr_ratio` at the last step `total_steps - 1`.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    low = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - low) * progress
    return low + (cfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets the optimizer's learning rate for each step; its state is the next step index."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
        self.optimizer, self.cfg, self.total_steps = optimizer, cfg, total_steps
        self.step_index = 0

    def apply(self) -> float:
        """Set the lr of every param group for the coming optimizer step; return it."""
        lr = lr_at(self.step_index, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def advance(self) -> None:
        self.step_index += 1

    def state_dict(self) -> dict:
        return {"step_index": self.step_index}

    def load_state_dict(self, state: dict) -> None:
        self.step_index = int(state["step_index"])


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (fp32 scalar tensor); scale them down to `max_norm` if
    `max_norm > 0`. The one-rank form (ParallelRuntime.clip_grad_norm on a world of 1): it sums no
    partial norms of sharded parameters, which longctx_moe.parallel.grad_reduce.clip_grad_norm
    does on a larger mesh."""
    grads = [p for p in params if p.grad is not None]
    limit = max_norm if max_norm > 0 else float("inf")
    return torch.nn.utils.clip_grad_norm_(grads, limit, foreach=True)
