"""Single-device varlen attention kernels against the dense float64 reference.

Shape legend: T query tokens, S key tokens, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cp_attention.kernels import (
    attn_backward,
    attn_forward,
    reference_attention,
    resolve_backend,
    varlen_attention,
)
from cp_attention.kernels._buckets import plan_buckets
from cp_attention.kernels._common import external_lse_grads
from cp_attention.kernels.reference import doc_mask_TS, reference_backward, reference_forward

NEG_INF = float("-inf")


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32)


def _make(lens_q, lens_k, hq, hkv, d, pad, dtype, seed, dv=None):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    t, s = int(cu_q[-1]) + pad, int(cu_k[-1]) + pad
    q = torch.randn(t, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(s, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(s, hkv, dv or d, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(t, hq, dv or d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout, cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0)


def _assert_lse(lse, ref, atol):
    # -inf (rows that see no key, padding) must match exactly; finite values within atol.
    assert torch.equal(lse == NEG_INF, ref == NEG_INF)
    fin = ref != NEG_INF
    torch.testing.assert_close(lse[fin].double(), ref[fin].double(), atol=atol, rtol=0)


@st.composite
def packs(draw):
    n = draw(st.integers(1, 20))
    length = st.one_of(st.just(1), st.integers(0, 24))
    lens_q = draw(st.lists(length, min_size=n, max_size=n))
    same = draw(st.booleans())
    lens_k = lens_q if same else draw(st.lists(length, min_size=n, max_size=n))
    hq, hkv = draw(st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (4, 1)]))
    causal = draw(st.booleans())
    # Sliding windows (causal only) from 1 key to wider than any document; the value head dim
    # equal to the q/k one, smaller, or larger (MLA: 128 against 192).
    window = draw(st.one_of(st.none(), st.integers(1, 30))) if causal else None
    dv = draw(st.sampled_from([8, 4, 12]))
    return (lens_q, lens_k, hq, hkv, draw(st.integers(0, 3)), causal, draw(st.integers(0, 99)),
            window, dv)


@settings(max_examples=60)
@given(packs(), st.one_of(st.just(0), st.integers(-30, 30)))
# One query and one key moved apart by the offset: a bucket of one row whose causal mask leaves it
# no key (lse -inf, out 0), which a per-key mask of one row must not be taken for.
@example(case=([1], [1], 1, 1, 0, True, 0, None, 8), offset=-1)
def test_float64_matches_reference(case, offset):
    """offset (causal only): the alignment moved, as the ring's windowed zigzag blocks use it."""
    lens_q, lens_k, hq, hkv, pad, causal, seed, window, dv = case
    offset = offset if causal else 0
    q, k, v, dout, cu_q, cu_k, mq, mk = _make(lens_q, lens_k, hq, hkv, 8, pad, torch.float64, seed,
                                              dv)
    args = (cu_q, cu_k, mq, mk, causal)
    out, lse = attn_forward(q, k, v, *args, backend="torch_cpu", window=window, offset=offset)
    ref_out, ref_lse = reference_attention(q, k, v, *args, window=window, offset=offset)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    _assert_lse(lse, ref_lse, 1e-10)
    assert torch.all(out[ref_lse.t() == NEG_INF] == 0)  # rows that see nothing: exactly 0
    grads = attn_backward(dout, q, k, v, out, lse, *args, backend="torch_cpu", window=window,
                          offset=offset)
    ref_grads = reference_backward(dout, q, k, v, ref_out, ref_lse, *args, window=window,
                                   offset=offset)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)
    t_real, s_real = int(cu_q[-1]), int(cu_k[-1])
    assert torch.all(grads[0][t_real:] == 0) and torch.all(grads[1][s_real:] == 0)
    assert torch.all(grads[2][s_real:] == 0)


def _dense_sink_attention(q_THD, k_SHD, v_SHD, mask_TS, sink_H, scale):
    """gpt-oss's eager attention (transformers) on one [1, H, T, D] batch: the sink logit is a
    last softmax column that is dropped before the values."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = q_THD.shape[1] // k_SHD.shape[1]
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sink_H, g, False
    bias_TS = torch.zeros(mask_TS.shape, dtype=q_THD.dtype).masked_fill(~mask_TS, float("-inf"))
    q, k, v = (x.transpose(0, 1)[None] for x in (q_THD, k_SHD, v_SHD))
    out, _ = eager_attention_forward(module, q, k, v, bias_TS[None, None], scale)
    return out[0]


@settings(max_examples=25)
@given(packs())
def test_sinks_match_gpt_oss_eager_attention_in_float64(case):
    """varlen_attention with a sink (and windows, Dv != D) against transformers' gpt-oss eager
    attention: output, and gradients of q, k, v and the sink. Rows of query-only documents
    (no key) see only the sink: output 0."""
    lens_q, lens_k, hq, hkv, pad, causal, seed, window, dv = case
    pytest.importorskip("transformers")
    q, k, v, dout, cu_q, cu_k, mq, mk = _make(lens_q, lens_k, hq, hkv, 8, pad, torch.float64, seed,
                                              dv)
    sink = torch.randn(hq, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    out, _ = varlen_attention(*leaves[:3], cu_q, cu_k, mq, mk, causal, backend="torch_cpu",
                              window=window, sink=leaves[3])
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    mask_TS = doc_mask_TS(cu_q, cu_k, q.shape[0], k.shape[0], causal, window)
    ref = _dense_sink_attention(*ref_leaves[:3], mask_TS, ref_leaves[3], 8 ** -0.5)
    want = torch.autograd.grad(ref, ref_leaves, dout)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)


def test_reference_mask_is_bottom_right():
    # One document with Lq=2, Lk=4: query 0 sees keys 0..2, query 1 sees all four.
    mask = doc_mask_TS(_cu([2]), _cu([4]), 2, 4, causal=True)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    # Lq=3, Lk=1: only the last query sees the key; the others see nothing.
    mask = doc_mask_TS(_cu([3]), _cu([1]), 3, 1, causal=True)
    assert mask.flatten().tolist() == [False, False, True]


# bf16 / float32 against the float64 reference on the same (rounded) inputs.
# float32: the kernel accumulates in float32 over <= 64 keys of O(1) terms, so errors are a few
#   ulps of values O(1-10): 2e-5 absolute leaves a wide margin yet catches any masking mistake
#   (those are O(0.1)).
# bf16: out is rounded to bf16 (relative 2^-8 ~ 4e-3) and the kernel rounds P to bf16 before P@V;
#   |out| <= max |v| ~ 4, so 3e-2 absolute; lse is float32 computed from bf16 q, k: 1e-2.
#   Gradients sum a few dozen bf16-rounded products: 6e-2 absolute.
@pytest.mark.parametrize("dtype,tol_out,tol_lse,tol_grad", [
    (torch.float32, 2e-5, 2e-5, 5e-5), (torch.bfloat16, 3e-2, 1e-2, 6e-2)])
def test_low_precision_matches_reference(dtype, tol_out, tol_lse, tol_grad):
    cases = [([5, 1, 17, 9, 0, 30], [5, 1, 17, 9, 0, 30], True),
             ([3, 8, 1, 12], [20, 8, 4, 1], True),
             ([3, 8, 1, 12], [20, 8, 4, 0], False)]
    if dtype == torch.bfloat16:  # 700 tokens: padded to 768, backward on the kernel's bf16 path
        cases.append(([700, 20], [700, 20], True))
    for i, (lq, lk, causal) in enumerate(cases):
        q, k, v, dout, cu_q, cu_k, mq, mk = _make(lq, lk, 4, 2, 16, 2, dtype, i)
        args = (cu_q, cu_k, mq, mk, causal)
        out, lse = attn_forward(q, k, v, *args)
        assert out.dtype == dtype and lse.dtype == torch.float32
        ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args)
        torch.testing.assert_close(out.double(), ref_out, atol=tol_out, rtol=0)
        _assert_lse(lse, ref_lse, tol_lse)
        grads = attn_backward(dout, q, k, v, out, lse, *args)
        ref = reference_backward(dout.double(), q.double(), k.double(), v.double(), ref_out,
                                 ref_lse, *args)
        for g, r in zip(grads, ref, strict=False):
            assert g.dtype == dtype
            torch.testing.assert_close(g.double(), r, atol=tol_grad, rtol=0)

def _assert_causal_exact(q, k, v, dout, cu_q, cu_k, mq, mk):
    """float64 forward (out, lse) and backward (dq, dk, dv) equal the dense reference to 1e-10."""
    args = (cu_q, cu_k, mq, mk, True)
    out, lse = attn_forward(q, k, v, *args)
    ref_out, ref_lse = reference_attention(q, k, v, *args)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    _assert_lse(lse, ref_lse, 1e-10)
    grads = attn_backward(dout, q, k, v, out, lse, *args)
    ref = reference_backward(dout, q, k, v, ref_out, ref_lse, *args)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=0)


def test_tiled_and_scattered_assembly_are_exact():
    """Rows of unpadded single-document buckets that tile the row are assembled with one cat;
    trailing padding (or any gathered bucket) takes the scatter path. Both exact in float64."""
    from cp_attention.kernels import torch_cpu

    lens = [100, 300, 600]
    for pad, tiled in ((0, True), (3, False)):
        q, k, v, dout, cu_q, cu_k, mq, mk = _make(lens, lens, 4, 2, 8, pad, torch.float64, 9)
        plan = torch_cpu._plan(cu_q, cu_k, True, q.dtype, False)
        assert (torch_cpu._tiling(plan, q.shape[0], k.shape[0]) is not None) == tiled
        _assert_causal_exact(q, k, v, dout, cu_q, cu_k, mq, mk)


def test_padded_big_block_layout_is_exact(monkeypatch):
    """The bf16 backward pads causal buckets up to the kernel's big-block length (768); shrink
    that length to check the padded layouts themselves in float64 (Lq != Lk, 1-token docs, GQA)."""
    from cp_attention.kernels import _buckets, torch_cpu

    pad_to = {}
    monkeypatch.setattr(torch_cpu, "_plan", lambda cu_q, cu_k, causal, dtype, invariant, backward=False,
                        window=None, offset=0: _buckets.plan_buckets(
                            tuple(cu_q.tolist()), tuple(cu_k.tolist()), bool(causal),
                            pad_to["len"], False, window, offset))
    cases = [  # (pad length, lens_q, lens_k): a gathered padded bucket; then a one-document
        # bucket padded in place (the 20-token documents after it fill its padded slots)
        (64, [5, 1, 17, 9, 31, 2, 40], [7, 1, 17, 12, 31, 1, 40]),
        (150, [120, 20, 20], [120, 20, 20])]
    for length, lens_q, lens_k in cases:
        pad_to["len"] = length
        q, k, v, dout, cu_q, cu_k, mq, mk = _make(lens_q, lens_k, 4, 2, 8, 2, torch.float64, 4)
        plan = torch_cpu._plan(cu_q, cu_k, True, None, False)
        assert max(bk.pk for bk in plan) == length > max(lens_k)
        assert (length == 150) == any(bk.q_slice is not None and bk.q_len < bk.pq for bk in plan)
        _assert_causal_exact(q, k, v, dout, cu_q, cu_k, mq, mk)


def test_gradcheck_tiny():
    q, k, v, _, cu_q, cu_k, mq, mk = _make([3, 1, 2], [3, 2, 2], 2, 1, 4, 1, torch.float64, 7)
    for causal in (True, False):
        fn = lambda q_, k_, v_, c=causal: varlen_attention(q_, k_, v_, cu_q, cu_k, mq, mk, c)[0]
        inputs = tuple(x.clone().requires_grad_() for x in (q, k, v))
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, fast_mode=True)


def test_gradcheck_through_lse():
    """lse is differentiable too (a ring written in plain autograd merges with it)."""
    q, k, v, _, cu_q, cu_k, mq, mk = _make([3, 1, 2], [4, 0, 2], 2, 1, 4, 1, torch.float64, 8)
    w = torch.randn(2, q.shape[0], dtype=torch.float64)

    def fn(q_, k_, v_):
        out, lse = varlen_attention(q_, k_, v_, cu_q, cu_k, mq, mk, True)
        return out, torch.where(torch.isfinite(lse), lse, 0.0) * w

    inputs = tuple(x.clone().requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, fast_mode=True)


def _merge(o1, l1, o2, l2):
    """Merge two partial attentions over disjoint key sets (float64, -inf safe)."""
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(lse == NEG_INF, 0.0, lse)
    w1 = torch.exp(l1 - safe).t()[..., None]
    w2 = torch.exp(l2 - safe).t()[..., None]
    return o1 * w1 + o2 * w2, lse


def _split_keys(q, k, v, lens_q, lens_k, cuts):
    """Per document, keys [0, cut) go to block 1, [cut, Lk) to block 2."""
    starts = _cu(lens_k).tolist()
    i1 = [j for s, c in zip(starts, cuts, strict=False) for j in range(s, s + c)]
    i2 = [j for s, lk, c in zip(starts, lens_k, cuts, strict=False) for j in range(s + c, s + lk)]
    lens1, lens2 = cuts, [lk - c for lk, c in zip(lens_k, cuts, strict=False)]
    return (k[i1], v[i1], _cu(lens1), max(lens1)), (k[i2], v[i2], _cu(lens2), max(lens2)), i1, i2


def test_backward_with_merged_out_lse():
    """Ring use: keys split in two blocks, partial results merged, each block's backward run with
    the merged (out, lse); the blocks' gradients must sum to the full gradient. Causal documents
    have Lk >= Lq and cut <= Lk - Lq, so block 1 is fully visible (non-causal) and block 2 keeps
    the bottom-right causal mask; non-causal documents are cut anywhere."""
    for causal in (True, False):
        lens_q, lens_k, cuts = [4, 1, 6, 3], [9, 1, 6, 7], [5, 0, 0, 2]
        q, k, v, dout, cu_q, _, mq, _ = _make(lens_q, lens_k, 4, 2, 8, 2, torch.float64, 3)
        cu_k = _cu(lens_k)
        b1, b2, i1, i2 = _split_keys(q, k, v, lens_q, lens_k, cuts)
        full = attn_forward(q, k, v, cu_q, cu_k, mq, max(lens_k), causal)
        o1, l1 = attn_forward(q, b1[0], b1[1], cu_q, b1[2], mq, b1[3], False)
        o2, l2 = attn_forward(q, b2[0], b2[1], cu_q, b2[2], mq, b2[3], causal)
        out, lse = _merge(o1, l1, o2, l2)
        torch.testing.assert_close(out, full[0], atol=1e-12, rtol=0)
        g1 = attn_backward(dout, q, b1[0], b1[1], out, lse, cu_q, b1[2], mq, b1[3], False)
        g2 = attn_backward(dout, q, b2[0], b2[1], out, lse, cu_q, b2[2], mq, b2[3], causal)
        ref = reference_backward(dout, q, k, v, *full, cu_q, cu_k, mq, max(lens_k), causal)
        torch.testing.assert_close(g1[0] + g2[0], ref[0], atol=1e-10, rtol=0)
        for grad_full, a, b in ((ref[1], g1[1], g2[1]), (ref[2], g1[2], g2[2])):
            torch.testing.assert_close(a, grad_full[i1], atol=1e-10, rtol=0)
            torch.testing.assert_close(b, grad_full[i2], atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_documents_are_isolated(dtype):
    lens = [7, 30, 1, 30, 12]
    q, k, v, dout, cu_q, cu_k, mq, mk = _make(lens, lens, 4, 2, 16, 3, dtype, 11)
    base = attn_forward(q, k, v, cu_q, cu_k, mq, mk, True)
    base_g = attn_backward(dout, q, k, v, *base, cu_q, cu_k, mq, mk, True)
    doc = slice(7, 37)  # document 1: same length as document 3, so likely in one kernel batch
    for x in (q, k, v):
        x[doc] = torch.randn_like(x[doc])
    new = attn_forward(q, k, v, cu_q, cu_k, mq, mk, True)
    new_g = attn_backward(dout, q, k, v, *new, cu_q, cu_k, mq, mk, True)
    other = torch.ones(q.shape[0], dtype=torch.bool)
    other[doc] = False
    assert not torch.equal(new[0][doc], base[0][doc])
    assert torch.equal(new[0][other], base[0][other]) and torch.equal(new[1][:, other], base[1][:, other])
    for a, b in zip(new_g, base_g, strict=False):
        assert torch.equal(a[other], b[other]) and not torch.equal(a[doc], b[doc])


def test_buckets_cover_each_document_once():
    lens = [1] * 40 + [200, 190, 5, 0, 64]
    bounds = tuple(_cu(lens).tolist())
    buckets = plan_buckets(bounds, bounds, True)
    tokens = torch.cat([b.q_tok for b in buckets]).sort().values
    assert torch.equal(tokens, torch.arange(sum(lens)))
    keys = torch.cat([b.k_tok for b in buckets]).sort().values
    assert torch.equal(keys, torch.arange(sum(lens)))
    assert len(buckets) < 10  # forty 1-token documents share one kernel call


def test_errors_name_cause_and_fix():
    q, k, v, _, cu_q, cu_k, mq, mk = _make([3, 2], [3, 2], 4, 2, 8, 0, torch.float32, 0)
    with pytest.raises(RuntimeError, match="flash-attn"):
        attn_forward(q, k, v, cu_q, cu_k, mq, mk, True, backend="flash_attn")
    with pytest.raises(RuntimeError, match="flash-attn"):
        resolve_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("flash", "cpu")
    assert resolve_backend("auto", "cpu") == "torch_cpu"
    with pytest.raises(ValueError, match="Hq % Hkv"):
        attn_forward(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu_q, cu_k, mq, mk, True)
    with pytest.raises(ValueError, match="max_q"):
        attn_forward(q, k, v, cu_q, cu_k, 2, mk, True)
    with pytest.raises(ValueError, match="documents"):
        attn_forward(q, k, v, cu_q, cu_k[:2], mq, mk, True)
    with pytest.raises(ValueError, match="past the tensors"):
        attn_forward(q, k, v, cu_q + 1 - (cu_q == 0).int(), cu_k, mq, mk, True)


def test_recompute_backward_with_merged_lse():
    """The GPU flex backend's trick, checked on CPU with the differentiable float64 reference as
    the local kernel: back-propagating (w * dout, w * (D_local - D)) through a block's local
    (out, lse) equals that block's share of the full gradient under the merged (out, lse)."""
    lens_q, lens_k, cuts = [4, 2, 6], [9, 0, 8], [5, 0, 3]
    q, k, v, dout, cu_q, _, mq, _ = _make(lens_q, lens_k, 4, 2, 8, 1, torch.float64, 5)
    cu_k = _cu(lens_k)
    b1, b2, i1, i2 = _split_keys(q, k, v, lens_q, lens_k, cuts)
    full = reference_forward(q, k, v, cu_q, cu_k, mq, max(lens_k), True)
    ref = reference_backward(dout, q, k, v, *full, cu_q, cu_k, mq, max(lens_k), True)
    dq = torch.zeros_like(q)
    for (kb, vb, cu_b, mb), idx, causal in ((b1, i1, False), (b2, i2, True)):
        local = lambda q_, k_, v_, kb=kb, cu_b=cu_b, mb=mb, c=causal: reference_forward(
            q_, k_, v_, cu_q, cu_b, mq, mb, c)
        gq, gk, gv = external_lse_grads(local, dout, q, kb, vb, *full)
        torch.testing.assert_close(gk, ref[1][idx], atol=1e-10, rtol=0)
        torch.testing.assert_close(gv, ref[2][idx], atol=1e-10, rtol=0)
        dq += gq
    torch.testing.assert_close(dq, ref[0], atol=1e-10, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_document_mask_forward_on_cpu(monkeypatch):
    """flex's eager CPU path (forward only) checks the document mask_mod and the lse convention
    that the CUDA backend relies on; the output must come from flex_attention itself (an adapter
    that fell back to dense maths would match the reference too)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from cp_attention.kernels import flex as flex_backend

    calls = []
    real = flex.flex_attention

    @functools.wraps(real)  # the adapter reads the signature (return_aux vs return_lse)
    def counting(*args, **kwargs):
        calls.append(kwargs["block_mask"])
        return real(*args, **kwargs)

    monkeypatch.setattr(flex, "flex_attention", counting)
    # flex imports on this torch, so the CPU refusal names the device, not the torch release.
    assert "only fast on CUDA" in flex_backend.unavailable_reason(torch.device("cpu"))
    for causal, window, offset in ((True, None, 0), (False, None, 0), (True, 2, 3), (True, 4, -2)):
        q, k, v, _, cu_q, cu_k, mq, mk = _make([3, 1, 5, 2], [6, 0, 5, 1], 4, 2, 8, 2,
                                               torch.float64, 1)
        out, lse = flex_backend.forward(q, k, v, cu_q, cu_k, mq, mk, causal, None, window, offset)
        assert len(calls) == 1 and isinstance(calls.pop(), flex.BlockMask)
        ref_out, ref_lse = reference_attention(q, k, v, cu_q, cu_k, mq, mk, causal,
                                               window=window, offset=offset)
        torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
        _assert_lse(lse, ref_lse, 1e-10)


def test_flash_attn_arguments_bind_by_name_across_releases():
    """flash-attn's private varlen functions changed signature (2.5: window_size tuple; 2.6:
    window_size_left/right + softcap; 2.7+: wrapped as torch custom ops). The adapter binds by
    name, checked here against stand-ins with each upstream signature."""
    from cp_attention.kernels import flash_attn as fa

    q = torch.zeros(2, 1, 8, dtype=torch.bfloat16)
    vals = fa._common_args(q, q, q, _cu([2]), _cu([2]), 2, 2, True, None)

    def v25(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, alibi_slopes, return_softmax, block_table=None):
        return window_size, causal

    def v26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None):
        return (window_size_left, window_size_right), causal

    @torch.library.custom_op("longctx_test::fa_varlen", mutates_args=())
    def v27(q: torch.Tensor, max_seqlen_q: int, causal: bool, softcap: float = 0.0) -> torch.Tensor:
        return q + (1.0 if causal else 0.0)

    assert fa._call_by_name(v25, vals) == ((-1, -1), True)
    assert fa._call_by_name(v26, vals) == ((-1, -1), True)
    assert torch.equal(fa._call_by_name(v27, vals), q + 1)
    with pytest.raises(RuntimeError, match="flash-attn >= 2.5"):
        fa._call_by_name(lambda q, unknown_arg: None, vals)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        fa._common_args(q.float(), q, q, _cu([2]), _cu([2]), 2, 2, True, None)


def test_flash_attn_window_and_value_head_dim_contract(monkeypatch):
    """The flash-attn adapter on CPU with the function it calls mocked: a window W reaches it as
    flash-attn's bottom-right (W - 1, 0) in both spellings; a v head dim != D arrives zero-padded
    to one head dim (flash-attn 2 takes one) and the output comes back sliced; an installed
    version without a window is refused at start-up in one line naming the backend and the fix."""
    from cp_attention.kernels import _registry
    from cp_attention.kernels import flash_attn as fa

    seen = {}

    def fwd_26(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
               alibi_slopes=None, return_softmax=False):
        seen.update(window=(window_size_left, window_size_right), dims=(q.shape[-1], v.shape[-1]),
                    scale=softmax_scale)
        return (v[:, :1].expand(-1, q.shape[1], -1).clone(),
                torch.zeros(q.shape[1], q.shape[0]), None, None)

    interface = type("FlashInterface", (), {"_flash_attn_varlen_forward": staticmethod(fwd_26)})
    monkeypatch.setattr(fa, "_interface", lambda: interface)
    monkeypatch.setattr(fa, "unavailable_reason", lambda device: None)
    q, k, v, _, cu_q, cu_k, mq, mk = _make([3, 2], [3, 2], 4, 2, 8, 0, torch.bfloat16, 0, dv=4)
    out, _ = attn_forward(q, k, v, cu_q, cu_k, mq, mk, True, backend="flash_attn", window=5)
    assert seen == {"window": (4, 0), "dims": (8, 8), "scale": 1.0 / math.sqrt(8)}
    assert out.shape == (5, 4, 4) and torch.equal(out, v[:, :1].expand(-1, 4, -1))
    vals = fa._common_args(q, k, k, cu_q, cu_k, mq, mk, True, None, window=3)
    assert vals["window_size"] == (2, 0)  # the 2.5 spelling
    assert fa.window_unsupported_reason(torch.device("cuda")) is None

    def fwd_old(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, return_softmax):
        raise AssertionError("a window must be refused before the kernel is called")

    interface._flash_attn_varlen_forward = staticmethod(fwd_old)
    with pytest.raises(RuntimeError, match=r"'flash_attn' cannot apply a sliding window: .*"
                                           r"flash-attn >= 2.3 or use attention_backend=flex"):
        _registry.check_window_support("flash_attn", torch.device("cuda"))
    with pytest.raises(RuntimeError, match="cannot apply a sliding window"):
        attn_forward(q, k, v, cu_q, cu_k, mq, mk, True, backend="flash_attn", window=5)


def test_window_and_head_dim_errors_name_cause_and_fix():
    q, k, v, _, cu_q, cu_k, mq, mk = _make([3, 2], [3, 2], 4, 2, 8, 0, torch.float64, 0, dv=4)
    with pytest.raises(ValueError, match="sliding window needs causal=True"):
        attn_forward(q, k, v, cu_q, cu_k, mq, mk, False, window=3)
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        attn_forward(q, k, v, cu_q, cu_k, mq, mk, True, window=0)
    with pytest.raises(ValueError, match="only their head dims may differ"):
        attn_forward(q, k, v[:, :1], cu_q, cu_k, mq, mk, True)
    with pytest.raises(ValueError, match=r"sink must be one logit per query head \[4\]"):
        varlen_attention(q, k, v, cu_q, cu_k, mq, mk, sink=torch.zeros(2))


def test_accumulate_dtype_is_float64_only_for_float64():
    from cp_attention.kernels import accumulate_dtype

    assert accumulate_dtype(torch.float64) == torch.float64
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert accumulate_dtype(dt) == torch.float32


def test_offset_goes_to_a_backend_that_takes_it_or_is_refused():
    """A call with an offset alignment (the ring's windowed zigzag blocks) runs on the backend
    asked for when it takes one, else on flex where flex runs, else is refused in one line."""
    from cp_attention.kernels import offset_backend

    cpu = torch.device("cpu")
    assert offset_backend("torch_cpu", cpu) == "torch_cpu"
    assert offset_backend("reference", cpu) == "reference"
    for name in ("flash_attn", "torch_varlen"):  # no offset; flex does not run on CPU
        with pytest.raises(RuntimeError, match=f"{name}' cannot move its causal/window alignment"):
            offset_backend(name, cpu)
    q, k, v, _, cu_q, cu_k, mq, mk = _make([4], [4], 2, 2, 8, 0, torch.float64, 0)
    with pytest.raises(ValueError, match="offset=2 moves the causal alignment and needs causal"):
        attn_forward(q, k, v, cu_q, cu_k, mq, mk, False, offset=2)


def test_flash_fix_ups_match_their_definition():
    """The CUDA adapters' fix-ups on CPU, against their definition: rows past cu_q[-1] and rows
    whose lse is not finite get out 0, lse -inf; the backward's lse maps -inf to +inf only. The
    trailing-padding mask is made once per boundary tensor and again after an in-place write."""
    from cp_attention.kernels import flash_attn as fa

    g = torch.Generator().manual_seed(0)
    out = torch.randn(6, 2, 4, generator=g, dtype=torch.float64).to(torch.bfloat16)
    lse = torch.randn(2, 6, generator=g)
    lse[0, 1], lse[1, 2], lse[0, 3] = math.inf, math.nan, -math.inf
    cu = _cu([3, 2])
    rows = torch.arange(6) >= cu[-1]
    want_lse = torch.where(rows[None, :] | ~torch.isfinite(lse), NEG_INF, lse)
    want_out = out.masked_fill((rows[:, None] | torch.isinf(want_lse).t())[..., None], 0)
    got_out, got_lse = fa._fix_padding(out, lse.clone(), cu)
    assert torch.equal(got_lse, want_lse) and torch.equal(got_out, want_out)
    assert torch.equal(fa.kernel_lse(want_lse), torch.where(want_lse == NEG_INF, math.inf, want_lse))
    assert torch.equal(fa.kernel_lse(lse).isnan(), lse.isnan())
    assert fa.tail_rows(cu, 6) is fa.tail_rows(cu, 6)
    cu[-1] = 6
    assert not fa.tail_rows(cu, 6).any()
