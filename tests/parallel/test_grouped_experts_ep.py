"""The dispatchers with the model's real GroupedExperts, sharded by shard_experts, on 2 gloo ranks.

1. float64 (GroupedExperts loops): EP output and gradients equal LocalDispatcher on the full
   experts within 1e-10; float32 (torch._grouped_mm on CPU) within 1e-5 relative to the largest
   entry: the same products summed in another order (dispatch rows vs LocalDispatcher's bmm, token
   sums over 24 rows), a few fp32 ulps (6e-8) times the number of terms.
2. fp8 payloads over 50 Adam steps: the loss stays within 1e-2 of the uncompressed run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from longctx_moe.model.moe import GroupedExperts, LocalDispatcher
from longctx_moe.parallel.dispatch import AllGatherDispatcher, AllToAllDispatcher
from longctx_moe.parallel.expert_parallel import shard_experts
from tests.launcher import run_distributed

E, D, F, K, T = 4, 16, 8, 2, 12


class Layer(nn.Module):
    def __init__(self, seed, dtype):
        super().__init__()
        torch.manual_seed(seed)
        self.router = nn.Linear(D, E, bias=False, dtype=dtype)
        self.experts = GroupedExperts(E, D, F).to(dtype)
        for p in self.experts.parameters():
            nn.init.normal_(p, std=0.3)

    def forward(self, x_TD, dispatcher):
        probs_TE = torch.softmax(self.router(x_TD), dim=1)
        idx_TK = torch.topk(probs_TE, K, dim=1).indices
        return dispatcher(x_TD, idx_TK, probs_TE.gather(1, idx_TK), self.experts)


def _grads(layer):
    return [p.grad.clone() for p in (layer.router.weight, layer.experts.w_gate_up, layer.experts.w_down)]


def _check_exact(rank, world, dtype, tol):
    x = torch.randn(world * T, D, generator=torch.Generator().manual_seed(7), dtype=dtype)
    ref = Layer(0, dtype)
    y_ref = ref(x, LocalDispatcher())
    (y_ref.square().sum() / 2).backward()
    mine = slice(rank * T, (rank + 1) * T)
    e = slice(rank * E // world, (rank + 1) * E // world)
    for cls in (AllToAllDispatcher, AllGatherDispatcher):
        layer = Layer(0, dtype)
        shard_experts(layer.experts, rank, world)
        y = layer(x[mine], cls(E, dist.group.WORLD))
        (y.square().sum() / 2).backward()
        dist.all_reduce(layer.router.weight.grad)  # replicated router: sum over ranks
        assert (y - y_ref[mine]).abs().max() < tol, (cls.__name__, dtype)
        want = [g if i == 0 else g[e] for i, g in enumerate(_grads(ref))]
        for got, w in zip(_grads(layer), want, strict=True):
            # relative to the largest entry: gradients here reach ~50
            assert (got - w).abs().max() < tol * max(1.0, w.abs().max()), (cls.__name__, got.shape)


def _train_losses(rank, world, dispatch_dtype, steps=50):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, D, generator=g)
    target = torch.randn(T, D, generator=g)
    layer = Layer(1, torch.float32)
    shard_experts(layer.experts, rank, world)
    disp = AllToAllDispatcher(E, dist.group.WORLD, dispatch_dtype=dispatch_dtype)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = (layer(x, disp) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(layer.router.weight.grad)  # expert grads already cover both ranks' tokens
        opt.step()
        losses.append(loss.item())
    return losses


def _check_all(rank, world):
    _check_exact(rank, world, torch.float64, 1e-10)
    _check_exact(rank, world, torch.float32, 1e-5)
    base, fp8 = _train_losses(rank, world, "none"), _train_losses(rank, world, "fp8")
    assert base[-1] < 0.9 * base[0], "the reference run must actually train"
    assert max(abs(a - b) for a, b in zip(base, fp8, strict=True)) <= 1e-2, (base, fp8)
    return base[-1], fp8[-1]


def test_grouped_experts_under_ep_and_fp8_training():
    res = run_distributed(_check_all, world_size=2, timeout=300)
    assert all(b != f for b, f in res)  # fp8 really changed the numbers
