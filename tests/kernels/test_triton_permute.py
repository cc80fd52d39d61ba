"""Triton MoE permute / unpermute against the torch dispatcher path (moe.LocalDispatcher).

Tolerances: the permute is a copy (bitwise); its backward sums K=2 rows (a + b, the same one
rounding in both paths: bitwise). The un-permute's weighted sum and the dot products of its
weight gradient are fp32 sums of K or D products formed in another order than MKL's bmm (which
may fuse multiply-adds): within a few ulps, so 1e-6 relative."""

from __future__ import annotations

import pytest
import torch

from longctx_moe.kernels import triton_ops as ops
from longctx_moe.model.experts import GroupedExperts
from longctx_moe.model.grouped_gemm import pad_layout
from longctx_moe.model.moe import LocalDispatcher, permute_layout

pytestmark = pytest.mark.triton


def _routes(t: int, k: int, e: int, seed: int, skip_expert: int | None = None):
    g = torch.Generator().manual_seed(seed)
    idx_TK = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if skip_expert is not None:  # an expert that receives no token
        idx_TK = torch.where(idx_TK == skip_expert, (skip_expert + 1) % e, idx_TK)
        idx_TK[:, 1] = torch.where(idx_TK[:, 1] == idx_TK[:, 0], (idx_TK[:, 0] + 2) % e, idx_TK[:, 1])
    return idx_TK


def _torch_permute(x_TD, idx_TK, e, pad):
    """The torch path's rows: gather in expert order, then (when padded) scatter into slots."""
    k = idx_TK.shape[1]
    order = torch.argsort(idx_TK.flatten(), stable=True)
    x_MD = x_TD.index_select(0, order // k)
    if not pad:
        return x_MD
    slot_M, _, total = pad_layout(torch.bincount(idx_TK.flatten(), minlength=e))
    return x_MD.new_zeros(total, x_MD.shape[1]).index_copy_(0, slot_M, x_MD)


@pytest.mark.parametrize("pad", [False, True])
def test_permute_forward_and_grad_bitwise_equal_torch_rows(pad):
    t, k, e, d = 37, 2, 5, 300  # D spans two column blocks; expert 3 gets no token
    idx_TK = _routes(t, k, e, seed=0, skip_expert=3)
    x = torch.randn(t, d, requires_grad=True)
    slot_TK, counts_E, total = permute_layout(idx_TK, e, pad)
    out = ops().permute(x, slot_TK, total)
    ref = _torch_permute(x, idx_TK, e, pad)
    assert out.shape == ref.shape and torch.equal(out, ref)
    assert int(counts_E[3]) == 0 and int(counts_E.sum()) == total
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(out, x, g)
    (gx_ref,) = torch.autograd.grad(ref, x, g)
    assert torch.equal(gx, gx_ref)


def test_permute_casts_on_the_way_and_sums_grads_in_fp32():
    t, k, e, d = 19, 2, 4, 64
    idx_TK = _routes(t, k, e, seed=1)
    x = torch.randn(t, d, requires_grad=True)
    slot_TK, _, total = permute_layout(idx_TK, e, pad=True)
    out = ops().permute(x, slot_TK, total, torch.bfloat16)
    ref = _torch_permute(x, idx_TK, e, pad=True).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    g = torch.randn(total, d).to(torch.bfloat16)
    (gx,) = torch.autograd.grad(out, x, g)
    (gx_ref,) = torch.autograd.grad(ref, x, g)
    # Both paths add the bf16 gradients of the K copies in fp32 (the cast's backward comes first).
    assert gx.dtype == torch.float32 and torch.equal(gx, gx_ref)


@pytest.mark.parametrize("pad", [False, True])
def test_unpermute_matches_gather_and_bmm(pad):
    t, k, e, d = 29, 2, 6, 300
    idx_TK = _routes(t, k, e, seed=2, skip_expert=0)
    slot_TK, _, total = permute_layout(idx_TK, e, pad)
    y = torch.randn(total, d, requires_grad=True)
    w = torch.rand(t, k, requires_grad=True)
    out = ops().unpermute(y, slot_TK, w)
    ref = torch.bmm(w.unsqueeze(1), y[slot_TK]).squeeze(1)  # the torch path's sum over K
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(t, d)
    gy, gw = torch.autograd.grad(out, (y, w), g)
    gy_ref, gw_ref = torch.autograd.grad(ref, (y, w), g)
    torch.testing.assert_close(gy, gy_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-6, atol=1e-5)  # a sum of D=300 products
    if pad:  # padding rows are never read, so they get no gradient
        used = torch.zeros(total, dtype=torch.bool)
        used[slot_TK.flatten()] = True
        assert not used.all() and torch.all(gy[~used] == 0)


def _dispatch(kernels, x, idx_TK, w_TK, experts):
    return LocalDispatcher(kernels)(x, idx_TK, w_TK, experts)


# gpt-oss's experts: biases on every (padded) row and the clamped SwiGLU.
GPT_OSS = dict(bias=True, activation="clamped_swiglu", limit=0.5)


@pytest.mark.parametrize("dtype,kind", [(torch.float32, {}), (torch.bfloat16, {}),
                                        (torch.float32, GPT_OSS), (torch.bfloat16, GPT_OSS)])
def test_local_dispatcher_triton_matches_torch_path(dtype, kind):
    """The whole single-device dispatch, fp32 (unpadded rows) and bf16 autocast (padded rows)."""
    torch.manual_seed(3)
    t, k, e, d, f = 40, 2, 4, 32, 16
    # precision=autocast: bf16 experts whatever the host (auto keeps them fp32 on a CPU without
    # native bf16, which is not the path this case compares).
    experts = GroupedExperts(e, d, f, **kind)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    idx_TK = _routes(t, k, e, seed=4, skip_expert=2)
    x = torch.randn(t, d, requires_grad=True)
    w = torch.rand(t, k, requires_grad=True)
    outs = {}
    for kernels in ("torch", "triton"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = _dispatch(kernels, x, idx_TK, w, experts)
        grads = torch.autograd.grad(y.float().square().sum(), (x, w, *experts.parameters()))
        outs[kernels] = (y, *grads)
    # fp32: the GEMMs are the same calls on the same rows; only the weighted K-sum is ordered
    # differently (1e-6). bf16: the outputs are rounded to bf16 (relative step 2^-8) after that
    # sum, so one rounding may land a step apart: 1e-2 relative on outputs and gradients.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(outs["triton"], outs["torch"], strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("pad", [False, True])
def test_unpermute_takes_fp32_weights_as_their_bf16_cast(pad):
    """fp32 router weights with bf16 rows: bitwise the cast-then-unpermute result, forward and
    both gradients (w's comes back fp32, the bf16 cast's gradient widened)."""
    t, k, e, d = 29, 2, 6, 300
    slot_TK, _, total = permute_layout(_routes(t, k, e, seed=5), e, pad)
    y = torch.randn(total, d).to(torch.bfloat16).requires_grad_()
    w = torch.rand(t, k, requires_grad=True)
    out = ops().unpermute(y, slot_TK, w)
    ref = ops().unpermute(y, slot_TK, w.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    g = torch.randn(t, d).to(torch.bfloat16)
    gy, gw = torch.autograd.grad(out, (y, w), g)
    gy_ref, gw_ref = torch.autograd.grad(ref, (y, w), g)
    assert gw.dtype == torch.float32 and torch.equal(gw, gw_ref) and torch.equal(gy, gy_ref)


def test_unpermute_refuses_narrower_weights():
    slot_TK, _, total = permute_layout(_routes(5, 2, 4, seed=6), 4, False)
    with pytest.raises(ValueError, match="wider float"):
        ops().unpermute(torch.randn(total, 8), slot_TK, torch.rand(5, 2).to(torch.bfloat16))
