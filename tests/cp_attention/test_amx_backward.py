"""The brgemm attention backward (cp_attention.kernels.amx_backward; AMX or AVX512-BF16) against
the float64 reference, and the torch_cpu backend's choice between it and aten's kernel.

Shape legend: T tokens, Hq / Hkv heads, D head dim.
"""

from __future__ import annotations

import pytest
import torch

from cp_attention import native, native_checks
from cp_attention.hardware import cpu_has_avx512_bf16
from cp_attention.kernels import (
    amx_backward,
    attn_backward,
    attn_forward,
    reference_attention,
)
from cp_attention.kernels._common import kernel_lse
from cp_attention.kernels.reference import reference_backward
from tests.cp_attention.cp_cases import bf16_row as _row

# Keyed on the CPU, not on available(): where the kernel can be built, a failed build or self-check
# must fail these tests, not skip them (the model would silently stay on aten's kernel).
needs_kernel = pytest.mark.skipif(
    not cpu_has_avx512_bf16(), reason="no AVX512-BF16 x86 CPU here: aten's backward is used")


# Documents straddling the 64-row tiles (63/64/65/129), 1-token documents, tokens after the last
# document (pad), GQA, long documents (700 and 1100 span two and three 512-query chunks of the
# dV / dK products), and head dims past one 64-column panel (128, 80).
CASES = [([5, 1, 63, 64, 65, 129, 2], 4, 2, 16, 3), ([700, 20], 8, 4, 64, 0), ([1], 2, 1, 16, 1),
         ([300, 1, 1, 211], 3, 3, 32, 2), ([200, 77], 4, 2, 128, 1), ([90], 2, 2, 80, 0),
         ([1100, 3], 2, 1, 16, 0)]


@needs_kernel
@pytest.mark.parametrize("lens,hq,hkv,d,pad", CASES)
def test_matches_float64_reference(lens, hq, hkv, d, pad):
    q, k, v, dout, cu, mx = _row(lens, hq, hkv, d, pad, seed=len(lens))
    args = (cu, cu, mx, mx, True)
    out, lse = attn_forward(q, k, v, *args)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args)
    ref = reference_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, *args)
    amx = amx_backward.varlen_causal_backward(dout, q, k, v, out, kernel_lse(lse), cu, d ** -0.5)
    for a, r in zip(amx, ref, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape
        # bf16 operands, P and dS rounded to bf16 for their products (as aten's bf16 kernel and
        # FlashAttention do), fp32 accumulation: the bf16 kernel test's 6e-2, and within 1% of the
        # gradient's scale (measured 0.3-0.6%; aten's bf16 kernel reaches 1.2% on 2048 tokens).
        err = (a.double() - r).abs().max().item()
        assert err < 6e-2 and err <= 1e-2 * r.abs().max().item(), err  # exact where r == 0
        if pad:
            assert not a[-pad:].any()  # tokens outside every document get no gradient


@needs_kernel
def test_backend_uses_it_only_for_bf16_causal_self_attention(monkeypatch):
    calls = []
    real = amx_backward.varlen_causal_backward
    monkeypatch.setattr(amx_backward, "varlen_causal_backward", lambda *a: calls.append(1) or real(*a))
    q, k, v, dout, cu, mx = _row([40, 9], 2, 1, 16, 0, seed=0)
    d8 = [x[..., :8].contiguous() for x in (q, k, v, dout)]
    cu_k = torch.tensor([0, 9, 49], dtype=torch.int32)
    for qq, kk, vv, dd, ck, causal, used in [
            (q, k, v, dout, cu, True, True),
            (q, k, v, dout, cu, False, False),  # not causal
            (q, k, v, dout, cu_k, True, False),  # other key boundaries (a ring step)
            (q.float(), k.float(), v.float(), dout.float(), cu, True, False),  # not bf16
            (*d8, cu, True, False)]:  # head dim not a multiple of 16
        calls.clear()
        out, lse = attn_forward(qq, kk, vv, cu, ck, mx, 40, causal)
        attn_backward(dd, qq, kk, vv, out, lse, cu, ck, mx, 40, causal)
        assert bool(calls) == used



@needs_kernel
def test_a_failing_call_falls_back_to_aten_with_one_warning(monkeypatch):
    monkeypatch.setattr(native._STATE, "reasons", dict(native._STATE.reasons))  # restored afterwards

    def broken(*args):
        raise RuntimeError("could not create a BRGeMM ukernel")

    monkeypatch.setattr(amx_backward, "varlen_causal_backward", broken)
    q, k, v, dout, cu, mx = _row([30, 7], 2, 1, 16, 0, seed=1)
    args = (cu, cu, mx, mx, True)
    out, lse = attn_forward(q, k, v, *args)
    with pytest.warns(UserWarning, match=r"brgemm \(AMX or AVX512-BF16\) attention backward unavailable.*BRGeMM"):
        grads = attn_backward(dout, q, k, v, out, lse, *args)
    assert not amx_backward.available()
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), *args)
    ref = reference_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, *args)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g.double(), r, atol=6e-2, rtol=0)


@needs_kernel
def test_self_check_rejects_a_wrong_kernel():
    """A kernel 5% off (a wrong oneDNN path would be O(1) off) fails the self-check."""
    real = native.extension()

    class Off:
        def varlen_causal_backward(self, *args):
            return [g.float().mul(1.05).bfloat16() for g in real.varlen_causal_backward(*args)]

    native_checks.attention_bwd(real)
    with pytest.raises(RuntimeError, match="self-check"):
        native_checks.attention_bwd(Off())
