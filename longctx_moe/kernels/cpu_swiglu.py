"""Adapter for the fused CPU SwiGLU of the experts (`_cpu_swiglu.cpp`), built on first use.

model.moe._SwiGLUDown keeps only h = [gate | up] for its backward and recomputes the activation
there. On a CPU its torch path is two elementwise passes forward (silu, the product) and five
backward (silu and the product again, two more products, silu_backward), each writing a fresh
[M, F] tensor: on the bench/verl_engine.py batch, ~8.5 ms of every 16,384-row backward against
2.7 ms for the kernel's single pass. The kernel keeps the torch path's float32 arithmetic and its
roundings to the rows' dtype, so the two agree bitwise where aten vectorises whole rows (widths
of a multiple of 64 in bf16, 32 in float32: every model here) and within a few roundings elsewhere.

It serves float32 and bf16 rows (float64 stays on torch: the exactness tests' reference) on CPUs
with AVX512 where cp_attention's builder builds its kernels (~15 s the first time, cached on
disk); a failed build or self-check warns once and leaves the activation on torch.
`LONGCTX_CPU_SWIGLU=0` turns it off. Shape legend: M expert rows, F expert hidden features.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cp_attention.kernels._cpp_kernel import CppKernel

ENV = "LONGCTX_CPU_SWIGLU"
_DTYPES = (torch.float32, torch.bfloat16)


def _self_check(mod) -> None:
    """Raise if the kernel disagrees with float64 maths on a few rows (a vector tail included):
    a wrong build must cost a warning, not a run. The reference is the closed form (the first
    use may come inside no_grad, where autograd cannot run)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 2 * 37, generator=g, dtype=torch.float64) * 3
    dact = torch.randn(5, 37, generator=g, dtype=torch.float64)
    gate, up = h.chunk(2, -1)
    s = torch.sigmoid(gate)
    act = gate * s * up
    dh = torch.cat([dact * up * s * (1 + gate * (1 - s)), dact * gate * s], -1)
    got = (mod.swiglu_forward(h.float()), *mod.swiglu_backward(h.float(), dact.float()))
    for x, ref in zip(got, (act, act, dh), strict=True):
        if not torch.allclose(x.double(), ref, rtol=1e-5, atol=1e-5):
            raise RuntimeError("self-check against float64 maths failed")


KERNEL = CppKernel(str(Path(__file__).with_name("_cpu_swiglu.cpp")), "longctx_cpu_swiglu_", ENV,
                   "fused CPU SwiGLU", "torch's SwiGLU ops", _self_check)
available, disabled = KERNEL.available, KERNEL.disabled


def serves(h_MF2: torch.Tensor) -> bool:
    """Whether the kernel runs the activation of these rows: float32 / bf16 on the CPU, where it
    built, outside torch.compile (which traces and fuses the torch path itself)."""
    return (h_MF2.device.type == "cpu" and h_MF2.dtype in _DTYPES and not torch.compiler.is_compiling()
            and available())


def forward(h_MF2: torch.Tensor) -> torch.Tensor:
    """act_MF = silu(gate) * up for h = [gate | up]."""
    with torch.profiler.record_function("longctx_moe::cpu_swiglu"):
        return KERNEL.module().swiglu_forward(h_MF2.contiguous())


def backward(h_MF2: torch.Tensor, dact_MF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(act_MF recomputed, dh_MF2 = [d gate | d up]) for the activation's gradient dact."""
    with torch.profiler.record_function("longctx_moe::cpu_swiglu_backward"):
        return KERNEL.module().swiglu_backward(h_MF2.contiguous(), dact_MF.to(h_MF2.dtype).contiguous())
