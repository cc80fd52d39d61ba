"""torch._scaled_mm as a GPU takes it, for tests that train through FP8 GEMMs on a CPU.

CPU's own _scaled_mm is a reference loop: a 256 x 128 x 128 product takes ~130 ms against ~0.4 ms
for the float32 matmul of the same operands (Xeon, one thread), so a few training steps of a tiny
FP8 model took a minute. The stand-in computes what the op documents, (a * scale_a) @ (b *
scale_b) with float32 accumulation, at float32-matmul speed; it differs from CPU's op only in the
order of the float32 sums (test_fp8.py checks the two agree to float32 rounding, and the kernel
tests there keep CPU's op against a float64 reference). Each call is first judged by torch's own
meta checks of _scaled_mm and by what cuBLAS's FP8 GEMM accepts and CPU's op does not check:
a row-major, b column-major, widths multiples of 16, float32 scalar scales, no E5M2 x E5M2."""

from __future__ import annotations

import torch

from longctx_moe.kernels.fp8 import E5M2

REAL = torch._scaled_mm  # CPU's op, bound at import: the stand-in below replaces the attribute


def check_cublas_operands(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                          scale_b: torch.Tensor) -> None:
    assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
    assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
    assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.numel() == scale_b.numel() == 1
    assert not (a.dtype == b.dtype == E5M2), "E5M2 x E5M2: cuBLAS has no such product"


def stand_in(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm(a, b, scale_a=, scale_b=, out_dtype=) of per-tensor scales, in float32."""
    check_cublas_operands(a, b, scale_a, scale_b)
    on_meta = [t.to("meta").as_strided(t.shape, t.stride()) for t in (a, b, scale_a, scale_b)]
    y = REAL(*on_meta, out_dtype=out_dtype)  # torch's own checks of the op's arguments
    out = (a.float() * scale_a) @ (b.float() * scale_b)
    assert out.shape == y.shape
    return out.to(out_dtype)


def install() -> None:
    """Replace torch._scaled_mm in this process (a test's rank) with the stand-in."""
    torch._scaled_mm = stand_in
