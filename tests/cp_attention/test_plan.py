"""The CP planner and schedule on one process: every physical token owned once, shard/unshard
inverse, the union of all ring steps' kernel calls equals the causal mask exactly (each pair once;
under a sliding window the windowed mask),
planned cost recomputed by brute force, balance and set-up errors. Plus the fp32 merge."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_attention.merge import merge_, new_accumulators
from cp_attention.plan import CostModel, plan_cp
from tests.cp_attention.cp_cases import cu_of


@st.composite
def packs(draw):
    p = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, 6 * p + 3), min_size=1, max_size=40))
    slots = [max(2 * p, math.ceil(n / (2 * p)) * 2 * p) for n in lens]
    placement = draw(st.sampled_from(["auto", "zigzag"]))
    max_imb = draw(st.sampled_from([1.0, 1.05, 1.5, 100.0]))
    return p, lens, slots, placement, max_imb


def _step_pairs(plan, r, t):
    """Physical (query, key) pairs computed by ring rank r at step t, from the step's cu's."""
    ring = plan.ring
    src = (r + t) % ring.size  # the ring runs towards lower ranks
    q_idx = ring.index[r]
    if t == 0:
        keys = [ring.index[r], None]
    else:  # the block travels as half A (first chunks) and half B (second chunks)
        keys = [ring.index[src][rows] for rows in ring.chunk_rows(src)]
    pairs = []
    for spec, k_idx in zip(ring.step(r, t), keys, strict=True):
        if spec is None:
            continue
        cq, ck = spec.cu_q.tolist(), spec.cu_k.tolist()
        for i in range(len(cq) - 1):
            lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
            for a in range(lq):
                for b in range(lk):
                    if not spec.causal or b <= a + lk - lq:
                        pairs.append((int(q_idx[cq[i] + a]), int(k_idx[ck[i] + b])))
    return pairs


def _causal_pairs(lens, slots):
    start, pairs = 0, []
    for n, s in zip(lens, slots, strict=True):
        pairs += [(start + a, start + b) for a in range(n) for b in range(a + 1)]
        start += s
    return pairs


@settings(max_examples=60)
@given(packs())
def test_ring_schedule_covers_the_causal_mask_exactly_once(pack):
    p, lens, slots, placement, max_imb = pack
    plan = plan_cp(cu_of(lens), cu_of(slots), p, placement=placement, max_imbalance=max_imb)
    owned = torch.sort(torch.cat(plan.rank_index)).values
    assert torch.equal(owned, torch.arange(sum(slots))), "every token owned exactly once"
    got = [pr for r in range(p) for t in range(p) for pr in _step_pairs(plan, r, t)]
    assert len(got) == len(set(got)), "a query-key pair is computed twice"
    assert set(got) == set(_causal_pairs(lens, slots))
    if plan.ring.zigzag_tokens == 0:
        assert all(s is None or s.empty for r in range(p) for t in range(1, p)
                   for s in plan.ring.step(r, t))


def _window_pairs(plan, r, t, window):
    """Physical (query, key) pairs of ring rank r at step t under a sliding window, per call."""
    ring = plan.ring
    src = (r + t) % ring.size
    q_idx = ring.index[r]
    keys = ([ring.index[r], None] if t == 0
            else [ring.index[src][rows] for rows in ring.chunk_rows(src)])
    per_call = []
    for specs, k_idx in zip(ring.window_step(r, t, window), keys, strict=True):
        for spec in specs:
            cq, ck, pairs = spec.cu_q.tolist(), spec.cu_k.tolist(), []
            for i in range(len(cq) - 1):
                lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
                for a in range(lq):
                    last = a + lk - lq + spec.offset  # the last key this query may see
                    for b in range(lk):
                        if not spec.causal or (b <= last and (spec.window is None
                                                              or b > last - spec.window)):
                            pairs.append((int(q_idx[cq[i] + a]), int(k_idx[ck[i] + b])))
            per_call.append(pairs)
    return per_call


@settings(max_examples=60)
@given(packs(), st.integers(1, 40))
def test_windowed_ring_schedule_covers_the_window_mask_exactly_once(pack, window):
    """Under a sliding window the ring's calls (window_schedule.py) cover exactly the pairs whose
    distance in the document is below the window, each once, and no call is without work."""
    p, lens, slots, placement, max_imb = pack
    plan = plan_cp(cu_of(lens), cu_of(slots), p, placement=placement, max_imbalance=max_imb)
    calls = [c for r in range(p) for t in range(p) for c in _window_pairs(plan, r, t, window)]
    assert all(calls), "a kernel call in which no query sees a key"
    got = [pr for c in calls for pr in c]
    assert len(got) == len(set(got)), "a query-key pair is computed twice"
    assert set(got) == {(i, j) for i, j in _causal_pairs(lens, slots) if i - j < window}
    if window == 1:  # every query sees only itself: nothing to compute after the first step
        assert all(not c for r in range(p) for t in range(1, p)
                   for c in _window_pairs(plan, r, t, window))


@settings(max_examples=40)
@given(packs(), st.floats(0.0, 10.0))
def test_planned_cost_matches_brute_force_and_balance(pack, b):
    p, lens, slots, placement, max_imb = pack
    cm = CostModel(1.0, b)
    plan = plan_cp(cu_of(lens), cu_of(slots), p, cost_model=cm, placement=placement,
                   max_imbalance=max_imb)
    doc_pos = torch.full((sum(slots),), -1)  # position inside its document, -1 at padding
    start = 0
    for n, s in zip(lens, slots, strict=True):
        doc_pos[start:start + n] = torch.arange(n)
        start += s
    for r in range(p):
        pos = doc_pos[plan.ring.index[r]]
        area = int((pos[pos >= 0] + 1).sum())
        assert plan.rank_cost[r] == pytest.approx(area + b * plan.local_tokens(r))
    if placement == "zigzag" or max_imb >= 100.0:
        return
    # auto never does worse than the per-document zigzag placement's own balance or the target
    zz = plan_cp(cu_of(lens), cu_of(slots), p, cost_model=cm, placement="zigzag")
    assert plan.planned_imbalance <= max(max_imb, zz.planned_imbalance) + 1e-12


def test_zigzag_chunks_and_whole_documents():
    p = 2
    lens, slots = [16, 3, 2], [16, 4, 4]
    plan = plan_cp(cu_of(lens), cu_of(slots), p, max_imbalance=1.1)
    assert plan.zigzag_docs == [0]
    c = 4  # 16 / (2P)
    assert plan.ring.index[0][:8].tolist() == list(range(0, c)) + list(range(3 * c, 4 * c))
    assert plan.ring.index[1][:8].tolist() == list(range(c, 2 * c)) + list(range(2 * c, 3 * c))
    assert plan.ring.zigzag_tokens == 8
    assert sorted(plan.local_tokens(r) for r in range(p)) == [12, 12]
    x = torch.randn(sum(slots), 3)
    assert torch.equal(plan.unshard([plan.shard(x, r) for r in range(p)]), x)
    # P=2: half A (4 tokens) once per pass from both ranks; half B only from rank 1 (fwd, bwd
    # KV) and the dK/dV of B only on rank 0 (which sends rank 1's B accumulator home).
    half = 4 * 2 * 2 * 4  # tokens * (K, V) * Hkv * D
    tr0, tr1 = (plan.ring.traffic(r, 2, 4, 2, 4) for r in range(p))
    assert tr0 == {"ring_fwd_kv": (half * 2, 1), "ring_bwd_kv": (half * 2, 1),
                   "ring_bwd_dkv": (2 * half * 4, 2)}
    assert tr1 == {"ring_fwd_kv": (2 * half * 2, 2), "ring_bwd_kv": (2 * half * 2, 2),
                   "ring_bwd_dkv": (half * 4, 1)}
    assert plan.ring_bytes_per_rank(2, 4, 2, True, 4) == (sum(b for b, _ in tr0.values())
                                                          + sum(b for b, _ in tr1.values())) / 2


def test_hierarchical_split_and_local_cu():
    lens, slots = [30, 5, 1], [32, 8, 8]
    plan = plan_cp(cu_of(lens), cu_of(slots), 4, hierarchical_sizes=[2, 2])
    assert plan.hierarchical_sizes == (2, 2) and plan.ring.size == 2
    for o in range(2):
        joined = torch.cat([plan.rank_index[2 * o], plan.rank_index[2 * o + 1]])
        assert torch.equal(joined, plan.ring.index[o])
    for r in range(4):
        assert int(plan.local_cu_seqlens[r][-1]) == plan.local_tokens(r)


def test_setup_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"slot \(12 tokens\) is not a multiple of 2\*cp=8"):
        plan_cp(cu_of([10]), cu_of([12]), 4, placement="zigzag")
    with pytest.raises(ValueError, match="document 1 has length 9 but its padded slot is 8"):
        plan_cp(cu_of([3, 9]), cu_of([4, 8]), 2)
    with pytest.raises(ValueError, match=r"hierarchical_sizes=\[2, 3\] .* cp_size=4"):
        plan_cp(cu_of([8]), cu_of([8]), 4, hierarchical_sizes=[2, 3])
    # one document that must be split but cannot be: auto placement refuses it too
    with pytest.raises(ValueError, match=r"document 0 must be split over 2 ranks .* \(6 tokens\)"):
        plan_cp(cu_of([6, 1]), cu_of([6, 4]), 2, max_imbalance=1.05)
    with pytest.raises(ValueError, match="placement='ring'"):
        plan_cp(cu_of([8]), cu_of([8]), 2, placement="ring")


def test_merge_is_exact_and_handles_empty_rows():
    torch.manual_seed(0)
    h, t, d = 2, 5, 3
    s1, s2 = torch.randn(h, t, 4, dtype=torch.float64), torch.randn(h, t, 6, dtype=torch.float64)
    v1, v2 = torch.randn(4, d, dtype=torch.float64), torch.randn(6, d, dtype=torch.float64)
    s1[:, 0] = float("-inf")  # row 0 sees nothing in block 1
    s1[:, 1] = s2[:, 1] = float("-inf")  # row 1 sees nothing at all
    blocks = []
    for s, v in ((s1, v1), (s2, v2)):
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
        blocks.append((torch.einsum("htk,kd->thd", p, v), lse))
    out, lse = new_accumulators(torch.zeros(t, h, d, dtype=torch.float64))
    for o, l_ in blocks:
        merge_(out, lse, o, l_)
    s = torch.cat([s1, s2], -1)
    want_lse = torch.logsumexp(s, -1)
    want = torch.einsum("htk,kd->thd", torch.softmax(s, -1).nan_to_num(0.0), torch.cat([v1, v2]))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[:, 1]).all() and (out[1] == 0).all()
    torch.testing.assert_close(lse[:, [0, 2, 3, 4]], want_lse[:, [0, 2, 3, 4]], atol=1e-12, rtol=0)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
