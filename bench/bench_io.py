"""What the bench programs share: writing the results of `--out FILE`, the machine's compute
capabilities stated in them, and the compute dtype a bench runs in."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

DTYPE_CHOICES = ("auto", "bf16", "fp32")


def compute_dtype(setting: str = "auto"):
    """The ComputeDtype (longctx_moe.precision) of a CPU bench: `auto` is bf16 where the CPU has
    native bf16 and float32 elsewhere, as in training; `fp32` is no autocast."""
    from longctx_moe.precision import resolve_compute_dtype

    return resolve_compute_dtype("none" if setting == "fp32" else setting, torch.float32, "cpu")


def host_info() -> dict:
    """What decides a CPU bench's dtype and kernels: aten's vector ISA, native bf16 and why, and
    the AVX2 emulation switches if set."""
    from cp_attention.hardware import native_bf16

    native, why = native_bf16("cpu")
    env = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
           if k in os.environ}
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native,
            "native_bf16_reason": why, "isa_env": env, "torch": torch.__version__}


def write_json(path: str | None, result: dict, indent: int = 1) -> None:
    """`result` as JSON at `path`, its folder made if missing (a run of many minutes must not
    end in a missing directory), with the machine's `host` block; nothing when path is None."""
    if path:
        result = {**result, "host": result.get("host") or host_info()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=indent) + "\n")
