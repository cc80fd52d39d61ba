"""The MoE layer's balance statistics in four launches forward and one backward: the
sequence-wise aux loss, the router z-loss and the real tokens routed to each expert.

    balance_losses(scores_TE, logits_TE, idx_TK, doc_id_T, num_docs, aux_coeff, z_coeff)
        -> (aux_loss, z_loss, counts_E int64)

The torch path is moe.MoE.stats with balance.aux_loss_type=seq and no reduction over ranks
(losses.sequence_aux_loss, losses.router_z_loss, losses.id_counts): ~45 small launches forward
and ~28 in autograd's backward per layer. Here:
- a zero-filled int64 buffer takes, by integer atomics (exact, in any order), the assignments per
  document and expert, the real tokens per document and the assignments per expert;
- one pass over the tokens: p = scores / their row sum (the clamp as the torch path's), each real
  token's c_s * sum_e count_se * p_te (c_s = E / (K max(len_s^2, 1)): the document's loss is the
  sum over its tokens, the per-document sums of p never formed) and lse(logits)^2, as one partial
  sum per block of tokens;
- one program sums the partials in a fixed order (deterministic) and writes both losses;
- the backward writes d scores and d logits per token from the same counts in one pass.
Padding (doc id -1) counts for nothing; real tokens need not be in document order.
Legend: T tokens, E experts, K top-k, N documents. Math in the scores' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_T = 16  # tokens per program (E is small: a program holds [16, E] values)
_BLOCK_P = 1024  # partial sums the finishing program adds per iteration


@triton.jit
def _counts_kernel(idx_ptr, doc_ptr, cnt_ptr, T, E, N, K: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    doc = tl.load(doc_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    real = (rows < T) & (doc >= 0)
    one = tl.full([BLOCK_T], 1, tl.int64)
    tl.atomic_add(cnt_ptr + N * E + doc, one, mask=real)
    for k in tl.static_range(K):
        e = tl.load(idx_ptr + rows.to(tl.int64) * K + k, mask=real, other=0).to(tl.int64)
        tl.atomic_add(cnt_ptr + doc * E + e, one, mask=real)
        tl.atomic_add(cnt_ptr + N * E + N + e, one, mask=real)


@triton.jit
def _row_stats(s_ptr, z_ptr, doc_ptr, cnt_ptr, rows, cols, T, E, N, K: tl.constexpr):
    """Per token of the block: (real, s, the clamped row sum S, the document's count row as s's
    dtype, c_s, lse of the logits)."""
    in_t = rows < T
    mask = in_t[:, None] & (cols[None, :] < E)
    offs = rows[:, None].to(tl.int64) * E + cols[None, :]
    s = tl.load(s_ptr + offs, mask=mask, other=0.0)
    doc = tl.load(doc_ptr + rows, mask=in_t, other=-1).to(tl.int64)
    real = in_t & (doc >= 0)
    cnt = tl.load(cnt_ptr + doc[:, None] * E + cols[None, :], mask=mask & real[:, None], other=0).to(s.dtype)
    length = tl.load(cnt_ptr + N * E + doc, mask=real, other=0).to(s.dtype)
    c = E / (K * tl.maximum(length * length, 1.0))
    z = tl.load(z_ptr + offs, mask=mask, other=float("-inf"))
    z = tl.where(in_t[:, None], z, 0.0)  # rows past T: finite values, never used
    m = tl.max(z, axis=1)
    lse = m + tl.log(tl.sum(tl.exp(z - m[:, None]), axis=1))
    return real, s, tl.sum(s, axis=1), cnt, c, lse, z, mask, offs


@triton.jit
def _loss_kernel(s_ptr, z_ptr, doc_ptr, cnt_ptr, part_ptr, T, E, N, tiny, K: tl.constexpr,
                 HAS_Z: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    real, s, total, cnt, c, lse, _, _, _ = _row_stats(s_ptr, z_ptr, doc_ptr, cnt_ptr, rows, cols, T, E, N, K)
    p = s / tl.maximum(total, tiny)[:, None]
    v = tl.where(real, c * tl.sum(cnt * p, axis=1), 0.0)
    tl.store(part_ptr + pid, tl.sum(v, axis=0))
    if HAS_Z:
        tl.store(part_ptr + tl.num_programs(0) + pid, tl.sum(tl.where(real, lse * lse, 0.0), axis=0))


@triton.jit
def _finish_kernel(part_ptr, cnt_ptr, aux_ptr, zl_ptr, tok_ptr, P, N, E, aux_scale, z_coeff,
                   HAS_Z: tl.constexpr, BLOCK_P: tl.constexpr):
    offs = tl.arange(0, BLOCK_P)
    aux = tl.zeros([BLOCK_P], dtype=aux_ptr.dtype.element_ty)
    zsum = tl.zeros([BLOCK_P], dtype=aux_ptr.dtype.element_ty)
    tokens = tl.zeros([BLOCK_P], dtype=tl.int64)
    for start in range(0, P, BLOCK_P):
        aux += tl.load(part_ptr + start + offs, mask=start + offs < P, other=0.0)
        if HAS_Z:
            zsum += tl.load(part_ptr + P + start + offs, mask=start + offs < P, other=0.0)
    for start in range(0, N, BLOCK_P):
        tokens += tl.load(cnt_ptr + N * E + start + offs, mask=start + offs < N, other=0)
    t_all = tl.maximum(tl.sum(tokens, axis=0), 1).to(aux.dtype)
    tl.store(aux_ptr, tl.sum(aux, axis=0) * aux_scale)
    tl.store(zl_ptr, tl.sum(zsum, axis=0) / t_all * z_coeff)
    tl.store(tok_ptr, t_all)


@triton.jit
def _bwd_kernel(g_aux_ptr, g_z_ptr, s_ptr, z_ptr, doc_ptr, cnt_ptr, tok_ptr, gs_ptr, gz_ptr, T, E, N,
                tiny, aux_scale, z_coeff, K: tl.constexpr, HAS_GA: tl.constexpr, HAS_GZ: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    real, s, total, cnt, c, lse, z, mask, offs = _row_stats(s_ptr, z_ptr, doc_ptr, cnt_ptr, rows, cols, T, E,
                                                            N, K)
    if HAS_GA:
        # p = s / max(S, tiny): d p_e / d s_j = delta_ej / S - s_e / S^2 (S a constant when clamped)
        g_p = tl.where(real, c * tl.load(g_aux_ptr).to(s.dtype) * aux_scale, 0.0)[:, None] * cnt
        clamped = tl.maximum(total, tiny)
        dot = tl.where(total >= tiny, tl.sum(g_p * s, axis=1) / clamped, 0.0)
        tl.store(gs_ptr + offs, (g_p - dot[:, None]) / clamped[:, None], mask=mask)
    if HAS_GZ:
        scale = tl.load(g_z_ptr).to(s.dtype) * z_coeff / tl.load(tok_ptr)
        soft = tl.exp(z - lse[:, None])
        g_z = tl.where(real, 2.0 * lse * scale, 0.0)[:, None] * soft
        tl.store(gz_ptr + offs, g_z, mask=mask)


def _blocks(e: int) -> dict:
    return dict(BLOCK_T=_BLOCK_T, BLOCK_E=triton.next_power_of_2(e))


def _fwd_outputs(scores_TE, num_docs):
    """(aux, z, counts [N*E + N + E] int64, real tokens clamped at 1 as scores' dtype), unwritten."""
    e, dev, dt = scores_TE.shape[1], scores_TE.device, scores_TE.dtype
    return (torch.empty((), dtype=dt, device=dev), torch.empty((), dtype=dt, device=dev),
            torch.empty(num_docs * e + num_docs + e, dtype=torch.int64, device=dev),
            torch.empty((), dtype=dt, device=dev))


# The kernels as torch operators (torch.ops.longctx.*) with fake implementations (no launch on
# meta tensors: the cluster rehearsal); the autograd formula is registered below them.

@torch.library.custom_op("longctx::balance_fwd", mutates_args=())
def balance_fwd(scores_TE: torch.Tensor, logits_TE: torch.Tensor, idx_TK: torch.Tensor,
                doc_id_T: torch.Tensor, num_docs: int, aux_coeff: float, z_coeff: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux_loss, z_loss, counts: [counts_NE | len_N | counts_E] int64, real tokens (>= 1))."""
    s_TE, z_TE, idx_TK, doc_T = (a.contiguous() for a in (scores_TE, logits_TE, idx_TK, doc_id_T))
    t, e = s_TE.shape
    aux, zl, cnt, tok = _fwd_outputs(s_TE, num_docs)
    cnt.zero_()
    grid = (max(triton.cdiv(t, _BLOCK_T), 1),)
    part = torch.empty(2 * grid[0], dtype=s_TE.dtype, device=s_TE.device)
    _counts_kernel[grid](idx_TK, doc_T, cnt, t, e, num_docs, K=idx_TK.shape[1], BLOCK_T=_BLOCK_T)
    _loss_kernel[grid](s_TE, z_TE, doc_T, cnt, part, t, e, num_docs, torch.finfo(s_TE.dtype).tiny,
                       K=idx_TK.shape[1], HAS_Z=z_coeff != 0, **_blocks(e))
    _finish_kernel[(1,)](part, cnt, aux, zl, tok, grid[0], num_docs, e, aux_coeff / max(num_docs, 1), z_coeff,
                         HAS_Z=z_coeff != 0, BLOCK_P=_BLOCK_P)
    return aux, zl, cnt, tok


@balance_fwd.register_fake
def _(scores_TE, logits_TE, idx_TK, doc_id_T, num_docs, aux_coeff, z_coeff):
    return _fwd_outputs(scores_TE, num_docs)


@torch.library.custom_op("longctx::balance_bwd", mutates_args=())
def balance_bwd(g_aux: torch.Tensor | None, g_z: torch.Tensor | None, scores_TE: torch.Tensor,
                logits_TE: torch.Tensor, doc_id_T: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor,
                top_k: int, num_docs: int, aux_coeff: float, z_coeff: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d scores_TE, d logits_TE) from the losses' gradients (none: zero)."""
    s_TE, z_TE, doc_T = (a.contiguous() for a in (scores_TE, logits_TE, doc_id_T))
    t, e = s_TE.shape
    g_s_TE, g_z_TE = torch.empty_like(s_TE), torch.empty_like(z_TE)
    has_ga, has_gz = g_aux is not None, g_z is not None and z_coeff != 0
    if not has_ga:
        g_s_TE.zero_()
    if not has_gz:
        g_z_TE.zero_()
    if t and (has_ga or has_gz):
        _bwd_kernel[(triton.cdiv(t, _BLOCK_T),)](
            g_aux if has_ga else s_TE, g_z if has_gz else s_TE, s_TE, z_TE, doc_T, counts, tokens, g_s_TE,
            g_z_TE, t, e, num_docs, torch.finfo(s_TE.dtype).tiny, aux_coeff / max(num_docs, 1), z_coeff,
            K=top_k, HAS_GA=has_ga, HAS_GZ=has_gz, **_blocks(e))
    return g_s_TE, g_z_TE


@balance_bwd.register_fake
def _(g_aux, g_z, scores_TE, logits_TE, doc_id_T, counts, tokens, top_k, num_docs, aux_coeff, z_coeff):
    return torch.empty_like(scores_TE), torch.empty_like(logits_TE)


def _setup(ctx, inputs, output):
    scores_TE, logits_TE, idx_TK, doc_id_T, num_docs, aux_coeff, z_coeff = inputs
    _, _, counts, tokens = output
    ctx.mark_non_differentiable(counts, tokens)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the counts: a launch each
    ctx.save_for_backward(scores_TE, logits_TE, doc_id_T, counts, tokens)
    ctx.opts = (idx_TK.shape[1], num_docs, aux_coeff, z_coeff)


def _backward(ctx, g_aux, g_z, _g_counts, _g_tokens):
    g_s_TE, g_z_TE = balance_bwd(g_aux, g_z, *ctx.saved_tensors, *ctx.opts)
    return g_s_TE, g_z_TE, None, None, None, None, None


balance_fwd.register_autograd(_backward, setup_context=_setup)


def balance_losses(scores_TE: torch.Tensor, logits_TE: torch.Tensor, idx_TK: torch.Tensor,
                   doc_id_T: torch.Tensor, num_docs: int, aux_coeff: float, z_coeff: float):
    """(aux_coeff * the mean over documents of the sequence-wise aux loss, z_coeff * the router
    z-loss, counts_E int64: real assignments per expert), the losses differentiable in the scores
    and the logits ([T, E], fp32 or float64). Every document id of a real token lies in
    [0, num_docs), padding's is -1; num_docs >= 1."""
    if num_docs < 1:
        raise ValueError(f"num_docs={num_docs}: the fused balance statistics need a document; "
                         "take the torch path (MoE.stats) for an empty micro-batch")
    e = scores_TE.shape[1]
    aux, zl, counts, _ = balance_fwd(scores_TE, logits_TE, idx_TK, doc_id_T, num_docs, float(aux_coeff),
                                     float(z_coeff))
    return aux, zl, counts[num_docs * e + num_docs:]
