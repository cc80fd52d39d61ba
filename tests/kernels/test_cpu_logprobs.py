"""The fused CPU log-prob head (cp_attention/csrc/logprobs.cpp) against the torch path it replaces
under bf16 autocast: the same float32 statistics to float32 rounding, the same bf16 gradient of
the logits up to one bf16 rounding, hence h's and W's gradients to bf16 GEMM rounding."""

import pytest
import torch

from cp_attention import native, native_checks
from cp_attention.hardware import cpu_has_avx512_bf16
from longctx_moe.kernels import cpu_logprobs
from longctx_moe.model.losses import chunked_token_logprobs

# On the CPUs it is built for, a kernel that fails to build or its self-check fails these tests
# (the head would silently fall back to torch); elsewhere they do not apply.
pytestmark = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the fused CPU log-prob head needs AVX512-BF16")


def _case(t=45, d=32, v=1003, seed=0):
    """V=1003: 62 full vectors of 16 and a tail of 11; three rows are not targets."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(t, d, generator=g) * 2).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g)
    labels[[0, 5, 6]] = -100
    labels[7] = v - 1  # a label in the tail
    return h, w, labels


def _run(h, w, labels, **kw):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = chunked_token_logprobs(h, w, labels, **kw)
    g = torch.Generator().manual_seed(7)
    loss = (logp * torch.randn(logp.shape, generator=g)).sum()
    if ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    return (logp, *(() if ent is None else (ent,)), *torch.autograd.grad(loss, (h, w)))


def _rel_err(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("temperature,entropy,cache_mb", [(1.0, False, 0), (0.7, True, 0), (1.0, True, 8)])
def test_fused_head_matches_the_torch_path(monkeypatch, temperature, entropy, cache_mb):
    h, w, labels = _case()
    kw = dict(chunk_tokens=16, temperature=temperature, entropy=entropy, logits_cache_mb=cache_mb)
    calls = []
    real = cpu_logprobs.forward_stats
    monkeypatch.setattr(cpu_logprobs, "forward_stats", lambda *a: calls.append(1) or real(*a))
    fused = _run(h, w, labels, impl="cpp", **kw)
    assert len(calls) == 3  # 42 target rows in chunks of 16: the kernel ran the head
    ref = _run(h, w, labels, impl="torch", **kw)
    assert len(calls) == 3
    n_stats = 2 if entropy else 1
    for a, b in zip(fused[:n_stats], ref[:n_stats], strict=True):
        # float32 statistics of the same bf16 logits: only the summation order differs
        # (measured <= 2e-7).
        assert _rel_err(a, b) <= 1e-6
    for a, b in zip(fused[n_stats:], ref[n_stats:], strict=True):
        # The logits' gradient may differ by one bf16 rounding in an element (2^-8 relative),
        # which the two bf16 products carry into h's and W's gradients (measured: equal, or
        # <= 2e-6 apart, over three seeds).
        assert _rel_err(a, b) <= 1e-3
    assert torch.all(fused[0][labels == -100] == 0)


def test_the_logits_gradient_is_one_rounding_of_float32_maths():
    """The built kernel itself (not through its self-check, which would hide a wrong one behind
    the torch fallback) against float64 maths on the same bf16 logits: float32-exact statistics,
    the gradient within one bf16 rounding."""
    mod = native.extension()
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(9, 70, generator=g) * 4).bfloat16()
    labels = torch.randint(0, 70, (9,), generator=g)
    gl, ge = torch.randn(9, generator=g), torch.randn(9, generator=g)
    logp, ent, lse = mod.forward_stats(z, labels, 1.3, True)
    x = z.double() / 1.3
    lp = x.log_softmax(-1)
    h = -(lp.exp() * lp).sum(-1)
    torch.testing.assert_close(logp.double(), lp.gather(1, labels[:, None]).squeeze(1), rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), h, rtol=0, atol=2e-6)
    p = lp.exp()
    ref = -gl.double()[:, None] * p - ge.double()[:, None] * p * (lp + h[:, None])
    ref[torch.arange(9), labels] += gl.double()
    ref /= 1.3
    got = mod.backward_grad_(z.clone(), labels, lse, ent, gl, ge, 1.3).double()
    ulp = ref.abs().clamp_min(1e-30) * 2.0 ** -8  # bf16 keeps 8 significant bits
    assert torch.all((got - ref).abs() <= ulp + 1e-12)


def test_bad_inputs_are_refused_by_the_kernel():
    z = torch.zeros(3, 20, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="label out of range"):
        cpu_logprobs.forward_stats(z, torch.tensor([0, 20, 1]), 1.0, False)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_logprobs.forward_stats(z.float(), torch.tensor([0, 1, 1]), 1.0, False)


def test_self_check_rejects_a_wrong_kernel():
    """A gradient 2% off fails the self-check (the head then stays on torch, with a warning)."""
    real = native.extension()

    class Off:
        forward_stats = staticmethod(real.forward_stats)

        def backward_grad_(self, *args):
            return real.backward_grad_(*args).float().mul(1.02).bfloat16()

    native_checks.logprobs(real)
    with pytest.raises(RuntimeError, match="self-check"):
        native_checks.logprobs(Off())
