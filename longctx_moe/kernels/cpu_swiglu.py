"""Adapter for the fused CPU SwiGLU of the experts (`cp_attention/csrc/swiglu.cpp`).

model.experts._SwiGLUDown keeps only h = [gate | up] for its backward and recomputes the activation
there. On a CPU its torch path is two elementwise passes forward (silu, the product) and five
backward (silu and the product again, two more products, silu_backward), each writing a fresh
[M, F] tensor: on the bench/verl_engine.py batch, ~8.5 ms of every 16,384-row backward against
2.7 ms for the kernel's single pass. The kernel keeps the torch path's float32 arithmetic and its
roundings to the rows' dtype, so the two agree bitwise where aten vectorises whole rows (widths
of a multiple of 64 in bf16, 32 in float32: every model here) and within a few roundings elsewhere.

It serves float32 and bf16 rows (float64 stays on torch: the exactness tests' reference) on CPUs
with AVX512-BF16, as part of cp_attention's native extension (cp_attention.native: built on first
use, cached on disk); a failed build or self-check warns once and leaves the activation on torch.
`available()` is whether it is built and self-checked here; `disabled()` runs a block on torch.
Shape legend: M expert rows, F expert hidden features.
"""

from __future__ import annotations

import torch

from cp_attention import native

KERNEL = "swiglu"  # its name in cp_attention.native
_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return native.unavailable_reason(KERNEL) is None


def disabled():
    """A context: torch's SwiGLU ops for the block."""
    return native.disabled(KERNEL)


def serves(h_MF2: torch.Tensor) -> bool:
    """Whether the kernel runs the activation of these rows: float32 / bf16 on the CPU, where it
    built, outside torch.compile (which traces and fuses the torch path itself)."""
    return (h_MF2.device.type == "cpu" and h_MF2.dtype in _DTYPES and not torch.compiler.is_compiling()
            and available())


def forward(h_MF2: torch.Tensor) -> torch.Tensor:
    """act_MF = silu(gate) * up for h = [gate | up]."""
    with torch.profiler.record_function("longctx_moe::cpu_swiglu"):
        return native.kernel(KERNEL).swiglu_forward(h_MF2.contiguous())


def backward(h_MF2: torch.Tensor, dact_MF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(act_MF recomputed, dh_MF2 = [d gate | d up]) for the activation's gradient dact."""
    with torch.profiler.record_function("longctx_moe::cpu_swiglu_backward"):
        return native.kernel(KERNEL).swiglu_backward(h_MF2.contiguous(), dact_MF.to(h_MF2.dtype).contiguous())
