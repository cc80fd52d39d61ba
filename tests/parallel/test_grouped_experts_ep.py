"""The dispatchers with the model's real GroupedExperts, sharded by shard_experts, on 2 gloo ranks.

1. float64 (GroupedExperts loops): EP output and gradients equal LocalDispatcher on the full
   experts within 1e-10; float32 (torch._grouped_mm on CPU) within 1e-5 relative to the largest
   entry: the same products summed in another order (dispatch rows vs LocalDispatcher's bmm, token
   sums over 24 rows), a few fp32 ulps (6e-8) times the number of terms.
2. fp8 payloads over 50 Adam steps: the loss stays within 1e-2 of the uncompressed run.
3. ETP2 x EP2 on 4 ranks where one EP group holds no token at all (a Dynamic-CP empty slot): its
   ranks still run their halves of the hidden units for the ETP peers that hold tokens, so outputs
   and every gradient slice equal LocalDispatcher on the full experts (float64, 1e-10).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from longctx_moe.model.experts import GroupedExperts
from longctx_moe.model.moe import LocalDispatcher
from longctx_moe.parallel.dispatch import AllGatherDispatcher, AllToAllDispatcher
from longctx_moe.parallel.expert_parallel import shard_expert_hidden, shard_experts
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


@pytest.mark.slow
def test_grouped_experts_under_ep_and_fp8_training():
    res = run_distributed(_check_all, world_size=2, timeout=300)
    assert all(b != f for b, f in res)  # fp8 really changed the numbers


def _check_empty_ep_group(rank, world):
    """Ranks 0, 1 (EP group 0) hold no token; ranks 2, 3 (EP group 1) hold T each. ETP pairs
    {0, 2} and {1, 3}: rank r holds experts of EP rank r % 2, hidden half r // 2."""
    dtype = torch.float64
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    etp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep_rank, etp_rank = rank % 2, rank // 2
    x = torch.randn(2 * T, D, generator=torch.Generator().manual_seed(11), dtype=dtype)
    ref = Layer(0, dtype)
    y_ref = ref(x, LocalDispatcher())
    (y_ref.square().sum() / 2).backward()
    mine = slice(0, 0) if rank < 2 else slice((rank - 2) * T, (rank - 1) * T)
    experts, units = slice(ep_rank * E // 2, (ep_rank + 1) * E // 2), slice(etp_rank * F // 2, (etp_rank + 1) * F // 2)
    r_w, r_gate_up, r_down = _grads(ref)
    want = [r_w, r_gate_up[experts][..., units], r_down[experts][:, units]]
    for cls in (AllToAllDispatcher, AllGatherDispatcher):
        layer = Layer(0, dtype)
        shard_expert_hidden(shard_experts(layer.experts, ep_rank, 2), etp_rank, 2)
        y = layer(x[mine], cls(E, ep_groups[rank // 2], etp_group=etp_groups[ep_rank]))
        (y.square().sum() / 2).backward()
        if layer.router.weight.grad is None:  # no token here: the router saw nothing
            layer.router.weight.grad = torch.zeros_like(layer.router.weight)
        dist.all_reduce(layer.router.weight.grad)
        assert y.shape == (mine.stop - mine.start, D)
        assert y.numel() == 0 or (y - y_ref[mine]).abs().max() < 1e-10, cls.__name__
        for got, w in zip(_grads(layer), want, strict=True):
            assert got.shape == w.shape and (got - w).abs().max() < 1e-10 * max(1.0, w.abs().max()), \
                (cls.__name__, rank, got.shape)
            assert w.abs().max() > 0  # every slice, the empty group's included, got work


@pytest.mark.slow
def test_etp_peers_of_an_empty_ep_group_still_run_their_units():
    run_distributed(_check_empty_ep_group, world_size=4, timeout=300)
