"""CPU backend: torch's own flash kernel for CPU over buckets of similar-length documents.

Built on aten._scaled_dot_product_flash_attention_for_cpu and its _backward, which take dense
[B, H, L, D] batches and return the logsumexp. Documents are grouped into padded buckets by
`_buckets.plan_buckets` (exact: padding never reaches a real row), so a row of many short
documents costs a few kernel calls rather than one per document, and no score is computed across
documents (unlike a dense block-diagonal mask over the whole row).

The bf16 causal self-attention of every layer (cu_q == cu_k) runs on our own C++ kernels where
the CPU has them (AVX512-BF16, AMX included): brgemm_forward for the forward, amx_backward (named
for its first target, AMX) for the backward; each falls back to aten's kernel alone, so either can
pair with aten's other half.

Shape legend: T query tokens, S key tokens, Hq / Hkv heads, G = Hq // Hkv, D head dim,
B documents in a bucket, Pq / Pk padded slots.
"""

from __future__ import annotations

import torch

from . import amx_backward, brgemm_forward
from ._buckets import Bucket, plan_buckets
from ._common import accumulate_dtype, default_scale, kernel_lse
from ._registry import AttnKernel

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# aten's CPU flash kernels pick their query block from the padded length: 32 rows below 192, 64
# below 768, 256 from 768 on, with 5 small GEMM calls per (query block, 512-key block). In bf16
# each call has a fixed cost, so the bf16 backward of short buckets pays ~2-4 us per row and head
# whatever the length, while the float32 GEMMs have almost none. Backward of one document, 8
# heads of 64, min of 7 on this CPU, 2 threads (1 thread): 128 tokens bf16 2.5 ms vs float32
# incl. casts 1.6 (3.9 vs 1.7); 256: 3.5 vs 5.9 (5.3 vs 4.4); 400: 6.4 vs 11.6 (11.5 vs 11.2);
# 700: 16.1 vs 21.3 (28.7 vs 35.0); 767: 20.4 vs 24.9; 768: 13.3 vs 21.6 (21.3 vs 29.8).
# In a whole backward over the bench's mixed documents the two choices measure within noise of
# each other on a quiet machine (bf16 wins ~25% on rows of only 250-400-token documents), and
# float32 wins by ~25% when the machine is loaded, besides being more accurate. Hence, in the
# backward only:
# buckets under 768 rows run in float32 (inputs upcast once, gradients rounded once at the end);
# reduced-precision buckets from 600 to 767 rows are padded to 768, the kernel's big-block path,
# and run in bf16. The forward is not padded (no such cliff there) and stays in the input dtype
# (bf16 is 2-3x faster than float32 there).
TAKES_OFFSET = True  # see cp_attention.kernels.attn_forward(offset=)
TAKES_KERNEL = True  # reads the AttnKernel's batch invariance and C++ kernel choices
_DEFAULT = AttnKernel("torch_cpu")
SMALL_BLOCK_LEN = 768  # below this many rows the backward runs in float32
BIG_BLOCK_LEN = 768
_REDUCED = (torch.bfloat16, torch.float16)


def _plan(cu_q, cu_k, causal, dtype, invariant: bool, backward: bool = False,
          window: int | None = None, offset: int = 0):
    pad_to = BIG_BLOCK_LEN if backward and dtype in _REDUCED else 0
    return plan_buckets(tuple(cu_q.tolist()), tuple(cu_k.tolist()), bool(causal), pad_to,
                        invariant, window, offset)


def _backward_dtype(dtype, bk: Bucket):
    return torch.float32 if dtype in _REDUCED and bk.pq < SMALL_BLOCK_LEN else dtype


def _q_view(x_THD, bk: Bucket, hkv: int):
    """Query-like rows of the bucket as the kernel's [batch, heads, P, D].

    An in-place bucket (one document, read where it lies) is a view with the GQA group folded
    into the kernel's axes, [Hkv, G, P, D], so keys/values need no copy (see _kv_view). A
    gathered bucket is [B, Hq, P, D] (strided as [B, P, Hq, D])."""
    if bk.q_slice is not None:
        p, hq, d = bk.pq, x_THD.shape[1], x_THD.shape[2]
        return x_THD.narrow(0, bk.q_slice, p).reshape(p, hkv, hq // hkv, d).permute(1, 2, 0, 3)
    return x_THD.index_select(0, bk.q_src).view(bk.batch, bk.pq, *x_THD.shape[1:]).transpose(1, 2)


def _kv_view(x_SHD, bk: Bucket, groups: int):
    """Keys/values matching _q_view: a stride-0 expansion [Hkv, G, P, D] for in-place buckets;
    otherwise gathered and repeated to [B, Hq, P, D] (the CPU kernel has no GQA mode)."""
    hkv, d = x_SHD.shape[1], x_SHD.shape[2]
    if bk.k_slice is not None:
        x = x_SHD.narrow(0, bk.k_slice, bk.pk).permute(1, 0, 2).unsqueeze(1)
        return x.expand(hkv, groups, bk.pk, d)
    x = x_SHD.index_select(0, bk.k_src).view(bk.batch, bk.pk, hkv, 1, d)
    return x.expand(-1, -1, -1, groups, -1).reshape(bk.batch, bk.pk, hkv * groups, d).transpose(1, 2)


def _rows(o, bk: Bucket, hq: int):
    """Kernel output of _q_view's shape -> [B*P, Hq, D] rows (a view: the kernel writes P-major)."""
    if bk.q_slice is not None:
        return o.permute(2, 0, 1, 3).reshape(bk.pq, hq, o.shape[-1])
    return o.transpose(1, 2).reshape(bk.batch * bk.pq, hq, o.shape[-1])


def _kv_rows(g, bk: Bucket, hkv: int):
    """Kernel key/value gradient -> [B*Pk, Hkv, D] rows, summed over each GQA group."""
    if bk.k_slice is not None:  # g: [Hkv, G, P, D]
        return g.sum(1).permute(1, 0, 2)
    b, hq, p, d = g.shape
    return g.transpose(1, 2).reshape(b * p, hkv, hq // hkv, d).sum(2)


def _tiling(plan, total_q: int, total_k: int):
    """The buckets in token order when each is one in-place document and together they tile
    [0, T) and [0, S): then outputs are assembled with one torch.cat instead of one copy per
    document (fewer parallel regions, which matters on a shared, oversubscribed CPU)."""
    if any(bk.q_slice is None or bk.k_slice is None for bk in plan):
        return None
    order = sorted(plan, key=lambda bk: bk.q_slice)
    q_end = k_end = 0
    for bk in order:
        if bk.q_slice != q_end or bk.k_slice != k_end:
            return None
        q_end, k_end = q_end + bk.q_len, k_end + bk.k_len
    return order if (q_end, k_end) == (total_q, total_k) and order else None


def _assemble(pieces, plan, shape, like, fill, dim=0, dtype=None):
    """Scatter per-bucket rows (pos/tok indexed along `dim`) into a new [shape] tensor."""
    dtype = dtype or like.dtype
    covered = sum(bk.q_tok.numel() for bk in plan) == shape[dim]
    dst = _new(shape, like, fill, covered, dtype)
    for bk, rows in zip(plan, pieces, strict=True):
        if bk.q_slice is not None:
            dst.narrow(dim, bk.q_slice, bk.q_len).copy_(rows.narrow(dim, 0, bk.q_len))
        else:
            dst.index_copy_(dim, bk.q_tok, rows.index_select(dim, bk.q_pos).to(dtype))
    return dst


def _new(shape, like, fill, covered: bool, dtype=None):
    """Output buffer; no fill pass when the buckets write every row."""
    dtype = dtype or like.dtype
    if covered:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return torch.full(shape, fill, dtype=dtype, device=like.device)


def _forward_bucket(q_THD, k_SHD, v_SHD, bk: Bucket, scale):
    """-> (rows [B*P, Hq, D], lse [Hq, B*P]) of one kernel call."""
    hq, hkv = q_THD.shape[1], k_SHD.shape[1]
    q = _q_view(q_THD, bk, hkv)
    k, v = _kv_view(k_SHD, bk, hq // hkv), _kv_view(v_SHD, bk, hq // hkv)
    o, lse = _fwd(q, k, v, 0.0, bk.layout == "shift",
                  attn_mask=bk.additive_mask(q.dtype, q.device), scale=scale)
    lse = lse.reshape(hq, bk.pq) if bk.q_slice is not None else lse.transpose(0, 1).reshape(hq, -1)
    rows = _rows(o, bk, hq)
    dead = _keyless_rows(bk)
    if dead is not None:  # in-place buckets keep such rows: out 0 like every row without a key
        lse = lse.masked_fill(dead.to(lse.device), float("-inf"))
        rows = rows.masked_fill(dead.to(rows.device)[:, None, None], 0)
    return rows, lse


def _keyless_rows(bk: Bucket):
    """bool [B*Pq]: query rows the mask leaves without any key (a sliding window, or a causal
    document with more queries than keys, in the masked layout), or None if there are none.
    aten's kernel reports lse 0 for such a row; attention with no key has lse -inf (and out 0)."""
    if bk.mask is None:
        return None
    # mask [B, 1, Pq or 1, Pk]: a one-row (per-key) mask holds for every query row of its document
    dead = (~bk.mask.any(-1)).expand(bk.batch, 1, bk.pq).reshape(-1)
    return dead if bool(dead.any()) else None


def forward(q_THD, k_SHD, v_SHD, cu_q, cu_k, max_q, max_k, causal, scale=None, window=None,
            offset=0, kernel: AttnKernel = _DEFAULT):
    """-> (out_THD in the input dtype, lse_HT float32, or float64 for float64 inputs).
    A sliding window or an offset runs on aten's kernel with a mask (our C++ kernels have
    neither)."""
    t, hq, d = q_THD.shape
    scale = default_scale(scale, d)
    # brgemm_forward: 2.7-3.9x aten's kernel on 2048-8192-token rows (see its module docstring);
    # per document by construction, so batch invariance needs nothing more from it.
    if (kernel.native_forward and window is None and not offset
            and _causal_self_bf16((q_THD, k_SHD, v_SHD), cu_q, cu_k, causal)
            and d <= 256 and brgemm_forward.available()):
        res = brgemm_forward.try_varlen_causal_forward(q_THD, k_SHD, v_SHD, cu_q, scale)
        if res is not None:
            return res
    plan = _plan(cu_q, cu_k, causal, q_THD.dtype, kernel.batch_invariant, window=window, offset=offset)
    tiles = _tiling(plan, t, k_SHD.shape[0])
    plan = tiles or plan
    res = [_forward_bucket(q_THD, k_SHD, v_SHD, bk, scale) for bk in plan]
    if tiles:
        return (torch.cat([r[0][:bk.q_len] for r, bk in zip(res, plan, strict=True)]),
                torch.cat([r[1][:, :bk.q_len] for r, bk in zip(res, plan, strict=True)], dim=1))
    out_THD = _assemble([r[0] for r in res], plan, (t, hq, d), q_THD, 0.0)
    lse_HT = _assemble([r[1] for r in res], plan, (hq, t), q_THD, float("-inf"), dim=1,
                       dtype=accumulate_dtype(q_THD.dtype))
    return out_THD, lse_HT


def _bucket_lse(klse_HT, bk: Bucket, hkv: int):
    """Kernel lse of _q_view's shape; +inf at padded slots (klse_HT is already +inf where -inf)."""
    hq = klse_HT.shape[0]
    if bk.q_slice is not None:
        lse = klse_HT.narrow(1, bk.q_slice, bk.pq).reshape(hkv, hq // hkv, bk.pq)
        if bk.q_len < bk.pq:  # the slots past the document belong to other tokens
            lse = lse.clone()
            lse[..., bk.q_len:] = float("inf")
        return lse
    lse = klse_HT.index_select(1, bk.q_src).view(hq, bk.batch, bk.pq).transpose(0, 1)
    return lse.masked_fill(bk.q_pad.view(bk.batch, 1, bk.pq), float("inf"))


def _bucket_dout(dout_THD, bk: Bucket, hkv: int):
    dout = _q_view(dout_THD, bk, hkv)
    if bk.q_slice is None:
        dout = dout.masked_fill(bk.q_pad.view(bk.batch, 1, bk.pq, 1), 0)
    elif bk.q_len < bk.pq:  # [Hkv, G, P, D] view: zero the rows past the document
        dout = dout.clone()
        dout[:, :, bk.q_len:] = 0
    return dout


def _backward_bucket(t, bk: Bucket, scale):
    """t = (dout, q, k, v, out, kernel lse) in the bucket's compute dtype ->
    (dq rows [B*Pq, Hq, D], dk rows [B*Pk, Hkv, D], dv rows)."""
    dout_THD, q_THD, k_SHD, v_SHD, out_THD, klse_HT = t
    hq, hkv = q_THD.shape[1], k_SHD.shape[1]
    q, o = _q_view(q_THD, bk, hkv), _q_view(out_THD, bk, hkv)
    k, v = _kv_view(k_SHD, bk, hq // hkv), _kv_view(v_SHD, bk, hq // hkv)
    lse = _bucket_lse(klse_HT, bk, hkv)
    gq, gk, gv = _bwd(_bucket_dout(dout_THD, bk, hkv), q, k, v, o, lse, 0.0,
                      bk.layout == "shift", attn_mask=bk.additive_mask(q.dtype, q.device),
                      scale=scale)
    return _rows(gq, bk, hq), _kv_rows(gk, bk, hkv), _kv_rows(gv, bk, hkv)


def _scatter_kv(pieces, plan, like):
    dst = _new(like.shape, like, 0.0, sum(bk.k_tok.numel() for bk in plan) == like.shape[0])
    for bk, rows in zip(plan, pieces, strict=True):
        if bk.k_slice is not None:
            dst.narrow(0, bk.k_slice, bk.k_len).copy_(rows[:bk.k_len])
        else:
            dst.index_copy_(0, bk.k_tok, rows.index_select(0, bk.k_pos).to(dst.dtype))
    return dst


def _causal_self_bf16(tensors, cu_q, cu_k, causal) -> bool:
    """Causal self-attention in bf16 over shared boundaries, head dim a multiple of 16: the
    packed-row attention of every layer, the case our C++ kernels compute (tensors: q, k first)."""
    q_THD, k_SHD = tensors[0], tensors[1]
    return (causal and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)
            and q_THD.shape[0] == k_SHD.shape[0] and q_THD.shape[2] % 16 == 0  # their tested head dims
            and cu_q.shape == cu_k.shape and bool(torch.equal(cu_q, cu_k)))


def _brgemm_backward_eligible(tensors, cu_q, cu_k, causal) -> bool:
    """The case amx_backward computes, where it is faster than aten's kernel: 1.7-2.7x with AMX,
    2.3-4x on AVX512-BF16 without AMX (see its module docstring)."""
    return _causal_self_bf16(tensors[1:], cu_q, cu_k, causal) and amx_backward.available()


def backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD, lse_HT, cu_q, cu_k, max_q, max_k, causal,
             scale=None, window=None, offset=0, kernel: AttnKernel = _DEFAULT):
    """Gradients of this block for a (possibly larger, merged) (out, lse): (dq_THD, dk_SHD,
    dv_SHD) in the input dtype. The kernel computes rowsum(dout * out) from the out passed."""
    scale = default_scale(scale, q_THD.shape[2])
    if kernel.native_backward and window is None and not offset and _brgemm_backward_eligible((dout_THD, q_THD, k_SHD, v_SHD, out_THD),
                                                    cu_q, cu_k, causal):
        grads = amx_backward.try_varlen_causal_backward(dout_THD, q_THD, k_SHD, v_SHD, out_THD,
                                                        kernel_lse(lse_HT), cu_q, scale)
        if grads is not None:
            return grads
    plan = _plan(cu_q, cu_k, causal, q_THD.dtype, kernel.batch_invariant, backward=True,
                 window=window, offset=offset)
    tiles = _tiling(plan, q_THD.shape[0], k_SHD.shape[0])
    plan = tiles or plan
    inputs = {}  # compute dtype -> inputs cast once for every bucket that needs them
    klse_HT = kernel_lse(lse_HT)
    res = []
    for bk in plan:
        ct = _backward_dtype(q_THD.dtype, bk)
        if ct not in inputs:
            inputs[ct] = (*(x.to(ct) for x in (dout_THD, q_THD, k_SHD, v_SHD, out_THD)),
                          klse_HT.to(accumulate_dtype(ct)))
        res.append(_backward_bucket(inputs[ct], bk, scale))
    if tiles:
        lens = [(bk.q_len, bk.k_len, bk.k_len) for bk in plan]
        return tuple(torch.cat([r[i][:n[i]] for r, n in zip(res, lens, strict=True)]).to(q_THD.dtype)
                     for i in range(3))
    dq = _assemble([r[0] for r in res], plan, q_THD.shape, q_THD, 0.0)
    return dq, _scatter_kv([r[1] for r in res], plan, k_SHD), _scatter_kv([r[2] for r in res], plan, v_SHD)
