"""RMSNorm, and residual add + RMSNorm, in Triton: one read of each input row, one write of each
output row (the torch path reads and writes the [N, D] rows once per op: upcast, square, mean,
scale, weight, downcast; the residual add is one more pass, whose result the norm reads again).

    rmsnorm(x, weight, eps, out_dtype) -> y                     y = w * x * rsqrt(mean(x^2) + eps)
    add_rmsnorm(x, res, weight, eps, out_dtype) -> (s, y)       s = x + res, y = rmsnorm(s)

The numerics are layers._RMSNormFn's: normalised in fp32 (float64 for float64), the sum rounded
to its dtype (the promoted dtype of x and res, as torch's `x + res`) before it is normalised; the
backward keeps the input and one scale per row and recomputes x * r. The weight gradient is
summed per program over its rows (at most 512 programs), then over the programs in torch.
Legend: N rows (any leading shape flattened), D normalised dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx_moe.kernels.triton_common import cast_rne

_TILE = 4096  # elements per program: [4096 / D] rows (32 rows of a 128-wide q/k head norm)
_MAX_PROGS = 512  # backward programs: each sums its tiles' weight gradient (<= 512 x D partials)


@triton.jit
def _fwd_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, y_ptr, r_ptr, N, D, eps, HAS_RES: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    acc_ty = r_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = cast_rne(x.to(acc_ty) + res.to(acc_ty), sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, x, mask=mask)
    x = x.to(acc_ty)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(acc_ty)
    tl.store(y_ptr + offs, cast_rne(x * r[:, None] * w[None, :], y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + rows, r, mask=rows < N)


@triton.jit
def _bwd_kernel(g_ptr, gs_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dwp_ptr, N, D, HAS_GS: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx = r (g w - xh mean(g w xh)) (+ gs, the sum output's gradient); dw partial = sum g xh,
    over the tiles pid, pid + programs, ... (a grid-stride loop: few partials at any N)."""
    pid, progs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    acc_ty = r_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(acc_ty)
    dw = tl.zeros([ROWS, BLOCK_D], dtype=acc_ty)
    for tile in range(pid, tl.cdiv(N, ROWS), progs):
        rows = tile * ROWS + tl.arange(0, ROWS).to(tl.int64)
        mask = (rows[:, None] < N) & (cols[None, :] < D)
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_ty)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(acc_ty)
        r = tl.load(r_ptr + rows, mask=rows < N, other=0.0)[:, None]
        xh = x * r
        gw = g * w[None, :]
        dx = r * (gw - xh * (tl.sum(gw * xh, axis=1) / D)[:, None])
        if HAS_GS:  # rounded to x's dtype first, as autograd's sum of the two gradients is
            dx = cast_rne(dx, dx_ptr.dtype.element_ty).to(acc_ty)
            dx += tl.load(gs_ptr + offs, mask=mask, other=0.0).to(acc_ty)
        tl.store(dx_ptr + offs, cast_rne(dx, dx_ptr.dtype.element_ty), mask=mask)
        dw += g * xh
    tl.store(dwp_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw, axis=0), mask=cols < D)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _blocks(d: int) -> dict:
    block_d = triton.next_power_of_2(d)
    return dict(ROWS=max(1, _TILE // block_d), BLOCK_D=block_d)


def _forward(x_ND, res_ND, weight, eps, out_dtype):
    n, d = x_ND.shape
    sum_ND = None
    if res_ND is not None:
        sum_ND = torch.empty(n, d, dtype=torch.promote_types(x_ND.dtype, res_ND.dtype),
                             device=x_ND.device)
    normed = x_ND if sum_ND is None else sum_ND
    y_ND = torch.empty(n, d, dtype=out_dtype, device=x_ND.device)
    r_N = torch.empty(n, dtype=_acc_dtype(normed), device=x_ND.device)
    if n:
        blocks = _blocks(d)
        _fwd_kernel[(triton.cdiv(n, blocks["ROWS"]),)](
            x_ND, x_ND if res_ND is None else res_ND, y_ND if sum_ND is None else sum_ND, weight,
            y_ND, r_N, n, d, eps, HAS_RES=res_ND is not None, **blocks)
    return sum_ND, y_ND, r_N


def _backward(g_ND, gs_ND, x_ND, weight, r_N):
    n, d = x_ND.shape
    blocks = _blocks(d)
    progs = max(1, min(_MAX_PROGS, triton.cdiv(n, blocks["ROWS"])))
    dx_ND = torch.empty_like(x_ND)
    dw_PD = torch.zeros(progs, d, dtype=r_N.dtype, device=x_ND.device)
    if n:
        _bwd_kernel[(progs,)](g_ND, g_ND if gs_ND is None else gs_ND, x_ND, weight, r_N, dx_ND,
                              dw_PD, n, d, HAS_GS=gs_ND is not None, **blocks)
    return dx_ND, dw_PD.sum(0).to(weight.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype):
        _, y_ND, r_N = _forward(_rows(x), None, weight.contiguous(), eps, out_dtype)
        ctx.save_for_backward(x, weight, r_N)
        return y_ND.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, weight, r_N = ctx.saved_tensors
        dx_ND, dw_D = _backward(_rows(g), None, _rows(x), weight.contiguous(), r_N)
        return dx_ND.view(x.shape), dw_D, None, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, res, weight, eps: float, out_dtype: torch.dtype):
        s_ND, y_ND, r_N = _forward(_rows(x), _rows(res), weight.contiguous(), eps, out_dtype)
        ctx.save_for_backward(s_ND, weight, r_N)
        ctx.dtypes, ctx.shape = (x.dtype, res.dtype), x.shape
        return s_ND.view(x.shape), y_ND.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_s, g_y):
        s_ND, weight, r_N = ctx.saved_tensors
        if g_y is None:  # only the sum was used
            g_y = torch.zeros_like(s_ND)
        gs = None if g_s is None else _rows(g_s)
        d_ND, dw_D = _backward(_rows(g_y), gs, s_ND, weight.contiguous(), r_N)
        shape = ctx.shape
        return d_ND.view(shape).to(ctx.dtypes[0]), d_ND.view(shape).to(ctx.dtypes[1]), dw_D, None, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim, in out_dtype; differentiable."""
    return _RMSNorm.apply(x, weight, eps, out_dtype)


def add_rmsnorm(x: torch.Tensor, res: torch.Tensor, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + res, rmsnorm(x + res)); the sum in torch's promoted dtype of x and res."""
    if x.shape != res.shape:
        raise ValueError(f"add_rmsnorm: x {tuple(x.shape)} and res {tuple(res.shape)} must match")
    return _AddRMSNorm.apply(x, res, weight, eps, out_dtype)
