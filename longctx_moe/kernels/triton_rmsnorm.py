"""RMSNorm, and residual add + RMSNorm, in Triton: one read of each input row, one write of each
output row (the torch path reads and writes the [N, D] rows once per op: upcast, square, mean,
scale, weight, downcast; the residual add is one more pass, whose result the norm reads again).

    rmsnorm(x, weight, eps, out_dtype) -> y                     y = w * x * rsqrt(mean(x^2) + eps)
    add_rmsnorm(x, res, weight, eps, out_dtype) -> (s, y)       s = x + res, y = rmsnorm(s)

The numerics are layers._RMSNormFn's: normalised in fp32 (float64 for float64), the sum rounded
to its dtype (the promoted dtype of x and res, as torch's `x + res`) before it is normalised; the
backward keeps the input and one scale per row and recomputes x * r. The weight gradient is
summed per program over its rows (at most 512 programs), then over the programs in torch.
The backward writes the gradient of a narrower addend (the bf16 branch output added to the fp32
residual stream) in its dtype in the same pass, rounded as a cast of the wide one would round.
The kernels run as torch operators, torch.ops.longctx.{rmsnorm_fwd, add_rmsnorm_fwd, rmsnorm_bwd,
add_rmsnorm_bwd}.
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
def _bwd_kernel(g_ptr, gs_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dlo_ptr, dwp_ptr, N, D, HAS_GS: tl.constexpr,
                HAS_LO: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx = r (g w - xh mean(g w xh)) (+ gs, the sum output's gradient); dw partial = sum g xh,
    over the tiles pid, pid + programs, ... (a grid-stride loop: few partials at any N). With
    HAS_LO, dx once more in dlo's dtype: the stored dx rounded as its cast would round it."""
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
        dx = cast_rne(dx, dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offs, dx, mask=mask)
        if HAS_LO:
            tl.store(dlo_ptr + offs, cast_rne(dx, dlo_ptr.dtype.element_ty), mask=mask)
        dw += g * xh
    tl.store(dwp_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw, axis=0), mask=cols < D)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _blocks(d: int) -> dict:
    block_d = triton.next_power_of_2(d)
    return dict(ROWS=max(1, _TILE // block_d), BLOCK_D=block_d)


def _fwd_outputs(x_ND, res_ND, out_dtype):
    """The forward's (sum_ND or None, y_ND, r_N), unwritten: its shapes and dtypes, which the
    fake (meta) implementations return as they are."""
    n, d = x_ND.shape
    sum_ND = None
    if res_ND is not None:
        sum_ND = torch.empty(n, d, dtype=torch.promote_types(x_ND.dtype, res_ND.dtype),
                             device=x_ND.device)
    normed = x_ND if sum_ND is None else sum_ND
    y_ND = torch.empty(n, d, dtype=out_dtype, device=x_ND.device)
    r_N = torch.empty(n, dtype=_acc_dtype(normed), device=x_ND.device)
    return sum_ND, y_ND, r_N


def _forward(x_ND, res_ND, weight_D, eps, out_dtype):
    x_ND, weight_D = x_ND.contiguous(), weight_D.contiguous()
    res_ND = None if res_ND is None else res_ND.contiguous()
    sum_ND, y_ND, r_N = _fwd_outputs(x_ND, res_ND, out_dtype)
    n, d = x_ND.shape
    if n:
        blocks = _blocks(d)
        _fwd_kernel[(triton.cdiv(n, blocks["ROWS"]),)](
            x_ND, x_ND if res_ND is None else res_ND, y_ND if sum_ND is None else sum_ND, weight_D,
            y_ND, r_N, n, d, eps, HAS_RES=res_ND is not None, **blocks)
    return sum_ND, y_ND, r_N


# The kernels as torch operators (torch.ops.longctx.*), each with a fake implementation: a meta
# or fake tensor gets its outputs' shapes and dtypes with no launch (the cluster rehearsal), and
# torch.compile sees one opaque node. The autograd formulas are registered at the end.

@torch.library.custom_op("longctx::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(x_ND: torch.Tensor, weight_D: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_ND in out_dtype, r_N: 1 / rms of each row in the accumulation dtype)."""
    return _forward(x_ND, None, weight_D, eps, out_dtype)[1:]


@rmsnorm_fwd.register_fake
def _(x_ND, weight_D, eps, out_dtype):
    return _fwd_outputs(x_ND, None, out_dtype)[1:]


@torch.library.custom_op("longctx::add_rmsnorm_fwd", mutates_args=())
def add_rmsnorm_fwd(x_ND: torch.Tensor, res_ND: torch.Tensor, weight_D: torch.Tensor, eps: float,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s_ND = x + res in their promoted dtype, y_ND = rmsnorm(s) in out_dtype, r_N)."""
    return _forward(x_ND, res_ND, weight_D, eps, out_dtype)


@add_rmsnorm_fwd.register_fake
def _(x_ND, res_ND, weight_D, eps, out_dtype):
    return _fwd_outputs(x_ND, res_ND, out_dtype)


def _bwd_outputs(x_ND, weight_D):
    """The backward's (dx_ND, dw_D), unwritten and contiguous whatever the inputs' strides."""
    return (torch.empty(x_ND.shape, dtype=x_ND.dtype, device=x_ND.device),
            torch.empty(weight_D.shape, dtype=weight_D.dtype, device=weight_D.device))


def _backward(g_ND, gs_ND, x_ND, weight_D, r_N, lo_dtype=None):
    """(dx_ND, dx_ND in lo_dtype or None, dw_D): one kernel over the rows, the weight gradient's
    per-program partials summed after it."""
    g_ND, x_ND, weight_D = g_ND.contiguous(), x_ND.contiguous(), weight_D.contiguous()
    gs_ND = None if gs_ND is None else gs_ND.contiguous()
    n, d = x_ND.shape
    blocks = _blocks(d)
    progs = max(1, min(_MAX_PROGS, triton.cdiv(n, blocks["ROWS"])))
    dx_ND, _ = _bwd_outputs(x_ND, weight_D)
    lo_ND = None if lo_dtype is None else torch.empty(n, d, dtype=lo_dtype, device=x_ND.device)
    # every program stores its whole partial row: no fill first, unless no program runs
    dw_PD = (torch.empty if n else torch.zeros)(progs, d, dtype=r_N.dtype, device=x_ND.device)
    if n:
        _bwd_kernel[(progs,)](g_ND, g_ND if gs_ND is None else gs_ND, x_ND, weight_D, r_N, dx_ND,
                              dx_ND if lo_ND is None else lo_ND, dw_PD, n, d, HAS_GS=gs_ND is not None,
                              HAS_LO=lo_ND is not None, **blocks)
    return dx_ND, lo_ND, dw_PD.sum(0).to(weight_D.dtype)


@torch.library.custom_op("longctx::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(g_ND: torch.Tensor, gs_ND: torch.Tensor | None, x_ND: torch.Tensor,
                weight_D: torch.Tensor, r_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx_ND in x's dtype, dw_D in weight's): the gradient through y = rmsnorm(x) of g_ND, plus
    gs_ND (the sum output's gradient, of add_rmsnorm) when given."""
    dx_ND, _, dw_D = _backward(g_ND, gs_ND, x_ND, weight_D, r_N)
    return dx_ND, dw_D


@rmsnorm_bwd.register_fake
def _(g_ND, gs_ND, x_ND, weight_D, r_N):
    return _bwd_outputs(x_ND, weight_D)


@torch.library.custom_op("longctx::add_rmsnorm_bwd", mutates_args=())
def add_rmsnorm_bwd(g_ND: torch.Tensor, gs_ND: torch.Tensor | None, s_ND: torch.Tensor, weight_D: torch.Tensor,
                    r_N: torch.Tensor, lo_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ds_ND in s's dtype, ds_ND in lo_dtype, dw_D): add_rmsnorm's backward where one addend is
    narrower than the sum (a bf16 branch output on the fp32 residual stream), its gradient written
    in the same pass, rounded as ds.to(lo_dtype) would round it, instead of cast in another."""
    return _backward(g_ND, gs_ND, s_ND, weight_D, r_N, lo_dtype)


@add_rmsnorm_bwd.register_fake
def _(g_ND, gs_ND, s_ND, weight_D, r_N, lo_dtype):
    ds_ND, dw_D = _bwd_outputs(s_ND, weight_D)
    return ds_ND, torch.empty(s_ND.shape, dtype=lo_dtype, device=s_ND.device), dw_D


def _rmsnorm_setup(ctx, inputs, output):
    x_ND, weight_D, _, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the row scales: a launch
    ctx.save_for_backward(x_ND, weight_D, output[1])


def _rmsnorm_backward(ctx, g_y, _g_r):
    x_ND, weight_D, r_N = ctx.saved_tensors
    dx_ND, dw_D = rmsnorm_bwd(g_y, None, x_ND, weight_D, r_N)
    return dx_ND, dw_D, None, None


def _add_rmsnorm_setup(ctx, inputs, output):
    x_ND, res_ND, weight_D, _, _ = inputs
    s_ND, _, r_N = output
    ctx.mark_non_differentiable(r_N)
    ctx.set_materialize_grads(False)  # no zero-filled gradients (row scales, an unused output)
    ctx.save_for_backward(s_ND, weight_D, r_N)
    ctx.dtypes = (x_ND.dtype, res_ND.dtype)


def _add_rmsnorm_backward(ctx, g_s, g_y, _g_r):
    s_ND, weight_D, r_N = ctx.saved_tensors
    if g_y is None:  # only the sum was used
        g_y = torch.zeros_like(s_ND)
    narrow = [dt for dt in ctx.dtypes if dt != s_ND.dtype]
    if not narrow:
        d_ND, dw_D = rmsnorm_bwd(g_y, g_s, s_ND, weight_D, r_N)
        return d_ND, d_ND, dw_D, None, None
    # The narrower addend's gradient comes out of the kernel in its dtype; only a second narrow
    # one (bf16 + fp16, summed in fp32) is still cast.
    d_ND, lo_ND, dw_D = add_rmsnorm_bwd(g_y, g_s, s_ND, weight_D, r_N, narrow[0])
    return *(lo_ND if dt == narrow[0] else d_ND.to(dt) for dt in ctx.dtypes), dw_D, None, None


rmsnorm_fwd.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)
add_rmsnorm_fwd.register_autograd(_add_rmsnorm_backward, setup_context=_add_rmsnorm_setup)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim, in out_dtype; differentiable."""
    y_ND, _ = rmsnorm_fwd(_rows(x), weight, eps, out_dtype)
    return y_ND.view(x.shape)


def add_rmsnorm(x: torch.Tensor, res: torch.Tensor, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + res, rmsnorm(x + res)); the sum in torch's promoted dtype of x and res."""
    if x.shape != res.shape:
        raise ValueError(f"add_rmsnorm: x {tuple(x.shape)} and res {tuple(res.shape)} must match")
    s_ND, y_ND, _ = add_rmsnorm_fwd(_rows(x), _rows(res), weight, eps, out_dtype)
    return s_ND.view(x.shape), y_ND.view(x.shape)
