"""Dense masked varlen attention in float64: the ground truth every backend is tested against.

Materialises the full [Hq, T, S] score matrix, so it is for tests and small shapes only.
Shape legend: T query tokens, S key tokens, Hq / Hkv heads, D head dim of q / k, Dv of v,
G = Hq // Hkv.
"""

from __future__ import annotations

import torch

from ._common import accumulate_dtype, default_scale


def doc_mask_TS(cu_q, cu_k, total_q: int, total_k: int, causal: bool,
                window: int | None = None, offset: int = 0) -> torch.Tensor:
    """bool [T, S]: query t may attend key s (same document, bottom-right causal when asked,
    moved `offset` keys further on, and within the `window` latest keys when given)."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    doc_q = torch.full((total_q,), -1, dtype=torch.long)
    doc_k = torch.full((total_k,), -2, dtype=torch.long)
    pos_q = torch.zeros(total_q, dtype=torch.long)
    pos_k = torch.zeros(total_k, dtype=torch.long)
    shift = torch.zeros(total_q, dtype=torch.long)  # Lk - Lq of the query's document
    for i in range(len(bq) - 1):
        lq, lk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        doc_q[bq[i]:bq[i + 1]] = i
        doc_k[bk[i]:bk[i + 1]] = i
        pos_q[bq[i]:bq[i + 1]] = torch.arange(lq)
        pos_k[bk[i]:bk[i + 1]] = torch.arange(lk)
        shift[bq[i]:bq[i + 1]] = lk - lq + offset
    mask = doc_q[:, None] == doc_k[None, :]
    if causal:
        mask &= pos_k[None, :] <= (pos_q + shift)[:, None]
    if window is not None:
        mask &= pos_k[None, :] > (pos_q + shift - window)[:, None]
    return mask


def _scores_HTS(q_THD, k_SHD, mask_TS, scale):
    g = q_THD.shape[1] // k_SHD.shape[1]
    k = k_SHD.double().repeat_interleave(g, dim=1)
    s_HTS = torch.einsum("thd,shd->hts", q_THD.double(), k) * scale
    return s_HTS.masked_fill(~mask_TS, float("-inf"))


def reference_forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale=None,
                      window=None, offset=0):
    """-> (out_THDv in q's dtype, lse_HT float32/float64); computed in float64."""
    scale = default_scale(scale, q_THD.shape[-1])
    mask_TS = doc_mask_TS(cu_q, cu_k, q_THD.shape[0], k_SHD.shape[0], causal, window, offset)
    s_HTS = _scores_HTS(q_THD, k_SHD, mask_TS, scale)
    # Double where: rows that see no key get lse -inf without NaN gradients under autograd.
    seen_HT = mask_TS.any(-1).expand(s_HTS.shape[:2])
    lse_HT = torch.logsumexp(torch.where(seen_HT[..., None], s_HTS, 0.0), dim=-1)
    lse_HT = torch.where(seen_HT, lse_HT, float("-inf"))
    p_HTS = torch.exp(s_HTS - torch.where(seen_HT, lse_HT, 0.0)[..., None])
    g = q_THD.shape[1] // k_SHD.shape[1]
    v = v_SHD.double().repeat_interleave(g, dim=1)
    out_THD = torch.einsum("hts,shd->thd", p_HTS, v)
    return out_THD.to(q_THD.dtype), lse_HT.to(accumulate_dtype(q_THD.dtype))


def reference_backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k,
                       causal, scale=None, window=None, offset=0):
    """Gradients of this block given a (possibly larger, merged) (out, lse): float64 maths,
    results in the input dtype. dS = P * (dP - rowsum(dout * out)), P = exp(S - lse)."""
    scale = default_scale(scale, q_THD.shape[-1])
    hq, hkv = q_THD.shape[1], k_SHD.shape[1]
    g = hq // hkv
    mask_TS = doc_mask_TS(cu_q, cu_k, q_THD.shape[0], k_SHD.shape[0], causal, window, offset)
    s_HTS = _scores_HTS(q_THD, k_SHD, mask_TS, scale)
    lse = lse_HT.double()
    # Rows that see no key anywhere (lse = -inf) carry no gradient.
    p_HTS = torch.exp(s_HTS - torch.where(torch.isfinite(lse), lse, float("inf"))[..., None])
    dout = dout_THD.double()
    v = v_SHD.double().repeat_interleave(g, dim=1)
    k = k_SHD.double().repeat_interleave(g, dim=1)
    dv_SHD = torch.einsum("hts,thd->shd", p_HTS, dout)
    dp_HTS = torch.einsum("thd,shd->hts", dout, v)
    delta_HT = (dout * out_THD.double()).sum(-1).transpose(0, 1)
    ds_HTS = p_HTS * (dp_HTS - delta_HT[..., None])
    dq_THD = torch.einsum("hts,shd->thd", ds_HTS, k) * scale
    dk_SHD = torch.einsum("hts,thd->shd", ds_HTS, q_THD.double()) * scale
    s = k_SHD.shape[0]
    dk_SHD = dk_SHD.view(s, hkv, g, q_THD.shape[-1]).sum(2)
    dv_SHD = dv_SHD.view(s, hkv, g, v_SHD.shape[-1]).sum(2)
    return dq_THD.to(q_THD.dtype), dk_SHD.to(k_SHD.dtype), dv_SHD.to(v_SHD.dtype)
