"""Adapter for the fused CPU RMSNorm (`_cpu_rmsnorm.cpp`), built on first use.

model.layers._RMSNormFn's torch path makes ~8 elementwise passes over its [N, D] rows each way
(squares, a mean, products with the scale and the weight, float32 copies of bf16 inputs and the
casts back): on a CPU the norms of a step (two per layer, plus q / k norms) cost about as much as
a fifth of its GEMMs. The kernel reads each row once to sum its squares and once more to write
the output, and the backward likewise, with the same float32 arithmetic (only the order of each
row's sum differs).

It serves float32 and bf16 rows (float64 stays on torch: the exactness tests' reference) on CPUs
with AVX512 where cp_attention's builder builds its kernels (~15 s the first time, cached on
disk); a failed build or self-check warns once and leaves the norm on torch.
`LONGCTX_CPU_RMSNORM=0` turns it off (the benchmarks compare the two with `disabled()`).
Shape legend: N rows, D normalised features.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cp_attention.kernels._cpp_kernel import CppKernel

ENV = "LONGCTX_CPU_RMSNORM"
_DTYPES = (torch.float32, torch.bfloat16)


def _self_check(mod) -> None:
    """Raise if the kernel disagrees with float64 maths on a few rows (a vector tail included):
    a wrong build must cost a warning, not a run. The reference is the closed form (the first
    use may come inside no_grad or inference mode, where autograd cannot run)."""
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(5, 37, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(37, generator=g, dtype=torch.float64)
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    xh, gw = x * r, dy * w
    refs = (xh * w, r * (gw - xh * (gw * xh).mean(-1, keepdim=True)), (dy * xh).sum(0))
    y, r32 = mod.rmsnorm_forward(x.float(), w.float(), 1e-6, torch.float32)
    dx, dw = mod.rmsnorm_backward(dy.float(), x.float(), w.float(), r32)
    for got, ref in zip((y, dx, dw), refs, strict=True):
        if not torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5):
            raise RuntimeError("self-check against float64 maths failed")


KERNEL = CppKernel(str(Path(__file__).with_name("_cpu_rmsnorm.cpp")), "longctx_cpu_rmsnorm_", ENV,
                   "fused CPU RMSNorm", "torch's RMSNorm ops", _self_check)
available, disabled = KERNEL.available, KERNEL.disabled


def serves(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the kernel runs this norm: float32 / bf16 rows on the CPU, where it built."""
    # under torch.compile the torch path is traced and fused instead (an extension call would
    # break the graph)
    return (x.device.type == "cpu" and x.dtype in _DTYPES and out_dtype in _DTYPES
            and not torch.compiler.is_compiling() and available())


def forward(x_ND: torch.Tensor, w_D: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """(y_ND in out_dtype, r_N float32)."""
    with torch.profiler.record_function("longctx_moe::cpu_rmsnorm"):
        return KERNEL.module().rmsnorm_forward(x_ND.contiguous(), w_D.float().contiguous(), float(eps), out_dtype)


def backward(g_ND: torch.Tensor, x_ND: torch.Tensor, w_D: torch.Tensor, r_N: torch.Tensor):
    """(dx_ND in x's dtype, dw_D float32); g is cast to float32 if it is neither dtype served."""
    g = g_ND if g_ND.dtype in _DTYPES else g_ND.float()
    with torch.profiler.record_function("longctx_moe::cpu_rmsnorm_backward"):
        return KERNEL.module().rmsnorm_backward(g.contiguous(), x_ND.contiguous(), w_D.float().contiguous(),
                                                r_N.contiguous())
