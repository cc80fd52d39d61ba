"""Small dense building blocks: RMSNorm, rotary embedding (rotate-half, Qwen/Llama layout), SwiGLU MLP.

Shapes: T tokens, D model dim, H heads, R head dim (rotary dim), F MLP hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longctx_moe.kernels import cpu_rmsnorm, triton_ops

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `x` run in: the autocast dtype when autocast is on for x's device
    and x is fp32, else x's own dtype. Used where we cast by hand (ops autocast does not cover)."""
    return _autocast_of(x.dtype, x.device.type)


def _autocast_of(dtype: torch.dtype, kind: str) -> torch.dtype:
    if dtype == torch.float32 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return dtype


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), normalised in at least fp32.

    Returns the dtype the next matmul wants: the autocast dtype for an fp32 input under autocast
    (so q/k/v/router/experts share one cast instead of one per consumer), else x's dtype.

    The backward keeps x as it came and one fp32 scale per row (_RMSNormFn), not the fp32 copy
    and normalised tensor that autograd through the composite op keeps: at long context the
    norms' saved tensors were a third of a layer's activations.

    `impl` (Ops.norm): torch; triton, one Triton kernel (longctx_moe.kernels); cpp, the fused C++
    kernel for the rows it serves (kernels/cpu_rmsnorm.py)."""

    def __init__(self, dim: int, eps: float = 1e-6, impl: str = "torch"):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (x + residual, norm(x + residual)): one kernel under Triton."""
        if residual is None:
            return self._norm(x)
        if self.impl == "triton" and x.shape == residual.shape:
            dtype = _autocast_of(torch.promote_types(x.dtype, residual.dtype), x.device.type)
            return triton_ops().add_rmsnorm(x, residual, self.weight, self.eps, dtype)
        s = x + residual
        return s, self._norm(s)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "triton":
            return triton_ops().rmsnorm(x, self.weight, self.eps, autocast_dtype(x))
        return _RMSNormFn.apply(x, self.weight, self.eps, autocast_dtype(x), self.impl == "cpp")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # bf16/fp16 inputs are normalised in fp32 (as HF Qwen3 does); float64 stays float64 so the
    # float64 exactness tests are not limited by fp32 rounding.
    return torch.float32 if x.dtype in _LOW_PRECISION else x.dtype


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm with a lean backward. Legend: N rows (any leading shape), D normalised dim.

    forward:  r_N = rsqrt(mean(x^2) + eps),  y = w * x * r
    backward: xh = x * r (recomputed),  dw = sum_N(g * xh),
              dx = r * (g w - xh * mean_D(g w * xh))"""

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype, cpp: bool = False):
        ctx.fused = cpp and cpu_rmsnorm.serves(x, out_dtype)  # the same arithmetic in one pass per row
        if ctx.fused:
            y_ND, r_N = cpu_rmsnorm.forward(x.reshape(-1, x.shape[-1]), weight, eps, out_dtype)
            ctx.save_for_backward(x, weight, r_N.view(*x.shape[:-1], 1))
            return y_ND.view(x.shape)
        dtype = _compute_dtype(x)
        x_hi = x.to(dtype)
        r_N1 = torch.rsqrt(x_hi.square().mean(-1, keepdim=True) + eps)
        y = x_hi * r_N1 * weight.to(dtype)
        ctx.save_for_backward(x, weight, r_N1)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, r_N1 = ctx.saved_tensors
        if ctx.fused:
            d = x.shape[-1]
            dx_ND, dw = cpu_rmsnorm.backward(g.reshape(-1, d), x.reshape(-1, d), weight, r_N1.reshape(-1))
            return dx_ND.view(x.shape), dw.to(weight.dtype), None, None, None
        dtype = r_N1.dtype
        xh = x.to(dtype) * r_N1
        gw = g.to(dtype) * weight.to(dtype)
        dx = r_N1 * (gw - xh * (gw * xh).mean(-1, keepdim=True))
        dw = (g.to(dtype) * xh).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None


def rope_cos_sin(position_ids_T: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [T, R] for positions [T] (R = head_dim, halves repeated as in HF's layout).

    Computed in fp32 like HF's Qwen3: positions < 2^24 are exact and the angles match HF bit for bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids_T.device,
                                             dtype=torch.float32) / head_dim))
    freqs_TR2 = position_ids_T.float()[:, None] * inv_freq[None, :]
    emb_TR = torch.cat((freqs_TR2, freqs_TR2), dim=-1)
    return emb_TR.cos(), emb_TR.sin()


def apply_rope(x_THR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x*cos + rotate_half(x)*sin; cos/sin must already have x's dtype."""
    half = x_THR.shape[-1] // 2
    x1, x2 = x_THR[..., :half], x_THR[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_THR * cos_TR[:, None, :] + rotated * sin_TR[:, None, :]


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x)). Used for first_k_dense layers and the shared
    expert; separate gate/up projections so TP can column-shard them without interleaving.
    `impl` (Ops.swiglu): torch, or triton (the activation and its backward in one pass each,
    kernels/triton_swiglu.py); the C++ kernel serves the experts' [gate | up] rows only."""

    def __init__(self, dim: int, hidden: int, impl: str = "torch"):
        super().__init__()
        self.triton = impl == "triton"
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TF, up_TF = self.w_gate(x_TD), self.w_up(x_TD)
        if torch.compiler.is_compiling() or type(self.w_down) is not nn.Linear:
            # Inductor's partitioner already recomputes the pointwise silu and product in the
            # backward instead of saving them; the plain ops let it fuse them. A w_down that is
            # not a plain Linear (execution.fp8's Fp8Linear) runs its own product.
            return self.w_down(F.silu(gate_TF) * up_TF)
        # The weight's cast is the one autocast would make, outside the function so its gradient
        # reaches the fp32 parameter through autograd.
        return _GatedDown.apply(gate_TF, up_TF, self.w_down.weight.to(gate_TF.dtype), self.triton)


class _GatedDown(torch.autograd.Function):
    """linear(silu(gate) * up, w) keeping only gate, up and w for the backward. Autograd through
    the three ops also keeps silu(gate) and the activation ([T, F] each: 2 of the D + 4F values a
    token holds per dense MLP); the backward recomputes both (two pointwise ops) and forms the
    products autograd's linear, mul and silu backward form, in their order, so every gradient is
    bitwise the plain composition's. The experts' version is experts._SwiGLUDown. Legend: N rows
    (any leading shape), F hidden, D model dim."""

    @staticmethod
    def forward(ctx, gate_NF, up_NF, w_DF, triton: bool = False):
        ctx.triton = triton  # the activation and its gradients in one Triton pass each way
        ctx.save_for_backward(gate_NF, up_NF, w_DF)
        act_NF = triton_ops().swiglu(gate_NF, up_NF) if triton else F.silu(gate_NF) * up_NF
        return F.linear(act_NF, w_DF)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_ND):
        gate_NF, up_NF, w_DF = ctx.saved_tensors
        if ctx.triton:
            return (*_GatedDown.triton_backward(gate_NF, up_NF, w_DF, g_ND, ctx.needs_input_grad[2]),
                    None)
        silu_NF = F.silu(gate_NF)
        act_NF = silu_NF * up_NF
        g_2D = g_ND.reshape(-1, g_ND.shape[-1])
        dw_DF = g_2D.t().mm(act_NF.reshape(-1, act_NF.shape[-1])) if ctx.needs_input_grad[2] else None
        del act_NF
        dact_NF = g_2D.mm(w_DF).view(gate_NF.shape)
        dup_NF = dact_NF * silu_NF
        del silu_NF
        dgate_NF = torch.ops.aten.silu_backward(dact_NF.mul_(up_NF), gate_NF)
        return dgate_NF, dup_NF, dw_DF, None

    @staticmethod
    def triton_backward(gate_NF, up_NF, w_DF, g_ND, weight_grad: bool):
        """(d gate, d up: views of one [N, 2F] buffer, d w) with the activation's backward in
        Triton; the same GEMMs as the torch path."""
        f = gate_NF.shape[-1]
        g_2D = g_ND.reshape(-1, g_ND.shape[-1])
        dact_2F = g_2D.mm(w_DF)
        act_2F, dh_2F2 = triton_ops().swiglu_bwd(gate_NF.reshape(-1, f), up_NF.reshape(-1, f), dact_2F)
        del dact_2F
        dw_DF = g_2D.t().mm(act_2F) if weight_grad else None
        dgate_NF, dup_NF = dh_2F2.view(*gate_NF.shape[:-1], 2 * f).chunk(2, dim=-1)
        return dgate_NF, dup_NF, dw_DF
