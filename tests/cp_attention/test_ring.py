"""Ring attention on real gloo process groups (CP 2, 3, 4 in one 4-process group) against the
single-process float64 reference: output, LSE, dq/dk/dv, zero gradients at padding, bitwise
repeatability and the communication formulas."""

import pytest
import torch
import torch.distributed as dist

from cp_attention.comm import CommStats
from cp_attention.ring import ring_attention
from tests.cp_attention.cp_cases import hypothesis_cases, make_cases, plan_case, run_and_check
from tests.launcher import run_distributed

HEADS = (4, 2, 8)  # Hq, Hkv (GQA), D
CASES_PER_P = {2: 12, 3: 10, 4: 10}  # seeded cases, plus HYPOTHESIS_PER_P drawn by hypothesis
HYPOTHESIS_PER_P = 6


def _expected(plan, rank: int, kind: str, itemsize: int, acc_itemsize: int) -> tuple[int, int]:
    """Formula: every message is a half block [2, Z/2, Hkv, D] (first or second chunks of the
    zigzag pieces). Per pass, half A goes P-1 hops from every rank; half B is sent only while the
    receiver lies below the block's owner: KV: P - r messages from rank r >= 1, none from rank 0;
    dK/dV of B: P - 1 - r messages. Nothing at all when Z = 0 (every document whole).
    Z is recomputed here from the zigzag documents' slots (each rank holds 2 of 2P chunks)."""
    p = plan.ring.size
    z = sum(int(plan.cu_seqlens_padded[i + 1] - plan.cu_seqlens_padded[i]) // p
            for i in plan.zigzag_docs)
    if p == 1 or z == 0:
        return 0, 0
    half = 2 * (z // 2) * HEADS[1] * HEADS[2]
    if kind == "ring_bwd_dkv":
        n = (p - 1) + (p - 1 - rank)
        return n * half * acc_itemsize, n
    n = (p - 1) + (p - rank if rank else 0)
    return n * half * itemsize, n


def _check_stats(stats: CommStats, plan, rank: int, itemsize: int, acc_itemsize: int) -> None:
    for kind in ("ring_fwd_kv", "ring_bwd_kv", "ring_bwd_dkv"):
        want = _expected(plan, rank, kind, itemsize, acc_itemsize)
        got = (stats.bytes(kind), stats.messages(kind))
        assert got == want, f"{kind}: sent {got}, formula {want}"
        assert want == plan.ring.traffic(rank, HEADS[1], HEADS[2], itemsize, acc_itemsize)[kind]
    assert stats.bytes_sent == sum(_expected(plan, rank, k, itemsize, acc_itemsize)[0]
                                   for k in ("ring_fwd_kv", "ring_bwd_kv", "ring_bwd_dkv"))


def _ring_worker(rank, world, f64_cases, f32_cases):
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    # float64 end to end (fp64 accumulators): only summation-order rounding remains, ~1e-15.
    checked = _run_cases(rank, groups, f64_cases, torch.float64, 1e-10, 0.0, True)
    # float32 inputs (eps 6e-8), fp32 merge/accumulators: each output is a convex combination of
    # O(1) values over <= 40 keys and at most 2P-1 merges, and grads sum O(1) terms over <= 40
    # keys; rounding stays below 1e-5 absolute + 1e-5 relative (observed max 1.7e-6 over these
    # cases at CP 4).
    checked += _run_cases(rank, groups, f32_cases, torch.float32, 1e-5, 1e-5, False)
    _check_errors(rank, groups)
    return checked


def _run_cases(rank, groups, cases_by_p, dtype, atol, rtol, repeat):
    checked = 0
    for p, cases in cases_by_p.items():
        if rank >= p:
            continue
        for case in cases:
            plan = plan_case(case, p)
            stats = CommStats()

            def call(q, k, v, plan=plan, group=groups[p], stats=stats):
                return ring_attention(q, k, v, plan, group, stats=stats)

            first = run_and_check(call, case, plan, rank, HEADS, dtype, atol, rtol)
            item = torch.empty(0, dtype=dtype).element_size()
            _check_stats(stats, plan, rank, item, max(item, 4))
            if repeat:
                again = run_and_check(call, case, plan, rank, HEADS, dtype, atol, rtol)
                assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), \
                    "two runs differ bitwise"
            checked += 1
    return checked


def _check_errors(rank, groups):
    """Impossible set-ups fail before any communication, naming the numbers."""
    case = make_cases(7, 4, 1)[0]
    plan = plan_case(case, 4)
    t = plan.local_tokens(rank)
    x = torch.zeros(t, 2, 4)
    if rank < 2:
        with pytest.raises(ValueError, match="group has 2 ranks but the plan is for cp_size=4"):
            ring_attention(x, x, x, plan, groups[2])
    with pytest.raises(ValueError, match="causal=False is not supported"):
        ring_attention(x, x, x, plan, groups[4], causal=False)
    with pytest.raises(ValueError, match=f"holds {t} tokens in the plan but q has {t + 1}"):
        ring_attention(torch.zeros(t + 1, 2, 4), x, x, plan, groups[4])
    hier = plan_case(case, 4, hierarchical_sizes=[2, 2])
    with pytest.raises(ValueError, match=r"hierarchical_sizes=\[2, 2\]; call hierarchical"):
        ring_attention(x, x, x, hier, groups[4])


@pytest.mark.multirank
def test_ring_exact_in_float64_and_within_tolerance_in_float32():
    f64 = {p: make_cases(100 + p, p, n) + hypothesis_cases(p, HYPOTHESIS_PER_P)
           for p, n in CASES_PER_P.items()}
    f32 = {p: make_cases(200 + p, p, 5) for p in (2, 4)}
    res = run_distributed(_ring_worker, 4, args=(f64, f32), timeout=500)
    n = {p: len(f64[p]) + (5 if p in f32 else 0) for p in CASES_PER_P}
    assert res == [n[2] + n[3] + n[4], n[2] + n[3] + n[4], n[3] + n[4], n[4]]
