"""Ulysses (CP 2 and 4), hierarchical 2x2 and CP 2 x TP 2 attention on one 4-process gloo group,
against the single-process float64 reference: output, LSE, dq/dk/dv, zero gradients at padding,
bitwise repeatability, all-to-all and ring bytes equal to their formulas, and set-up errors."""

import pytest
import torch
import torch.distributed as dist

from cp_attention.comm import CommStats
from cp_attention.ring import ring_attention
from cp_attention.ulysses import hierarchical_attention, ulysses_attention
from tests.cp_attention.cp_cases import hypothesis_cases, make_cases, plan_case, run_and_check
from tests.launcher import run_distributed

D = 8
HEAD_CHOICES = [(4, 2, D), (4, 1, D), (4, 4, D)]  # (Hq, Hkv, D): split, replicated, MHA


def _a2a_formula(counts, rank, hq, hkv, itemsize, lse_itemsize):
    """(bytes, messages) sent by `rank` in the forward and the backward all-to-alls: q, k, v
    scatter (L_r tokens to each peer), out and lse gather (L_j tokens to peer j), and the mirror
    in the backward (dout scatter; dq, dk, dv gather). KV heads replicated up to P when Hkv < P."""
    p, lr = len(counts), counts[rank]
    others = [c for j, c in enumerate(counts) if j != rank]
    hk = max(hkv, p)

    def scat(h):
        return (p - 1) * lr * (h // p) * D * itemsize, (p - 1) if lr else 0

    def gath(h, d, item):
        return sum(others) * (h // p) * d * item, sum(1 for c in others if c)

    def add(*parts):
        return tuple(sum(x) for x in zip(*parts, strict=True))

    fwd = add(scat(hq), scat(hk), scat(hk), gath(hq, D, itemsize), gath(hq, 1, lse_itemsize))
    bwd = add(scat(hq), gath(hq, D, itemsize), gath(hk, D, itemsize), gath(hk, D, itemsize))
    return fwd, bwd


def _check_a2a(stats, counts, rank, heads, item):
    fwd, bwd = _a2a_formula(counts, rank, heads[0], heads[1], item, max(item, 4))
    assert (stats.bytes("a2a_fwd"), stats.messages("a2a_fwd")) == fwd, (stats.by_kind, fwd)
    assert (stats.bytes("a2a_bwd"), stats.messages("a2a_bwd")) == bwd, (stats.by_kind, bwd)


def _ulysses_cases(rank, group, p, cases, dtype, atol):
    for n, case in enumerate(cases):
        heads = HEAD_CHOICES[n % len(HEAD_CHOICES)]
        plan = plan_case(case, p)
        stats = CommStats()

        def call(q, k, v, plan=plan, stats=stats):
            return ulysses_attention(q, k, v, plan, group, stats=stats)

        first = run_and_check(call, case, plan, rank, heads, dtype, atol)
        counts = [plan.local_tokens(j) for j in range(p)]
        _check_a2a(stats, counts, rank, heads, torch.empty(0, dtype=dtype).element_size())
        again = run_and_check(call, case, plan, rank, heads, dtype, atol)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), "runs differ"


def _hier_cases(rank, inner_g, outer_g, cases, dtype, atol):
    inner = outer = 2
    for n, case in enumerate(cases):
        heads = HEAD_CHOICES[n % len(HEAD_CHOICES)]
        plan = plan_case(case, 4, hierarchical_sizes=[inner, outer])
        stats = CommStats()

        def call(q, k, v, plan=plan, stats=stats):
            return hierarchical_attention(q, k, v, plan, inner_g, outer_g, stats=stats)

        first = run_and_check(call, case, plan, rank, heads, dtype, atol)
        o, i = divmod(rank, inner)
        counts = [plan.local_tokens(o * inner + j) for j in range(inner)]
        item = torch.empty(0, dtype=dtype).element_size()
        _check_a2a(stats, counts, i, heads, item)
        ring_heads = max(heads[1], inner) // inner
        want = sum(b for b, _ in plan.ring.traffic(o, ring_heads, D, item, max(item, 4)).values())
        got = sum(stats.bytes(k) for k in ("ring_fwd_kv", "ring_bwd_kv", "ring_bwd_dkv"))
        assert got == want, f"hierarchical ring bytes {got} != formula {want}"
        again = run_and_check(call, case, plan, rank, heads, dtype, atol)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), "runs differ"


def _worker(rank, world, cases2, cases4, cases_h):
    pair = dist.new_group([0, 1])
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    # float64 end to end: only summation-order rounding remains (~1e-15), so 1e-10 is strict.
    if rank < 2:
        _ulysses_cases(rank, pair, 2, cases2, torch.float64, 1e-10)
    _ulysses_cases(rank, dist.group.WORLD, 4, cases4, torch.float64, 1e-10)
    _hier_cases(rank, inner, outer, cases_h, torch.float64, 1e-10)
    _cp_tp_cases(rank, inner, cases2[:3])
    _check_errors(rank, outer, cases4[0])
    return rank


def _cp_tp_cases(rank, cp_group, cases):
    """CP 2 x TP 2: CP rank = rank % 2 (groups {0, 1} and {2, 3}), TP rank = rank // 2 holds half
    the query and KV heads; ring and Ulysses on head-sharded inputs."""
    tp = (rank // 2, 2)
    for case in cases:
        plan = plan_case(case, 2)
        for fn in (ring_attention, ulysses_attention):
            def call(q, k, v, plan=plan, fn=fn):
                return fn(q, k, v, plan, cp_group)

            run_and_check(call, case, plan, rank % 2, (8, 4, D), torch.float64, 1e-10, tp=tp)


def _check_errors(rank, outer, case):
    """Impossible layouts fail before any communication, naming the numbers."""
    plan = plan_case(case, 4)
    t = plan.local_tokens(rank)
    q, kv = torch.zeros(t, 6, D), torch.zeros(t, 3, D)
    with pytest.raises(ValueError, match="6 query heads do not divide over 4"):
        ulysses_attention(q, kv, kv, plan, dist.group.WORLD)
    q, kv = torch.zeros(t, 4, D), torch.zeros(t, 4, D)
    with pytest.raises(ValueError, match="group has 2 ranks but the plan is for cp_size=4"):
        ulysses_attention(q, kv, kv, plan, outer)
    with pytest.raises(ValueError, match="holds .* tokens in the plan"):
        ulysses_attention(q[:-1] if t else torch.zeros(1, 4, D), kv, kv, plan, dist.group.WORLD)


@pytest.mark.multirank
def test_ulysses_and_hierarchical_float64_exact():
    cases2 = make_cases(300, 2, 7) + hypothesis_cases(2, 4)
    cases4 = make_cases(301, 4, 7) + hypothesis_cases(4, 4)
    cases_h = make_cases(302, 2, 7, multiple=8) + hypothesis_cases(2, 4, multiple=8)  # slots for CP=4 (2*4)
    res = run_distributed(_worker, 4, args=(cases2, cases4, cases_h), timeout=400)
    assert res == [0, 1, 2, 3]
