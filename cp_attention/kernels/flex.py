"""Adapter for flex_attention with a document block mask (CUDA; fp16/bf16/fp32).

The packed row is one batch of length T (queries) x S (keys); the mask_mod admits a key when it
belongs to the query's document and, for causal attention, is at or before the query's
bottom-right aligned position. Document ids and positions are computed on the device
(searchsorted), so nothing is read back to the host.

flex_attention has no public backward that accepts an external (out, lse), so the backward
recomputes the block's local (out_l, lse_l) under autograd and back-propagates
    grad_out = w * dout,  grad_lse = w * (rowsum(dout * out_l) - rowsum(dout * out)),
    w = exp(lse_l - lse)
which yields exactly dS = P * (dP - rowsum(dout * out)) with P = exp(S - lse) (see
`_common.external_lse_grads`). This needs lse gradients from flex_attention (torch >= 2.6).
Shape legend: T query tokens, S key tokens, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ._common import accumulate_dtype, default_scale, external_lse_grads


def _flex():
    try:
        from torch.nn.attention import flex_attention  # noqa: PLC0415 - lazy import
    except ImportError:
        return None
    return flex_attention


def unavailable_reason(device: torch.device) -> str | None:
    if _flex() is None:
        return f"torch {torch.__version__} has no flex_attention; upgrade torch to >= 2.5"
    if device.type != "cuda":
        return f"flex_attention is only fast on CUDA, not {device.type}; use backend='auto'"
    return None


TAKES_OFFSET = True  # see cp_attention.kernels.attn_forward(offset=)


def _doc_index(cu, total, device):
    """(doc id [total] with -1 past cu[-1], position inside the document [total])."""
    t = torch.arange(total, device=device)
    cu = cu.to(device=device, dtype=torch.long)
    doc = torch.searchsorted(cu[1:], t, right=True)
    inside = t < cu[-1]
    pos = t - cu[doc.clamp_max(cu.numel() - 2)]
    return torch.where(inside, doc, -1), pos


def block_mask(cu_q, cu_k, total_q, total_k, causal, device, window=None, offset=0):
    """flex BlockMask for packed documents (bottom-right causal when asked, moved `offset` keys
    on, and within the `window` latest keys when given: blocks wholly outside are skipped)."""
    flex = _flex()
    doc_q, pos_q = _doc_index(cu_q, total_q, device)
    doc_k, pos_k = _doc_index(cu_k, total_k, device)
    lens_q = (cu_q[1:] - cu_q[:-1]).to(device=device, dtype=torch.long)
    lens_k = (cu_k[1:] - cu_k[:-1]).to(device=device, dtype=torch.long)
    shift = (lens_k - lens_q + offset)[doc_q.clamp_min(0)]  # Lk - Lq (+ offset) per query
    k_doc = torch.where(doc_k < 0, -2, doc_k)  # padding keys match no query

    def mask_mod(b, h, qi, ki):
        same = doc_q[qi] == k_doc[ki]
        if not causal:
            return same
        seen = same & (pos_k[ki] <= pos_q[qi] + shift[qi])
        return seen if window is None else seen & (pos_k[ki] > pos_q[qi] + shift[qi] - window)

    return flex.create_block_mask(mask_mod, None, None, total_q, total_k, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # Without torch.compile flex_attention materialises the full [T, S] score matrix; compiled
    # once per process with dynamic shapes, since every packed row has its own T.
    return torch.compile(_flex().flex_attention, dynamic=True)


def _local(q_THD, k_SHD, v_SHD, mask, scale):
    """(out [T, Hq, D], lse [Hq, T] natural log) of flex_attention on the packed row."""
    flex = _flex()
    fn = _compiled_flex() if q_THD.is_cuda else flex.flex_attention  # eager on CPU: tests only
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_THD, k_SHD, v_SHD))
    kwargs = dict(block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if "return_aux" in inspect.signature(flex.flex_attention).parameters:
        out, aux = fn(q, k, v, return_aux=flex.AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    else:
        out, lse = fn(q, k, v, return_lse=True, **kwargs)
    return out[0].transpose(0, 1), lse[0]


def forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale=None, window=None,
            offset=0):
    """-> (out [T, Hq, D] input dtype, lse [Hq, T] float32, float64 for float64 inputs)."""
    scale = default_scale(scale, q_THD.shape[-1])
    mask = block_mask(cu_q, cu_k, q_THD.shape[0], k_SHD.shape[0], causal, q_THD.device, window,
                      offset)
    out, lse = _local(q_THD, k_SHD, v_SHD, mask, scale)
    lse = torch.where(torch.isfinite(lse), lse, float("-inf")).to(accumulate_dtype(q_THD.dtype))
    return out.masked_fill((lse == float("-inf")).t()[..., None], 0), lse


def backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k, causal,
             scale=None, window=None, offset=0):
    """Block gradients for a passed (possibly merged) out / lse; -> (dq, dk, dv)."""
    scale = default_scale(scale, q_THD.shape[-1])
    mask = block_mask(cu_q, cu_k, q_THD.shape[0], k_SHD.shape[0], causal, q_THD.device, window,
                      offset)
    local = lambda q, k, v: _local(q, k, v, mask, scale)
    return external_lse_grads(local, dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT)
