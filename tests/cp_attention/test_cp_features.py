"""The attention features of pretrained MoE families through every CP executor, on one 4-process
gloo group against a float64 reference written with plain tensor maths (cp_cases.dense_reference):
a value head dim != the query/key head dim (MLA), attention sinks (gpt-oss; the sink counted once
per row and its gradient summed over the CP ranks) and sliding windows (Ulysses, the ring and
hierarchical; windows below, at and above the zigzag chunk length, and wider than whole
documents). Output, LSE, dq/dk/dv/dsink to 1e-10."""

import pytest
import torch
import torch.distributed as dist

from cp_attention.ring import ring_attention
from cp_attention.ulysses import hierarchical_attention, ulysses_attention
from tests.cp_attention.cp_cases import (
    assert_close_local,
    dense_reference,
    hypothesis_cases,
    make_cases,
    plan_case,
    random_qkv,
)
from tests.launcher import run_distributed

HQ, HKV, D, DV = 4, 2, 8, 12


def _reference(case, window, with_sink):
    """float64 (q, k, v, dout, sink, out, lse, dq, dk, dv, dsink) over the whole pack."""
    q, k, v, dout = random_qkv(case, HQ, HKV, D, dv=DV)
    sink = torch.randn(HQ, generator=torch.Generator().manual_seed(case["seed"] + 1),
                       dtype=torch.float64) if with_sink else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    s = sink.clone().requires_grad_() if with_sink else None
    out, lse = dense_reference(*leaves, case["lens"], case["slots"], window=window, sink=s)
    grads = torch.autograd.grad(out, leaves + ([s] if with_sink else []), dout)
    dsink = grads[3] if with_sink else None
    return (q, k, v, dout, sink), (out.detach(), lse.detach(), *grads[:3], dsink)


def _check(call, case, plan, rank, window=None, with_sink=True, group=None):
    """Run call(q, k, v, sink) on this rank's shard and compare with the reference shard; the
    sink gradient, summed over `group` (the CP gradient reduction), equals the reference's."""
    (q, k, v, dout, sink), ref = _reference(case, window, with_sink)
    ql, kl, vl = (plan.shard(x, rank).clone().requires_grad_() for x in (q, k, v))
    s = sink.clone().requires_grad_() if with_sink else None
    out, lse = call(ql, kl, vl, s)
    out.backward(plan.shard(dout, rank))
    idx = plan.rank_index[rank]
    got = (out.detach(), lse, ql.grad, kl.grad, vl.grad)
    want = (ref[0][idx], ref[1][:, idx], ref[2][idx], ref[3][idx], ref[4][idx])
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert_close_local(f"{name} (case seed {case['seed']})", g, w, 1e-10)
    if with_sink:
        dsink = s.grad.clone()
        dist.all_reduce(dsink, group=group)
        assert_close_local("dsink", dsink, ref[5], 1e-10)


def _ring_window(case, p: int, n: int) -> int | None:
    """A window for the n-th ring case: none, 1, the chunk length C of the case's longest zigzag
    candidate (slot / 2P), C + 1, 2C - 1 or wider than any document, so blocks are skipped, full
    and banded."""
    c = max(max(case["slots"]) // (2 * p), 1)
    return (None, 1, c, c + 1, max(2 * c - 1, 1), 4 * max(case["slots"]))[n % 6]


def _worker(rank, world, cases2, cases4, cases_h):
    pair = dist.new_group([0, 1])
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    checked = 0
    for p, group, cases in ((2, pair, cases2), (4, dist.group.WORLD, cases4)):
        if rank >= p:
            continue
        for n, case in enumerate(cases):
            plan = plan_case(case, p)
            rw = _ring_window(case, p, n)

            def ring(q, k, v, s, plan=plan, group=group, rw=rw):
                return ring_attention(q, k, v, plan, group, sink=s, window=rw)

            _check(ring, case, plan, rank, rw, with_sink=n % 3 != 2, group=group)
            window = (1, 3, 17)[n % 3]

            def uly(q, k, v, s, plan=plan, group=group, window=window):
                return ulysses_attention(q, k, v, plan, group, sink=s, window=window)

            _check(uly, case, plan, rank, window, with_sink=n % 2 == 0, group=group)
            checked += 2
    for n, case in enumerate(cases_h):
        plan = plan_case(case, 4, hierarchical_sizes=[2, 2])
        hw = _ring_window(case, 2, n + 1)

        def hier(q, k, v, s, plan=plan, hw=hw):
            return hierarchical_attention(q, k, v, plan, inner, outer, sink=s, window=hw)

        _check(hier, case, plan, rank, hw, group=dist.group.WORLD)
        checked += 1
    _check_refusals(rank, cases4[0])
    return checked


def _check_refusals(rank, case):
    plan = plan_case(case, 4)
    t = plan.local_tokens(rank)
    q, kv = torch.zeros(t, HQ, D), torch.zeros(t, HKV, D)
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        ring_attention(q, kv, kv, plan, dist.group.WORLD, window=0)
    with pytest.raises(ValueError, match=r"sink must be one logit per query head \[4\]"):
        ring_attention(q, kv, kv, plan, dist.group.WORLD, sink=torch.zeros(3))


@pytest.mark.multirank
def test_value_head_dim_sinks_and_windows_exact_through_ring_ulysses_hierarchical():
    cases2 = make_cases(400, 2, 4) + hypothesis_cases(2, 2)
    cases4 = make_cases(401, 4, 4) + hypothesis_cases(4, 2)
    cases_h = make_cases(402, 2, 3, multiple=8) + hypothesis_cases(2, 2, multiple=8)
    res = run_distributed(_worker, 4, args=(cases2, cases4, cases_h), timeout=400)
    n2, n4, nh = 2 * len(cases2), 2 * len(cases4), len(cases_h)
    assert res == [n2 + n4 + nh, n2 + n4 + nh, n4 + nh, n4 + nh]
