"""Triton log-prob + entropy head against losses.chunked_token_logprobs' torch path.

Tolerances (fp32), relative to each tensor's largest magnitude: both paths form logp = z - lse
with |z|, |lse| up to ~30 here, where one ulp is 2e-6, and sum V terms in another order (online
over 1024-column tiles here); so lse may differ by an ulp, which moves every p = exp(logp) and
every gradient by up to 2e-6 relative. Measured: 1e-7 on logp and entropy, 3e-7..1.3e-6 on dh
and dW; the bound is 3e-6 of the scale. bf16 (autocast): the logits are the same bf16 GEMM
outputs in both paths and the statistics fp32, so logp and entropy agree as in fp32; the logits'
gradient is rounded to bf16 (relative step 2^-8) before the gradient GEMMs, so one rounding may
land a step apart: 1e-2 of the scale on dh and dW (measured: equal)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longctx_moe.model.losses import VocabShard, chunked_token_logprobs
from tests.launcher import run_distributed

pytestmark = pytest.mark.triton


def _case(t=23, d=16, v=1500, seed=0, dtype=torch.float32):
    """V=1500: two tiles of 1024 columns, the second partial; some rows are not targets."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(t, d, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g)
    labels[[0, 5, 6]] = -100
    return h, w, labels


def assert_close_to_scale(got, ref, rel):
    """max |got - ref| <= rel * max |ref| (the errors are ulps of the largest values)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} exceeds {rel:g} x scale {scale:.3g}"


def _run(kernels, h, w, labels, autocast=False, **kw):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp, ent = chunked_token_logprobs(h, w, labels, impl=kernels, **kw)
    g = torch.Generator().manual_seed(7)
    loss = (logp * torch.randn(logp.shape, generator=g)).sum()
    if ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    return (logp, ent, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 64)])
def test_logprobs_and_entropy_match_torch_fp32(temperature, chunk):
    h, w, labels = _case()
    kw = dict(chunk_tokens=chunk, temperature=temperature, entropy=True)
    got, ref = _run("triton", h, w, labels, **kw), _run("torch", h, w, labels, **kw)
    for a, b in zip(got, ref, strict=True):
        assert_close_to_scale(a, b, 3e-6)
    assert torch.all(got[0][labels == -100] == 0) and torch.all(got[1][labels == -100] == 0)


def test_logprobs_without_entropy_match_torch():
    h, w, labels = _case(seed=1)
    got, ref = _run("triton", h, w, labels), _run("torch", h, w, labels)
    assert got[1] is None and ref[1] is None
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:], strict=True):
        assert_close_to_scale(a, b, 3e-6)


def test_logprobs_bf16_autocast_within_bound():
    h, w, labels = _case(seed=2)
    kw = dict(chunk_tokens=8, entropy=True, autocast=True)
    got, ref = _run("triton", h, w, labels, **kw), _run("torch", h, w, labels, **kw)
    assert_close_to_scale(got[0], ref[0], 3e-6)
    assert_close_to_scale(got[1], ref[1], 3e-6)
    for a, b in zip(got[2:], ref[2:], strict=True):
        assert_close_to_scale(a, b, 1e-2)


def _sharded(rank, world_size, kernels):
    h, w, labels = _case(v=600, seed=3)
    v_l = w.shape[0] // world_size
    w_local = w.detach()[rank * v_l:(rank + 1) * v_l].clone().requires_grad_()
    shard = VocabShard(dist.group.WORLD, rank * v_l)
    out = _run(kernels, h, w_local, labels, chunk_tokens=5, entropy=True, shard=shard)
    return [t.detach() for t in out]


@pytest.mark.slow  # two gloo ranks
def test_vocab_sharded_logprobs_match_whole_vocab():
    """Two ranks holding half the vocabulary each merge their statistics to the whole-vocab
    result of the torch path on one process (same tolerances as fp32 above)."""
    h, w, labels = _case(v=600, seed=3)
    ref = _run("torch", h, w, labels, chunk_tokens=5, entropy=True)
    for rank, got in enumerate(run_distributed(_sharded, 2, args=("triton",), timeout=300)):
        for a, b in zip(got[:3], ref[:3], strict=True):
            assert_close_to_scale(a, b, 3e-6)
        assert_close_to_scale(got[3], ref[3][rank * 300:(rank + 1) * 300], 3e-6)


def test_kept_logits_give_the_recomputed_results_bitwise(monkeypatch):
    """The Triton head writes the gradient over the logits it kept from the forward
    (execution.loss_logits_cache_mb): the same values as recomputing them, and a retained graph's
    second backward (which finds them handed over already) recomputes and agrees."""
    from longctx_moe.kernels import logits_cache, triton_logprobs

    handed = []
    monkeypatch.setattr(triton_logprobs, "kept_logits",
                        lambda kept, i: handed.append(logits_cache.kept_logits(kept, i)) or handed[-1])
    h, w, labels = _case(seed=2)
    kw = dict(chunk_tokens=7, temperature=0.7, entropy=True)
    recomputed = _run("triton", h, w, labels, **kw)
    assert handed and all(z is None for z in handed)
    handed.clear()
    kept = _run("triton", h, w, labels, logits_cache_mb=1, **kw)
    assert len(handed) == 3 and all(z is not None for z in handed)  # 20 target rows, chunks of 7
    for a, b in zip(kept, recomputed, strict=True):
        assert torch.equal(a, b)
    logp, _ = chunked_token_logprobs(h, w, labels, impl="triton", logits_cache_mb=1, **kw)
    first = torch.autograd.grad(logp.sum(), (h, w), retain_graph=True)
    second = torch.autograd.grad(logp.sum(), (h, w))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _ce(kernels, h, w, labels, weight=None, autocast=False, chunk=7):
    from longctx_moe.model.losses import chunked_cross_entropy

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ce = chunked_cross_entropy(h, w, labels, weight, chunk_tokens=chunk, impl=kernels)
    return (ce, *torch.autograd.grad(ce * 1.5, (h, w)))


@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_matches_torch_fp32(weighted):
    """The supervised loss's chunks through the log-prob kernels (CE = lse - z_y, the logits'
    gradient written in place) against its torch path, with and without per-token weights."""
    h, w, labels = _case(seed=4)
    weight = torch.rand(labels.shape, generator=torch.Generator().manual_seed(5)) if weighted else None
    got, ref = _ce("triton", h, w, labels, weight), _ce("torch", h, w, labels, weight)
    for a, b in zip(got, ref, strict=True):
        assert_close_to_scale(a, b, 3e-6)


def test_cross_entropy_bf16_autocast_within_bound():
    h, w, labels = _case(seed=6)
    got, ref = _ce("triton", h, w, labels, autocast=True, chunk=8), _ce("torch", h, w, labels, autocast=True, chunk=8)
    assert_close_to_scale(got[0], ref[0], 3e-6)
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_close_to_scale(a, b, 1e-2)
