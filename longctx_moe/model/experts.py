"""The experts of an MoE layer: SwiGLU experts held as [E, ...] parameters and run as two grouped
GEMMs over the rows the dispatcher sorted by expert, with their fused activation-and-down-projection
backward.

Contract (docs/ARCHITECTURE.md): experts(x_MD, tokens_per_local_expert_E) -> y_MD, the rows
sorted by local expert. Expert parallelism slices GroupedExperts along dim 0.

Shapes: E experts (local experts under EP), D model dim, M routed rows, F expert hidden.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from longctx_moe.execution import Ops
from longctx_moe.kernels import cpu_swiglu, fp8, triton_ops
from longctx_moe.model.grouped_gemm import (
    grouped_matmul,
    grouped_weight_grad,
    host_counts,
    resolve_impl,
    wants_padding,
    with_padded_groups,
)
from longctx_moe.model.layers import autocast_dtype
from longctx_moe.model.recompute import recompute_call


class GroupedExperts(nn.Module):
    """SwiGLU experts held as [E, ...] parameters, run as two grouped GEMMs.

    w_gate_up [E, D, 2, F] (index 0 of dim 2: gate, 1: up), w_down [E, F, D]. The GEMM reads
    w_gate_up as [E, D, 2F] = [gate | up] (a free view). Keeping gate/up as their own dim makes
    any block of hidden units one rectangular slice (dim 3), so expert tensor parallelism keeps
    [gate | up] of its own units with no reordering (parallel/expert_parallel.py). EP slices dim
    0 and sets num_local_experts / expert_offset (the global index of local expert 0).

    `bias` (model.expert_proj_bias, gpt-oss): b_gate_up [E, 2, F] added to [gate | up] and b_down
    [E, D'] added to the down projection's output columns [down_bias_offset, + D') (ETP splits
    D so that the partial outputs summed over its ranks hold the bias once; D' = D otherwise).
    `activation` (model.expert_activation): swiglu or gpt-oss's clamped_swiglu (`limit`).
    `ops` (longctx_moe.execution): the grouped GEMM (grouped_gemm), the GEMMs' dtype
    (expert_precision), the SwiGLU's one-pass kernel, C++ or Triton (swiglu), row padding for batch invariance, FP8
    (fp8, fp8_recipe: the recipe's object holds these experts' amax histories under delayed
    scaling) and selective recompute (recompute)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, bias: bool = False,
                 activation: str = "swiglu", limit: float = 7.0, ops: Ops | None = None):
        super().__init__()
        ops = Ops() if ops is None else ops
        self.num_local_experts, self.expert_offset = num_experts, 0
        self.impl, self.precision, self.swiglu_impl = ops.grouped_gemm, ops.expert_precision, ops.swiglu
        self.batch_invariant = ops.batch_invariant
        self.activation, self.limit, self.down_bias_offset = activation, limit, 0
        self.recompute = ops.recompute == "selective"
        self.fp8: str | None = ops.fp8_recipe if ops.fp8 != "none" else None
        self.fp8_scaling = fp8.make_recipe(ops.fp8_recipe, ops.fp8_amax_history, ops.fp8_grouped) if self.fp8 else None
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, dim, 2, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.b_gate_up = nn.Parameter(torch.empty(num_experts, 2, hidden)) if bias else None
        self.b_down = nn.Parameter(torch.empty(num_experts, dim)) if bias else None

    def expert_params(self) -> list[torch.Tensor]:
        """Every [E, ...] parameter in a fixed order: the weights, then the biases if any (what
        expert lending sends and `forward`'s `borrowed` holds)."""
        biases = [] if self.b_gate_up is None else [self.b_gate_up, self.b_down]
        return [self.w_gate_up, self.w_down, *biases]

    def compute_dtype(self, x_MD: torch.Tensor) -> torch.dtype:
        if self.precision == "param":
            return self.w_gate_up.dtype
        # _grouped_mm is not on autocast's list: we cast by hand, once per forward per weight.
        return autocast_dtype(x_MD)

    @property
    def wants_rows(self) -> bool:
        """Whether forward wants `rows`, the rows per expert on the host: the FP8 GEMMs loop over
        experts by them. The dispatchers pass them only to experts that say so (stand-ins of the
        plain experts(x, counts) contract need not take them)."""
        return self.fp8 is not None

    def forward(self, x_MD: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                borrowed: tuple[torch.Tensor, ...] | None = None,
                padded: bool = False, x_fp8=None, rows: list[int] | None = None) -> torch.Tensor:
        """`borrowed` (expert_params() of [B, ...] each): other ranks' experts lent for this
        call (parallel/expert_lending.py), run after the local ones; tokens_per_expert then has
        E + B entries. `padded`: the rows are already laid out per expert as the GEMM wants them
        (the dispatcher's Triton permute wrote them so), in the compute dtype. `x_fp8`: the same
        rows already in FP8 (Fp8Tiles of 1 x 128, as the fp8 dispatch sent them), the first
        GEMM's operand under execution.fp8_recipe=block. `rows`: tokens_per_expert_E as host
        ints where the caller has them (the EP dispatchers, from the routing counts); the FP8
        GEMMs loop by them, and read the counts back once here where they are not given."""
        cdtype = self.compute_dtype(x_MD)
        x_MD = x_MD.to(cdtype)
        params = self.expert_params()
        if borrowed is not None:
            params = [torch.cat([p, b]) for p, b in zip(params, borrowed, strict=True)]
        params[0] = params[0].flatten(2)  # w_gate_up [E, D, 2F]: gate columns, then up
        if padded or not wants_padding(x_MD, self.batch_invariant):  # the rows as they came
            rows = self._host_rows(tokens_per_expert_E, rows)
            reuse = x_fp8 is not None and self.fp8 == "block" and not padded  # the FP8 form still matches
            run = partial(self._swiglu, x_fp8=x_fp8 if reuse else None, rows=rows)
        else:  # padded here per expert: the counts are the CPU's host values, the FP8 form is stale
            run = self._padded_swiglu
        if self.recompute and torch.is_grad_enabled():
            return recompute_call(run, params[0], params[1], x_MD, tokens_per_expert_E, *params[2:])
        return run(params[0], params[1], x_MD, tokens_per_expert_E, *params[2:])

    def _host_rows(self, counts_E: torch.Tensor, rows: list[int] | None) -> list[int] | None:
        """The rows per expert on the host for the FP8 GEMMs, which loop over experts by them:
        the caller's (every dispatcher hands them over), else counts_E read back once for the
        call (a sync on a GPU; the CPU's padded counts are host values); None where nothing
        needs them."""
        if not self.fp8 or rows is not None:
            return rows
        return host_counts(counts_E)

    def _padded_swiglu(self, w_gate_up, w_down, x_MD: torch.Tensor, counts_E: torch.Tensor,
                       *biases) -> torch.Tensor:
        # On CPU in bf16, rows are padded per expert so the GEMM shapes repeat (see grouped_gemm).
        def run(x, c):
            return self._swiglu(w_gate_up, w_down, x, c, *biases, rows=self._host_rows(c, None))

        return with_padded_groups(run, x_MD, counts_E, self.batch_invariant)

    def _swiglu(self, w_gate_up, w_down, x_MD: torch.Tensor, counts_E: torch.Tensor,
                *biases, x_fp8=None, rows: list[int] | None = None) -> torch.Tensor:
        h_MF2 = self._grouped(x_MD, w_gate_up, counts_E, x_fp8, rows)
        if self.activation == "swiglu" and not biases and not self.fp8:
            return _SwiGLUDown.apply(h_MF2, w_down.to(x_MD.dtype), counts_E, self.impl,
                                     self.swiglu_impl)
        return self._biased_down(h_MF2, w_down, counts_E, biases, rows)

    def _grouped(self, x_MD: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
                 x_fp8=None, rows: list[int] | None = None) -> torch.Tensor:
        """The experts' grouped GEMM in x's dtype: in FP8 under execution.fp8 (which quantises the
        float32 masters itself: no cast to the compute dtype first; x too, unless `x_fp8` is
        its FP8 form already; looping over experts by the host `rows`), else w cast to x's
        dtype (the device counts_E as its offsets)."""
        if self.fp8:
            return fp8.grouped_matmul(x_MD, w_EDF, rows, x_MD.dtype, self.fp8_scaling, x_fp8)
        return grouped_matmul(x_MD, w_EDF.to(x_MD.dtype), counts_E, self.impl)

    def _biased_down(self, h_MF2, w_EFD, counts_E, biases, rows=None) -> torch.Tensor:
        """The experts with biases and / or the clamped activation, or in FP8, through plain
        autograd (gpt-oss; the bias-free SwiGLU keeps _SwiGLUDown's leaner backward)."""
        m, cdtype = h_MF2.shape[0], h_MF2.dtype
        if biases:  # every row gets its expert's bias (padding rows too: nobody reads them)
            h_MF2 = h_MF2 + biases[0].flatten(1).to(cdtype).repeat_interleave(counts_E, 0, output_size=m)
        gate_MF, up_MF = h_MF2.chunk(2, dim=-1)
        if self.swiglu_impl == "triton":  # one pass each way
            limit = self.limit if self.activation == "clamped_swiglu" else None
            act_MF = triton_ops().swiglu(gate_MF, up_MF, limit)
        else:
            act_MF = _activation(gate_MF, up_MF, self.activation, self.limit)
        y_MD = self._grouped(act_MF, w_EFD, counts_E, rows=rows)
        if not biases:
            return y_MD
        b_ED = biases[1].to(cdtype)
        if b_ED.shape[1] != y_MD.shape[1]:  # this ETP rank's columns of the bias, zeros elsewhere
            lo = self.down_bias_offset
            b_ED = F.pad(b_ED, (lo, y_MD.shape[1] - lo - b_ED.shape[1]))
        return y_MD + b_ED.repeat_interleave(counts_E, 0, output_size=m)


GPT_OSS_ALPHA = 1.702  # gpt-oss's sigmoid slope (transformers' GptOssExperts.alpha)


def _activation(gate_MF: torch.Tensor, up_MF: torch.Tensor, kind: str, limit: float) -> torch.Tensor:
    """silu(gate) * up, or gpt-oss's clamped form in transformers' order of operations."""
    if kind == "swiglu":
        return F.silu(gate_MF) * up_MF
    gate_MF = gate_MF.clamp(max=limit)
    up_MF = up_MF.clamp(min=-limit, max=limit)
    return (up_MF + 1) * (gate_MF * torch.sigmoid(gate_MF * GPT_OSS_ALPHA))


def _fused_path(path: str, h_MF2: torch.Tensor) -> str | None:
    """The one-pass kernel that runs the activation of these rows ("cpp" / "triton"), or None
    for the torch ops."""
    if path == "cpp":
        return "cpp" if cpu_swiglu.serves(h_MF2) else None
    return "triton" if path == "triton" else None


def _fused_forward(path: str, h_MF2: torch.Tensor) -> torch.Tensor:
    if path == "triton":
        return triton_ops().swiglu_fwd(*h_MF2.chunk(2, dim=-1))
    return cpu_swiglu.forward(h_MF2)


def _fused_backward(path: str, h_MF2: torch.Tensor, dact_MF: torch.Tensor):
    """(act_MF recomputed, dh_MF2 = [d gate | d up])."""
    if path == "triton":
        return triton_ops().swiglu_bwd(*h_MF2.chunk(2, dim=-1), dact_MF.to(h_MF2.dtype))
    return cpu_swiglu.backward(h_MF2, dact_MF)


def _silu_and_act(h_MF2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate), silu(gate) * up) of [gate | up] rows."""
    gate_MF, up_MF = h_MF2.chunk(2, dim=-1)
    silu_MF = F.silu(gate_MF)
    return silu_MF, silu_MF * up_MF


class _SwiGLUDown(torch.autograd.Function):
    """grouped_matmul(silu(gate) * up, w_down) keeping only h = [gate | up] (and the weights) for
    the backward. Autograd through the three ops would also keep silu(gate) and the activation
    ([M, F] each, 2 of the 5 bytes-per-row units an expert row holds when F = D); the backward
    recomputes both from h (two elementwise ops), then forms exactly the products autograd would:
    the same aten kernels in the same order (silu_backward, the GEMMs `_grouped_mm`'s backward
    runs), so gradients are bitwise those of the plain composition."""

    @staticmethod
    def forward(ctx, h_MF2, w_EFD, counts_E, impl, act_path="torch"):
        # `act_path` (Ops.swiglu): the activation in one pass each way, with the torch path's
        # roundings (kernels/cpu_swiglu.py for the rows the CPU kernel serves, triton_swiglu.py)
        ctx.fused = _fused_path(act_path, h_MF2)
        act_MF = _fused_forward(ctx.fused, h_MF2) if ctx.fused else _silu_and_act(h_MF2)[1]
        ctx.impl = resolve_impl(impl, act_MF, w_EFD)
        ctx.save_for_backward(h_MF2, w_EFD, counts_E)
        return grouped_matmul(act_MF, w_EFD, counts_E, ctx.impl)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_MD):
        h_MF2, w_EFD, counts_E = ctx.saved_tensors
        g_MD = g_MD.contiguous()
        if ctx.fused:
            dact_MF = grouped_matmul(g_MD, w_EFD.transpose(-2, -1), counts_E, ctx.impl)
            act_MF, dh_MF2 = _fused_backward(ctx.fused, h_MF2, dact_MF)
            del dact_MF
            dw_EFD = grouped_weight_grad(act_MF, g_MD, counts_E, ctx.impl) if ctx.needs_input_grad[1] else None
            return dh_MF2, dw_EFD, None, None, None
        silu_MF, act_MF = _silu_and_act(h_MF2)
        gate_MF, up_MF = h_MF2.chunk(2, dim=-1)
        dw_EFD = grouped_weight_grad(act_MF, g_MD, counts_E, ctx.impl) if ctx.needs_input_grad[1] else None
        del act_MF
        dact_MF = grouped_matmul(g_MD, w_EFD.transpose(-2, -1), counts_E, ctx.impl)
        # Both halves are written into one [M, 2F] buffer and d silu is formed in dact's storage:
        # four [M, F] units live at once instead of the six a cat of fresh tensors needs (the
        # largest transient of the backward on a rank whose experts got many rows).
        dh_MF2 = torch.empty_like(h_MF2)
        dgate_MF, dup_MF = dh_MF2.chunk(2, dim=-1)
        torch.mul(dact_MF, silu_MF, out=dup_MF)
        del silu_MF
        torch.ops.aten.silu_backward.grad_input(dact_MF.mul_(up_MF), gate_MF, grad_input=dgate_MF)
        return dh_MF2, dw_EFD, None, None, None
