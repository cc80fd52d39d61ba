"""Adapter for the fused CPU RMSNorm (`cp_attention/csrc/rmsnorm.cpp`).

model.layers._RMSNormFn's torch path makes ~8 elementwise passes over its [N, D] rows each way
(squares, a mean, products with the scale and the weight, float32 copies of bf16 inputs and the
casts back): on a CPU the norms of a step (two per layer, plus q / k norms) cost about as much as
a fifth of its GEMMs. The kernel reads each row once to sum its squares and once more to write
the output, and the backward likewise, with the same float32 arithmetic (only the order of each
row's sum differs).

It serves float32 and bf16 rows (float64 stays on torch: the exactness tests' reference) on CPUs
with AVX512-BF16, as part of cp_attention's native extension (cp_attention.native: built on first
use, cached on disk); a failed build or self-check warns once and leaves the norm on torch.
`available()` is whether it is built and self-checked here; `disabled()` runs a block on torch
(the benchmarks compare the two with it).
Shape legend: N rows, D normalised features.
"""

from __future__ import annotations

import torch

from cp_attention import native

KERNEL = "rmsnorm"  # its name in cp_attention.native
_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return native.unavailable_reason(KERNEL) is None


def disabled():
    """A context: torch's RMSNorm ops for the block."""
    return native.disabled(KERNEL)


def serves(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the kernel runs this norm: float32 / bf16 rows on the CPU, where it built."""
    # under torch.compile the torch path is traced and fused instead (an extension call would
    # break the graph)
    return (x.device.type == "cpu" and x.dtype in _DTYPES and out_dtype in _DTYPES
            and not torch.compiler.is_compiling() and available())


def forward(x_ND: torch.Tensor, w_D: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """(y_ND in out_dtype, r_N float32)."""
    with torch.profiler.record_function("longctx_moe::cpu_rmsnorm"):
        return native.kernel(KERNEL).rmsnorm_forward(x_ND.contiguous(), w_D.float().contiguous(), float(eps), out_dtype)


def backward(g_ND: torch.Tensor, x_ND: torch.Tensor, w_D: torch.Tensor, r_N: torch.Tensor):
    """(dx_ND in x's dtype, dw_D float32); g is cast to float32 if it is neither dtype served."""
    g = g_ND if g_ND.dtype in _DTYPES else g_ND.float()
    with torch.profiler.record_function("longctx_moe::cpu_rmsnorm_backward"):
        return native.kernel(KERNEL).rmsnorm_backward(g.contiguous(), x_ND.contiguous(),
                                                      w_D.float().contiguous(), r_N.contiguous())
