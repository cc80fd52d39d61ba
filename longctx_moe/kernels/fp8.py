"""FP8 GEMMs through torch's own `torch._scaled_mm` (`model.fp8=torch`).

The recipe is Transformer Engine's "current scaling" with its HYBRID format: every operand is
scaled per tensor from its own absolute maximum at the moment it is quantised (no amax history,
so nothing to checkpoint or to warm up), activations and weights in E4M3, output gradients in E5M2
(wider range, fewer bits: gradients span more decades than they need digits). Weights are
quantised from the float32 master weights on every call (one rounding, not bf16 then FP8), and
the optimizer only ever sees float32. The dense linears of attention and MLPs and the experts'
grouped GEMMs run in FP8; the router, a shared expert's gate, the embedding and the LM head stay
in the compute dtype, as in TE-based trainers (they are small, or precision-sensitive, or both).

Forward and both backward products are FP8 x FP8 with float32 accumulation, so each of the three
GEMMs of a linear layer runs on FP8 tensor cores. The quantised operands are what autograd
saves: an FP8 activation is half the bytes of a bf16 one.

cuBLAS's FP8 GEMM wants the second operand column-major, and both the contraction length and
the output width multiples of 16. The contraction of a weight gradient is over tokens, so rows
are zero-padded to a multiple of 16 there (zeros add nothing to a sum). Widths are the model's
and are checked with a one-line error. On CPU `_scaled_mm` runs too (slowly: it is the reference
the tests use); `model.fp8=torch` is refused on devices without FP8 tensor cores.

Shape legend: M rows (tokens), K contraction, N output features, E experts, D / F the experts'
input / output widths.
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_CHOICES = ("none", "torch", "te")
_ALIGN = 16  # cuBLAS FP8: contraction and output widths in multiples of 16 elements


def unavailable_reason(setting: str, device, tp: int = 1) -> str | None:
    """None when `model.fp8=setting` can run on `device`, else one cause-and-fix sentence."""
    device = torch.device(device)
    if setting == "none":
        return None
    if setting == "te":
        return ("model.fp8=te: the Transformer Engine path is not built (its wheels cannot be installed "
                "or run where this project is tested); model.fp8=torch runs the same recipe through "
                "torch's FP8 GEMMs; or set model.fp8=none")
    if setting != "torch":
        return f"model.fp8={setting!r} is not one of {FP8_CHOICES}"
    if tp > 1:
        return (f"model.fp8=torch with parallel.tp={tp}: the tensor-parallel projections run their own "
                "GEMMs and are not FP8 yet; set parallel.tp=1 or model.fp8=none")
    if device.type != "cuda":
        return f"model.fp8=torch needs a CUDA GPU with FP8 tensor cores, not {device.type}; set model.fp8=none"
    if torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        return (f"model.fp8=torch needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} has {cap}; set model.fp8=none")
    return None


def quantize(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in `fp8`, its float32 dequantisation factor): x ~ x_q * inv_scale, with one scale per
    tensor mapping the largest |x| onto the format's largest finite value (an all-zero tensor
    keeps scale 1). Non-finite values stay non-finite, for the trainer's step guard to see."""
    top = torch.finfo(fp8).max
    amax = x.detach().abs().amax().float()
    scale = torch.where(amax > 0, top / amax, torch.ones_like(amax))
    x_q = (x.detach().float() * scale).clamp(-top, top).to(fp8)
    return x_q, scale.reciprocal()


def _check_widths(k: int, n: int, device: torch.device) -> None:
    if device.type == "cuda" and (k % _ALIGN or n % _ALIGN):
        raise ValueError(f"model.fp8=torch: a GEMM of contraction {k} and width {n} is not FP8-able "
                         f"(cuBLAS needs multiples of {_ALIGN}); make the model's widths multiples of "
                         f"{_ALIGN} or set model.fp8=none")


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    extra = -x.shape[0] % _ALIGN
    return x if not extra else torch.cat([x, x.new_zeros(extra, *x.shape[1:])])


def scaled_mm(a_MK: torch.Tensor, inv_a: torch.Tensor, b_KN: torch.Tensor, inv_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a * inv_a) @ (b * inv_b) of FP8 operands, float32 accumulation, in `out_dtype`. Takes any
    layouts: a is made row-major and b column-major, as cuBLAS wants them."""
    _check_widths(a_MK.shape[1], b_KN.shape[1], a_MK.device)
    if a_MK.shape[0] == 0:
        return a_MK.new_zeros(0, b_KN.shape[1], dtype=out_dtype)
    b_col = b_KN if b_KN.stride(0) == 1 else b_KN.t().contiguous().t()
    return torch._scaled_mm(a_MK.contiguous(), b_col, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)


def _contract_rows(x_MK: torch.Tensor, g_MN: torch.Tensor, inv_x, inv_g, out_dtype) -> torch.Tensor:
    """x^T @ g over the M rows (a weight gradient), rows zero-padded to a multiple of 16."""
    if x_MK.shape[0] == 0:  # an expert without rows this step
        return torch.zeros(x_MK.shape[1], g_MN.shape[1], dtype=out_dtype, device=x_MK.device)
    return scaled_mm(_pad_rows(x_MK).t(), inv_x, _pad_rows(g_MN), inv_g, out_dtype)


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    # _scaled_mm writes bf16, fp16 or fp32; float64 callers (tests) get float32 results, cast up.
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


class _Fp8Linear(torch.autograd.Function):
    """y_MN = x_MK @ w_NK^T (+ b_N) with FP8 operands in all three products."""

    @staticmethod
    def forward(ctx, x_MK, w_NK, b_N, cdtype):
        x_q, inv_x = quantize(x_MK, E4M3)
        w_q, inv_w = quantize(w_NK, E4M3)
        y_MN = scaled_mm(x_q, inv_x, w_q.t(), inv_w, _out_dtype(cdtype)).to(cdtype)
        if b_N is not None:
            y_MN = y_MN + b_N.to(cdtype)
        ctx.save_for_backward(x_q, inv_x, w_q, inv_w)
        ctx.dtypes = (x_MK.dtype, w_NK.dtype, None if b_N is None else b_N.dtype)
        return y_MN

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_MN):
        x_q, inv_x, w_q, inv_w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g_q, inv_g = quantize(g_MN, E5M2)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(g_q, inv_g, w_q, inv_w, _out_dtype(x_dtype)).to(x_dtype)
        if ctx.needs_input_grad[1]:  # (x^T g)^T = g^T x: rows over N, contraction over M
            dw = _contract_rows(g_q, x_q, inv_g, inv_x, torch.float32).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = g_MN.float().sum(0).to(b_dtype)
        return dx, dw, db, None


def linear(x: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, cdtype: torch.dtype) -> torch.Tensor:
    """F.linear in FP8 over the last dim of x (any leading dims); the result in `cdtype`."""
    y_MN = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), w_NK, b_N, cdtype)
    return y_MN.view(*x.shape[:-1], w_NK.shape[0])


class _Fp8Grouped(torch.autograd.Function):
    """y_MF: rows sorted by expert, counts_E rows each, y[rows of e] = x[rows of e] @ w_EDF[e],
    FP8 with one scale for the activations and one per expert's weight (each expert's weight
    is its own tensor, as in TE's GroupedLinear). One GEMM per expert with rows."""

    @staticmethod
    def forward(ctx, x_MD, w_EDF, counts_E, cdtype):
        x_q, inv_x = quantize(x_MD, E4M3)
        per_expert = [quantize(w, E4M3) for w in w_EDF]
        w_q, inv_w = [q for q, _ in per_expert], [inv for _, inv in per_expert]
        counts = counts_E.tolist()
        pieces = torch.split(x_q, counts)
        out = _out_dtype(cdtype)
        y = [scaled_mm(p, inv_x, w_q[e], inv_w[e], out) for e, p in enumerate(pieces)]
        ctx.save_for_backward(x_q, inv_x, *w_q, *inv_w)
        ctx.counts, ctx.dtypes = counts, (x_MD.dtype, w_EDF.dtype)
        return torch.cat(y).to(cdtype) if y else x_MD.new_zeros(0, w_EDF.shape[-1], dtype=cdtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_MF):
        x_q, inv_x, *rest = ctx.saved_tensors
        e = len(rest) // 2
        w_q, inv_w = rest[:e], rest[e:]
        x_dtype, w_dtype = ctx.dtypes
        g_q, inv_g = quantize(g_MF, E5M2)
        g_pieces, x_pieces = torch.split(g_q, ctx.counts), torch.split(x_q, ctx.counts)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            out = _out_dtype(x_dtype)
            dx = torch.cat([scaled_mm(g, inv_g, w_q[i].t(), inv_w[i], out)
                            for i, g in enumerate(g_pieces)]).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.stack([_contract_rows(x, g, inv_x, inv_g, torch.float32)
                              for x, g in zip(x_pieces, g_pieces, strict=True)]).to(w_dtype)
        return dx, dw, None, None


def grouped_matmul(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
                   cdtype: torch.dtype) -> torch.Tensor:
    """The experts' grouped GEMM in FP8 (model.grouped_gemm's contract, result in `cdtype`)."""
    return _Fp8Grouped.apply(x_MD, w_EDF, counts_E, cdtype)


__all__ = ["E4M3", "E5M2", "FP8_CHOICES", "grouped_matmul", "linear", "quantize", "scaled_mm",
           "unavailable_reason"]
