"""The brgemm attention forward (cp_attention.kernels.brgemm_forward) against the float64 reference
and aten's kernel, and the torch_cpu backend's choice between the two.

Shape legend: T tokens, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

import pytest
import torch

from cp_attention import native
from cp_attention.hardware import cpu_has_avx512_bf16
from cp_attention.kernels import (
    AttnKernel,
    attn_backward,
    attn_forward,
    brgemm_forward,
    reference_attention,
)
from cp_attention.kernels.reference import reference_backward
from tests.cp_attention.cp_cases import bf16_row as _row

# Keyed on the CPU, not on available(): where the kernel can be built, a failed build or self-check
# must fail these tests, not skip them (the model would silently stay on aten's kernel).
needs_kernel = pytest.mark.skipif(
    not cpu_has_avx512_bf16(), reason="no AVX512-BF16 x86 CPU here: aten's forward is used")
_aten = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _aten_out(q, k, v, cu):
    """aten's forward, one call per document: its error is the bar ours must meet."""
    g, outs = q.shape[1] // k.shape[1], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qb, kb, vb = (x[a:b].repeat_interleave(n, 1).transpose(0, 1)[None]
                      for x, n in ((q, 1), (k, g), (v, g)))
        outs.append(_aten(qb, kb, vb, 0.0, True)[0][0].transpose(0, 1))
    return torch.cat(outs)


# Documents straddling the 64-row tiles (63/64/65/129), 1-token documents, tokens after the last
# document (pad), GQA (2 and 4 query heads per KV head), one long document, head dims 16 to 128
# (80: a V panel of 64 plus one of 16).
CASES = [([5, 1, 63, 64, 65, 129, 2], 4, 2, 16, 3), ([700, 20], 8, 4, 64, 0), ([1], 2, 1, 32, 1),
         ([300, 1, 1, 211], 3, 3, 32, 2), ([200, 77], 4, 2, 128, 1), ([90], 2, 2, 80, 0),
         ([130, 128], 8, 2, 64, 5)]


@needs_kernel
@pytest.mark.parametrize("lens,hq,hkv,d,pad", CASES)
def test_matches_float64_reference(lens, hq, hkv, d, pad):
    q, k, v, _, cu, mx = _row(lens, hq, hkv, d, pad, seed=len(lens))
    out, lse = brgemm_forward.varlen_causal_forward(q, k, v, cu, d ** -0.5)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), cu, cu, mx, mx, True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    n = int(cu[-1])
    # bf16 operands and P, fp32 accumulation, like aten's kernel: its error on the same documents
    # plus one bf16 ulp at the output's scale (rounding P differently moves single elements).
    err = (out[:n].double() - ref_out[:n].double()).abs().max().item()
    aten_err = (_aten_out(q, k, v, cu).double() - ref_out[:n].double()).abs().max().item()
    assert err <= aten_err + 2 ** -8 * ref_out.abs().max().item(), (err, aten_err)
    # lse: fp32 sums of at most ~1000 terms over exact bf16 products; 1e-5 is ~10 fp32 ulps.
    torch.testing.assert_close(lse[:, :n].double(), ref_lse[:, :n].double(), atol=1e-5, rtol=0)
    if pad:  # tokens outside every document: out 0, lse -inf, as aten's path returns them
        assert not out[n:].any() and bool((lse[:, n:] == float("-inf")).all())


@needs_kernel
@pytest.mark.parametrize("lens,hq,hkv,d,pad", [CASES[0], CASES[4]])
def test_its_lse_drives_the_backward(lens, hq, hkv, d, pad):
    """attn_forward runs this kernel; the backward (aten's, or the AMX one) recomputes P from our
    lse, so the gradients are only right if lse is the natural-log logsumexp of scaled scores."""
    q, k, v, dout, cu, mx = _row(lens, hq, hkv, d, pad, seed=3)
    args = (cu, cu, mx, mx, True)
    out, lse = attn_forward(q, k, v, *args)
    grads = attn_backward(dout, q, k, v, out, lse, *args)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args)
    ref = reference_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, *args)
    for g, r in zip(grads, ref, strict=True):
        # bf16 gradients: the AMX backward test's bound (aten's bf16 kernel reaches 1.2% of scale).
        err = (g.double() - r).abs().max().item()
        assert err < 6e-2 and err <= 1.5e-2 * r.abs().max().item(), err


@needs_kernel
def test_backend_uses_it_only_for_bf16_causal_self_attention(monkeypatch):
    calls = []
    real = brgemm_forward.varlen_causal_forward
    monkeypatch.setattr(brgemm_forward, "varlen_causal_forward", lambda *a: calls.append(1) or real(*a))
    q, k, v, _, cu, mx = _row([40, 9], 2, 1, 16, 0, seed=0)
    d8 = [x[..., :8].contiguous() for x in (q, k, v)]
    cu_k = torch.tensor([0, 9, 49], dtype=torch.int32)
    for qq, kk, vv, ck, causal, used in [
            (q, k, v, cu, True, True),
            (q, k, v, cu, False, False),  # not causal
            (q, k, v, cu_k, True, False),  # other key boundaries (a ring step)
            (q.float(), k.float(), v.float(), cu, True, False),  # not bf16
            (*d8, cu, True, False)]:  # head dim not a multiple of 16
        calls.clear()
        attn_forward(qq, kk, vv, cu, ck, mx, 40, causal)
        assert bool(calls) == used



@needs_kernel
def test_a_failing_call_falls_back_to_aten_with_one_warning(monkeypatch):
    monkeypatch.setattr(native._STATE, "reasons", dict(native._STATE.reasons))  # restored afterwards

    def broken(*args):
        raise RuntimeError("could not create a BRGeMM ukernel")

    monkeypatch.setattr(brgemm_forward, "varlen_causal_forward", broken)
    q, k, v, _, cu, mx = _row([30, 7], 2, 1, 16, 0, seed=1)
    args = (cu, cu, mx, mx, True)
    with pytest.warns(UserWarning, match="brgemm attention forward unavailable.*BRGeMM"):
        out, lse = attn_forward(q, k, v, *args)
    assert not brgemm_forward.available()
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args)
    torch.testing.assert_close(out.double(), ref_out.double(), atol=2e-2, rtol=0)  # aten's bf16 out
    # aten's own lse is less exact: 6e-5 off on this input (measured; ours is within 1e-6).
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-4, rtol=0)


@needs_kernel
def test_a_document_is_bitwise_the_same_alone_and_packed():
    """Per-document work items: neither the neighbours nor the thread count change a bit, with or
    without batch invariance (which only changes aten's bucketing)."""
    q, k, v, _, cu, mx = _row([77, 300, 5, 130], 4, 2, 64, 2, seed=5)
    a, b = 77, 377  # the 300-token document
    alone = attn_forward(q[a:b], k[a:b], v[a:b], *(torch.tensor([0, 300], dtype=torch.int32),) * 2,
                         300, 300, True)
    threads = torch.get_num_threads()
    try:
        for n in {1, threads}:
            torch.set_num_threads(n)
            for invariant in (True, False):
                kernel = AttnKernel("torch_cpu", batch_invariant=invariant)
                out, lse = attn_forward(q, k, v, cu, cu, mx, mx, True, backend=kernel)
                assert torch.equal(out[a:b], alone[0]) and torch.equal(lse[:, a:b], alone[1])
    finally:
        torch.set_num_threads(threads)
