"""MoE token permute / unpermute in Triton, for any row layout of the routed copies.

A layout is `slot_TK` (int64 [T, K]): the row, among P rows, that copy k of token t occupies.
The dispatcher's layout sorts the copies by expert (ties in token order) and may pad each
expert's rows for the grouped GEMM (longctx_moe.model.grouped_gemm.pad_layout); rows no copy
occupies are zeros on the way in and are never read on the way out.

    permute(x_TD, slot_TK, P, dtype) -> x_PD      x_PD[slot[t, k]] = x[t] (cast to dtype)
    unpermute(y_PD, slot_TK, w_TK) -> y_TD        y[t] = sum_k w[t, k] * y_PD[slot[t, k]]

Both backwards gather by token (no atomics, so they are deterministic): permute's sums the K
copies' gradients in fp32; unpermute's writes w * g to each copy's row and dot(g, y) to w.
Legend: T tokens, K top-k, D model dim, P permuted (padded) rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx_moe.kernels.triton_common import cast_rne

_BLOCK_T, _BLOCK_D = 16, 256  # a program moves a [16, 256] tile (rows of a 4-7K model dim: a few)


@triton.jit
def _scatter_kernel(x_ptr, slot_ptr, out_ptr, T, D, K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = rows < T
    mask = ok[:, None] & (cols[None, :] < D)
    tile = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask)
    tile = cast_rne(tile, out_ptr.dtype.element_ty)
    for k in tl.static_range(K):
        slot = tl.load(slot_ptr + rows * K + k, mask=ok, other=0)
        tl.store(out_ptr + slot[:, None] * D + cols[None, :], tile, mask=mask)


@triton.jit
def _gather_kernel(src_ptr, slot_ptr, w_ptr, out_ptr, T, D, K: tl.constexpr, HAS_W: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_k (w[t, k] *) src[slot[t, k]], accumulated in fp32 (float64 for float64)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = rows < T
    mask = ok[:, None] & (cols[None, :] < D)
    acc_ty = tl.float64 if src_ptr.dtype.element_ty == tl.float64 else tl.float32
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=acc_ty)
    for k in tl.static_range(K):
        slot = tl.load(slot_ptr + rows * K + k, mask=ok, other=0)
        tile = tl.load(src_ptr + slot[:, None] * D + cols[None, :], mask=mask, other=0.0).to(acc_ty)
        if HAS_W:
            tile = tile * tl.load(w_ptr + rows * K + k, mask=ok, other=0.0).to(acc_ty)[:, None]
        acc += tile
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], cast_rne(acc, out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _unpermute_bwd_kernel(g_ptr, y_ptr, slot_ptr, w_ptr, gy_ptr, gw_ptr, T, D, K: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """gy[slot[t, k]] = w[t, k] * g[t];  gw[t, k] = sum_d g[t, d] * y[slot[t, k], d]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    ok = rows < T
    acc_ty = tl.float64 if y_ptr.dtype.element_ty == tl.float64 else tl.float32
    for k in tl.static_range(K):
        slot = tl.load(slot_ptr + rows * K + k, mask=ok, other=0)
        w = tl.load(w_ptr + rows * K + k, mask=ok, other=0.0).to(acc_ty)
        dot = tl.zeros([BLOCK_T, BLOCK_D], dtype=acc_ty)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = ok[:, None] & (cols[None, :] < D)
            g = tl.load(g_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(acc_ty)
            y = tl.load(y_ptr + slot[:, None] * D + cols[None, :], mask=mask, other=0.0).to(acc_ty)
            tl.store(gy_ptr + slot[:, None] * D + cols[None, :],
                     cast_rne(w[:, None] * g, gy_ptr.dtype.element_ty), mask=mask)
            dot += g * y
        tl.store(gw_ptr + rows * K + k, cast_rne(tl.sum(dot, axis=1), gw_ptr.dtype.element_ty),
                 mask=ok)


def _gather(src_PD, slot_TK, w_TK, out_dtype) -> torch.Tensor:
    t, k = slot_TK.shape
    d = src_PD.shape[1]
    out_TD = torch.empty(t, d, dtype=out_dtype, device=src_PD.device)
    if t:
        grid = (triton.cdiv(t, _BLOCK_T), triton.cdiv(d, _BLOCK_D))
        _gather_kernel[grid](src_PD, slot_TK, slot_TK if w_TK is None else w_TK, out_TD, t, d,
                             K=k, HAS_W=w_TK is not None, BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
    return out_TD


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, slot_TK, total: int, dtype: torch.dtype):
        x_TD = x_TD.contiguous()
        t, d = x_TD.shape
        out_PD = x_TD.new_zeros(total, d, dtype=dtype)
        if t:
            grid = (triton.cdiv(t, _BLOCK_T), triton.cdiv(d, _BLOCK_D))
            _scatter_kernel[grid](x_TD, slot_TK, out_PD, t, d, K=slot_TK.shape[1],
                                  BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
        ctx.save_for_backward(slot_TK)
        ctx.x_dtype = x_TD.dtype
        return out_PD

    @staticmethod
    def backward(ctx, g_PD):
        (slot_TK,) = ctx.saved_tensors
        return _gather(g_PD.contiguous(), slot_TK, None, ctx.x_dtype), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_PD, slot_TK, w_TK):
        y_PD, w_TK = y_PD.contiguous(), w_TK.contiguous()
        ctx.save_for_backward(y_PD, slot_TK, w_TK)
        return _gather(y_PD, slot_TK, w_TK, y_PD.dtype)

    @staticmethod
    def backward(ctx, g_TD):
        y_PD, slot_TK, w_TK = ctx.saved_tensors
        g_TD = g_TD.contiguous()
        gy_PD = torch.zeros_like(y_PD)  # padding rows get no gradient
        gw_TK = torch.empty_like(w_TK)
        t, k = slot_TK.shape
        if t:
            _unpermute_bwd_kernel[(triton.cdiv(t, _BLOCK_T),)](
                g_TD, y_PD, slot_TK, w_TK, gy_PD, gw_TK, t, y_PD.shape[1], K=k,
                BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
        return gy_PD, None, gw_TK


def _check_slots(slot_TK: torch.Tensor, t: int) -> None:
    if slot_TK.dtype != torch.int64 or slot_TK.dim() != 2 or slot_TK.shape[0] != t:
        raise ValueError(f"slot_TK must be int64 [T={t}, K], got {slot_TK.dtype} "
                         f"{tuple(slot_TK.shape)}; build it with the dispatcher's layout")


def permute(x_TD: torch.Tensor, slot_TK: torch.Tensor, total: int,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """x_PD [total, D] in `dtype` (x's by default): row slot[t, k] holds x[t], other rows 0.
    Differentiable in x (the gradient of x keeps x's dtype, summed in fp32)."""
    _check_slots(slot_TK, x_TD.shape[0])
    return _Permute.apply(x_TD, slot_TK.contiguous(), total, dtype or x_TD.dtype)


def unpermute(y_PD: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """y_TD [T, D] in y's dtype: sum over k of w[t, k] * y[slot[t, k]] (fp32 accumulation).
    w_TK must have y's dtype (cast it outside, so its gradient reaches the fp32 router)."""
    _check_slots(slot_TK, w_TK.shape[0])
    if w_TK.dtype != y_PD.dtype or w_TK.shape != slot_TK.shape:
        raise ValueError(f"w_TK must be {y_PD.dtype} of shape {tuple(slot_TK.shape)}, got "
                         f"{w_TK.dtype} {tuple(w_TK.shape)}; cast the router weights to y's dtype")
    return _Unpermute.apply(y_PD, slot_TK.contiguous(), w_TK)
