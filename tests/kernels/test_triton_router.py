"""Triton router (scores + top-k + weights) against moe.Router's torch path.

Tolerances: the kernel's softmax / sigmoid use numpy's exp under the interpreter and torch uses
its vectorised exp (each within an ulp or two), and sums over E or K are ordered differently:
1e-6 absolute on values in [0, 1] and on their gradients. The chosen experts must be identical
(random logits have no ties)."""

from __future__ import annotations

import pytest
import torch

from longctx_moe.model.config import ModelConfig
from longctx_moe.model.moe import Router

pytestmark = pytest.mark.triton

TOL = dict(rtol=1e-6, atol=1e-6)


def _routers(score: str, bias: bool, renormalize: bool, e: int = 12, k: int = 3, d: int = 16):
    routers = {}
    for kernels in ("torch", "triton"):
        cfg = ModelConfig(hidden_size=d, num_experts=e, top_k=k, router_score=score,
                          router_renormalize=renormalize, expert_bias=bias)
        torch.manual_seed(0)
        r = Router(cfg, kernels)
        torch.nn.init.normal_(r.weight, std=0.5)
        if bias:  # large enough to change which experts win
            r.expert_bias.copy_(torch.linspace(-0.2, 0.2, e))
        routers[kernels] = r
    return routers


def _run(router, x, replay=None):
    idx, w, aux = router(x, replay)
    g_w, g_s = torch.randn_like(w, generator=torch.Generator().manual_seed(1)), None
    g_s = torch.randn_like(aux.scores_TE, generator=torch.Generator().manual_seed(2))
    loss = (w * g_w).sum() + (aux.scores_TE * g_s).sum()  # weights and the aux losses' scores
    gx, gr = torch.autograd.grad(loss, (x, router.weight))
    return idx, w, aux.scores_TE, gx, gr


@pytest.mark.parametrize("score,bias,renormalize", [
    ("softmax", False, True), ("softmax", True, False), ("sigmoid", True, True),
    ("sigmoid", False, False)])
def test_router_topk_matches_torch(score, bias, renormalize):
    routers = _routers(score, bias, renormalize)
    x = torch.randn(37, 16, requires_grad=True)  # 37: three blocks of 16 tokens, the last partial
    got, ref = _run(routers["triton"], x), _run(routers["torch"], x)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_router_bias_changes_selection_as_in_torch():
    """The bias must steer selection only: the same experts as torch, different from no bias."""
    biased, plain = _routers("sigmoid", True, True), _routers("sigmoid", False, True)
    x = torch.randn(64, 16, requires_grad=True)
    idx_b = biased["triton"](x)[0]
    assert torch.equal(idx_b, biased["torch"](x)[0])
    assert not torch.equal(idx_b, plain["triton"](x)[0])


def test_router_replay_uses_kernel_scores_and_given_experts():
    routers = _routers("softmax", False, True)
    x = torch.randn(20, 16, requires_grad=True)
    replay = torch.randint(0, 12, (20, 3))
    replay[::3] = -1  # unknown routes: live selection
    replay[1::3] = torch.stack([torch.randperm(12)[:3] for _ in range(len(replay[1::3]))])
    replay[2::3] = torch.stack([torch.randperm(12)[:3] for _ in range(len(replay[2::3]))])
    got, ref = _run(routers["triton"], x, replay), _run(routers["torch"], x, replay)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_router_float64_and_no_tokens():
    routers = _routers("softmax", True, True)
    for r in routers.values():
        r.double()
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    got, ref = _run(routers["triton"], x), _run(routers["torch"], x)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # float64 end to end
    idx, w, aux = routers["triton"](torch.zeros(0, 16, dtype=torch.float64))
    assert idx.shape == (0, 3) and w.shape == (0, 3) and aux.scores_TE.shape == (0, 12)
