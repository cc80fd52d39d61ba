"""CPU backend: torch's own flash kernel for CPU over buckets of similar-length documents.

Built on aten._scaled_dot_product_flash_attention_for_cpu and its _backward, which take dense
[B, H, L, D] batches and return the logsumexp. Documents are grouped into padded buckets by
`_buckets.plan_buckets` (exact: padding never reaches a real row), so a row of many short
documents costs a few kernel calls rather than one per document, and no score is computed across
documents (unlike a dense block-diagonal mask over the whole row).

Shape legend: T query tokens, S key tokens, Hq / Hkv heads, G = Hq // Hkv, D head dim,
B documents in a bucket, Pq / Pk padded slots.
"""

from __future__ import annotations

import torch

from ._buckets import Bucket, plan_buckets
from ._common import default_scale, kernel_lse, lse_dtype

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _plan(cu_q, cu_k, causal):
    return plan_buckets(tuple(cu_q.tolist()), tuple(cu_k.tolist()), bool(causal))


def _gather(x_THD, src, start, b, p):
    """[B, H, P, D] view (strided as [B, P, H, D]) of the bucket's slots of x."""
    if start is not None:
        return x_THD.narrow(0, start, p).unsqueeze(0).transpose(1, 2)
    return x_THD.index_select(0, src).view(b, p, *x_THD.shape[1:]).transpose(1, 2)


def _gather_kv(x_SHD, bk: Bucket, groups: int):
    """Keys/values of the bucket with kv heads repeated to the query heads: [B, Hq, Pk, D].
    The CPU kernel has no GQA mode; repeating kv costs one copy, far below the attention work."""
    x = _gather(x_SHD, bk.k_src, bk.k_slice, bk.batch, bk.pk)
    if groups == 1:
        return x
    b, h, p, d = x.shape
    return x.unsqueeze(2).expand(b, h, groups, p, d).reshape(b, h * groups, p, d)


def _scatter_rows(dst_THD, src_BHPD, pos, tok, start):
    """Write the real rows of a kernel output [B, H, P, D] (laid out [B, P, H, D]) into dst."""
    rows = src_BHPD.transpose(1, 2)
    if start is not None:
        dst_THD.narrow(0, start, rows.shape[1]).copy_(rows[0])
        return
    flat = rows.reshape(-1, *dst_THD.shape[1:])
    dst_THD.index_copy_(0, tok, flat.index_select(0, pos))


def forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale=None):
    """-> (out_THD in the input dtype, lse_HT float32, or float64 for float64 inputs)."""
    t, hq, d = q_THD.shape
    groups = hq // k_SHD.shape[1]
    scale = default_scale(scale, d)
    out_THD = q_THD.new_zeros(t, hq, d)
    lse_HT = torch.full((hq, t), float("-inf"), dtype=lse_dtype(q_THD.dtype), device=q_THD.device)
    for bk in _plan(cu_q, cu_k, causal):
        q = _gather(q_THD, bk.q_src, bk.q_slice, bk.batch, bk.pq)
        k, v = _gather_kv(k_SHD, bk, groups), _gather_kv(v_SHD, bk, groups)
        o, lse = _fwd(q, k, v, 0.0, bk.layout == "shift",
                      attn_mask=bk.additive_mask(q.dtype, q.device), scale=scale)
        _scatter_rows(out_THD, o, bk.q_pos, bk.q_tok, bk.q_slice)
        lse_flat = lse.to(lse_HT.dtype).transpose(0, 1).reshape(hq, -1)
        if bk.q_slice is not None:
            lse_HT.narrow(1, bk.q_slice, bk.pq).copy_(lse_flat)
        else:
            lse_HT.index_copy_(1, bk.q_tok, lse_flat.index_select(1, bk.q_pos))
    return out_THD, lse_HT


def _bucket_lse(lse_HT, bk: Bucket):
    """[B, Hq, Pq] contiguous kernel lse: +inf at padded slots and at rows that see no key."""
    if bk.q_slice is not None:
        lse = lse_HT.narrow(1, bk.q_slice, bk.pq).unsqueeze(0)
    else:
        lse = lse_HT.index_select(1, bk.q_src).view(-1, bk.batch, bk.pq).transpose(0, 1)
        lse = lse.masked_fill(bk.q_pad.view(bk.batch, 1, bk.pq), float("inf"))
    return kernel_lse(lse).contiguous()


def _bucket_dout(dout_THD, bk: Bucket):
    dout = _gather(dout_THD, bk.q_src, bk.q_slice, bk.batch, bk.pq)
    if bk.q_slice is None:
        dout = dout.masked_fill(bk.q_pad.view(bk.batch, 1, bk.pq, 1), 0)
    return dout


def _scatter_kv_grad(dst_SHD, g_BHPD, bk: Bucket, groups: int):
    """Sum the repeated heads back to kv heads and write the real key rows."""
    rows = g_BHPD.transpose(1, 2)  # [B, Pk, Hq, D]
    b, p, hq, d = rows.shape
    if groups > 1:
        rows = rows.reshape(b, p, hq // groups, groups, d).sum(3)
    if bk.k_slice is not None:
        dst_SHD.narrow(0, bk.k_slice, p).copy_(rows[0])
        return
    dst_SHD.index_copy_(0, bk.k_tok, rows.reshape(b * p, *dst_SHD.shape[1:]).index_select(0, bk.k_pos))


def backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k, causal,
             scale=None):
    """Gradients of this block for a (possibly larger, merged) (out, lse): (dq_THD, dk_SHD,
    dv_SHD) in the input dtype. The kernel computes rowsum(dout * out) from the out passed."""
    hq, d = q_THD.shape[1], q_THD.shape[2]
    groups = hq // k_SHD.shape[1]
    scale = default_scale(scale, d)
    dq, dk, dv = torch.zeros_like(q_THD), torch.zeros_like(k_SHD), torch.zeros_like(v_SHD)
    for bk in _plan(cu_q, cu_k, causal):
        q = _gather(q_THD, bk.q_src, bk.q_slice, bk.batch, bk.pq)
        o = _gather(out_THD, bk.q_src, bk.q_slice, bk.batch, bk.pq)
        k, v = _gather_kv(k_SHD, bk, groups), _gather_kv(v_SHD, bk, groups)
        lse = _bucket_lse(lse_HT, bk).to(q.dtype if q.dtype == torch.float64 else torch.float32)
        gq, gk, gv = _bwd(_bucket_dout(dout_THD, bk), q, k, v, o, lse, 0.0, bk.layout == "shift",
                          attn_mask=bk.additive_mask(q.dtype, q.device), scale=scale)
        _scatter_rows(dq, gq, bk.q_pos, bk.q_tok, bk.q_slice)
        _scatter_kv_grad(dk, gk, bk, groups)
        _scatter_kv_grad(dv, gv, bk, groups)
    return dq, dk, dv
