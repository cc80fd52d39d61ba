"""The dtype a run computes in: `train.autocast_dtype` resolved once against the device.

`auto` (the default) autocasts to bf16 where the device computes bf16 natively (CUDA from Ampere
on; a CPU with AVX512-BF16 or AMX, as oneDNN reports it) and computes in the parameters' own dtype
elsewhere: on an AVX2-only CPU a bf16 matmul runs 20-30x slower than float32
(cp_attention.hardware), so bf16 there would turn a one-minute run into half an hour. float64
parameters (the exactness tests) always compute in float64. An explicit `bf16` / `fp16` is obeyed
everywhere, with a one-line warning where the device runs it slowly.
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
