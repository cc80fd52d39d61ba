"""AdamW with fp32 master weights, the learning-rate schedule, and gradient clipping.

With train.param_dtype fp32 (or fp64 in exactness tests) the parameters themselves are the master
weights and bf16 exists only inside autocast. With bf16 the model holds its matmul weights in bf16
and `MasterAdamW` keeps their fp32 masters: AdamW updates the masters (state in fp32), and each
step ends by rounding them into the bf16 weights, the values autocast would have cast them to.
Under the distributed optimizer the tensors are this rank's slabs, so each rank holds the masters
of its slabs only. With optim.offload=cpu the masters and AdamW's state live in host memory and
the update runs there (optim_offload.HostAdamW, a MasterAdamW).
"""

from __future__ import annotations

import math

import torch
from torch.utils import _foreach_utils

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

    Fused AdamW runs on the devices torch lists as having its kernels (CPU since torch 2.4, CUDA);
    "auto" asks that list, so a device is judged as torch's own optimizer judges it. When a dtype
    is unsupported the constructor raises and build_adamw falls back to foreach. It silently
    computes wrong updates for non-contiguous tensors (seen on torch 2.13 CPU), which the
    distributed optimizer's strided slabs are: "auto" takes foreach for those.
    """
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "for_loop":
        return {"foreach": False}
    devices = {p.device.type for p in params}
    fused_ok = (devices <= set(_foreach_utils._get_fused_kernels_supported_devices())
                and all(p.is_contiguous() for p in params))
    return {"fused": True} if fused_ok else {"foreach": True}


LOW_PRECISION = (torch.bfloat16, torch.float16)


def build_adamw(tensors: list[torch.Tensor], cfg: OptimConfig):
    """torch AdamW over `tensors` (fp32/fp64 master weights, state in that dtype), or a
    MasterAdamW where some of them are bf16, or with optim.offload=cpu a HostAdamW (masters and
    state in host memory, optim_offload.py)."""
    if cfg.offload == "cpu":
        from longctx_moe.optim_offload import HostAdamW

        return HostAdamW(tensors, cfg)
    if any(t.dtype in LOW_PRECISION for t in tensors):
        return MasterAdamW(tensors, cfg)
    return _adamw(tensors, cfg)


def _adamw(tensors: list[torch.Tensor], cfg: OptimConfig) -> torch.optim.AdamW:
    groups = decay_groups(tensors, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    try:
        return torch.optim.AdamW(groups, **kwargs, **_impl_kwargs(cfg.impl, tensors))
    except (RuntimeError, ValueError, TypeError):
        if cfg.impl != "auto":
            raise
        return torch.optim.AdamW(groups, **kwargs, foreach=True)


class MasterAdamW:
    """AdamW over fp32 master copies of the bf16 tensors among `tensors` (the fp32 ones are their
    own masters). To the trainer, the schedule and checkpoints it is a torch optimizer whose
    parameters are the masters: `param_groups`, `state` (with each master under the field
    "master", so a checkpoint saves it by the parameter's global slice), `step`, `zero_grad`,
    `state_dict`, `load_state_dict`; `param_of` / `master_of` map between a master and the
    model's tensor.

    A master's gradient is the fp32 one a reduction left on it (the distributed optimizer's
    reduce-scatter writes there), else its model tensor's bf16 gradient, widened at `step`."""

    def __init__(self, tensors: list[torch.Tensor], cfg: OptimConfig):
        self.tensors = list(tensors)
        self.masters = [self._master(t) for t in self.tensors]
        self._param_of = {id(m): t for t, m in zip(self.tensors, self.masters, strict=True)}
        self._master_of = {id(t): m for t, m in zip(self.tensors, self.masters, strict=True)}
        self.optimizer = _adamw(self.masters, cfg)

    def _master(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor AdamW updates for `t`: an fp32 copy of a bf16 one, else `t` itself."""
        return t.detach().to(torch.float32, copy=True) if t.dtype in LOW_PRECISION else t

    def param_of(self, master: torch.Tensor) -> torch.Tensor:
        return self._param_of.get(id(master), master)

    def master_of(self, t: torch.Tensor) -> torch.Tensor:
        return self._master_of.get(id(t), t)

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model tensor, its separate master), in the optimizer's order."""
        return [(self.param_of(m), m) for g in self.param_groups for m in g["params"]
                if self.param_of(m) is not m]

    @staticmethod
    def _saves_master(t: torch.Tensor) -> bool:
        """Whether the state carries the master of model tensor `t`: where the model holds a
        rounded copy (bf16). An fp32 tensor is itself the master a checkpoint keeps."""
        return t.dtype in LOW_PRECISION

    @property
    def param_groups(self) -> list[dict]:
        # The inner optimizer's current list: its load_state_dict replaces the list it had.
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        out = dict(self.optimizer.state)
        for t, m in self._pairs():
            if self._saves_master(t):
                out[m] = {**out.get(m, {}), "master": m}
        return out

    @torch.no_grad()
    def step(self) -> None:
        pairs = self._pairs()
        for t, m in pairs:
            if m.grad is None and t.grad is not None:
                m.grad = t.grad.to(torch.float32)
        self.optimizer.step()
        for t, m in pairs:
            t.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for t in self.tensors:
            t.grad = None

    def state_dict(self) -> dict:
        sd = self.optimizer.state_dict()
        masters = [m for g in self.param_groups for m in g["params"]]
        for i, m in enumerate(masters):
            if self.param_of(m) is not m and self._saves_master(self.param_of(m)):
                sd["state"][i] = {**sd["state"].get(i, {}), "master": m}
        return sd

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """torch's form; an entry's "master" (required for every bf16 tensor) is copied into
        the master and rounded into the model's tensor. A separate master of an fp32 tensor
        (HostAdamW's host copy) takes the entry's "master" where given, else the tensor."""
        masters = [m for g in self.param_groups for m in g["params"]]
        inner = {}
        for i, m in enumerate(masters):
            entry = dict(state["state"].get(i, {}))
            value = entry.pop("master", None)
            t = self.param_of(m)
            if t is not m:
                if value is None and self._saves_master(t):
                    raise ValueError(f"optimizer state lacks the fp32 master of tensor {i} "
                                     f"{tuple(m.shape)}; train.param_dtype=bf16 resumes from a "
                                     "checkpoint that holds its masters")
                m.copy_(t if value is None else value)
                t.copy_(m)
            if entry:
                inner[i] = entry
        self.optimizer.load_state_dict({**state, "state": inner})


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig):
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
    if not any(p.grad.dtype in LOW_PRECISION for p in grads):
        return torch.nn.utils.clip_grad_norm_(grads, limit, foreach=True)
    # bf16 gradients: the norm summed in fp32 (torch's would be rounded to bf16)
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in grads]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    torch.nn.utils.clip_grads_with_norm_(grads, limit, total, foreach=True)
    return total
