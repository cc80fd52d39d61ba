"""What this machine computes natively, asked once: bf16 on the CPU, and the switch that emulates a
CPU without it.

Why it matters: on an x86-64 CPU without AVX512-BF16 or AMX (AVX2-only cloud VMs, laptops, CI
runners) oneDNN has no bf16 GEMM kernel and falls back to a reference loop: a 512^3 bf16 matmul
runs 20-30x slower than float32 there (1.5 vs 41.8 GFLOP/s measured on a 2-core AVX2 EPYC VM).
The compute dtype (longctx_moe.precision) and the C++ kernels (cp_attention/native.py) both
follow `native_bf16()`.

The AVX2 path runs on an AVX512 machine with two of torch's environment variables, set before the
process starts (the Makefile's `train-avx2` / `test-avx2` targets set them):
  ONEDNN_MAX_CPU_ISA=AVX2      oneDNN dispatches as on an AVX2 CPU (its bf16 GEMMs become slow)
  ATEN_CPU_CAPABILITY=avx2     aten's vectorised kernels are the AVX2 builds
Our probes then answer as on an AVX2 CPU (no native bf16, no C++ kernels): they ask torch which
kernels it dispatches to, never a variable of our own.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch


def aten_capability() -> str:
    """The instruction set aten's vectorised CPU kernels were dispatched for (AVX512, AVX2, ...):
    the CPU's own, or less where ATEN_CPU_CAPABILITY capped it."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def _native_cpu_bf16() -> tuple[bool, str]:
    flags = _cpuinfo_flags()
    has_isa = "avx512_bf16" in flags or "amx_bf16" in flags
    capability = aten_capability()
    if has_isa and not capability.startswith("AVX512"):
        return False, f"aten's CPU kernels run the {capability} build (the AVX2 path: no native bf16)"
    # oneDNN's own answer: it also honours ONEDNN_MAX_CPU_ISA, and covers CPUs whose flags
    # /proc/cpuinfo does not show (non-Linux).
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if onednn and (has_isa or not flags):
        isa = "AMX" if "amx_bf16" in flags else "AVX512-BF16"
        return True, f"the CPU has native bf16 ({isa}, oneDNN bf16 GEMMs)"
    if has_isa:
        return False, "oneDNN's bf16 GEMMs are capped below the CPU's bf16 instructions (ONEDNN_MAX_CPU_ISA)"
    return False, "the CPU has no native bf16 (no AVX512-BF16 or AMX: bf16 matmuls run 20-30x slower than float32)"


def native_bf16(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """(whether bf16 matmuls run at full speed on `device`, the reason in words)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return True, f"CUDA device {torch.cuda.get_device_name(device)} computes bf16 natively"
        return False, f"CUDA device {torch.cuda.get_device_name(device)} has no bf16 (pre-Ampere)"
    if device.type != "cpu":
        return False, f"no bf16 rule for device type {device.type}"
    return _native_cpu_bf16()


def cpu_has_avx512_bf16() -> bool:
    """The C++ attention kernels' probe: AVX512-BF16 with BW/VL intrinsics, oneDNN's bf16 brgemm
    usable, and the AVX2 switch off."""
    flags = _cpuinfo_flags()
    return (all(f in flags for f in ("avx512_bf16", "avx512bw", "avx512vl"))
            and native_bf16("cpu")[0])
