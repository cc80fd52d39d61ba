"""Validation and small helpers shared by every varlen attention backend.

Shape legend: T query tokens, S key tokens, Hq query heads, Hkv key/value heads, D head dim of
q and k, Dv head dim of v and out (MLA: Dv != D), N documents. cu_q / cu_k are int32 [N+1]
cumulative boundaries on q's device (read on the host only where that is the device); document
i's queries are q[cu_q[i]:cu_q[i+1]] and its keys k[cu_k[i]:cu_k[i+1]]. Tokens past cu_q[-1]
(cu_k[-1]) are trailing padding: output 0, lse -inf, zero gradients.
"""

from __future__ import annotations

import math

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of sums, logsumexps and softmax statistics over `dtype` inputs: float64 for float64
    inputs (the exactness tests), float32 for every 16/32-bit input (bf16/fp16 sums lose digits).
    The one rule for cp_attention and longctx_moe (the router, the losses) alike."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_inputs(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q: int, max_k: int) -> None:
    """Raise ValueError with a one-line cause and fix for any malformed argument."""
    if q_THD.dim() != 3 or k_SHD.dim() != 3 or v_SHD.dim() != 3:
        raise ValueError(
            f"varlen attention expects q [T, Hq, D] and k, v [S, Hkv, D]; got q {tuple(q_THD.shape)}, "
            f"k {tuple(k_SHD.shape)}, v {tuple(v_SHD.shape)} (flatten the batch dim into tokens)")
    if k_SHD.shape[:2] != v_SHD.shape[:2]:
        raise ValueError(f"k {tuple(k_SHD.shape)} and v {tuple(v_SHD.shape)} must have the same "
                         "tokens and heads (only their head dims may differ)")
    hq, hkv = q_THD.shape[1], k_SHD.shape[1]
    if q_THD.shape[2] != k_SHD.shape[2]:
        raise ValueError(f"head dim of q ({q_THD.shape[2]}) differs from k ({k_SHD.shape[2]})")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"GQA needs Hq % Hkv == 0; got Hq={hq}, Hkv={hkv} (choose divisible head counts)")
    if not (q_THD.dtype == k_SHD.dtype == v_SHD.dtype) or q_THD.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q, k, v must share one floating dtype; got {q_THD.dtype}, {k_SHD.dtype}, {v_SHD.dtype}")
    for name, cu in (("cu_q", cu_q), ("cu_k", cu_k)):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) or cu.numel() < 1:
            raise ValueError(f"{name} must be an int32 tensor [N+1] of cumulative lengths; got "
                             f"{cu.dtype} {tuple(cu.shape)}")
        if cu.device != q_THD.device:
            raise ValueError(f"{name} is on {cu.device} but q on {q_THD.device}; pass the boundaries "
                             "on q's device (copy them there once per micro-batch, keep a host copy "
                             "for planning)")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_q has {cu_q.numel() - 1} documents but cu_k has {cu_k.numel() - 1}; "
                         "pass one boundary per document to both")
    if not isinstance(max_q, int) or not isinstance(max_k, int):
        raise ValueError("max_q and max_k must be host ints (never read them from a device tensor)")


def check_window(window: int | None, causal: bool) -> None:
    """A sliding window of `window` keys (the query's own included) needs causal attention."""
    if window is None:
        return
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int (keys a query sees, itself "
                         "included) or None for full causal attention")
    if not causal:
        raise ValueError("a sliding window needs causal=True (bidirectional windows are not "
                         "supported); pass window=None for causal=False")


def pad_head_dims(q_THD, k_SHD, v_SHD, *more_THDv):
    """Zero-pad q, k (head dim D) and v and `more` (head dim Dv: out, dout) to max(D, Dv), for
    kernels that need one head dim. Zero columns add nothing to q.k and give zero output columns,
    so the result sliced back is exact (the scale must be fixed from the unpadded D)."""
    d, dv = q_THD.shape[-1], v_SHD.shape[-1]
    width = max(d, dv)
    pad = lambda x: x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    return (pad(q_THD), pad(k_SHD), pad(v_SHD), *(pad(x) for x in more_THDv))


def doc_lengths(cu_q, cu_k, total_q: int, total_k: int, max_q: int, max_k: int):
    """Host lists (starts_q, lens_q, starts_k, lens_k), validated against the tensor sizes."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    lens_q = [b - a for a, b in zip(bq[:-1], bq[1:], strict=False)]
    lens_k = [b - a for a, b in zip(bk[:-1], bk[1:], strict=False)]
    if bq[0] != 0 or bk[0] != 0 or min(lens_q + lens_k + [0]) < 0:
        raise ValueError("cu_q / cu_k must start at 0 and be non-decreasing (cumulative lengths)")
    if bq[-1] > total_q or bk[-1] > total_k:
        raise ValueError(f"cu_q ends at {bq[-1]} (T={total_q}) / cu_k at {bk[-1]} (S={total_k}): "
                         "boundaries past the tensors; fix the packing")
    if max(lens_q, default=0) > max_q or max(lens_k, default=0) > max_k:
        raise ValueError(f"max_q={max_q} / max_k={max_k} smaller than the longest document "
                         f"({max(lens_q, default=0)}, {max(lens_k, default=0)}); pass the true maxima")
    return bq[:-1], lens_q, bk[:-1], lens_k


def kernel_lse(lse_HT: torch.Tensor) -> torch.Tensor:
    """Replace -inf (rows that see no key anywhere) by +inf, so exp(S - lse) = 0 in a kernel's
    backward instead of exp(-inf + inf) = NaN; those rows then contribute no gradient."""
    return torch.where(lse_HT == float("-inf"), float("inf"), lse_HT)


def external_lse_grads(local_fn, dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT):
    """Block gradients for an external (merged) (out, lse) from any differentiable local kernel.

    local_fn(q, k, v) -> (out_l [T, Hq, D], lse_l [Hq, T]) must support gradients through both.
    With w = exp(lse_l - lse), back-propagating grad_out = w * dout and
    grad_lse = w * (rowsum(dout * out_l) - rowsum(dout * out)) gives
    dS = P_l * w * (dP - rowsum(dout * out)) = P * (dP - D), P = exp(S - lse): the ring formula.
    """
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_() for x in (q_THD, k_SHD, v_SHD))
        out_l, lse_l = local_fn(q, k, v)
        lse_ext = lse_HT.to(lse_l.dtype)
        seen = torch.isfinite(lse_l) & torch.isfinite(lse_ext)
        w_HT = torch.where(seen, torch.exp(lse_l.detach() - torch.where(seen, lse_ext, 0.0)), 0.0)
        w_TH1 = w_HT.t()[..., None]
        d_local = (dout_THD * out_l.detach()).sum(-1, dtype=w_HT.dtype)
        d_ext = (dout_THD * out_THD).sum(-1, dtype=w_HT.dtype)
        grad_lse = w_HT * (d_local - d_ext).t()
        grad_out = (dout_THD * w_TH1).to(out_l.dtype)
        return torch.autograd.grad((out_l, lse_l), (q, k, v), (grad_out, grad_lse))
