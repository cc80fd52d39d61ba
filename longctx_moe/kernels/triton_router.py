"""Router scores, top-k selection and combine weights in one Triton kernel (and its backward).

    router_topk(logits_TE, score, top_k, renormalize, bias_E) -> (scores_TE, idx_TK, weight_TK)

The torch path is moe.Router: scores = softmax | sigmoid of the logits; the top-k experts are
chosen on scores + bias (the aux-loss-free bias steers selection only); the weights are the
unbiased scores of the chosen experts, renormalised to sum to 1 when asked (the sum clamped at
1e-20). Experts come out in descending order of score + bias, as torch.topk returns them; on
exact ties the lower expert id wins. The logits GEMM stays in torch (it is a [T, D] x [D, E]
product); this kernel replaces the ~8 elementwise/reduction passes over [T, E] that follow it.

Backward: d weight / d scores through the renormalisation, scattered onto the chosen experts and
added to the incoming d scores (the aux losses read the scores), then through softmax or sigmoid.
The kernels run as torch operators, torch.ops.longctx.router_topk_{fwd,bwd}.
Legend: T tokens, E experts, K top-k. Math in the logits' dtype (fp32, float64 for float64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_T = 16  # tokens per program: E is small (8-256), so a program holds [16, E] values


@triton.jit
def _router_fwd_kernel(z_ptr, bias_ptr, s_ptr, idx_ptr, w_ptr, sum_ptr, T, E,
                       K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                       RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    in_e = cols[None, :] < E
    mask = (rows[:, None] < T) & in_e
    offs = rows[:, None].to(tl.int64) * E + cols[None, :]
    z = tl.load(z_ptr + offs, mask=mask, other=float("-inf"))
    z = tl.where(rows[:, None] < T, z, 0.0)  # rows past T: finite values, never stored
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-z))
    else:
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        s = e / tl.sum(e, axis=1)[:, None]
    s = tl.where(mask, s, 0.0)
    tl.store(s_ptr + offs, s, mask=mask)
    sel = s
    if HAS_BIAS:
        sel = s + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(s.dtype)[None, :]
    sel = tl.where(in_e, sel, float("-inf"))
    idx = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=s.dtype)
    for k in tl.static_range(K):
        best = tl.argmax(sel, axis=1)  # the first maximum: the lower id wins a tie
        hit = cols[None, :] == best[:, None]
        w_k = tl.sum(tl.where(hit, s, 0.0), axis=1)
        idx = tl.where(kcols[None, :] == k, best[:, None].to(tl.int64), idx)
        w = tl.where(kcols[None, :] == k, w_k[:, None], w)
        sel = tl.where(hit, float("-inf"), sel)
    kmask = (rows[:, None] < T) & (kcols[None, :] < K)
    koffs = rows[:, None].to(tl.int64) * K + kcols[None, :]
    total = tl.sum(w, axis=1)
    if RENORM:
        w = w / tl.maximum(total, 1e-20)[:, None]
    tl.store(idx_ptr + koffs, idx, mask=kmask)
    tl.store(w_ptr + koffs, w, mask=kmask)
    tl.store(sum_ptr + rows, total, mask=rows < T)


@triton.jit
def _router_bwd_kernel(gs_ptr, gw_ptr, s_ptr, idx_ptr, w_ptr, sum_ptr, gz_ptr, T, E,
                       K: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                       HAS_GS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < T) & (cols[None, :] < E)
    offs = rows[:, None].to(tl.int64) * E + cols[None, :]
    s = tl.load(s_ptr + offs, mask=mask, other=0.0)
    g = tl.zeros([BLOCK_T, BLOCK_E], dtype=s.dtype)
    if HAS_GS:
        g = tl.load(gs_ptr + offs, mask=mask, other=0.0).to(s.dtype)
    kmask = (rows[:, None] < T) & (kcols[None, :] < K)
    koffs = rows[:, None].to(tl.int64) * K + kcols[None, :]
    gw = tl.load(gw_ptr + koffs, mask=kmask, other=0.0).to(s.dtype)
    idx = tl.load(idx_ptr + koffs, mask=kmask, other=-1)
    if RENORM:
        # w_k = s_k / S: d/ds_j = (delta_kj - w_k) / S; a clamped S (< 1e-20) is a constant.
        w = tl.load(w_ptr + koffs, mask=kmask, other=0.0)
        total = tl.load(sum_ptr + rows, mask=rows < T, other=1.0)
        dot = tl.where(total >= 1e-20, tl.sum(gw * w, axis=1), 0.0)
        gw = (gw - dot[:, None]) / tl.maximum(total, 1e-20)[:, None]
    for k in tl.static_range(K):
        idx_k = tl.sum(tl.where(kcols[None, :] == k, idx, 0), axis=1)
        gw_k = tl.sum(tl.where(kcols[None, :] == k, gw, 0.0), axis=1)
        g += tl.where(cols[None, :] == idx_k[:, None], gw_k[:, None], 0.0)
    if SIGMOID:
        gz = g * s * (1.0 - s)
    else:
        gz = s * (g - tl.sum(g * s, axis=1)[:, None])
    tl.store(gz_ptr + offs, gz, mask=mask)


def _blocks(e: int, k: int) -> dict:
    return dict(BLOCK_T=_BLOCK_T, BLOCK_E=triton.next_power_of_2(e),
                BLOCK_K=triton.next_power_of_2(k))


def _fwd_outputs(z_TE, top_k):
    """The forward's (s_TE, idx_TK, w_TK, sum_T), unwritten (the fake implementation's result)."""
    t = z_TE.shape[0]
    s_TE = torch.empty(z_TE.shape, dtype=z_TE.dtype, device=z_TE.device)
    idx_TK = torch.empty(t, top_k, dtype=torch.int64, device=z_TE.device)
    w_TK = torch.empty(t, top_k, dtype=z_TE.dtype, device=z_TE.device)
    sum_T = torch.empty(t, dtype=z_TE.dtype, device=z_TE.device)
    return s_TE, idx_TK, w_TK, sum_T


# The kernels as torch operators (torch.ops.longctx.*), each with a fake implementation: a meta
# or fake tensor gets its outputs' shapes and dtypes with no launch (the cluster rehearsal), and
# torch.compile sees one opaque node. The autograd formula is registered below them.

@torch.library.custom_op("longctx::router_topk_fwd", mutates_args=())
def router_topk_fwd(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int,
                    sigmoid: bool, renormalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores_TE, idx_TK int64, weight_TK, sum_T: the chosen scores' sum before renormalising)."""
    z_TE = logits_TE.contiguous()
    t, e = z_TE.shape
    s_TE, idx_TK, w_TK, sum_T = _fwd_outputs(z_TE, top_k)
    if t:
        _router_fwd_kernel[(triton.cdiv(t, _BLOCK_T),)](
            z_TE, z_TE if bias_E is None else bias_E.contiguous(), s_TE, idx_TK, w_TK, sum_T,
            t, e, K=top_k, SIGMOID=sigmoid, HAS_BIAS=bias_E is not None,
            RENORM=renormalize, **_blocks(e, top_k))
    return s_TE, idx_TK, w_TK, sum_T


@router_topk_fwd.register_fake
def _(logits_TE, bias_E, top_k, sigmoid, renormalize):
    return _fwd_outputs(logits_TE, top_k)


@torch.library.custom_op("longctx::router_topk_bwd", mutates_args=())
def router_topk_bwd(g_s_TE: torch.Tensor | None, g_w_TK: torch.Tensor, s_TE: torch.Tensor,
                    idx_TK: torch.Tensor, w_TK: torch.Tensor, sum_T: torch.Tensor, sigmoid: bool,
                    renormalize: bool) -> torch.Tensor:
    """g_z_TE: the gradient of the logits from those of the scores (none: zero) and weights."""
    s_TE, idx_TK, w_TK, sum_T = (a.contiguous() for a in (s_TE, idx_TK, w_TK, sum_T))
    t, e = s_TE.shape
    g_z_TE = torch.empty_like(s_TE)
    if t:
        top_k = idx_TK.shape[1]
        _router_bwd_kernel[(triton.cdiv(t, _BLOCK_T),)](
            s_TE if g_s_TE is None else g_s_TE.contiguous(), g_w_TK.contiguous(), s_TE, idx_TK,
            w_TK, sum_T, g_z_TE, t, e, K=top_k, SIGMOID=sigmoid, RENORM=renormalize,
            HAS_GS=g_s_TE is not None, **_blocks(e, top_k))
    return g_z_TE


@router_topk_bwd.register_fake
def _(g_s_TE, g_w_TK, s_TE, idx_TK, w_TK, sum_T, sigmoid, renormalize):
    return torch.empty(s_TE.shape, dtype=s_TE.dtype, device=s_TE.device)


def _router_setup(ctx, inputs, output):
    _, _, _, sigmoid, renormalize = inputs
    _, idx_TK, _, sum_T = output
    ctx.mark_non_differentiable(idx_TK, sum_T)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the ids and sums: a launch each
    ctx.save_for_backward(*output)
    ctx.opts = (sigmoid, renormalize)


def _router_backward(ctx, g_s_TE, _g_idx, g_w_TK, _g_sum):
    s_TE, idx_TK, w_TK, sum_T = ctx.saved_tensors
    g_w_TK = torch.zeros_like(w_TK) if g_w_TK is None else g_w_TK
    g_z_TE = router_topk_bwd(g_s_TE, g_w_TK, s_TE, idx_TK, w_TK, sum_T, *ctx.opts)
    return g_z_TE, None, None, None, None


router_topk_fwd.register_autograd(_router_backward, setup_context=_router_setup)


def router_topk(logits_TE: torch.Tensor, score: str, top_k: int, renormalize: bool,
                bias_E: torch.Tensor | None = None):
    """(scores_TE, idx_TK int64, weight_TK) as moe.Router computes them from logits_TE (fp32 or
    float64 [T, E]); scores and weights are differentiable in the logits."""
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"model.router_score={score!r} has no Triton kernel; use softmax or sigmoid")
    if not 1 <= top_k <= logits_TE.shape[-1]:
        raise ValueError(f"top_k={top_k} must lie in [1, E={logits_TE.shape[-1]}]")
    s_TE, idx_TK, w_TK, _ = router_topk_fwd(logits_TE, bias_E, top_k, score == "sigmoid",
                                            renormalize)
    return s_TE, idx_TK, w_TK
