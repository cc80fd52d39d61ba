"""Rotary embedding of q and k in Triton: one launch rotates both (the torch path is a slice,
a negation, a cat and three elementwise ops per tensor, each writing a fresh [T, H, D] tensor,
and as many again backward).

    rope_fwd(q_THD, k_TGD, cos_TR, sin_TR, interleaved) -> (q_THD, k_TGD) rotated
    rope_bwd(dq_THD, dk_TGD, cos_TR, sin_TR, interleaved) -> (dq, dk) of the inputs
    rope(q, k, cos, sin, interleaved) -> (q, k)                     differentiable

The rotation is layers.apply_rope's rotate-half on the first R dims of each head (R = the
tables' width; the other D - R dims pass through: partial rotary), with the tables per token as
the DocLayout caches them (positions restart at each packed document, so a table row is its
token's position in its own document). `interleaved` (DeepSeek-V3's rope_interleave): the R dims
come as pairs (0, 1), (2, 3), ... that the torch path first reorders to rotate-half's (i, i + R/2);
the output is in that reordered layout, as the torch path's is, and the backward writes the
gradient back to the pairs. q and k are read through their strides (MLA's rope parts are views
of wider projections); the outputs are contiguous.

The numerics are the torch path's in the tables' dtype (which must be x's): with x1, x2 the two
halves, y1 = x1 c - x2 s and y2 = x2 c + x1 s, each product and the sum rounded to that dtype as
torch's separate ops round them; the backward is autograd's: d1 = g1 c + g2 s, d2 = g2 c - g1 s.
Legend: T tokens, H q heads, G k heads, D head dim, R rotary dims (even), P = D - R.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx_moe.kernels.triton_common import cast_rne

_TILE = 4096  # elements per program: [4096 / D] (token, head) rows


@triton.jit
def _rotate_rows(x_ptr, y_ptr, cos_ptr, sin_ptr, tile, NH, n_rows, sxt, sxh, R, D,
                 BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, ACC: tl.constexpr,
                 ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rows tile * ROWS ... of one tensor ([T, NH, D] through strides sxt, sxh; the output
    contiguous) rotated by the tables [T, R]."""
    rows = tile * ROWS + tl.arange(0, ROWS).to(tl.int64)
    t = rows // NH
    src = t * sxt + (rows % NH) * sxh
    dst = rows * D
    half = R // 2
    i = tl.arange(0, HALF)
    mask = (rows[:, None] < n_rows) & (i[None, :] < half)
    # the forward reads the pairs of an interleaved input, the backward writes its gradient back
    # to them; the rotate-half side is at (i, i + R/2)
    if INTERLEAVED and not BACKWARD:
        in1, in2 = 2 * i, 2 * i + 1
    else:
        in1, in2 = i, i + half
    if INTERLEAVED and BACKWARD:
        out1, out2 = 2 * i, 2 * i + 1
    else:
        out1, out2 = i, i + half
    dtype = y_ptr.dtype.element_ty
    acc_ty = tl.float64 if ACC == 64 else tl.float32
    x1 = tl.load(x_ptr + src[:, None] + in1[None, :], mask=mask, other=0.0).to(acc_ty)
    x2 = tl.load(x_ptr + src[:, None] + in2[None, :], mask=mask, other=0.0).to(acc_ty)
    tab = t[:, None] * R + i[None, :]
    c1 = tl.load(cos_ptr + tab, mask=mask, other=0.0).to(acc_ty)
    c2 = tl.load(cos_ptr + tab + half, mask=mask, other=0.0).to(acc_ty)
    s1 = tl.load(sin_ptr + tab, mask=mask, other=0.0).to(acc_ty)
    s2 = tl.load(sin_ptr + tab + half, mask=mask, other=0.0).to(acc_ty)
    a1 = cast_rne(x1 * c1, dtype).to(acc_ty)
    a2 = cast_rne(x2 * c2, dtype).to(acc_ty)
    if BACKWARD:  # the transpose of the rotation: sin's sign flips, and each half takes the other's
        y1 = a1 + cast_rne(x2 * s2, dtype).to(acc_ty)
        y2 = a2 - cast_rne(x1 * s1, dtype).to(acc_ty)
    else:
        y1 = a1 - cast_rne(x2 * s1, dtype).to(acc_ty)
        y2 = a2 + cast_rne(x1 * s2, dtype).to(acc_ty)
    tl.store(y_ptr + dst[:, None] + out1[None, :], cast_rne(y1, dtype), mask=mask)
    tl.store(y_ptr + dst[:, None] + out2[None, :], cast_rne(y2, dtype), mask=mask)
    if BLOCK_P > 0:  # the dims past R pass through (partial rotary)
        p = R + tl.arange(0, BLOCK_P)
        pmask = (rows[:, None] < n_rows) & (p[None, :] < D)
        tl.store(y_ptr + dst[:, None] + p[None, :],
                 tl.load(x_ptr + src[:, None] + p[None, :], mask=pmask, other=0.0), mask=pmask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, H, G, T, q_progs, sqt, sqh,
                 skt, skh, R, D, BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr,
                 ACC: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr):
    """The first q_progs programs rotate q's rows, the rest k's: one launch for both."""
    pid = tl.program_id(0)
    if pid < q_progs:
        _rotate_rows(q_ptr, qo_ptr, cos_ptr, sin_ptr, pid, H, T * H, sqt, sqh, R, D, BACKWARD,
                     INTERLEAVED, ACC, ROWS, HALF, BLOCK_P)
    else:
        _rotate_rows(k_ptr, ko_ptr, cos_ptr, sin_ptr, pid - q_progs, G, T * G, skt, skh, R, D,
                     BACKWARD, INTERLEAVED, ACC, ROWS, HALF, BLOCK_P)


def _check(q_THD, k_TGD, cos_TR, sin_TR) -> None:
    t, _, d = q_THD.shape
    r = cos_TR.shape[-1]
    if k_TGD.shape[0] != t or k_TGD.shape[2] != d or q_THD.dtype != k_TGD.dtype:
        raise ValueError(f"rope: q {tuple(q_THD.shape)} {q_THD.dtype} and k {tuple(k_TGD.shape)} "
                         f"{k_TGD.dtype} must share tokens, head dim and dtype")
    if cos_TR.shape != (t, r) or sin_TR.shape != (t, r) or r % 2 or r > d:
        raise ValueError(f"rope: tables {tuple(cos_TR.shape)} / {tuple(sin_TR.shape)} must be "
                         f"[T={t}, R] with R even and <= the head dim {d}")
    if cos_TR.dtype != q_THD.dtype or sin_TR.dtype != q_THD.dtype:
        raise ValueError(f"rope: the tables ({cos_TR.dtype}) must have q's dtype ({q_THD.dtype}); "
                         "DocLayout caches them per dtype")


def _unit_cols(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(q_THD, k_TGD, cos_TR, sin_TR, interleaved: bool, backward: bool):
    _check(q_THD, k_TGD, cos_TR, sin_TR)
    q_THD, k_TGD = _unit_cols(q_THD), _unit_cols(k_TGD)
    cos_TR, sin_TR = cos_TR.contiguous(), sin_TR.contiguous()
    qo, ko = _outputs(q_THD, k_TGD)
    (t, h, d), g, r = q_THD.shape, k_TGD.shape[1], cos_TR.shape[-1]
    rows = max(1, _TILE // triton.next_power_of_2(d))
    q_progs, k_progs = triton.cdiv(t * h, rows), triton.cdiv(t * g, rows)
    if q_progs + k_progs:
        _rope_kernel[(q_progs + k_progs,)](
            q_THD, k_TGD, qo, ko, cos_TR, sin_TR, h, g, t, q_progs, q_THD.stride(0),
            q_THD.stride(1), k_TGD.stride(0), k_TGD.stride(1), r, d, BACKWARD=backward,
            INTERLEAVED=interleaved, ACC=64 if q_THD.dtype == torch.float64 else 32, ROWS=rows,
            HALF=triton.next_power_of_2(max(1, r // 2)),
            BLOCK_P=0 if r == d else triton.next_power_of_2(d - r))
    return qo, ko


def _outputs(q_THD, k_TGD):
    return (torch.empty(q_THD.shape, dtype=q_THD.dtype, device=q_THD.device),
            torch.empty(k_TGD.shape, dtype=k_TGD.dtype, device=k_TGD.device))


@torch.library.custom_op("longctx::rope_fwd", mutates_args=())
def rope_fwd(q_THD: torch.Tensor, k_TGD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
             interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) with their first R dims rotated by the tables [T, R] (see the module docstring)."""
    return _launch(q_THD, k_TGD, cos_TR, sin_TR, interleaved, backward=False)


@rope_fwd.register_fake
def _(q_THD, k_TGD, cos_TR, sin_TR, interleaved):
    _check(q_THD, k_TGD, cos_TR, sin_TR)
    return _outputs(q_THD, k_TGD)


@torch.library.custom_op("longctx::rope_bwd", mutates_args=())
def rope_bwd(dq_THD: torch.Tensor, dk_TGD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
             interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of rope_fwd's inputs from those of its outputs."""
    return _launch(dq_THD, dk_TGD, cos_TR, sin_TR, interleaved, backward=True)


@rope_bwd.register_fake
def _(dq_THD, dk_TGD, cos_TR, sin_TR, interleaved):
    _check(dq_THD, dk_TGD, cos_TR, sin_TR)
    return _outputs(dq_THD, dk_TGD)


def _setup(ctx, inputs, output):
    _, _, cos_TR, sin_TR, ctx.interleaved = inputs
    ctx.shapes = tuple(o.shape for o in output)
    ctx.save_for_backward(cos_TR, sin_TR)


def _backward(ctx, dq_THD, dk_TGD):
    cos_TR, sin_TR = ctx.saved_tensors
    # an output that reached no loss has no gradient: zeros (its input's gradient is then zero)
    dq_THD, dk_TGD = (cos_TR.new_zeros(shape) if g is None else g
                      for g, shape in zip((dq_THD, dk_TGD), ctx.shapes, strict=True))
    dq, dk = rope_bwd(dq_THD, dk_TGD, cos_TR, sin_TR, ctx.interleaved)
    return dq, dk, None, None, None


rope_fwd.register_autograd(_backward, setup_context=_setup)


def rope(q_THD: torch.Tensor, k_TGD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
         interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated, as apply_partial_rope applies it to each (after the interleaved pairs'
    reordering with `interleaved`); differentiable in q and k (the tables are constants)."""
    return rope_fwd(q_THD, k_TGD, cos_TR, sin_TR, interleaved)
