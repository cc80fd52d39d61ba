"""Expert lending (parallel.ep_spare_slots): the plan on its own, then the all-to-all dispatcher
with the model's GroupedExperts on 4 gloo ranks against LocalDispatcher on the full experts.

Routes are skewed on purpose (most rows to experts 0 and 1, both on EP rank 0) so the plan lends:
the test asserts it did, that every rank ran the rows the plan gave it, and that outputs and the
gradients of the input, the router and every expert weight equal the reference within 1e-10.
float64 throughout (GroupedExperts loops over experts in float64): a lent expert's gradient is the
sum of its owner's and its borrowers' pieces, so only the summation order differs from the
reference; 1e-10 is loose for sums of a few hundred O(1) terms. Cases: plain, the shared expert
overlapped with the all-to-all, selective recompute of the experts, a capacity factor that drops
rows, a rank with no tokens, and a near-balanced batch (no lend is worth its weights).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from longctx_moe.model.experts import GroupedExperts
from longctx_moe.model.moe import LocalDispatcher
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.dispatch import AllToAllDispatcher
from longctx_moe.parallel.expert_lending import make_plan, plan_lends, source_tables, split_pieces
from longctx_moe.parallel.expert_parallel import shard_experts
from longctx_moe.parallel.parallelize import check_supported
from tests.launcher import run_distributed
from tests.model.helpers import tiny_config

R, E, D, F, K = 4, 8, 12, 6, 2
TOL = 1e-10


# ---------------------------------------------------------------------- the plan (one process)


def _random_counts(gen: random.Random, skew: bool) -> torch.Tensor:
    counts = [[gen.randrange(0, 40) for _ in range(E)] for _ in range(R)]
    if skew:
        for row in counts:
            row[gen.randrange(E)] += gen.randrange(100, 400)
    return torch.tensor(counts, dtype=torch.int64)


@pytest.mark.parametrize("spare", [1, 2, 3])
def test_plan_balances_and_every_row_goes_to_exactly_one_rank(spare):
    gen = random.Random(spare)
    for trial in range(200):
        counts_RE = _random_counts(gen, skew=trial % 2 == 0)
        load = counts_RE.sum(0).tolist()
        lends = plan_lends(load, R, spare, min_rows=1)
        plan = split_pieces(load, R, lends)
        target = -(-sum(load) // R)
        rows = plan.rank_rows(R)
        assert sum(rows) == sum(load)
        assert all(len(b) <= spare for b in plan.borrowed)
        assert all(e // (E // R) != r for r, b in enumerate(plan.borrowed) for e in b)  # never its own
        # Lending never makes the busiest rank busier, and stops only at the target or out of slots.
        owned = [sum(load[r * E // R:(r + 1) * E // R]) for r in range(R)]
        assert max(rows) <= max(owned)
        if max(rows) > target:  # then no other rank has both a free slot and room
            hot = max(range(R), key=lambda r: rows[r])
            assert all(len(plan.borrowed[r]) == spare or rows[r] >= target for r in range(R) if r != hot)
        # Each expert's pieces tile [0, load) in order.
        for e in range(E):
            mine = sorted((p.start, p.stop) for p in plan.pieces if p.expert == e)
            assert mine[0][0] == 0 and mine[-1][1] == load[e]
            assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
        # What the sources send is what the ranks receive, slot by slot.
        recv = {}
        for me in range(R):
            order, send, recv_RS = source_tables(plan, counts_RE, me, R)
            assert sorted(order.tolist()) == list(range(int(counts_RE[me].sum())))
            assert sum(send) == int(counts_RE[me].sum())
            recv[me] = recv_RS
        for s in range(R):
            _, send, _ = source_tables(plan, counts_RE, s, R)
            assert send == [int(recv[r][s].sum()) for r in range(R)]
        assert [int(recv[r].sum()) for r in range(R)] == rows


def test_plan_is_skipped_below_min_rows_and_when_balanced():
    assert plan_lends([10] * E, R, 2, min_rows=1) == {}  # balanced: nothing to lend
    skew = [300, 0, 0, 0, 0, 0, 0, 0]
    assert plan_lends(skew, R, 2, min_rows=1)  # one expert on rank 0 holds every row
    assert plan_lends(skew, R, 2, min_rows=300) == {}  # each lend would move 75 rows: too few
    plan = make_plan(torch.tensor([skew] * R), 1, min_rows=1)
    assert plan.rank_rows(R) == [300] * R  # 1200 rows, one expert, split four ways


# ---------------------------------------------------------------------- the dispatcher on 4 ranks


# gpt-oss's experts (biases, a clamp the rows cross): the lent experts carry their biases.
GPT_OSS = dict(bias=True, activation="clamped_swiglu", limit=0.5)


class Layer(nn.Module):
    def __init__(self, dtype=torch.float64, experts: dict | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(D, E, bias=False, dtype=dtype)
        self.experts = GroupedExperts(E, D, F, **(experts or {})).to(dtype)
        self.shared = nn.Linear(D, D, dtype=dtype)
        for p in self.parameters():
            nn.init.normal_(p, std=0.3)

    def forward(self, x_TD, idx_TK, dispatcher, overlap_shared=False):
        probs_TE = torch.softmax(self.router(x_TD), dim=1)
        weight_TK = probs_TE.gather(1, idx_TK)
        if overlap_shared:
            return dispatcher(x_TD, idx_TK, weight_TK, self.experts, self.shared)
        return dispatcher(x_TD, idx_TK, weight_TK, self.experts) + self.shared(x_TD)


def _skewed_routes(T: int, gen: torch.Generator) -> torch.Tensor:
    """Top-2 choices, about 70% of rows to experts 0 and 1 (both owned by EP rank 0)."""
    hot = torch.rand(T, generator=gen) < 0.7
    other = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return torch.where(hot[:, None], torch.tensor([0, 1]), other)


CASES = [  # name, tokens per rank, skewed, kwargs of the dispatcher, recompute, overlap
    ("plain", [40, 30, 50, 20], True, {}, False, False),
    ("overlap_shared", [40, 30, 50, 20], True, {"overlap": True}, False, True),
    ("selective_recompute", [40, 30, 50, 20], True, {}, True, False),
    ("capacity", [40, 30, 50, 20], True, {"capacity_factor": 1.5}, False, False),
    ("rank_empty", [60, 0, 50, 30], True, {}, False, False),
    # near-balanced loads: lends would move fewer rows than min_lend_rows, so none is made
    ("balanced", [40, 30, 50, 20], False, {"min_lend_rows": 40}, False, False),
    ("gpt_oss_experts", [40, 30, 50, 20], True, {}, False, False),
]


def _reference(x, idx, sizes, cap, experts=None):
    """LocalDispatcher on the full experts, each rank's tokens routed on their own (capacity
    applies per source rank, as in the dispatchers): outputs and gradients."""
    layer = Layer(experts=experts)
    x = x.clone().requires_grad_()
    outs, start = [], 0
    for n in sizes:
        s = slice(start, start + n)
        if cap is None:
            disp = LocalDispatcher()
        else:  # the one-rank dispatcher with the same capacity rule
            disp = AllToAllDispatcher(E, None, capacity_factor=cap)
        outs.append(layer(x[s], idx[s], disp))
        start += n
    y = torch.cat(outs)
    y.square().sum().backward()
    return y.detach(), x.grad, layer


def _check(rank, world):
    group = dist.group.WORLD
    for seed, (name, sizes, skew, kw, recompute, overlap) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed)
        T = sum(sizes)
        x = torch.randn(T, D, generator=gen, dtype=torch.float64)
        idx = _skewed_routes(T, gen) if skew else torch.stack(
            [torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        kind = GPT_OSS if name == "gpt_oss_experts" else None
        y_ref, dx_ref, ref = _reference(x, idx, sizes, kw.get("capacity_factor"), kind)
        s = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        layer = Layer(experts=kind)
        shard_experts(layer.experts, rank, world)
        layer.experts.recompute = recompute
        disp = AllToAllDispatcher(E, group, spare_slots=2, **{"min_lend_rows": 4, **kw})
        x_loc = x[s].clone().requires_grad_()
        y = layer(x_loc, idx[s], disp, overlap_shared=overlap)
        y.square().sum().backward()
        for p in (layer.router.weight, layer.shared.weight, layer.shared.bias):
            dist.all_reduce(p.grad)  # replicated: gradients sum over ranks
        plan_lent = disp.rank_rows != _owner_rows(disp, idx, sizes, kw)
        assert plan_lent == skew, (name, disp.rank_rows)
        if skew:
            assert max(disp.rank_rows) < 1.3 * sum(disp.rank_rows) / world, (name, disp.rank_rows)
        e = slice(rank * E // world, (rank + 1) * E // world)
        pairs = [("y", y, y_ref[s]), ("dx", x_loc.grad, dx_ref[s]),
                 ("router", layer.router.weight.grad, ref.router.weight.grad),
                 ("shared", layer.shared.weight.grad, ref.shared.weight.grad),
                 ("w_gate_up", layer.experts.w_gate_up.grad, ref.experts.w_gate_up.grad[e]),
                 ("w_down", layer.experts.w_down.grad, ref.experts.w_down.grad[e])]
        if kind:
            pairs += [(b, getattr(layer.experts, b).grad, getattr(ref.experts, b).grad[e])
                      for b in ("b_gate_up", "b_down")]
        for what, got, want in pairs:
            if got.numel():
                err = (got - want).abs().max().item()
                assert err < TOL * max(1.0, want.abs().max().item()), f"{name} {what}: {err}"
    return True


def _owner_rows(disp, idx, sizes, kw):
    """Rows each EP rank's own experts got (kept ones), for telling a lend from no lend."""
    if "capacity_factor" in kw:
        return None  # drops: compare through the plan's own balance instead
    counts = torch.bincount(idx.flatten(), minlength=E)
    return counts.view(R, -1).sum(1).tolist()


@pytest.mark.slow
def test_lending_matches_local_dispatch_float64():
    assert run_distributed(_check, world_size=R, timeout=300) == [True] * R


def test_spare_slots_refused_where_nothing_can_be_lent():
    with pytest.raises(ValueError, match="ep_spare_slots"):
        ParallelConfig(ep_spare_slots=-1).validate()
    for sets in (dict(ep=1), dict(ep=2, etp=2), dict(ep=4, dispatcher="allgather")):
        cfg = ParallelConfig(ep_spare_slots=1, **sets)
        dims = ParallelDims.from_config(cfg, 4, tiny_config(num_experts=8))
        with pytest.raises(ValueError, match=r"ep_spare_slots=1 lends .* or ep_spare_slots=0"):
            check_supported(dims, cfg)
