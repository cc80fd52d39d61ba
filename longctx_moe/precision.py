"""The dtype a run computes in: `train.autocast_dtype` resolved once against the device.

`auto` (the default) autocasts to bf16 where the device computes bf16 natively (CUDA from Ampere
on; a CPU with AVX512-BF16 or AMX, as oneDNN reports it) and computes in the parameters' own dtype
elsewhere: on an AVX2-only CPU a bf16 matmul runs 20-30x slower than float32
(cp_attention.hardware), so bf16 there would turn a one-minute run into half an hour. float64
parameters (the exactness tests) always compute in float64. An explicit `bf16` / `fp16` is obeyed
everywhere, with a one-line warning where the device runs it slowly.

`train.param_dtype=bf16` holds the weights that autocast casts to bf16 (linear and expert
weights) in bf16 (`cast_params`); the fp32 master weights then live in the optimizer
(optim.MasterAdamW). Such a run always autocasts to bf16 (`auto` too, with the slowdown warning
where bf16 is emulated): its weights are bf16 whatever the device, and autocast keeps the ops it
runs in fp32 (norms, softmax, losses) in fp32, so the forward is today's autocast forward.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from cp_attention.hardware import native_bf16

AUTOCAST_CHOICES = ("auto", "bf16", "fp16", "none")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True)
class ComputeDtype:
    """`autocast`: the autocast dtype, or None (matmuls in `param_dtype`); `setting`: the value
    it was resolved from; `reason`: why, in words; `slow`: an explicit low precision that this
    device emulates."""

    autocast: torch.dtype | None
    param_dtype: torch.dtype
    setting: str
    reason: str
    slow: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The dtype matmuls run in."""
        return self.autocast or self.param_dtype

    @property
    def name(self) -> str:
        return _NAMES[self.dtype]

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast)

    def describe(self) -> str:
        return f"compute dtype: {self.name} (train.autocast_dtype={self.setting}: {self.reason})"


def _native_fp16(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def resolve_compute_dtype(setting: str, param_dtype: torch.dtype,
                          device: torch.device | str) -> ComputeDtype:
    """`setting` is train.autocast_dtype (auto | bf16 | fp16 | none)."""
    device = torch.device(device)
    if setting == "none":
        return ComputeDtype(None, param_dtype, setting, "no autocast: matmuls in the parameters' dtype")
    if setting == "auto":
        if param_dtype == torch.bfloat16:
            native, why = native_bf16(device)
            return ComputeDtype(torch.bfloat16, param_dtype, setting,
                                "bf16 parameters compute in bf16" + ("" if native else f", although {why}"),
                                slow=not native)
        if param_dtype == torch.float64:
            return ComputeDtype(None, param_dtype, setting, "float64 parameters compute in float64")
        native, why = native_bf16(device)
        return ComputeDtype(torch.bfloat16 if native else None, param_dtype, setting, why)
    if setting not in _DTYPES:
        raise ValueError(f"train.autocast_dtype={setting!r} is not one of {', '.join(AUTOCAST_CHOICES)}")
    if setting == "bf16":
        native, why = native_bf16(device)
    else:
        native = _native_fp16(device)
        why = "fp16 GEMMs are native here" if native else "the CPU has no native fp16 (AMX-FP16)"
    reason = "as configured" if native else f"as configured, although {why}"
    return ComputeDtype(_DTYPES[setting], param_dtype, setting, reason, slow=not native)


def announce(compute: ComputeDtype, rank: int) -> None:
    """Print the choice once per run (rank 0), and the slowdown warning for an emulated dtype."""
    if rank != 0:
        return
    print(compute.describe(), flush=True)
    if compute.slow:
        print(f"warning: train.autocast_dtype={compute.setting} is emulated on this device: expect "
              f"its matmuls to run 20-30x slower than float32; train.autocast_dtype=auto picks the "
              f"fast dtype", file=sys.stderr, flush=True)


PARAM_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


def low_precision_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters `train.param_dtype=bf16` holds in bf16: those of 2+ dims that autocast
    casts to bf16 before its matmuls (attention and MLP projections, the LM head, the experts).
    The embedding (its output is the fp32 residual stream), the router (its logits are computed
    in fp32), norm gains and biases stay fp32: with them in bf16 the forward would compute on
    rounded values where today's computes on the fp32 ones."""
    from longctx_moe.model.moe import Router

    keep = {id(p) for m in model.modules() if isinstance(m, (torch.nn.Embedding, Router))
            for p in m.parameters(recurse=False)}
    return [p for p in model.parameters() if p.ndim >= 2 and id(p) not in keep]


def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its parameters and floating buffers in `dtype`; for bf16, the parameters of
    `low_precision_params` in bf16 and the rest (buffers included) in float32."""
    if dtype != torch.bfloat16:
        return model.to(dtype=dtype)
    model.to(dtype=torch.float32)
    with torch.no_grad():
        for p in low_precision_params(model):
            p.data = p.data.to(torch.bfloat16)
    return model
