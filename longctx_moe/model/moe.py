"""Mixture-of-experts FFN: router, grouped experts, the single-device token dispatcher, and the
MoE layer that ties them together with its balance statistics.

Dispatch contract (docs/ARCHITECTURE.md):
    router(x_TD) -> (topk_idx_TK, topk_weight_TK, aux)
    dispatcher(x_TD, topk_idx_TK, topk_weight_TK, experts) -> y_TD
    experts(x_MD, tokens_per_local_expert_E) -> y_MD   (rows sorted by local expert)
Expert parallelism swaps `MoE.dispatcher` and slices `GroupedExperts` along dim 0. A dispatcher
with `overlaps_shared` is also handed the shared expert, to run it while tokens travel.

Shapes: T tokens, D model dim, E experts (local experts for GroupedExperts), K top-k,
M = T*K routed rows, F expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from cp_attention.kernels import accumulate_dtype
from longctx_moe.compile import eager_only
from longctx_moe.execution import Ops
from longctx_moe.kernels import cpu_swiglu, fp8, triton_ops
from longctx_moe.model.attention import DocLayout
from longctx_moe.model.config import BalanceConfig, ModelConfig
from longctx_moe.model.grouped_gemm import (
    grouped_matmul,
    grouped_weight_grad,
    host_counts,
    pad_layout,
    resolve_impl,
    wants_padding,
    with_padded_groups,
)
from longctx_moe.model.layers import SwiGLU, autocast_dtype
from longctx_moe.model.losses import id_counts, router_z_loss, sequence_aux_loss, switch_aux_loss
from longctx_moe.model.recompute import recompute_call
from longctx_moe.parallel.comm import RouteTable, RoutingCounts, gather_route_table


@dataclass
class RouterAux:
    logits_TE: torch.Tensor  # fp32 (float64 for a float64 model) router logits
    scores_TE: torch.Tensor  # softmax or sigmoid of the logits (no bias)
    replay_known_T: torch.Tensor | None = None  # bool [T]: routes were given (router replay)
    replay_agree_T: torch.Tensor | None = None  # bool [T]: ... and live routing picked the same


@dataclass
class MoEStats:
    aux_loss: torch.Tensor  # scalar, times balance.aux_loss_coeff
    z_loss: torch.Tensor  # scalar, times balance.z_loss_coeff
    counts_E: torch.Tensor  # int64 [E]: real tokens routed to each expert (after top-k)
    topk_idx_TK: torch.Tensor  # int64 [T, K]: the experts each token was sent to
    # Router replay: real tokens whose experts were given, and those where live routing agrees:
    # int64 scalars on the device where routes were replayed (read back with the step's other
    # sums, once per step), else 0.
    replay_known: torch.Tensor | int = 0
    replay_agree: torch.Tensor | int = 0


class Router(nn.Module):
    """Linear scores -> softmax|sigmoid -> top-k (selection may add the aux-free expert bias) ->
    weights from the unbiased scores, optionally renormalised. Math in fp32 regardless of autocast.
    Under `impl` (Ops.router) triton everything after the logits GEMM is one kernel (triton_router).
    `balance` gives the expert bias's update rate (BalanceConfig() when None)."""

    def __init__(self, cfg: ModelConfig, impl: str = "torch", balance: BalanceConfig | None = None):
        super().__init__()
        balance = BalanceConfig() if balance is None else balance
        self.top_k, self.score, self.renormalize = cfg.top_k, cfg.router_score, cfg.router_renormalize
        self.use_bias, self.bias_rate = cfg.expert_bias, balance.expert_bias_update_rate
        self.impl = impl
        self.groups, self.topk_groups = cfg.router_groups, cfg.router_topk_groups
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # gpt-oss: a bias on the logits, so it moves the scores and the selection alike.
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None
        # Aux-loss-free balancing bias (DeepSeek-V3): selection only, updated by update_bias.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor, replay_TK: torch.Tensor | None = None):
        """(topk_idx_TK, topk_weight_TK, RouterAux). `replay_TK` (int [T, K], -1 = unknown) forces
        the experts of every token whose K entries are all known (router replay, R3); their
        weights still come from the current scores, so the router keeps learning."""
        dtype = accumulate_dtype(x_TD.dtype)
        with torch.autocast(x_TD.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.to(dtype)
            logits_TE = F.linear(x_TD.to(dtype), self.weight.to(dtype), bias)
        # The Triton kernel has no group-limited selection: those routers take the torch path.
        if self.groups == 1 and self.impl == "triton":
            bias_E = self.expert_bias if self.use_bias else None
            scores_TE, topk_idx_TK, topk_weight_TK = triton_ops().router_topk(
                logits_TE, self.score, self.top_k, self.renormalize, bias_E)
            if replay_TK is None:
                return topk_idx_TK, topk_weight_TK * self.scale, RouterAux(logits_TE, scores_TE)
            # Replayed routes: the given experts' weights are gathered from the kernel's scores.
            return self._weights(logits_TE, scores_TE, topk_idx_TK, replay_TK)
        scores_TE = logits_TE.softmax(-1) if self.score == "softmax" else logits_TE.sigmoid()
        select_TE = scores_TE + self.expert_bias.to(dtype) if self.use_bias else scores_TE
        if self.groups > 1:
            select_TE = self._limit_to_groups(select_TE)
        topk_idx_TK = torch.topk(select_TE, self.top_k, dim=-1).indices
        return self._weights(logits_TE, scores_TE, topk_idx_TK, replay_TK)

    def _limit_to_groups(self, select_TE: torch.Tensor) -> torch.Tensor:
        """Selection scores with every expert outside the token's router_topk_groups best groups
        set to -inf (a group's score: the sum of its two best). Not 0: a kept expert's biased score
        can be negative and must still beat every dropped one (DeepSeek-V3's reference, transformers)."""
        t, e = select_TE.shape
        select_TGX = select_TE.view(t, self.groups, e // self.groups)
        group_TG = select_TGX.topk(2, dim=-1).values.sum(-1)
        best_TG = torch.topk(group_TG, self.topk_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_TG, True)
        return select_TGX.masked_fill(~keep_TG[:, :, None], float("-inf")).view(t, e)

    def _weights(self, logits_TE, scores_TE, topk_idx_TK, replay_TK):
        """(idx, weights, aux) of the selected (or replayed) experts from the scores."""
        aux = RouterAux(logits_TE, scores_TE)
        if replay_TK is not None:
            topk_idx_TK = self._replay(topk_idx_TK, replay_TK.to(topk_idx_TK.device).long(), aux)
        topk_weight_TK = scores_TE.gather(1, topk_idx_TK)
        if self.renormalize:
            topk_weight_TK = topk_weight_TK / topk_weight_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        return topk_idx_TK, topk_weight_TK * self.scale, aux

    def _replay(self, live_TK: torch.Tensor, given_TK: torch.Tensor, aux: RouterAux) -> torch.Tensor:
        """The given experts where all K are known, live ones elsewhere; records agreement (the
        same set of experts, in any order) on `aux` for the route-agreement metric."""
        if given_TK.shape != live_TK.shape:
            raise ValueError(f"replayed routes have shape {tuple(given_TK.shape)}, expected "
                             f"{tuple(live_TK.shape)} (tokens, top_k)")
        known_T = (given_TK >= 0).all(-1)
        same_T = (live_TK.sort(-1).values == given_TK.sort(-1).values).all(-1)
        aux.replay_known_T, aux.replay_agree_T = known_T, known_T & same_T
        return torch.where(known_T[:, None], given_TK, live_TK)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        """bias += rate * sign(mean - count): under-loaded experts become more likely to be picked."""
        counts = counts_E.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(self.bias_rate * torch.sign(counts.mean() - counts))


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
    (expert_precision), the SwiGLU's C++ kernel (swiglu), row padding for batch invariance, FP8
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
                                     self.swiglu_impl == "cpp")
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
    def forward(ctx, h_MF2, w_EFD, counts_E, impl, cpp):
        ctx.fused = cpp and cpu_swiglu.serves(h_MF2)  # the same roundings in one pass (kernels/cpu_swiglu.py)
        act_MF = cpu_swiglu.forward(h_MF2) if ctx.fused else _silu_and_act(h_MF2)[1]
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
            act_MF, dh_MF2 = cpu_swiglu.backward(h_MF2, dact_MF)
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


class _GatherRows(torch.autograd.Function):
    """x_TD[token_M] where token_M = order // K lists each token K times in expert order. The
    backward gathers instead of scatter-adding: g_TKD = g_MD[inv_order] summed over K."""

    @staticmethod
    def forward(ctx, x_TD, token_M, inv_order_M, k):
        ctx.save_for_backward(inv_order_M)
        ctx.k = k
        return x_TD.index_select(0, token_M)

    @staticmethod
    def backward(ctx, g_MD):
        (inv_order_M,) = ctx.saved_tensors
        g_TKD = g_MD.index_select(0, inv_order_M).view(-1, ctx.k, g_MD.shape[-1])
        return g_TKD.sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """y[perm] for a permutation; the backward is the gather with the inverse permutation."""

    @staticmethod
    def forward(ctx, y_MD, perm_M, inv_perm_M):
        ctx.save_for_backward(inv_perm_M)
        return y_MD.index_select(0, perm_M)

    @staticmethod
    def backward(ctx, g_MD):
        (inv_perm_M,) = ctx.saved_tensors
        return g_MD.index_select(0, inv_perm_M), None, None


class LocalDispatcher:
    """Single-device dispatch: stable sort of the T*K assignments by expert (argsort + id_counts, no
    one-hot), grouped GEMM, un-sort, and the weighted sum over K as one batched matmul. Nothing is
    read back from the device (the counts stay there for the grouped GEMM's offsets), except for
    experts that loop by host counts (FP8: `wants_rows`), which get them through the routing
    seam `counts` (parallel/comm.py RoutingCounts), once per layer forward.
    `impl` (Ops.permute) triton runs the permute and the un-sort + weighted sum in Triton."""

    def __init__(self, impl: str = "torch", counts: RoutingCounts | None = None):
        self.impl = impl
        self.counts = RoutingCounts() if counts is None else counts

    def __call__(self, x_TD, topk_idx_TK, topk_weight_TK, experts: GroupedExperts) -> torch.Tensor:
        if self.impl == "triton":
            return _triton_dispatch(x_TD, topk_idx_TK, topk_weight_TK, experts, self.host_rows)
        t, k = topk_idx_TK.shape
        flat_M = topk_idx_TK.flatten()
        order_M = torch.argsort(flat_M, stable=True)
        inv_order_M = torch.empty_like(order_M)
        inv_order_M[order_M] = torch.arange(order_M.numel(), device=order_M.device)
        counts_E = id_counts(flat_M, experts.num_local_experts)
        x_MD = _GatherRows.apply(x_TD, order_M // k, inv_order_M, k)
        y_MD = experts(x_MD, counts_E, **self.host_rows(experts, counts_E, t, k))
        y_TKD = _Permute.apply(y_MD, inv_order_M, order_M).view(t, k, y_MD.shape[-1])
        y_T1D = torch.bmm(topk_weight_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD)
        return y_T1D.squeeze(1)

    def take_step_rows(self) -> list[int] | None:
        """Rows each EP rank ran since the last call, where experts are lent; None here (one
        device lends nothing). Every dispatcher answers it (parallel/dispatch.py)."""
        return None

    def host_rows(self, experts, counts_E: torch.Tensor, tokens: int, top_k: int) -> dict:
        """{"rows": counts_E as host ints} for experts that want them, read through the routing
        seam (one copy: a sync on a GPU); {} for the others, which take the device counts."""
        if not getattr(experts, "wants_rows", False):
            return {}
        row_E1 = torch.cat([counts_E, counts_E.new_full((1,), tokens)])
        table = self.counts.read(gather_route_table(row_E1), RouteTable(counts_E.numel(), tokens, top_k))
        return {"rows": table[0, 0, :-1].tolist()}


def permute_layout(topk_idx_TK: torch.Tensor, num_experts: int, pad: bool):
    """(slot_TK, counts_E, P): the row of each (token, k) copy in LocalDispatcher's layout (sorted
    by expert, ties in token order, each expert's rows padded as with_padded_groups pads them when
    `pad`), the rows per expert the GEMM runs (padded counts when `pad`) and the total rows."""
    flat_M = topk_idx_TK.flatten()
    order_M = torch.argsort(flat_M, stable=True)
    counts_E = id_counts(flat_M, num_experts)
    if pad:  # on CPU only (wants_padding), where the counts are host values
        slot_M, counts_E, total = pad_layout(counts_E)
    else:
        slot_M, total = torch.arange(flat_M.numel(), device=flat_M.device), flat_M.numel()
    slot_TK = torch.empty_like(order_M).index_copy_(0, order_M, slot_M).view(topk_idx_TK.shape)
    return slot_TK, counts_E, total


def _triton_dispatch(x_TD, topk_idx_TK, topk_weight_TK, experts: GroupedExperts, host_rows) -> torch.Tensor:
    """LocalDispatcher's result with the permute (cast to the experts' dtype on the way) and the
    un-permute + weighted sum over K as Triton kernels (longctx_moe.kernels.triton_permute).
    `host_rows`: LocalDispatcher.host_rows, for the routed counts (padded ones are host values)."""
    cdtype = experts.compute_dtype(x_TD)
    pad = wants_padding(x_TD.new_empty(0, dtype=cdtype), experts.batch_invariant)  # the rows the GEMM wants
    slot_TK, counts_E, total = permute_layout(topk_idx_TK, experts.num_local_experts, pad)
    x_PD = triton_ops().permute(x_TD, slot_TK, total, cdtype)
    kw = {} if pad else host_rows(experts, counts_E, *topk_idx_TK.shape)
    y_PD = experts(x_PD, counts_E, padded=True, **kw)
    return triton_ops().unpermute(y_PD, slot_TK, topk_weight_TK.to(y_PD.dtype))


class SharedExpert(SwiGLU):
    """The always-on expert: a dense SwiGLU, optionally scaled per token by sigmoid(x w_gate_T1)
    (Qwen2-MoE's `shared_expert_gate`). TP shards it like a dense MLP; the scale is per token, so
    it may multiply the pre-reduction partial sums (the gate's gradient is then partial per TP
    rank: tensor_parallel tags it)."""

    def __init__(self, dim: int, hidden: int, gated: bool):
        super().__init__(dim, hidden)
        self.gate = nn.Linear(dim, 1, bias=False) if gated else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        y_TD = super().forward(x_TD)
        return y_TD if self.gate is None else y_TD * torch.sigmoid(self.gate(x_TD))


class MoE(nn.Module):
    """Routed experts (+ optional shared expert). forward(x_TD, layout) -> (y_TD, MoEStats).
    `balance`: the losses `stats` adds and the router bias's rate (BalanceConfig() when None)."""

    def __init__(self, cfg: ModelConfig, ops: Ops | None = None, balance: BalanceConfig | None = None):
        super().__init__()
        ops = Ops() if ops is None else ops
        balance = BalanceConfig() if balance is None else balance
        self.cfg, self.ops, self.balance = cfg, ops, balance
        self.router = Router(cfg, ops.router, balance)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_hidden_size,
                                      cfg.expert_proj_bias, cfg.expert_activation, cfg.swiglu_limit, ops)
        hs = cfg.shared_expert_hidden_size
        self.shared = SharedExpert(cfg.hidden_size, hs, cfg.shared_expert_gate) if hs > 0 else None
        # Expert parallelism replaces it with a dispatcher over the EP group (parallel/dispatch.py).
        self.dispatcher = LocalDispatcher(ops.permute)

    def forward(self, x_TD: torch.Tensor, layout: DocLayout, replay_TK: torch.Tensor | None = None):
        topk_idx_TK, topk_weight_TK, aux = self.router(x_TD, replay_TK)
        if self.shared is not None and getattr(self.dispatcher, "overlaps_shared", False):
            # An expert-parallel dispatcher computes routed + shared itself, the shared expert
            # while the tokens travel (parallel/dispatch.py); the same sum as below.
            y_TD = self.dispatch(x_TD, topk_idx_TK, topk_weight_TK, self.shared, layout.in_flight)
        else:
            y_TD = self.dispatch(x_TD, topk_idx_TK, topk_weight_TK, turn=layout.in_flight)
            if self.shared is not None:
                y_TD = y_TD + self.shared(x_TD)
        return y_TD, self.stats(topk_idx_TK, aux, layout)

    # Kept out of torch.compile: expert row counts are data dependent (padding, all-to-all splits).
    @eager_only
    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, shared=None, turn=None) -> torch.Tensor:
        """`turn`: DocLayout.in_flight, for a dispatcher whose transfers hand over to another
        micro-batch in flight; passed only when there is one (the local dispatcher moves nothing)."""
        extra = {} if turn is None else {"turn": turn}
        if shared is None:
            return self.dispatcher(x_TD, topk_idx_TK, topk_weight_TK, self.experts, **extra)
        return self.dispatcher(x_TD, topk_idx_TK, topk_weight_TK, self.experts, shared, **extra)

    # Kept out of torch.compile: the reductions over ranks (layout.reduce_stats) are collectives.
    @eager_only
    def stats(self, topk_idx_TK, aux: RouterAux, layout: DocLayout) -> MoEStats:
        """Balance statistics over the real tokens of this micro-batch (padding weighs 0: every
        shape follows from T, E and num_docs, and nothing is read back from the device).

        `layout.reduce_stats` (None on one device) sums no-grad counts over the ranks that split
        the micro-batch's tokens (CP, or the whole data-parallel batch for the global-batch aux
        loss); each rank's aux/z loss is then its share of the global value."""
        bal, scores_TE, red, real_T = self.balance, aux.scores_TE, layout.reduce_stats, layout.real_mask_T
        known, agree = _replay_counts(aux, real_T)
        counts_E = id_counts(topk_idx_TK, self.cfg.num_experts,
                             None if real_T is None else real_T[:, None].expand_as(topk_idx_TK))
        zero = scores_TE.new_zeros(())
        if not layout.balance_losses:  # every rank of the reductions skips them alike
            return MoEStats(aux_loss=zero, z_loss=zero, counts_E=counts_E, topk_idx_TK=topk_idx_TK,
                            replay_known=known, replay_agree=agree)
        if bal.aux_loss_type == "switch":
            aux_loss = bal.aux_loss_coeff * switch_aux_loss(scores_TE, topk_idx_TK, red, real_T)
        elif bal.aux_loss_type == "seq":
            # Padding has doc id -1 (real_mask_T is doc_id_T >= 0): the loss skips it by itself.
            per_doc_N = sequence_aux_loss(scores_TE, topk_idx_TK, layout.doc_id_T, layout.num_docs, red)
            # Mean over this micro-batch's documents (DeepSeek-V3 averages over sequences), so the
            # scale does not grow with how many documents a row packs.
            aux_loss = bal.aux_loss_coeff * per_doc_N.sum() / max(layout.num_docs, 1)
        else:
            aux_loss = zero
        z_loss = bal.z_loss_coeff * router_z_loss(aux.logits_TE, red, real_T) if bal.z_loss_coeff else zero
        return MoEStats(aux_loss=aux_loss, z_loss=z_loss, counts_E=counts_E, topk_idx_TK=topk_idx_TK,
                        replay_known=known, replay_agree=agree)


def _replay_counts(aux: RouterAux, real_T: torch.Tensor | None):
    """(real tokens with replayed routes, of which live routing agreed): int64 scalars on the
    device, summed over the step where it sums its other statistics and read back with them
    (trainer.py); (0, 0) without replay."""
    if aux.replay_known_T is None:
        return 0, 0
    known_T, agree_T = aux.replay_known_T, aux.replay_agree_T
    if real_T is not None:
        known_T, agree_T = known_T & real_T, agree_T & real_T
    return known_T.sum(), agree_T.sum()
