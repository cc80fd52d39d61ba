"""Grouped GEMM over experts: y[rows of expert e] = x[rows of expert e] @ w[e].

`torch._grouped_mm` runs forward and backward for fp32/bf16 on CPU and GPU (torch >= 2.9); where it
is missing, for float64, or for strides it rejects (rows must be 16-byte aligned), we loop over the
experts. The capability is probed once per (device type, dtype) and cached.

Shapes: M rows sorted by expert, D in features, F out features, E experts.
"""

from __future__ import annotations

import functools

import torch

IMPLS = ("auto", "grouped_mm", "loop")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: `_grouped_mm`'s backward
    rejects expanded or strided grad_outputs (e.g. the one `y.sum().backward()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """True when torch._grouped_mm runs forward and backward for this device type and dtype."""
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        x = torch.randn(8, 8, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([3, 8], device=device_type, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def resolve_impl(impl: str, x_MD: torch.Tensor, w_EDF: torch.Tensor) -> str:
    """The implementation `grouped_matmul` will use for these operands (raises for a bad request)."""
    if impl not in IMPLS:
        raise ValueError(f"model.grouped_gemm={impl!r} is not one of {list(IMPLS)}")
    usable = grouped_mm_works(x_MD.device.type, x_MD.dtype) and _aligned(x_MD, w_EDF)
    if impl == "grouped_mm" and not usable:
        raise ValueError(f"model.grouped_gemm='grouped_mm' cannot run {x_MD.dtype} on {x_MD.device.type} "
                         f"with D={x_MD.shape[-1]}, F={w_EDF.shape[-1]} (needs torch._grouped_mm, "
                         "fp32/bf16 and 16-byte rows); use grouped_gemm='auto'")
    return "grouped_mm" if impl == "grouped_mm" or (impl == "auto" and usable) else "loop"


def grouped_matmul(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
                   impl: str = "auto") -> torch.Tensor:
    """y_MF: rows sorted by expert, counts_E (int64 [E]) rows per expert; experts may have 0 rows.

    x and w must share a dtype (callers cast once per forward). Returns x's dtype."""
    if resolve_impl(impl, x_MD, w_EDF) == "grouped_mm":
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x_MD, w_EDF, offs=offs_E))
    # Loop fallback (float64 tests, old torch): one GEMM per expert; the host sync is the price.
    pieces = torch.split(x_MD, counts_E.tolist())
    return torch.cat([p @ w_EDF[e] for e, p in enumerate(pieces)])
