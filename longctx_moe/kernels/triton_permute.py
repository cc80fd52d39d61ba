"""MoE token permute / unpermute in Triton, for any row layout of the routed copies.

A layout is `slot_TK` (int64 [T, K]): the row, among P rows, that copy k of token t occupies.
The dispatcher's layout sorts the copies by expert (ties in token order) and may pad each
expert's rows for the grouped GEMM (longctx_moe.model.grouped_gemm.pad_layout); rows no copy
occupies are zeros on the way in and are never read on the way out.

    permute(x_TD, slot_TK, P, dtype) -> x_PD      x_PD[slot[t, k]] = x[t] (cast to dtype)
    unpermute(y_PD, slot_TK, w_TK) -> y_TD        y[t] = sum_k w[t, k] * y_PD[slot[t, k]]

Both backwards gather by token (no atomics, so they are deterministic): permute's sums the K
copies' gradients in fp32; unpermute's writes w * g to each copy's row and dot(g, y) to w.
The weights may come wider than y (the router's fp32): the kernels round them to y's dtype as a
cast would, and w's gradient is rounded to y's dtype before it is stored in w's, so the result
is the cast-then-unpermute one with no cast launched either way. A layout of exactly T*K rows
is a permutation: every row is written, so the outputs are not zero-filled first.
The kernels run as torch operators, torch.ops.longctx.{permute,unpermute}_{fwd,bwd}.
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
            w = cast_rne(tl.load(w_ptr + rows * K + k, mask=ok, other=0.0), src_ptr.dtype.element_ty)
            tile = tile * w.to(acc_ty)[:, None]
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
        w = cast_rne(tl.load(w_ptr + rows * K + k, mask=ok, other=0.0), y_ptr.dtype.element_ty).to(acc_ty)
        dot = tl.zeros([BLOCK_T, BLOCK_D], dtype=acc_ty)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = ok[:, None] & (cols[None, :] < D)
            g = tl.load(g_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(acc_ty)
            y = tl.load(y_ptr + slot[:, None] * D + cols[None, :], mask=mask, other=0.0).to(acc_ty)
            tl.store(gy_ptr + slot[:, None] * D + cols[None, :],
                     cast_rne(w[:, None] * g, gy_ptr.dtype.element_ty), mask=mask)
            dot += g * y
        gw = cast_rne(tl.sum(dot, axis=1), y_ptr.dtype.element_ty)  # as y's dtype, then widened
        tl.store(gw_ptr + rows * K + k, gw.to(gw_ptr.dtype.element_ty), mask=ok)


def _gather(src_PD, slot_TK, w_TK, out_dtype) -> torch.Tensor:
    src_PD, slot_TK = src_PD.contiguous(), slot_TK.contiguous()
    w_TK = None if w_TK is None else w_TK.contiguous()
    t, k = slot_TK.shape
    d = src_PD.shape[1]
    out_TD = torch.empty(t, d, dtype=out_dtype, device=src_PD.device)
    if t:
        grid = (triton.cdiv(t, _BLOCK_T), triton.cdiv(d, _BLOCK_D))
        _gather_kernel[grid](src_PD, slot_TK, slot_TK if w_TK is None else w_TK, out_TD, t, d,
                             K=k, HAS_W=w_TK is not None, BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
    return out_TD


def _gathered(src_PD, slot_TK, out_dtype) -> torch.Tensor:
    """_gather's output, unwritten (the fake implementations' result)."""
    return torch.empty(slot_TK.shape[0], src_PD.shape[1], dtype=out_dtype, device=src_PD.device)


# The kernels as torch operators (torch.ops.longctx.*), each with a fake implementation: a meta
# or fake tensor gets its outputs' shapes and dtypes with no launch (the cluster rehearsal), and
# torch.compile sees one opaque node. The autograd formulas are registered at the end.

@torch.library.custom_op("longctx::permute_fwd", mutates_args=())
def permute_fwd(x_TD: torch.Tensor, slot_TK: torch.Tensor, total: int,
                dtype: torch.dtype) -> torch.Tensor:
    """x_PD [total, D] in dtype: row slot[t, k] holds x[t], other rows 0."""
    x_TD, slot_TK = x_TD.contiguous(), slot_TK.contiguous()
    t, d = x_TD.shape
    # Rows no copy occupies (padding) are zeros; T*K rows are all written.
    out_PD = (x_TD.new_empty if total == t * slot_TK.shape[1] else x_TD.new_zeros)(total, d, dtype=dtype)
    if t:
        grid = (triton.cdiv(t, _BLOCK_T), triton.cdiv(d, _BLOCK_D))
        _scatter_kernel[grid](x_TD, slot_TK, out_PD, t, d, K=slot_TK.shape[1],
                              BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
    return out_PD


@permute_fwd.register_fake
def _(x_TD, slot_TK, total, dtype):
    return x_TD.new_empty(total, x_TD.shape[1], dtype=dtype)


@torch.library.custom_op("longctx::permute_bwd", mutates_args=())
def permute_bwd(g_PD: torch.Tensor, slot_TK: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """g_TD in x_dtype: the sum over k of g[slot[t, k]] (fp32 accumulation)."""
    return _gather(g_PD, slot_TK, None, x_dtype)


@permute_bwd.register_fake
def _(g_PD, slot_TK, x_dtype):
    return _gathered(g_PD, slot_TK, x_dtype)


@torch.library.custom_op("longctx::unpermute_fwd", mutates_args=())
def unpermute_fwd(y_PD: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """y_TD in y's dtype: the sum over k of w[t, k] * y[slot[t, k]] (fp32 accumulation)."""
    return _gather(y_PD, slot_TK, w_TK, y_PD.dtype)


@unpermute_fwd.register_fake
def _(y_PD, slot_TK, w_TK):
    return _gathered(y_PD, slot_TK, y_PD.dtype)


@torch.library.custom_op("longctx::unpermute_bwd", mutates_args=())
def unpermute_bwd(g_TD: torch.Tensor, y_PD: torch.Tensor, slot_TK: torch.Tensor,
                  w_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gy_PD: w[t, k] * g[t] in row slot[t, k], zero on padding rows; gw_TK = dot(g[t],
    y[slot[t, k]]))."""
    g_TD, y_PD, slot_TK, w_TK = (a.contiguous() for a in (g_TD, y_PD, slot_TK, w_TK))
    t, k = slot_TK.shape
    # padding rows get no gradient; T*K rows are all written
    gy_PD = torch.empty_like(y_PD) if y_PD.shape[0] == t * k else torch.zeros_like(y_PD)
    gw_TK = torch.empty_like(w_TK)
    if t:
        _unpermute_bwd_kernel[(triton.cdiv(t, _BLOCK_T),)](
            g_TD, y_PD, slot_TK, w_TK, gy_PD, gw_TK, t, y_PD.shape[1], K=k,
            BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D)
    return gy_PD, gw_TK


@unpermute_bwd.register_fake
def _(g_TD, y_PD, slot_TK, w_TK):
    return (torch.empty(y_PD.shape, dtype=y_PD.dtype, device=y_PD.device),
            torch.empty(w_TK.shape, dtype=w_TK.dtype, device=w_TK.device))


def _permute_setup(ctx, inputs, output):
    x_TD, slot_TK, _, _ = inputs
    ctx.save_for_backward(slot_TK)
    ctx.x_dtype = x_TD.dtype


def _permute_backward(ctx, g_PD):
    (slot_TK,) = ctx.saved_tensors
    return permute_bwd(g_PD, slot_TK, ctx.x_dtype), None, None, None


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_backward(ctx, g_TD):
    y_PD, slot_TK, w_TK = ctx.saved_tensors
    gy_PD, gw_TK = unpermute_bwd(g_TD, y_PD, slot_TK, w_TK)
    return gy_PD, None, gw_TK


permute_fwd.register_autograd(_permute_backward, setup_context=_permute_setup)
unpermute_fwd.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def _check_slots(slot_TK: torch.Tensor, t: int) -> None:
    if slot_TK.dtype != torch.int64 or slot_TK.dim() != 2 or slot_TK.shape[0] != t:
        raise ValueError(f"slot_TK must be int64 [T={t}, K], got {slot_TK.dtype} "
                         f"{tuple(slot_TK.shape)}; build it with the dispatcher's layout")


def permute(x_TD: torch.Tensor, slot_TK: torch.Tensor, total: int,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """x_PD [total, D] in `dtype` (x's by default): row slot[t, k] holds x[t], other rows 0.
    Differentiable in x (the gradient of x keeps x's dtype, summed in fp32)."""
    _check_slots(slot_TK, x_TD.shape[0])
    return permute_fwd(x_TD, slot_TK, total, dtype or x_TD.dtype)


def unpermute(y_PD: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """y_TD [T, D] in y's dtype: sum over k of w[t, k] * y[slot[t, k]] (fp32 accumulation).
    w_TK in y's dtype or a wider float (the router's fp32): used rounded to y's dtype, as a cast
    would round it; its gradient comes back in w's dtype."""
    _check_slots(slot_TK, w_TK.shape[0])
    wide = w_TK.dtype in (torch.float32, torch.float64) and w_TK.dtype.itemsize >= y_PD.dtype.itemsize
    if not (w_TK.dtype == y_PD.dtype or wide) or w_TK.shape != slot_TK.shape:
        raise ValueError(f"w_TK must be {y_PD.dtype} or a wider float of shape {tuple(slot_TK.shape)}, got "
                         f"{w_TK.dtype} {tuple(w_TK.shape)}; pass the router weights in y's dtype or fp32")
    return unpermute_fwd(y_PD, slot_TK, w_TK)
