"""SwiGLU's activation in Triton: act = silu(gate) * up in one pass forward, and in one pass
backward the recomputed activation (the down projection's weight gradient needs it) and both
halves' gradients (the torch path is two passes forward and five backward, each writing a fresh
[N, F] tensor).

    swiglu_fwd(gate_NF, up_NF, clamp_limit) -> act_NF
    swiglu_bwd(gate_NF, up_NF, dact_NF, clamp_limit) -> (act_NF, dh_N2F)   dh = [d gate | d up]
    swiglu(gate, up, clamp_limit) -> act                                    differentiable

`clamp_limit` (None: SwiGLU) is gpt-oss's clamped form (model.expert_activation=clamped_swiglu,
transformers' GptOssExperts): (clamp(up, -l, l) + 1) * gc * sigmoid(1.702 gc), gc = clamp(gate,
max=l), in transformers' order of operations, each intermediate rounded as torch's ops round it.

gate and up are read where they lie: the experts' [gate | up] halves of one [N, 2F] GEMM output
(row stride 2F) or the dense MLP's two projections (experts._SwiGLUDown, layers._GatedDown). The
gradient is one [N, 2F] buffer, [d gate | d up], what the experts' GEMM backward takes whole and
whose halves the dense MLP hands to its two projections as views.

The numerics are the torch path's (F.silu, the product, aten's silu_backward): float32 arithmetic
(float64 for float64) with each intermediate that torch writes rounded to the rows' dtype where
torch rounds it: silu(gate), silu * up, dact * silu, dact * up, then
d gate = (dact * up) * sig * (1 + gate * (1 - sig)).
The kernels run as torch operators, torch.ops.longctx.{swiglu_fwd, swiglu_bwd}.
Legend: N rows (any leading shape flattened), F hidden features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longctx_moe.kernels.triton_common import cast_rne

_ROWS, _BLOCK_F = 16, 256  # one program's tile: 4096 elements of each operand


@triton.jit
def _load(ptr, rows, stride, cols, mask, acc_ty: tl.constexpr):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(acc_ty)


@triton.jit
def _silu(g, dtype: tl.constexpr):
    """(sigmoid(g), silu(g) rounded to dtype as F.silu writes it) in g's (accumulation) dtype."""
    e = 1.0 + tl.exp(-g)
    return 1.0 / e, cast_rne(g / e, dtype).to(g.dtype)


@triton.jit
def _clamped(g, u, limit, dtype: tl.constexpr):
    """gpt-oss's activation in transformers' order, each intermediate rounded as torch writes
    it: gc = clamp(g, max=l), uc = clamp(u, -l, l), t = 1.702 gc, sg = sigmoid(t),
    glu = gc * sg, u1 = uc + 1; returns (gc, sg, glu, u1) and act = u1 * glu unrounded."""
    acc = g.dtype
    gc = tl.minimum(g, limit)
    uc = tl.minimum(tl.maximum(u, -limit), limit)
    t = cast_rne(gc * 1.702, dtype).to(acc)  # experts.GPT_OSS_ALPHA
    sg = cast_rne(1.0 / (1.0 + tl.exp(-t)), dtype).to(acc)
    glu = cast_rne(gc * sg, dtype).to(acc)
    u1 = cast_rne(uc + 1.0, dtype).to(acc)
    return gc, sg, glu, u1, u1 * glu


@triton.jit
def _tile(N, F, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's ROWS x BLOCK_F tile of the [N, F] rows: its row and column indices and the
    mask of those inside."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < N) & (cols[None, :] < F)
    return rows, cols, mask


@triton.jit
def _fwd_kernel(g_ptr, u_ptr, a_ptr, N, F, sg, su, limit, CLAMPED: tl.constexpr, ACC: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    rows, cols, mask = _tile(N, F, ROWS, BLOCK_F)
    dtype = a_ptr.dtype.element_ty
    acc_ty = tl.float64 if ACC == 64 else tl.float32
    g = _load(g_ptr, rows, sg, cols, mask, acc_ty)
    u = _load(u_ptr, rows, su, cols, mask, acc_ty)
    if CLAMPED:
        _, _, _, _, act = _clamped(g, u, limit, dtype)
    else:
        _, s = _silu(g, dtype)
        act = s * u
    tl.store(a_ptr + rows[:, None] * F + cols[None, :], cast_rne(act, dtype), mask=mask)


@triton.jit
def _bwd_kernel(g_ptr, u_ptr, d_ptr, a_ptr, dh_ptr, N, F, sg, su, sd, limit, CLAMPED: tl.constexpr,
                ACC: tl.constexpr, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    rows, cols, mask = _tile(N, F, ROWS, BLOCK_F)
    dtype = a_ptr.dtype.element_ty
    acc_ty = tl.float64 if ACC == 64 else tl.float32
    g = _load(g_ptr, rows, sg, cols, mask, acc_ty)
    u = _load(u_ptr, rows, su, cols, mask, acc_ty)
    d = _load(d_ptr, rows, sd, cols, mask, acc_ty)
    if CLAMPED:
        dgate, dup, act = _clamped_grads(g, u, d, limit, dtype)
    else:
        sig, s = _silu(g, dtype)
        act = s * u
        du = cast_rne(d * u, dtype).to(acc_ty)  # silu_backward's incoming gradient, as torch writes it
        dgate = du * sig * (1.0 + g * (1.0 - sig))
        dup = d * s
    tl.store(a_ptr + rows[:, None] * F + cols[None, :], cast_rne(act, dtype), mask=mask)
    dh = rows[:, None] * (2 * F) + cols[None, :]
    tl.store(dh_ptr + dh, cast_rne(dgate, dtype), mask=mask)
    tl.store(dh_ptr + dh + F, cast_rne(dup, dtype), mask=mask)


@triton.jit
def _clamped_grads(g, u, d, limit, dtype: tl.constexpr):
    """(d gate, d up, act) of _clamped: autograd's products, each rounded, in its order; the
    clamps pass the gradient where their input lies inside the bounds."""
    acc = g.dtype
    gc, sg, glu, u1, act = _clamped(g, u, limit, dtype)
    d_glu = cast_rne(d * u1, dtype).to(acc)
    d_sg = cast_rne(d_glu * gc, dtype).to(acc)
    d_t = cast_rne(d_sg * (1.0 - sg) * sg, dtype).to(acc)  # aten's sigmoid_backward
    d_gc = cast_rne(d_glu * sg, dtype).to(acc) + cast_rne(d_t * 1.702, dtype).to(acc)
    dgate = tl.where(g <= limit, d_gc, 0.0)
    dup = tl.where((u >= -limit) & (u <= limit), d * glu, 0.0)
    return dgate, dup, act


def _acc(x: torch.Tensor) -> int:
    return 64 if x.dtype == torch.float64 else 32


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """t as [N, F] with unit column stride (a copy only where the columns are strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(gate_NF: torch.Tensor, *others: torch.Tensor) -> None:
    for t in others:
        if t.shape != gate_NF.shape or t.dtype != gate_NF.dtype:
            raise ValueError(f"swiglu: operands {tuple(t.shape)} {t.dtype} and gate "
                             f"{tuple(gate_NF.shape)} {gate_NF.dtype} must match in shape and dtype")


def _grid(n: int, f: int) -> tuple[int, int]:
    return triton.cdiv(n, _ROWS), triton.cdiv(f, _BLOCK_F)


def _variant(gate_NF: torch.Tensor, clamp_limit: float | None) -> dict:
    """The kernels' arguments that pick SwiGLU or the clamped form, and the accumulation dtype."""
    return dict(limit=0.0 if clamp_limit is None else clamp_limit, CLAMPED=clamp_limit is not None,
                ACC=_acc(gate_NF), ROWS=_ROWS, BLOCK_F=_BLOCK_F)


@torch.library.custom_op("longctx::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate_NF: torch.Tensor, up_NF: torch.Tensor,
               clamp_limit: float | None = None) -> torch.Tensor:
    """act_NF = silu(gate) * up in the operands' dtype (both [N, F], any row stride); with
    `clamp_limit` l, gpt-oss's (clamp(up, -l, l) + 1) * gc * sigmoid(1.702 gc), gc = clamp(gate, max=l)."""
    _check(gate_NF, up_NF)
    gate_NF, up_NF = _rows_view(gate_NF), _rows_view(up_NF)
    n, f = gate_NF.shape
    act_NF = torch.empty(n, f, dtype=gate_NF.dtype, device=gate_NF.device)
    if act_NF.numel():
        _fwd_kernel[_grid(n, f)](gate_NF, up_NF, act_NF, n, f, gate_NF.stride(0), up_NF.stride(0),
                                 **_variant(gate_NF, clamp_limit))
    return act_NF


@swiglu_fwd.register_fake
def _(gate_NF, up_NF, clamp_limit=None):
    _check(gate_NF, up_NF)
    return gate_NF.new_empty(gate_NF.shape)


def _bwd_outputs(gate_NF):
    n, f = gate_NF.shape
    return gate_NF.new_empty(n, f), gate_NF.new_empty(n, 2 * f)


@torch.library.custom_op("longctx::swiglu_bwd", mutates_args=())
def swiglu_bwd(gate_NF: torch.Tensor, up_NF: torch.Tensor, dact_NF: torch.Tensor,
               clamp_limit: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(act_NF recomputed, dh_N2F = [d gate | d up]) for the activation's gradient dact_NF."""
    _check(gate_NF, up_NF, dact_NF)
    gate_NF, up_NF, dact_NF = _rows_view(gate_NF), _rows_view(up_NF), _rows_view(dact_NF)
    n, f = gate_NF.shape
    act_NF, dh_N2F = _bwd_outputs(gate_NF)
    if act_NF.numel():
        _bwd_kernel[_grid(n, f)](gate_NF, up_NF, dact_NF, act_NF, dh_N2F, n, f, gate_NF.stride(0),
                                 up_NF.stride(0), dact_NF.stride(0), **_variant(gate_NF, clamp_limit))
    return act_NF, dh_N2F


@swiglu_bwd.register_fake
def _(gate_NF, up_NF, dact_NF, clamp_limit=None):
    _check(gate_NF, up_NF, dact_NF)
    return _bwd_outputs(gate_NF)


def _setup(ctx, inputs, output):
    gate_NF, up_NF, ctx.clamp_limit = inputs
    ctx.save_for_backward(gate_NF, up_NF)


def _backward(ctx, dact_NF):
    gate_NF, up_NF = ctx.saved_tensors
    _, dh_N2F = swiglu_bwd(gate_NF, up_NF, dact_NF, ctx.clamp_limit)
    return *dh_N2F.chunk(2, dim=-1), None


swiglu_fwd.register_autograd(_backward, setup_context=_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor, clamp_limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up (or the clamped form, see swiglu_fwd) over any leading shape;
    differentiable (the gradients are the two halves of one buffer)."""
    f = gate.shape[-1]
    return swiglu_fwd(gate.reshape(-1, f), up.reshape(-1, f), clamp_limit).view(gate.shape)
