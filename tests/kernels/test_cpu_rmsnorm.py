"""The fused CPU RMSNorm (cp_attention/csrc/rmsnorm.cpp) against the torch path of
model.layers._RMSNormFn and a float64 reference.

Both compute in float32 and differ only by the order of each row's sums: the float32 results
agree to ~1e-6 relative (2e-6 allowed), and a bf16 output or input gradient can land one bf16
step (2^-8 of the largest value) from the torch path's, never more. Against float64 the float32
results stay within 1e-5 relative: a wrong formula (a missed scale, the wrong mean) is off by
percents."""

import pytest
import torch

from cp_attention.hardware import cpu_has_avx512_bf16
from longctx_moe.kernels import cpu_rmsnorm
from longctx_moe.model.layers import RMSNorm, _RMSNormFn

# Where it is built, a failed build or self-check fails these tests (the norm would silently stay
# on torch); elsewhere (AVX2-only CPUs) they do not apply.
pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the fused CPU RMSNorm is built for AVX512")


def _run(x, w, out_dtype, g, cpp):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = _RMSNormFn.apply(x, w, 1e-6, out_dtype, cpp)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("shape", [(33, 37), (64, 256), (40, 3, 80)])  # a vector tail; q / k norms' [T, H, D]
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)])
def test_fused_norm_matches_the_torch_path_and_float64(shape, x_dtype, out_dtype):
    assert cpu_rmsnorm.available()
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(x_dtype)
    w = torch.randn(shape[-1], generator=gen)
    g = torch.randn(shape, generator=gen).to(out_dtype)
    ours = _run(x, w, out_dtype, g, cpp=True)
    torch_path = _run(x, w, out_dtype, g, cpp=False)
    for a, b in zip(ours, torch_path, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _rel(a, b) <= (2e-6 if a.dtype == torch.float32 else 2**-8), (a.dtype, _rel(a, b))
    ref = _run(x.double(), w.double(), torch.float64, g.double(), cpp=False)
    if x_dtype == out_dtype == torch.float32:
        for a, b in zip(ours, ref, strict=True):
            assert _rel(a, b) < 1e-5
    assert _rel(ours[2], ref[2]) < 1e-5  # the weight gradient is summed in float32 either way


def test_the_norm_module_runs_the_kernel_and_repeats_itself_bit_for_bit():
    norm = RMSNorm(96, impl="cpp")
    x = torch.randn(50, 96, requires_grad=True)
    runs = []
    for _ in range(2):
        x.grad, norm.weight.grad = None, None
        with torch.profiler.profile() as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = norm(x)
            y.float().square().sum().backward()
        runs.append((y.detach(), x.grad.clone(), norm.weight.grad.clone()))
        names = {e.name for e in prof.events()}
        assert {"longctx_moe::cpu_rmsnorm", "longctx_moe::cpu_rmsnorm_backward"} <= names
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_float64_rows_stay_on_torch():
    assert not cpu_rmsnorm.serves(torch.zeros(2, 4, dtype=torch.float64), torch.float64)
    assert cpu_rmsnorm.serves(torch.zeros(2, 4), torch.bfloat16)
