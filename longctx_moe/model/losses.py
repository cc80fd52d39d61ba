"""Losses: load-balancing aux losses (Switch per micro-batch, DeepSeek-V3 per sequence), router
z-loss, and a chunked fused linear + cross-entropy that never holds fp32 logits for the whole row.

The fused CE and the per-token log-probs also run on a vocabulary split over ranks (a
vocab-parallel LM head, `VocabShard`): each rank projects onto its own rows of W, the softmax
max and sum-exp and the target logit are all-reduced over the shard's group per chunk, and the
gradients of W are formed locally; [T, V] is never gathered.

Shapes: T tokens, E experts, K top-k, N documents, D model dim, V vocabulary (V_l: this rank's
rows of a vocab-parallel head), C tokens of one chunk.
All router statistics are fp32 (or float64 for a float64 model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from cp_attention.kernels import accumulate_dtype
from data_packing.batch import IGNORE_INDEX
from longctx_moe.kernels import cpu_logprobs, triton_ops
from longctx_moe.kernels.logits_cache import keeps_logits, kept_logits
from longctx_moe.model.layers import autocast_dtype

# Sums a no-grad statistic (int64 counts) over the ranks that share one micro-batch's tokens.
Reduce = Callable[[torch.Tensor], torch.Tensor]


def _normalised(scores_TE: torch.Tensor) -> torch.Tensor:
    # Sigmoid scores do not sum to one; DeepSeek-V3 normalises them for the balance statistic.
    return scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(torch.finfo(scores_TE.dtype).tiny)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def id_counts(ids: torch.Tensor, n: int, weight: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [n]: occurrences of each id in [0, n) among `ids` (any shape), each counted
    `weight` times (int or bool, ids' shape) when given. The shape is n whatever the values:
    torch.bincount's is one past the largest id, which a GPU reads back (a sync for the max and
    one for the min) and a meta tensor cannot give. An id outside [0, n) fails here (an index
    error on the host, a device-side assert on a GPU)."""
    flat = ids.reshape(-1).long()
    ones = torch.ones_like(flat) if weight is None else weight.reshape(-1).long()
    return flat.new_zeros(n).scatter_add_(0, flat, ones)


def _real_rows(x: torch.Tensor, real_T: torch.Tensor | None) -> torch.Tensor:
    """x (rows along dim 0) with the rows of padding tokens zeroed (where, so that no value of a
    padding row reaches a sum or a gradient); x itself without a mask."""
    if real_T is None:
        return x
    return torch.where(real_T.view(-1, *[1] * (x.dim() - 1)), x, 0)


def _token_count(real_T: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """int64 scalar on like's device: the real tokens (every row of `like` without a mask).
    Filled on the device: a host int copied there would wait for the queued kernels."""
    if real_T is None:
        return like.new_full((), like.shape[0], dtype=torch.int64)
    return real_T.sum()


def switch_aux_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor,
                    reduce: Reduce | None = None, real_T: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss E * sum_e f_e * P_e over one micro-batch (1.0 when balanced).

    f_e = fraction of the T*K assignments that went to e; P_e = mean normalised score of e;
    both over the real tokens (`real_T`, bool [T]; every token when None).
    With `reduce` (sums no-grad statistics over the ranks that split this micro-batch's tokens,
    e.g. CP), the value is this shard's share: the shares sum to the loss of the whole batch."""
    reduce = reduce or _identity
    t, e = scores_TE.shape
    k = topk_idx_TK.shape[1]
    w_TK = None if real_T is None else real_T[:, None].expand(t, k)
    counts_E = reduce(id_counts(topk_idx_TK, e, w_TK))
    t_all = reduce(_token_count(real_T, scores_TE)).clamp_min(1).to(scores_TE.dtype)
    f_E = counts_E.to(scores_TE.dtype) / (t_all * k)
    p_E = _real_rows(_normalised(scores_TE), real_T).sum(0) / t_all
    return e * torch.dot(f_E, p_E)


def sequence_aux_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor, doc_id_T: torch.Tensor,
                      num_docs: int, reduce: Reduce | None = None) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss of each document: [N], 0 for empty documents.

    For document s with T_s tokens: E/(K T_s^2) * sum_e count_se * sum_t p_te. Padding (doc_id -1)
    counts for nothing. A packed row's per-document values equal those of each document on its own.
    Without `reduce` the real tokens' doc ids must be non-decreasing (true for packed rows): the
    per-document score sums are a segment reduction, ~100x faster on CPU than index_add_.
    `reduce` as in switch_aux_loss (doc ids must then be global to the micro-batch, any order).
    Every shape follows from T, E, K and num_docs: nothing is read back from the device."""
    e = scores_TE.shape[1]
    k = topk_idx_TK.shape[1]
    if reduce is None:
        reduce = _identity
    else:
        # A CP shard lists its zigzag pieces before its whole documents: global ids may go down.
        order_T = torch.argsort(doc_id_T, stable=True)
        doc_id_T, scores_TE, topk_idx_TK = doc_id_T[order_T], scores_TE[order_T], topk_idx_TK[order_T]
    counts_NE, len_N, psum_NE = _per_document(_normalised(scores_TE), topk_idx_TK, doc_id_T, num_docs)
    counts_NE, len_all_N = reduce(counts_NE).to(scores_TE.dtype), reduce(len_N).to(scores_TE.dtype)
    return (counts_NE * psum_NE).sum(-1) * e / (k * len_all_N.square().clamp_min(1))


def _per_document(p_TE: torch.Tensor, idx_TK: torch.Tensor, doc_id_T: torch.Tensor, num_docs: int):
    """(assignments per document and expert int64 [N, E], real tokens per document int64 [N],
    summed p of each document's real tokens [N, E]) for doc ids non-decreasing over the real
    tokens (-1 at padding). Each padding token joins the segment of the document before it (the
    first document for leading ones) with weight 0: every segment is then contiguous and the
    sums add exact zeros to the real tokens' values, in their order."""
    t, e = p_TE.shape
    if num_docs == 0:  # an idle rank's stand-in batch has no document
        zeros = idx_TK.new_zeros(0, dtype=torch.int64)
        return zeros.view(0, e), zeros, p_TE.new_zeros(0, e)
    real_T = doc_id_T >= 0
    seg_T = doc_id_T.cummax(0).values.clamp_min(0)
    flat_TK = seg_T[:, None] * e + idx_TK
    counts_NE = id_counts(flat_TK, num_docs * e, real_T[:, None].expand_as(flat_TK)).view(num_docs, e)
    # unsafe: the lengths sum to T by construction; the check would read them back.
    psum_NE = torch.segment_reduce(_real_rows(p_TE, real_T), "sum", lengths=id_counts(seg_T, num_docs),
                                   unsafe=True)
    return counts_NE, id_counts(seg_T, num_docs, real_T), psum_NE


def router_z_loss(logits_TE: torch.Tensor, reduce: Reduce | None = None,
                  real_T: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE router z-loss: mean over the real tokens (`real_T`, bool [T]; all when None) of
    logsumexp(logits)^2 (0 for no tokens); `reduce` as in switch_aux_loss."""
    t_all = (reduce or _identity)(_token_count(real_T, logits_TE))
    sq_T = _real_rows(torch.logsumexp(logits_TE, dim=-1).square(), real_T)
    return sq_T.sum() / t_all.clamp_min(1).to(sq_T.dtype)


@dataclass(frozen=True)
class VocabShard:
    """A vocabulary split over the ranks of `group`: this rank's W holds the rows of ids
    [start, start + V_l). The group is passed explicitly by whoever split the head (TP)."""

    group: Any
    start: int

    def reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def gather_columns(self, z_TV: torch.Tensor) -> torch.Tensor:
        """[T, V_l] -> [T, V] (no gradient): every rank's columns in vocabulary order."""
        parts = [torch.empty_like(z_TV) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, z_TV.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


def _sharded_log_softmax(z_CV: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """log_softmax over the whole vocabulary of this rank's columns z_CV (acc dtype): the max and
    the sum-exp are reduced over the shard's group, so no rank holds all V columns."""
    m_C1 = z_CV.detach().amax(-1, keepdim=True)
    shard.reduce(m_C1, dist.ReduceOp.MAX)
    sum_C1 = (z_CV.detach() - m_C1).exp().sum(-1, keepdim=True)
    shard.reduce(sum_C1)
    return z_CV - (m_C1 + sum_C1.log())


def _target_cols(labels_C: torch.Tensor, v_local: int, shard: VocabShard | None):
    """(column of each label in this rank's W, bool mask of the labels this rank holds; None when
    the vocabulary is whole)."""
    if shard is None:
        return labels_C, None
    local_C = labels_C - shard.start
    own_C = (local_C >= 0) & (local_C < v_local)
    return local_C.clamp(0, v_local - 1), own_C


def _pick(t_CV: torch.Tensor, cols_C: torch.Tensor, own_C, shard: VocabShard | None):
    """t[c, label_c] for each row: read on the rank holding the label's column, summed over the
    shard's group (the other ranks contribute zero)."""
    out_C = t_CV.gather(1, cols_C[:, None]).squeeze(1)
    if shard is None:
        return out_C
    return shard.reduce(torch.where(own_C, out_C, torch.zeros_like(out_C)))


def _block_rows(c: int, v: int, device: torch.device) -> int:
    """Rows per block of _softmax_grad_rows over a [c, v] chunk: on CPU, blocks whose fp32 copy
    fits in cache; elsewhere the whole chunk.

    With one intra-op thread, 1 MiB blocks (L2-resident) measured ~2x faster than 8 MiB ones
    (1024 x 16384 bf16 chunk on this CPU, medians of 5: 132 ms vs 266 ms). With several threads
    every op is a parallel region, and on a busy 2-core machine 1 MiB blocks (8x more ops) ran
    2-3x slower than 8 MiB ones (last-level cache), so those keep 8 MiB. A GPU gains nothing from
    blocks and pays each one's ~9 kernel launches: at a 32K vocabulary 8 MiB is 64 rows, and the
    ~1B model's 32K-token step on an H200, whose host was the bottleneck, ran 511 such blocks
    (docs/PERFORMANCE.md). Every op here is per row, so the blocking does not change results."""
    if device.type != "cpu":
        return max(1, c)
    block_bytes = (1 << 20) if torch.get_num_threads() == 1 else (8 << 20)
    return max(1, block_bytes // (4 * v))


def _softmax_grad_rows(logits_CV, labels_C, weight_C, acc, want_grad):
    """Per-row CE (acc dtype [C]) of a chunk's logits; with want_grad, overwrite the logits in place
    with d CE / d logits = weight * (softmax - onehot).

    Works in blocks of rows that stay in cache (see _block_rows): on a memory-bound CPU this
    turns many DRAM passes over the [C, V] chunk into one read and one write. Per block, one fused
    log_softmax (reads the low-precision logits, writes acc) replaces upcast + logsumexp + sub;
    the target column's gradient exp(logp_y) - 1 is formed in acc before the single downcast."""
    c, v = logits_CV.shape
    rows = _block_rows(c, v, logits_CV.device)
    ce_C = torch.empty(c, dtype=acc, device=logits_CV.device)
    for s in range(0, c, rows):
        blk = logits_CV[s:s + rows]
        y_B1 = labels_C[s:s + rows, None]
        logp_BV = torch.log_softmax(blk, -1, dtype=acc)
        logp_y_B1 = logp_BV.gather(1, y_B1)
        ce_C[s:s + rows] = logp_y_B1.squeeze(1).neg()
        if not want_grad:
            continue
        p_BV = logp_BV.exp_().scatter_(1, y_B1, logp_y_B1.exp_().sub_(1))
        if weight_C is not None:
            p_BV.mul_(weight_C[s:s + rows, None])
        blk.copy_(p_BV)
    return ce_C


def _sharded_softmax_grad_rows(logits_CV, labels_C, weight_C, acc, want_grad, shard):
    """_softmax_grad_rows on this rank's vocabulary columns: per-row CE over the whole vocabulary
    (acc [C], the same on every rank of the shard) and, with want_grad, this rank's columns of
    d CE / d logits written in place."""
    logp_CV = _sharded_log_softmax(logits_CV.to(acc), shard)
    cols_C, own_C = _target_cols(labels_C, logits_CV.shape[1], shard)
    ce_C = _pick(logp_CV, cols_C, own_C, shard).neg()
    if want_grad:
        p_CV = logp_CV.exp_()
        rows = own_C.nonzero().squeeze(1)
        p_CV.index_put_((rows, cols_C[rows]), p_CV.new_tensor(-1.0), accumulate=True)
        if weight_C is not None:
            p_CV.mul_(weight_C[:, None])
        logits_CV.copy_(p_CV)
    return ce_C


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_n w_n * CE(h[idx_n] @ W^T, y_n) computed chunk by chunk; gradients are formed in the
    forward (as Liger's fused linear CE does) so neither logits nor softmax are kept for backward,
    and the target rows are gathered per chunk so h's gradient is an index_copy, not a scatter-add.
    With a VocabShard, w_VD holds V_l rows: h's gradient is partial per rank and summed over the
    shard's group once, after the last chunk."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, idx_N, labels_N, weight_N, chunk, cdtype, shard, impl="torch"):
        acc = accumulate_dtype(cdtype)
        w_c = w_VD.to(cdtype)  # one cast per forward, not one per chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h_TD) if need_h else None
        grad_w = None
        # Each chunk's CE lands in ce_N, summed once after the loop (launches per chunk are the
        # host's cost on a GPU); the weights are cast once.
        ce_N = torch.empty(idx_N.numel(), dtype=acc, device=h_TD.device)
        weight_N = None if weight_N is None else weight_N.to(acc)
        rows_fn = _rows_fn(impl, shard, chunk, acc, h_TD.device)
        for s in range(0, idx_N.numel(), chunk):
            rows = idx_N[s:s + chunk]
            h_c = h_TD.index_select(0, rows).to(cdtype)
            w_C = None if weight_N is None else weight_N[s:s + chunk]
            g_CV = h_c @ w_c.t()  # logits of one chunk, overwritten by their gradient
            ce_N[s:s + chunk] = rows_fn(g_CV, labels_N[s:s + chunk], w_C, acc, need_h or need_w)
            if need_h:
                grad_h.index_copy_(0, rows, (g_CV @ w_c).to(h_TD.dtype))
            if need_w:
                g_w = g_CV.t() @ h_c
                grad_w = g_w.to(w_VD.dtype) if grad_w is None else grad_w.add_(g_w)
        if need_w and grad_w is None:
            grad_w = torch.zeros_like(w_VD)
        if need_h and shard is not None:
            shard.reduce(grad_h)
        ctx.save_for_backward(grad_h, grad_w)
        total = (ce_N if weight_N is None else ce_N * weight_N).sum()
        return total.float() if acc == torch.float32 else total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # Out of place: a retained graph may run this backward twice.
        gh = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
        gw = None if grad_w is None else grad_w * grad_out.to(grad_w.dtype)
        return gh, gw, None, None, None, None, None, None, None


def _rows_fn(impl: str, shard, chunk: int, acc: torch.dtype, device):
    """The chunk's CE and in-place logits gradient: torch's (a float32 copy of the chunk), or
    Triton's log-prob kernels (two passes over the chunk in its own dtype)."""
    if impl == "triton":
        return triton_ops().cross_entropy_rows(chunk, acc, device, shard)
    return _softmax_grad_rows if shard is None else partial(_sharded_softmax_grad_rows, shard=shard)


def chunked_cross_entropy(h_TD: torch.Tensor, w_VD: torch.Tensor, labels_T: torch.Tensor,
                          loss_weight_T: torch.Tensor | None = None,
                          chunk_tokens: int = 1024,
                          shard: VocabShard | None = None, impl: str = "torch") -> torch.Tensor:
    """ce_sum: sum over target tokens (labels != -100) of loss_weight * CE of the
    logits h @ W^T. h [T, D] (any float dtype), W [V, D]; ce_sum is fp32 (float64 for float64).

    Only target rows are projected, chunk_tokens at a time, in the autocast dtype when autocast is on.
    `shard`: W holds this rank's V_l rows of a vocab-parallel head; every rank of the shard's
    group must pass the same h and labels, and gets the same ce_sum. `impl` (Ops.logprobs): the
    softmax work of each chunk on torch or in Triton (kernels/triton_logprobs.py; the C++ path
    serves the log-prob head only, so cpp runs torch's here)."""
    if chunk_tokens < 1:
        raise ValueError(f"execution.loss_chunk_tokens={chunk_tokens} must be >= 1")
    idx_N = (labels_T != IGNORE_INDEX).nonzero().squeeze(1)
    labels_N = labels_T.index_select(0, idx_N)
    weight_N = None if loss_weight_T is None else loss_weight_T.index_select(0, idx_N)
    cdtype = autocast_dtype(h_TD)
    return _LinearCrossEntropy.apply(h_TD, w_VD, idx_N, labels_N, weight_N, chunk_tokens, cdtype, shard, impl)


class _LinearLogProbs(torch.autograd.Function):
    """(logp_N, entropy_N) of the rows idx_N of h @ W^T / temperature, chunk by chunk.

    Unlike _LinearCrossEntropy the upstream gradient is per token (an RL loss weighs each token
    by its own advantage and ratio), so the logits' gradient cannot be formed in the forward. The
    backward needs each chunk's logits again: the forward keeps them when all N x V of them fit in
    `keep_bytes` (the LM head's products then fall from four to three), else the backward
    recomputes each chunk's from h and W and never holds more than one chunk of [C, V]; the
    recomputed logits are the kept ones bit for bit. With a VocabShard the row statistics
    (max, sum-exp, target log-prob, entropy) are reduced over its group per chunk, and h's
    partial gradient once at the end of the backward."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, idx_N, labels_N, chunk, cdtype, temperature, want_entropy, shard,
                keep_bytes=0, cpp=False):
        acc = accumulate_dtype(cdtype)
        w_c = w_VD.to(cdtype)
        n = idx_N.numel()
        logp_N = torch.empty(n, dtype=acc, device=h_TD.device)
        keep = keeps_logits(ctx, n, w_VD.shape[0], cdtype, keep_bytes)
        kept = []
        # The fused CPU kernel's row statistics (lse; the entropies, always written) are kept for
        # its backward; without it lse_N is empty.
        fused = cpp and cpu_logprobs.serves(cdtype, h_TD.device, shard)
        ent_N = torch.zeros(n if want_entropy or fused else 0, dtype=acc, device=h_TD.device)
        lse_N = torch.empty(n if fused else 0, dtype=acc, device=h_TD.device)
        for s in range(0, n, chunk):
            rows = idx_N[s:s + chunk]
            z_CV = _chunk_logits(h_TD, w_c, rows, cdtype)
            if keep:
                kept.append(z_CV)
            cols_C, own_C = _target_cols(labels_N[s:s + chunk], w_VD.shape[0], shard)
            if fused:
                logp_N[s:s + chunk], ent_N[s:s + chunk], lse_N[s:s + chunk] = \
                    cpu_logprobs.forward_stats(z_CV, cols_C, temperature, want_entropy)
                continue
            logp_CV = _log_softmax(z_CV, acc, temperature, shard)
            logp_N[s:s + chunk] = _pick(logp_CV, cols_C, own_C, shard)
            if want_entropy:
                ent_N[s:s + chunk] = _row_sum(-(logp_CV.exp() * logp_CV), shard)
        ctx.save_for_backward(h_TD, w_VD, idx_N, labels_N, lse_N, ent_N)
        ctx.meta = (chunk, cdtype, acc, temperature, shard)
        ctx.kept = kept
        return logp_N, ent_N if want_entropy else ent_N[:0]

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        h_TD, w_VD, idx_N, labels_N, lse_N, ent_stats_N = ctx.saved_tensors
        chunk, cdtype, acc, temperature, shard = ctx.meta
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_c = w_VD.to(cdtype)
        grad_h = torch.zeros_like(h_TD) if need_h else None
        grad_w = torch.zeros(w_VD.shape, dtype=acc, device=w_VD.device) if need_w else None
        with_ent = g_ent_N is not None and g_ent_N.numel() > 0
        kept = ctx.kept
        for i, s in enumerate(range(0, idx_N.numel(), chunk)):
            rows = idx_N[s:s + chunk]
            z_CV = kept_logits(kept, i)
            if z_CV is None:
                z_CV = _chunk_logits(h_TD, w_c, rows, cdtype)
            g_logp_C = g_logp_N[s:s + chunk].to(acc)
            if lse_N.numel():  # the forward ran the fused CPU kernel: so does the backward
                sl = slice(s, s + chunk)
                g_CV = cpu_logprobs.backward_grad_(z_CV, labels_N[sl], lse_N[sl], ent_stats_N[sl], g_logp_C,
                                                   g_ent_N[sl] if with_ent else None, temperature)
                _project_grad(g_CV, h_TD, w_c, rows, cdtype, acc, grad_h, grad_w)
                continue
            if with_ent or shard is not None:
                logp_CV = _log_softmax(z_CV, acc, temperature, shard)
                p_CV = logp_CV.exp()
                g_CV = p_CV * -g_logp_C[:, None]
            else:  # the probabilities alone, in one pass, and the gradient written over them
                g_CV = _softmax(z_CV, acc, temperature)
                g_CV.mul_(-g_logp_C[:, None])
            # d logp_y / d z = (onehot_y - p) / temperature
            cols_C, own_C = _target_cols(labels_N[s:s + chunk], w_VD.shape[0], shard)
            if own_C is not None:  # only the rank holding the label's column adds the one-hot
                g_logp_C = torch.where(own_C, g_logp_C, torch.zeros_like(g_logp_C))
            g_CV.scatter_add_(1, cols_C[:, None], g_logp_C[:, None])
            if with_ent:
                # H = -sum p log p;  d H / d z_j = -p_j (log p_j + H) / temperature
                ent_C1 = _row_sum(-(p_CV * logp_CV), shard)[:, None]
                g_CV -= g_ent_N[s:s + chunk, None].to(acc) * p_CV * (logp_CV + ent_C1)
            if temperature != 1.0:
                g_CV /= temperature
            _project_grad(g_CV.to(cdtype), h_TD, w_c, rows, cdtype, acc, grad_h, grad_w)
        if need_h and shard is not None:
            shard.reduce(grad_h)
        return (grad_h, None if grad_w is None else grad_w.to(w_VD.dtype),
                None, None, None, None, None, None, None, None, None)


def _project_grad(g_CV, h_TD, w_c, rows, cdtype, acc, grad_h, grad_w) -> None:
    """Add one chunk's logits gradient (cdtype) to h's rows and to W: the head's two products."""
    if grad_h is not None:
        grad_h.index_add_(0, rows, (g_CV @ w_c).to(h_TD.dtype))
    if grad_w is not None:
        grad_w += (g_CV.t() @ h_TD.index_select(0, rows).to(cdtype)).to(acc)


def _row_sum(t_CV: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
    """Sum over the whole vocabulary of each row: [C]."""
    out_C = t_CV.sum(-1)
    return out_C if shard is None else shard.reduce(out_C)


def _chunk_logits(h_TD, w_c, rows, cdtype):
    """h[rows] @ W^T in the compute dtype: [C, V] (this rank's V_l columns with a VocabShard)."""
    return h_TD.index_select(0, rows).to(cdtype) @ w_c.t()


def _softmax(z_CV, acc, temperature):
    """softmax(z / temperature) in the accumulation dtype: [C, V] (unsharded)."""
    if temperature != 1.0:
        return torch.softmax(z_CV.to(acc) / temperature, -1)
    return torch.softmax(z_CV, -1, dtype=acc)


def _log_softmax(z_CV, acc, temperature, shard=None):
    """log_softmax(z / temperature) in the accumulation dtype: [C, V] (this rank's V_l columns,
    normalised over the whole vocabulary, with a VocabShard)."""
    if shard is not None:
        return _sharded_log_softmax(z_CV.to(acc) / temperature, shard)
    if temperature != 1.0:
        return torch.log_softmax(z_CV.to(acc) / temperature, -1)
    return torch.log_softmax(z_CV, -1, dtype=acc)


def chunked_token_logprobs(h_TD: torch.Tensor, w_VD: torch.Tensor, labels_T: torch.Tensor,
                           chunk_tokens: int = 1024, temperature: float = 1.0,
                           entropy: bool = False, shard: VocabShard | None = None,
                           impl: str = "torch",
                           logits_cache_mb: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(labels_T[t]) under softmax(h_t @ W^T / temperature): logp_T [T] fp32
    (float64 for float64), 0 where labels_T == -100, differentiable; and the entropy of each
    row's distribution (entropy_T, same layout) when `entropy`. [T, V] is never materialised.
    `shard` as in chunked_cross_entropy; `impl` (Ops.logprobs) runs the softmax work of each chunk
    on torch, in Triton (longctx_moe.kernels.triton_logprobs) or in C++ (kernels/cpu_logprobs.py,
    for the calls it serves); the backward reuses the forward's logits when they fit in
    `logits_cache_mb` (execution.loss_logits_cache_mb), else recomputes them."""
    if chunk_tokens < 1:
        raise ValueError(f"execution.loss_chunk_tokens={chunk_tokens} must be >= 1")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    idx_N = (labels_T != IGNORE_INDEX).nonzero().squeeze(1)
    labels_N = labels_T.index_select(0, idx_N)
    cdtype = autocast_dtype(h_TD)
    if logits_cache_mb < 0:
        raise ValueError(f"execution.loss_logits_cache_mb={logits_cache_mb} must be >= 0 (0: recompute)")
    args = (h_TD, w_VD, idx_N, labels_N, chunk_tokens, cdtype, float(temperature), entropy, shard,
            logits_cache_mb << 20)
    if impl == "triton":
        logp_N, ent_N = triton_ops().linear_logprobs(*args)
    else:
        logp_N, ent_N = _LinearLogProbs.apply(*args, impl == "cpp")
    t = labels_T.shape[0]
    logp_T = logp_N.new_zeros(t).index_put((idx_N,), logp_N)
    ent_T = ent_N.new_zeros(t).index_put((idx_N,), ent_N) if entropy else None
    return logp_T, ent_T
