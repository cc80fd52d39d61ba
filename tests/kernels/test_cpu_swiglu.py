"""The fused CPU SwiGLU (cp_attention/csrc/swiglu.cpp) against the torch path of
model.experts._SwiGLUDown and a float64 reference.

The kernel keeps the torch path's float32 arithmetic and stores, with at::vec's exp: where aten
runs its vector loop over a whole row (rows of a multiple of 64 bf16 / 32 float32 values: it
takes two vectors a step) the two agree bitwise; on the rest of a row aten's scalar loop uses
std::exp, a few roundings of the rows' dtype away. Against float64 the float32 results stay
within 1e-5 relative."""

import pytest
import torch

from cp_attention.hardware import cpu_has_avx512_bf16
from longctx_moe.kernels import cpu_swiglu
from longctx_moe.model.experts import _silu_and_act

# Where it is built, a failed build or self-check fails these tests (the activation would silently
# stay on torch); elsewhere (AVX2-only CPUs) they do not apply.
pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the fused CPU SwiGLU is built for AVX512")


def _torch_backward(h, dact):
    """_SwiGLUDown's torch path after the GEMMs: (act, dh)."""
    silu, act = _silu_and_act(h)
    gate, up = h.chunk(2, -1)
    dh = torch.empty_like(h)
    dgate, dup = dh.chunk(2, -1)
    torch.mul(dact, silu, out=dup)
    torch.ops.aten.silu_backward.grad_input(dact.clone().mul_(up), gate, grad_input=dgate)
    return act, dh


def _float64(h, dact):
    gate, up = h.double().chunk(2, -1)
    d, s = dact.double(), torch.sigmoid(gate.double())
    act = gate * s * up
    return act, torch.cat([d * up * s * (1 + gate * (1 - s)), d * gate * s], -1)


@pytest.mark.parametrize("f", [16, 40, 64, 256, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_torch_path_and_float64(f, dtype):
    assert cpu_swiglu.available()
    g = torch.Generator().manual_seed(f)
    h = (torch.randn(37, 2 * f, generator=g) * 4).to(dtype)
    dact = torch.randn(37, f, generator=g).to(dtype)
    ours = (cpu_swiglu.forward(h), *cpu_swiglu.backward(h, dact))
    ref = (_silu_and_act(h)[1], *_torch_backward(h, dact))
    for a, r in zip(ours, ref, strict=True):
        assert a.dtype == dtype and a.shape == r.shape
        if f % (64 if dtype == torch.bfloat16 else 32) == 0:  # aten's vector loop on whole rows
            torch.testing.assert_close(a, r, atol=0, rtol=0)
        else:  # a few roundings of the rows' dtype, at the scale of the largest value
            step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
            assert (a.double() - r.double()).abs().max() <= step * r.double().abs().max()
    if dtype == torch.float32:
        exact = _float64(h, dact)
        for a, r in zip(ours, (exact[0], *exact), strict=True):
            assert float((a.double() - r).abs().max() / r.abs().max()) < 1e-5


def test_serves_cpu_float32_and_bf16_rows_only():
    h = torch.zeros(2, 8)
    assert cpu_swiglu.serves(h) and cpu_swiglu.serves(h.bfloat16())
    assert not cpu_swiglu.serves(h.double())
    with cpu_swiglu.disabled():
        assert not cpu_swiglu.serves(h)
