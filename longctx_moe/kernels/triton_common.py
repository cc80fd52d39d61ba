"""Device functions shared by the Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even as torch does. The GPU converts fp32 -> bf16 that
    way, but Triton's interpreter (3.9) truncates, so bf16 is formed from the fp32 bits: add half
    an ulp (minus one when the kept bit is even) and drop the low 16 bits. The same result on
    both; Inf and NaN stay Inf and NaN."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
