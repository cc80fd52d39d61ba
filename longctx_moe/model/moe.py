"""Mixture-of-experts FFN: router, the single-device token dispatcher, and the MoE layer that ties
them with the experts (model/experts.py) together with its balance statistics.

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

import torch
import torch.nn.functional as F
from torch import nn

from cp_attention.kernels import accumulate_dtype
from longctx_moe.compile import eager_only
from longctx_moe.execution import Ops
from longctx_moe.kernels import triton_ops
from longctx_moe.model.attention import DocLayout
from longctx_moe.model.config import BalanceConfig, ModelConfig
from longctx_moe.model.experts import GroupedExperts
from longctx_moe.model.grouped_gemm import (
    pad_layout,
    wants_padding,
)
from longctx_moe.model.layers import SwiGLU
from longctx_moe.model.losses import id_counts, router_z_loss, sequence_aux_loss, switch_aux_loss
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
                return topk_idx_TK, self._scaled(topk_weight_TK), RouterAux(logits_TE, scores_TE)
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
        return topk_idx_TK, self._scaled(topk_weight_TK), aux

    def _scaled(self, topk_weight_TK: torch.Tensor) -> torch.Tensor:
        """The weights times routed_scaling_factor; a factor of 1 multiplies nothing (a launch
        each way on a GPU for the same values)."""
        return topk_weight_TK if self.scale == 1.0 else topk_weight_TK * self.scale

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
    # The rows the GEMM wants: padded groups on CPU only, so no probe tensor is made elsewhere.
    pad = x_TD.device.type == "cpu" and wants_padding(x_TD.new_empty(0, dtype=cdtype), experts.batch_invariant)
    if pad:
        slot_TK, counts_E, total = permute_layout(topk_idx_TK, experts.num_local_experts, pad)
    else:  # the same rows by a counting sort in three launches
        slot_TK, counts_E = triton_ops().route_layout(topk_idx_TK, experts.num_local_experts)
        total = topk_idx_TK.numel()
    x_PD = triton_ops().permute(x_TD, slot_TK, total, cdtype)
    kw = {} if pad else host_rows(experts, counts_E, *topk_idx_TK.shape)
    y_PD = experts(x_PD, counts_E, padded=True, **kw)
    return triton_ops().unpermute(y_PD, slot_TK, topk_weight_TK)  # rounds the weights to y's dtype itself


class SharedExpert(SwiGLU):
    """The always-on expert: a dense SwiGLU, optionally scaled per token by sigmoid(x w_gate_T1)
    (Qwen2-MoE's `shared_expert_gate`). TP shards it like a dense MLP; the scale is per token, so
    it may multiply the pre-reduction partial sums (the gate's gradient is then partial per TP
    rank: tensor_parallel tags it)."""

    def __init__(self, dim: int, hidden: int, gated: bool, impl: str = "torch"):
        super().__init__(dim, hidden, impl)
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
        self.shared = SharedExpert(cfg.hidden_size, hs, cfg.shared_expert_gate, ops.swiglu) if hs > 0 else None
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
        if self._fused_balance(layout):
            aux_loss, z_loss, counts_E = triton_ops().balance_losses(
                scores_TE, aux.logits_TE, topk_idx_TK, layout.doc_id_T, layout.num_docs, bal.aux_loss_coeff,
                bal.z_loss_coeff)
            return MoEStats(aux_loss=aux_loss, z_loss=z_loss, counts_E=counts_E, topk_idx_TK=topk_idx_TK,
                            replay_known=known, replay_agree=agree)
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

    def _fused_balance(self, layout: DocLayout) -> bool:
        """Whether the balance statistics take the Triton kernels (triton_balance, with the
        router's Triton path): the sequence-wise loss of one rank's documents (no reduction over
        ranks) and at least one document; the other cases keep the torch path."""
        return (self.ops.router == "triton" and layout.balance_losses and self.balance.aux_loss_type == "seq"
                and layout.reduce_stats is None and layout.num_docs > 0)


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
