"""Per-token log-probs and entropies from hidden states, chunk by chunk, with Triton doing the
softmax work (the RL hot path: compute_logprobs and the policy loss).

    linear_logprobs(h_TD, w_VD, idx_N, labels_N, chunk, cdtype, temperature, entropy, shard)
        -> (logp_N, ent_N)          the contract of losses._LinearLogProbs, its torch path

Each chunk of C target rows gets its logits z_CV = h[rows] @ W^T from the GEMM library (tensor
cores), in the compute dtype; [T, V] never exists. One kernel pass over z_CV then yields, per row,
the online softmax statistics m = max z, s = sum exp(z - m), a = sum exp(z - m) (z - m) and the
target's logit, from which lse = m + log s, logp = z_y - lse and H = log s - a / s. The torch path
makes ~5 passes over [C, V] in fp32 for the same numbers. With a VocabShard each rank's
statistics are merged over the shard's group (max, then rescaled sums) before that last step.

The backward recomputes each chunk's logits and one kernel pass overwrites them in place with
    d/dz_j = (onehot_y(j) g_logp - p_j g_logp - g_ent p_j (logp_j + H)) / temperature,
the product of both gradients (the torch path's formula); two GEMMs then give dh and dW.
The kernels run as torch operators, torch.ops.longctx.logprobs_{stats,grad}.
Legend: T tokens, D model dim, V (this rank's) vocabulary, N target rows, C rows of a chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cp_attention.kernels import accumulate_dtype
from longctx_moe.kernels.logits_cache import keeps_logits, kept_logits
from longctx_moe.kernels.triton_common import cast_rne

_BLOCK_V = 1024  # vocabulary columns per step of a row's loop


@triton.jit
def _stats_kernel(z_ptr, col_ptr, own_ptr, m_ptr, s_ptr, a_ptr, zy_ptr, V, temp_ptr,
                  ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """Online softmax statistics of row r of z / temperature and its target logit."""
    r = tl.program_id(0).to(tl.int64)
    acc_ty = tl.float64 if m_ptr.dtype.element_ty == tl.float64 else tl.float32
    temp = tl.load(temp_ptr)
    m = tl.full([], float("-inf"), acc_ty)
    s = tl.zeros([], acc_ty)
    a = tl.zeros([], acc_ty)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(z_ptr + r * V + cols, mask=mask, other=float("-inf")).to(acc_ty) / temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        d = tl.where(mask, z - m_new, 0.0)
        e = tl.where(mask, tl.exp(d), 0.0)
        if ENTROPY:  # a = sum exp(z - m) (z - m): re-centred on the new max first
            a = (a + tl.where(s > 0, m - m_new, 0.0) * s) * scale + tl.sum(e * d, axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    col = tl.load(col_ptr + r)
    own = tl.load(own_ptr + r)
    zy = tl.load(z_ptr + r * V + col).to(acc_ty) / temp
    tl.store(m_ptr + r, m)
    tl.store(s_ptr + r, s)
    tl.store(a_ptr + r, a)
    tl.store(zy_ptr + r, tl.where(own != 0, zy, 0.0))


@triton.jit
def _grad_kernel(z_ptr, col_ptr, own_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, V, temp_ptr,
                 ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row r of z overwritten with d(g_logp . logp + g_ent . H)/dz (in z's dtype)."""
    r = tl.program_id(0).to(tl.int64)
    acc_ty = tl.float64 if lse_ptr.dtype.element_ty == tl.float64 else tl.float32
    temp = tl.load(temp_ptr)
    lse = tl.load(lse_ptr + r)
    g_logp = tl.load(glogp_ptr + r).to(acc_ty)
    g_y = tl.where(tl.load(own_ptr + r) != 0, g_logp, 0.0)  # one-hot only where the label lives
    col = tl.load(col_ptr + r)
    if ENTROPY:
        ent = tl.load(ent_ptr + r)
        g_ent = tl.load(gent_ptr + r).to(acc_ty)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = cols < V
        logp = tl.load(z_ptr + r * V + cols, mask=mask, other=0.0).to(acc_ty) / temp - lse
        p = tl.exp(logp)
        g = p * -g_logp + tl.where(cols == col, g_y, 0.0)
        if ENTROPY:
            g -= g_ent * p * (logp + ent)
        tl.store(z_ptr + r * V + cols, cast_rne(g / temp, z_ptr.dtype.element_ty), mask=mask)


def _merge(m_C, s_C, a_C, zy_C, shard):
    """(lse_C, ent_C, logp_C) from this rank's statistics, merged over the shard's group.

    H = log s - a / s: a / s = E_p[z - m] <= 0, so both terms are >= 0 and nothing cancels (the
    form lse - E_p[z] loses |lse| * eps of a small entropy)."""
    if shard is not None:
        m_all = shard.reduce(m_C.clone(), torch.distributed.ReduceOp.MAX)
        scale_C = torch.exp(m_C - m_all)
        a_C = shard.reduce((a_C + (m_C - m_all) * s_C) * scale_C)
        s_C, m_C, zy_C = shard.reduce(s_C * scale_C), m_all, shard.reduce(zy_C)
    log_s_C = s_C.log()
    lse_C = m_C + log_s_C
    return lse_C, log_s_C - a_C / s_C, zy_C - lse_C


def _targets(labels_C, v_local: int, shard):
    """(column of each label in this rank's W, int8 1 where this rank holds it)."""
    if shard is None:
        return labels_C, torch.ones_like(labels_C, dtype=torch.int8)
    local_C = labels_C - shard.start
    own_C = (local_C >= 0) & (local_C < v_local)
    return local_C.clamp(0, v_local - 1), own_C.to(torch.int8)


def _stats_outputs(z_CV, temp):
    """The statistics' (m_C, s_C, a_C, zy_C), unwritten: one value per row in temp's dtype (the
    accumulation dtype)."""
    return tuple(torch.empty(z_CV.shape[0], dtype=temp.dtype, device=z_CV.device) for _ in range(4))


# The kernels as torch operators (torch.ops.longctx.*), each with a fake implementation: a meta
# or fake tensor gets its outputs' shapes and dtypes with no launch (the cluster rehearsal), and
# torch.compile sees one opaque node. They are not differentiated themselves: the autograd
# Function below holds the GEMMs and the shard's collectives around them.

@torch.library.custom_op("longctx::logprobs_stats", mutates_args=())
def logprobs_stats(z_CV: torch.Tensor, cols_C: torch.Tensor, own_C: torch.Tensor,
                   temp: torch.Tensor, entropy: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m_C, s_C, a_C, zy_C) of z / temp (contiguous [C, V]): the max, sum exp(z - m),
    sum exp(z - m) (z - m) (0 without entropy) and the target's logit (0 where own_C is 0)."""
    z_CV, cols_C, own_C = z_CV.contiguous(), cols_C.contiguous(), own_C.contiguous()
    m_C, s_C, a_C, zy_C = _stats_outputs(z_CV, temp)
    _stats_kernel[(z_CV.shape[0],)](z_CV, cols_C, own_C, m_C, s_C, a_C, zy_C, z_CV.shape[1], temp,
                                    ENTROPY=entropy, BLOCK_V=_BLOCK_V)
    return m_C, s_C, a_C, zy_C


@logprobs_stats.register_fake
def _(z_CV, cols_C, own_C, temp, entropy):
    return _stats_outputs(z_CV, temp)


@torch.library.custom_op("longctx::logprobs_grad", mutates_args=("z_CV",))
def logprobs_grad(z_CV: torch.Tensor, cols_C: torch.Tensor, own_C: torch.Tensor,
                  lse_C: torch.Tensor, ent_C: torch.Tensor, g_logp_C: torch.Tensor,
                  g_ent_C: torch.Tensor, temp: torch.Tensor, entropy: bool) -> None:
    """Overwrites z_CV (contiguous [C, V] logits) with the gradient of g_logp . logp (+ g_ent . H
    with entropy) in z's dtype: the logits' memory serves their gradient."""
    cols_C, own_C, lse_C, ent_C, g_logp_C, g_ent_C = (
        a.contiguous() for a in (cols_C, own_C, lse_C, ent_C, g_logp_C, g_ent_C))
    _grad_kernel[(z_CV.shape[0],)](z_CV, cols_C, own_C, lse_C, ent_C, g_logp_C, g_ent_C,
                                   z_CV.shape[1], temp, ENTROPY=entropy, BLOCK_V=_BLOCK_V)


@logprobs_grad.register_fake
def _(z_CV, cols_C, own_C, lse_C, ent_C, g_logp_C, g_ent_C, temp, entropy):
    return None


class _TritonLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, idx_N, labels_N, chunk, cdtype, temperature, want_entropy, shard,
                keep_bytes=0):
        acc = accumulate_dtype(cdtype)
        w_c = w_VD.to(cdtype)
        n, v = idx_N.numel(), w_VD.shape[0]
        keep, ctx.kept = keeps_logits(ctx, n, v, cdtype, keep_bytes), []
        # A tensor, so the kernels divide in the accumulation dtype as torch's z / temperature does.
        temp = torch.tensor([temperature], dtype=acc, device=h_TD.device)
        lse_N, ent_N, logp_N = (torch.empty(n, dtype=acc, device=h_TD.device) for _ in range(3))
        for s in range(0, n, chunk):
            rows = idx_N[s:s + chunk]
            z_CV = (h_TD.index_select(0, rows).to(cdtype) @ w_c.t()).contiguous()
            if keep:
                ctx.kept.append(z_CV)
            cols_C, own_C = _targets(labels_N[s:s + chunk], v, shard)
            stats = logprobs_stats(z_CV, cols_C, own_C, temp, want_entropy)
            lse_N[s:s + chunk], ent_N[s:s + chunk], logp_N[s:s + chunk] = _merge(*stats, shard)
        ctx.save_for_backward(h_TD, w_VD, idx_N, labels_N, lse_N, ent_N)
        ctx.meta = (chunk, cdtype, acc, temperature, want_entropy, shard)
        return logp_N, ent_N if want_entropy else ent_N[:0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp_N, g_ent_N):
        h_TD, w_VD, idx_N, labels_N, lse_N, ent_N = ctx.saved_tensors
        chunk, cdtype, acc, temperature, want_entropy, shard = ctx.meta
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w_c = w_VD.to(cdtype)
        temp = torch.tensor([temperature], dtype=acc, device=h_TD.device)
        grad_h = torch.zeros_like(h_TD) if need_h else None
        grad_w = torch.zeros(w_VD.shape, dtype=acc, device=w_VD.device) if need_w else None
        with_ent = want_entropy and g_ent_N is not None
        g_logp_N = torch.zeros_like(lse_N) if g_logp_N is None else g_logp_N.contiguous()
        g_ent_N = g_ent_N.contiguous() if with_ent else g_logp_N
        for i, s in enumerate(range(0, idx_N.numel(), chunk)):
            rows = idx_N[s:s + chunk]
            h_c = h_TD.index_select(0, rows).to(cdtype)
            g_CV = kept_logits(ctx.kept, i)  # the logits, overwritten by their gradient
            if g_CV is None:
                g_CV = (h_c @ w_c.t()).contiguous()
            cols_C, own_C = _targets(labels_N[s:s + chunk], w_VD.shape[0], shard)
            sl = slice(s, s + chunk)
            logprobs_grad(g_CV, cols_C, own_C, lse_N[sl], ent_N[sl], g_logp_N[sl], g_ent_N[sl],
                          temp, with_ent)
            if need_h:
                grad_h.index_add_(0, rows, (g_CV @ w_c).to(h_TD.dtype))
            if need_w:
                grad_w += (g_CV.t() @ h_c).to(acc)
        if need_h and shard is not None:
            shard.reduce(grad_h)
        return (grad_h, None if grad_w is None else grad_w.to(w_VD.dtype),
                None, None, None, None, None, None, None, None)


def linear_logprobs(h_TD, w_VD, idx_N, labels_N, chunk: int, cdtype: torch.dtype,
                    temperature: float, want_entropy: bool, shard=None, keep_bytes: int = 0):
    """(logp_N, ent_N) as losses._LinearLogProbs.apply returns them (ent_N empty without
    entropy): acc dtype [N], differentiable in h and W."""
    return _TritonLinearLogProbs.apply(h_TD, w_VD, idx_N, labels_N, chunk, cdtype,
                                       float(temperature), want_entropy, shard, keep_bytes)


def cross_entropy_rows(chunk: int, acc: torch.dtype, device, shard=None):
    """losses._softmax_grad_rows with these kernels, as a function (z_CV, labels_C, weight_C, acc,
    want_grad) -> ce_C for chunks of at most `chunk` rows: per-row CE (acc [C]) of a chunk's
    contiguous logits z_CV, and with want_grad z_CV overwritten by d (weight * CE) / d z in its own
    dtype. Two passes over [C, V] (statistics, then the gradient) where the torch path makes a
    float32 copy of the chunk and passes over it ~5 times; CE = lse - z_y, and the gradient is that
    of g_logp . logp with g_logp = -weight. The constants every chunk shares (temperature 1, the
    whole vocabulary's ownership flags, g_logp = -1) are made once, not per chunk."""
    temp = torch.ones(1, dtype=acc, device=device)
    own_K = torch.ones(chunk, dtype=torch.int8, device=device)
    minus_K = torch.full((chunk,), -1.0, dtype=acc, device=device)

    def rows(z_CV, labels_C, weight_C, _acc, want_grad: bool):
        c = z_CV.shape[0]
        if shard is None:
            cols_C, own_C = labels_C, own_K[:c]
        else:
            cols_C, own_C = _targets(labels_C, z_CV.shape[1], shard)
        m_C, s_C, a_C, zy_C = logprobs_stats(z_CV, cols_C, own_C, temp, False)
        if shard is None:
            lse_C = m_C + s_C.log()
            ce_C, ent_C = lse_C - zy_C, lse_C  # no entropy: the kernel does not read ent_C
        else:
            lse_C, ent_C, logp_C = _merge(m_C, s_C, a_C, zy_C, shard)
            ce_C = logp_C.neg()
        if want_grad:
            g_C = minus_K[:c] if weight_C is None else weight_C.neg()
            logprobs_grad(z_CV, cols_C, own_C, lse_C, ent_C, g_C, g_C, temp, False)
        return ce_C

    return rows
