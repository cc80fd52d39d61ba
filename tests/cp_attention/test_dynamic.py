"""Dynamic-CP scheduler: plan invariants (every sequence once, slots partition the block into
aligned power-of-two runs, capacity, smallest fitting size, costs and bytes recomputed here from
the definitions), the raising rules, the static-CP baseline, determinism, a case worked by hand,
the cost presets and the one-line errors."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_attention.dynamic import (
    _MIN_GAIN,
    Run,
    _finish,
    _problem,
    _shrink,
    schedule,
)
from cp_attention.dynamic_cost import (
    H100_ATTN_HALF_TOKENS,
    H100_RING_LATENCY,
    DynamicCPCost,
    fit_attention_efficiency,
    padded_length,
)
from cp_attention.dynamic_slot import Slot

COST = DynamicCPCost(a=1e-6, b=1e-10, kv_bytes_per_token=1e4, bandwidth=1e10, overlap=0.5)
# The same with a ring-step latency and a tile-efficiency curve (n_half = 64 tokens).
COST_LAT = DynamicCPCost(a=1e-6, b=1e-10, kv_bytes_per_token=1e4, bandwidth=1e10, overlap=0.5,
                         ring_step_seconds=2e-5, attn_half_tokens=64.0)


def min_size(n, max_cp, capacity, tp=1):
    """Smallest power of two whose per-rank share of n fits capacity (None: none up to max_cp)."""
    s = 1
    while s <= max_cp:
        if padded_length(n, s, tp) // s <= capacity:
            return s
        s *= 2
    return None


def seconds(n, s, cost=COST, tp=1):
    """The cost model written out: (GEMMs + attention at tile efficiency eff(pad / s)) / s +
    exposed ring time (bytes a rank receives); without the run's fixed ring-step cost."""
    pad = padded_length(n, s, tp)
    ring = (s - 1) / s * pad * cost.kv_bytes_per_token
    m = pad / s
    eff = m / (m + cost.attn_half_tokens)
    return ((cost.a * pad + cost.b * pad * pad / eff) / s
            + (1 - cost.overlap) * ring / cost.bandwidth)


def check_plan(plan, lengths, block, max_cp, capacity, cost=COST, tp=1):
    """Every invariant a plan must hold; returns {sequence: run size}."""
    size_of, rank_cost, slot_time, nbytes = {}, np.zeros(block), [], 0.0
    for runs in plan.slots:
        covered = []
        worst = 0.0
        for run in runs:
            assert run.size & (run.size - 1) == 0 and 1 <= run.size <= max_cp
            assert run.first_rank % run.size == 0, f"run {run} is not aligned"
            covered += list(run.ranks)
            pads = [padded_length(lengths[i], run.size, tp) for i in run.seq_indices]
            assert sum(pads) // run.size <= capacity, f"run {run} holds more than {capacity}"
            t = sum(seconds(lengths[i], run.size, cost, tp) for i in run.seq_indices)
            t += cost.ring_step_seconds * (run.size - 1) if run.seq_indices else 0.0
            rank_cost[run.first_rank:run.first_rank + run.size] += t
            worst = max(worst, t)
            nbytes += sum((run.size - 1) * p * cost.kv_bytes_per_token for p in pads)
            for i in run.seq_indices:
                assert i not in size_of, f"sequence {i} placed twice"
                size_of[i] = run.size
        assert sorted(covered) == list(range(block)), "a slot's runs must partition the block"
        assert [r.first_rank for r in runs] == sorted(r.first_rank for r in runs)
        slot_time.append(worst)
    assert sorted(size_of) == list(range(len(lengths))), "every sequence exactly once"
    for i, s in size_of.items():
        assert s >= min_size(lengths[i], max_cp, capacity, tp)
    # 1e-9 relative: the plan sums the same float terms, possibly in another order.
    assert plan.rank_cost == pytest.approx(rank_cost, rel=1e-9, abs=1e-15)
    assert plan.slot_seconds == pytest.approx(slot_time, rel=1e-9, abs=1e-15)
    assert plan.modeled_step_time == pytest.approx(sum(slot_time), rel=1e-9, abs=1e-15)
    assert plan.cp_bytes == pytest.approx(nbytes, rel=1e-9, abs=1e-6)
    assert plan.num_slots == len(plan.slots)
    hist = {}
    for s in size_of.values():
        hist[s] = hist.get(s, 0) + 1
    assert plan.cp_sizes_used == dict(sorted(hist.items()))
    for r in range(block):
        rows = plan.assignment(r)
        assert len(rows) == plan.num_slots
        assert all(r in run.ranks and seqs == run.seq_indices for run, seqs in rows)
    return size_of


@st.composite
def problems(draw):
    block = draw(st.sampled_from([1, 2, 4, 8, 64]))
    max_cp = draw(st.sampled_from([s for s in (1, 2, 4, 8) if s <= block]))
    tp = draw(st.sampled_from([1, 1, 2, 3]))
    capacity = draw(st.integers(2 * tp, 300))  # >= 2 * tp: a 1-token sequence fits max_cp ranks
    multiple = math.lcm(2 * max_cp, tp)
    longest = capacity * max_cp // multiple * multiple  # the longest length max_cp ranks hold
    edge = st.sampled_from(sorted({1, 2, min(capacity, longest), min(capacity + 1, longest),
                                   longest}))
    lengths = draw(st.lists(st.one_of(edge, st.integers(1, longest)), min_size=0, max_size=150))
    mode = draw(st.sampled_from(["dynamic", "min_size", "static"]))
    cost = draw(st.sampled_from([COST, COST_LAT]))
    return block, max_cp, tp, capacity, lengths, mode, cost


@settings(max_examples=150)
@given(problems())
def test_invariants_on_random_steps(problem):
    block, max_cp, tp, capacity, lengths, mode, cost = problem
    static_cp = max_cp if mode == "static" else None
    plan = schedule(lengths, block, max_cp, capacity, cost, static_cp, tp=tp,
                    raise_cp=mode == "dynamic")
    size_of = check_plan(plan, lengths, block, max_cp, capacity, cost, tp=tp)
    if mode == "static":
        assert set(size_of.values()) <= {max_cp}
    if mode == "min_size":
        assert all(s == min_size(lengths[i], max_cp, capacity, tp) for i, s in size_of.items())
    if mode == "dynamic":  # runs never exceed max_cp, so the static plan has the most bytes
        static = schedule(lengths, block, max_cp, capacity, cost, static_cp=max_cp, tp=tp)
        assert plan.cp_bytes <= static.cp_bytes * (1 + 1e-12)
        # the static plan is one of the candidates: never more than _MIN_GAIN faster
        assert plan.modeled_step_time * (1 - _MIN_GAIN) <= static.modeled_step_time * (1 + 1e-12)
    again = schedule(np.asarray(lengths, dtype=np.int64), block, max_cp, capacity, cost,
                     static_cp, tp=tp, raise_cp=mode == "dynamic")
    assert again.slots == plan.slots and again.modeled_step_time == plan.modeled_step_time


def test_worked_by_hand():
    # a = 1, b = 1/8, each rank receives (s-1)/s * n * 10 bytes at 20 B/s, half of it exposed.
    cost = DynamicCPCost(a=1.0, b=0.125, kv_bytes_per_token=10.0, bandwidth=20.0, overlap=0.5)
    plan = schedule([8, 6, 4], block_size=2, max_cp=2, capacity_tokens=8, cost=cost)
    # One rank each: 8 + 8^2/8 = 16 s, 6 + 36/8 = 10.5 s, 4 + 16/8 = 6 s; densest first (2, 1.75,
    # 1.5 s/token). 8 and 6 fill slot 0 (one per rank); 4 has no room there -> slot 1, rank 0.
    # Slot 1's rank 1 is idle, so the 4 spreads over both ranks: (4 + 2) / 2 + (1/2 * 4 * 10 /
    # 20) / 2 = 3.5 s < 6 s. Slot 0 on one 2-rank run would cost (8 + 8) / 2 + 1 = 9 s per
    # sequence, 18 s > 16 s, so it stays.
    assert plan.slots == [[Run(1, 0, (0,)), Run(1, 1, (1,))], [Run(2, 0, (2,))]]
    assert plan.slot_seconds == pytest.approx([16.0, 3.5])
    assert plan.modeled_step_time == pytest.approx(19.5)
    assert plan.rank_cost.tolist() == pytest.approx([19.5, 14.0])
    assert plan.imbalance == pytest.approx(19.5 / 16.75)
    assert plan.cp_bytes == pytest.approx(2 * (1 / 2 * 4 * 10))  # both ranks receive 20 bytes
    assert plan.cp_sizes_used == {1: 2, 2: 1}
    assert plan.assignment(1) == [(Run(1, 1, (1,)), (1,)), (Run(2, 0, (2,)), (2,))]


def test_edge_lengths_pick_the_smallest_fitting_size():
    # 1 token pads to 2 on one rank; exactly the capacity fits one rank; one more token needs
    # two; max_cp * capacity needs max_cp; the padding multiple grows with tp.
    lengths = [1, 64, 65, 512, 127]
    plan = schedule(lengths, 8, 8, 64, COST, raise_cp=False)
    sizes = check_plan(plan, lengths, 8, 8, 64)
    assert [sizes[i] for i in range(5)] == [1, 1, 2, 8, 2]
    # padded as the runtime pads (data_packing.batch.pad_multiple): one rank needs no chunks;
    # sequence parallelism splits each rank's share TP ways, which can need a larger size
    assert padded_length(1, 1) == 1 and padded_length(5, 1, tp=4) == 8
    assert padded_length(65, 2) == 68 and padded_length(65, 2, tp=3) == 72
    assert padded_length(7, 4, tp=16) == 16
    assert padded_length(65, 2, tp=4) == 68 and padded_length(65, 2, tp=4, sequence_parallel=True) == 72
    for sp, size in ((False, 2), (True, 4)):
        plan = schedule([65], 8, 8, 34, COST, tp=4, sequence_parallel=sp, raise_cp=False)
        assert plan.cp_sizes_used == {size: 1}


def test_more_sequences_than_ranks_and_fewer():
    many = [100] * 40  # 40 equal sequences on 4 ranks, 300 tokens per rank: 4 slots
    plan = schedule(many, 4, 4, 300, COST)
    check_plan(plan, many, 4, 4, 300)
    assert plan.num_slots == 4 and plan.imbalance == pytest.approx(1.0)
    few = [100, 100]  # 2 sequences on 64 ranks without raising: 62 idle ranks, one slot
    plan = schedule(few, 64, 8, 300, COST, raise_cp=False)
    check_plan(plan, few, 64, 8, 300)
    assert plan.num_slots == 1 and sum(1 for r in plan.slots[0] if not r.seq_indices) == 62
    assert plan.slots[0][0] == Run(1, 0, (0,)) and plan.slots[0][1] == Run(1, 1, (1,))


def test_raising_spreads_a_lone_sequence_and_keeps_full_blocks():
    # One sequence that fits a single rank: without raising 7 of 8 ranks idle; raised, it spreads
    # over max_cp ranks, since compute / 8 + exposed ring time < compute here.
    plan = schedule([4000], 8, 8, 4096, COST)
    assert plan.slots == [[Run(8, 0, (0,))]]
    assert plan.modeled_step_time == pytest.approx(seconds(4000, 8))
    lone = schedule([4000], 8, 8, 4096, COST, raise_cp=False)
    assert lone.modeled_step_time == pytest.approx(seconds(4000, 1))
    assert lone.modeled_step_time > plan.modeled_step_time
    # Two on 8 ranks: each spreads over 4 (8 for both would cost each rank both sequences).
    assert schedule([4000, 4000], 8, 8, 4096, COST).slots == [[Run(4, 0, (0,)), Run(4, 4, (1,))]]
    # Equal sequences, one per rank: no rank is idle and pairs on 2-run cost the same compute plus
    # ring time, so nothing is raised.
    plan = schedule([2000] * 8, 8, 8, 4096, COST)
    assert plan.cp_sizes_used == {1: 8} and plan.num_slots == 1 and plan.cp_bytes == 0


def test_raising_only_when_it_is_faster():
    # A quality check on one fixed mix (the greedy does not guarantee it for every input).
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7, 1.5, 300), 1, 8 * 1024).astype(int).tolist()
    fixed = schedule(lengths, 16, 8, 1024, COST, raise_cp=False)
    raised = schedule(lengths, 16, 8, 1024, COST)
    check_plan(raised, lengths, 16, 8, 1024)
    assert raised.modeled_step_time <= fixed.modeled_step_time
    # Expensive ring: raising never pays, so every sequence keeps its smallest size.
    dear = DynamicCPCost(a=1e-6, b=1e-10, kv_bytes_per_token=1e9, bandwidth=1e9, overlap=0.0)
    plan = schedule(lengths, 16, 8, 1024, dear)
    sizes = check_plan(plan, lengths, 16, 8, 1024, dear)
    assert all(s == min_size(lengths[i], 8, 1024) for i, s in sizes.items())


def test_runs_below_the_slot_time_are_halved():
    # Step 5 on a slot built by hand (the candidates rarely leave such a run in a small case):
    # an 800-token sequence needs 8 ranks and sets the slot's time; four 100-token sequences
    # raised onto the other 8 ranks go back to one rank each (8 -> 4+4 -> 2+2+2+2 -> 1 each, the
    # other rank of each pair idle).
    lengths = [100, 100, 100, 100, 800]
    prob = _problem(lengths, 16, 8, 100, 1, False, COST, None, True)
    slot = Slot(16, prob.sizes)
    for seqs in ([4], [0, 1, 2, 3]):
        run = slot.open_run(8)
        for i in seqs:
            _, tokens, secs = prob.options[i][-1]  # on 8 ranks
            slot.add(run, i, tokens, secs)
    before = _finish([slot], prob)
    _shrink(slot, prob)
    plan = _finish([slot], prob)
    check_plan(plan, lengths, 16, 8, 100)
    busy = [r for r in plan.slots[0] if r.seq_indices]
    assert [(r.size, r.first_rank) for r in busy] == [(8, 0), (1, 8), (1, 10), (1, 12), (1, 14)]
    assert plan.modeled_step_time == before.modeled_step_time
    assert plan.cp_bytes == pytest.approx(7 * 800 * COST.kv_bytes_per_token)
    assert before.cp_bytes == pytest.approx(7 * (800 + 4 * 112) * COST.kv_bytes_per_token)


def test_static_baseline_uses_only_its_size():
    lengths = [1, 17, 300, 4096, 50, 2048] * 5
    plan = schedule(lengths, 64, 8, 512, COST, static_cp=8)
    check_plan(plan, lengths, 64, 8, 512)
    assert plan.cp_sizes_used == {8: len(lengths)}
    assert all(run.size == 8 for runs in plan.slots for run in runs if run.seq_indices)
    smallest = schedule(lengths, 64, 8, 512, COST, raise_cp=False)
    assert smallest.cp_bytes < plan.cp_bytes


def test_block_of_one_rank():
    plan = schedule([5, 1, 3], 1, 1, 6, COST)
    check_plan(plan, [5, 1, 3], 1, 1, 6)
    assert [r.seq_indices for runs in plan.slots for r in runs] == [(0,), (1, 2)]
    assert plan.cp_bytes == 0 and plan.cp_sizes_used == {1: 3}


def test_empty_step():
    plan = schedule([], 8, 4, 100, COST)
    assert plan.num_slots == 0 and plan.modeled_step_time == 0 and plan.imbalance == 1.0
    assert plan.assignment(3) == []


def test_errors_are_one_line_and_name_the_fix():
    cases = [
        (dict(lengths=[10, 20000], max_cp=8, capacity_tokens=2048),
         ["sequence 1", "20000 tokens", "max_cp", "max_tokens_per_rank"]),
        (dict(lengths=[10, 20000], max_cp=8, capacity_tokens=2048, static_cp=2),
         ["sequence 1", "static_cp"]),
        (dict(lengths=[3, 0], max_cp=8, capacity_tokens=64), ["sequence 1", "length 0"]),
        (dict(lengths=[3], max_cp=3, capacity_tokens=64), ["max_cp=3", "power of two"]),
        (dict(lengths=[3], max_cp=16, capacity_tokens=64), ["max_cp=16", "8 ranks"]),
        (dict(lengths=[3], max_cp=8, capacity_tokens=0), ["capacity_tokens=0"]),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError) as err:
            schedule(block_size=8, cost=COST, **kwargs)
        msg = str(err.value)
        assert "\n" not in msg and all(w in msg for w in words), msg
    with pytest.raises(ValueError, match="overlap"):
        DynamicCPCost(a=1.0, b=0.0, overlap=1.5)
    for bad in (dict(ring_step_seconds=-1e-6), dict(attn_half_tokens=-1.0),
                dict(attn_half_tokens=math.inf)):
        with pytest.raises(ValueError, match="attn_half_tokens"):
            DynamicCPCost(a=1.0, b=0.0, **bad)
    with pytest.raises(ValueError, match="do not rise"):
        fit_attention_efficiency([512, 1024, 2048], [3e12, 2e12, 1e12])
    with pytest.raises(ValueError, match="outside the block"):
        schedule([1], 2, 2, 8, COST).assignment(2)


def test_cost_presets_follow_the_model_description():
    cost = DynamicCPCost.from_model(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                    active_params_per_token=1000, flops_per_s=1e6,
                                    bandwidth=5e3, attention_flops_per_s=2e6, itemsize=2,
                                    overlap=0.25)
    assert cost.a == pytest.approx(6 * 1000 / 1e6)
    # forward 4 * heads * head_dim per pair and layer, x3 with backward, n^2 / 2 causal pairs
    assert cost.b == pytest.approx(3 * 4 * 4 * 8 * 2 / 2 / 2e6)
    assert cost.kv_bytes_per_token == 3 * 2 * 2 * 8 * 2 * 2
    # n is taken as given (already padded): compute / 4 + 25% hidden of 3/4 * n * kv bytes.
    assert cost.seconds(100, 4) == pytest.approx((cost.a * 100 + cost.b * 1e4) / 4
                                                 + 0.75 * 0.75 * 100 * cost.kv_bytes_per_token
                                                 / 5e3)
    h100 = DynamicCPCost.h100()
    # 3.3B active params at 400 TFLOP/s: ~50 us of GEMMs per token; 48 layers x 4 KV heads of 128
    # in bf16, x3 for forward + backward: 295 KB of ring bytes per token.
    assert h100.a == pytest.approx(6 * 3.3e9 / 400e12)
    assert h100.kv_bytes_per_token == 3 * 2 * 4 * 128 * 2 * 48
    assert h100.bandwidth == 200e9 and 0 <= h100.overlap <= 1
    # 48 layers, one ring forward and one backward each, at NCCL's ~12 us per p2p hop
    assert h100.ring_step_seconds == pytest.approx(2 * 48 * H100_RING_LATENCY)
    assert h100.attn_half_tokens == H100_ATTN_HALF_TOKENS
    plain = DynamicCPCost.h100(ring_latency=0.0, attn_half_tokens=0.0)
    assert plain.ring_step_seconds == 0 and plain.attn_half_tokens == 0
    assert plain.a == h100.a and plain.b == h100.b


def test_cost_terms_written_out():
    # The attention term at tile efficiency eff(n/s) = (n/s) / (n/s + n_half) equals
    # b*n^2/s + b*n*n_half; the run's fixed ring-step cost is paid once per run, not per sequence.
    c = COST_LAT
    for n, s in ((64, 1), (512, 2), (4096, 8)):
        eff = (n / s) / (n / s + c.attn_half_tokens)
        assert c.compute_seconds(n, s) == pytest.approx((c.a * n + c.b * n * n / eff) / s)
        assert c.compute_seconds(n, s) == pytest.approx((c.a * n + c.b * n * n) / s
                                                        + c.b * n * c.attn_half_tokens)
    assert c.run_fixed_seconds(1) == 0 and c.run_fixed_seconds(8) == pytest.approx(7 * 2e-5)
    assert c.run_seconds([], 8) == 0
    assert c.run_seconds([512, 1024], 4) == pytest.approx(3 * 2e-5 + c.seconds(512, 4)
                                                          + c.seconds(1024, 4))
    # defaults recover the plain model: compute divides evenly over any s
    assert COST.compute_seconds(4096, 8) * 8 == pytest.approx(COST.compute_seconds(4096, 1))
    assert COST.run_fixed_seconds(8) == 0 and COST.attention_efficiency(10) == 1.0


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (8, 8)])
@pytest.mark.parametrize("g,s", [(2, 2), (4, 4), (2, 4), (4, 8), (2, 8)])
def test_a2a_bytes_equal_the_ulysses_executor(hq, hkv, g, s):
    """The model's all-to-all bytes per rank equal what ulysses_attention / hierarchical_attention
    send (the formula tests/cp_attention/test_ulysses.py checks against CommStats), without the
    LSE (a 1/head_dim sliver the model leaves out): a run of s ranks with an all-to-all over
    g = min(s, a2a_size) of them, every rank holding n / s tokens, GQA heads replicated up to g."""
    from tests.cp_attention.test_ulysses import D, _a2a_formula

    item, n = 8, 64 * s
    cost = DynamicCPCost.from_model(num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=D,
                                    active_params_per_token=1, flops_per_s=1, bandwidth=1,
                                    itemsize=item, a2a_size=g)
    counts = [n // s] * g
    sent = [sum(b for b, _ in _a2a_formula(counts, r, hq, hkv, item, 0)) for r in range(g)]
    assert cost.split(s) == (g, s // g)
    assert cost.a2a_bytes(n, s) == pytest.approx(sum(sent) / g, rel=1e-12)
    # the ring over s / g ranks carries the KV heads one rank holds after the all-to-all
    ring = (s // g - 1) / (s // g) * n * 3 * 2 * (max(hkv, g) // g) * D * item
    assert cost.ring_bytes(n, s) == pytest.approx(ring, rel=1e-12)
    assert cost.cp_bytes(n, s) == pytest.approx(ring + sum(sent) / g, rel=1e-12)


def test_a2a_is_not_hidden_and_pays_two_steps():
    """The ring hides `overlap` of its bytes, the all-to-all none; a run with an all-to-all pays
    two fixed steps for it on top of its ring steps; ring CP (a2a_size 1) is unchanged."""
    base = dict(a=1e-6, b=1e-10, kv_bytes_per_token=600.0, bandwidth=1e4, overlap=0.5,
                ring_step_seconds=1e-3, q_bytes_per_token=800.0, kv_heads=2)
    ring, hier = DynamicCPCost(**base), DynamicCPCost(**base, a2a_size=2)
    assert ring.a2a_bytes(256, 8) == 0 and ring.split(8) == (1, 8)
    assert hier.split(1) == (1, 1) and hier.split(2) == (2, 1) and hier.split(8) == (2, 4)
    for n, s in ((256, 2), (256, 8)):
        comm = (0.5 * hier.ring_bytes(n, s) + hier.a2a_bytes(n, s)) / 1e4
        assert hier.seconds(n, s) == pytest.approx(hier.compute_seconds(n, s) + comm)
    assert hier.ring_bytes(256, 2) == 0  # one all-to-all group: no ring
    # 2 KV heads over an all-to-all of 2: one per rank, so the 4-rank ring of an 8-rank run
    # carries half the KV bytes per token of the flat 8-rank ring, times (3/4) / (7/8)
    assert hier.ring_bytes(256, 8) == pytest.approx(ring.ring_bytes(256, 8) / 2 * (3 / 4) / (7 / 8))
    assert [hier.run_fixed_seconds(s) for s in (1, 2, 4, 8)] == pytest.approx([0, 2e-3, 3e-3, 5e-3])
    assert [ring.run_fixed_seconds(s) for s in (1, 2, 4, 8)] == pytest.approx([0, 1e-3, 3e-3, 7e-3])
    for bad in (dict(a2a_size=3), dict(a2a_size=0), dict(kv_heads=0), dict(q_bytes_per_token=-1)):
        with pytest.raises(ValueError, match="a2a_size a power of two"):
            DynamicCPCost(**{**base, **bad})


def test_tile_efficiency_is_monotone_and_fits_back():
    c = DynamicCPCost(a=0.0, b=1.0, attn_half_tokens=490.0)
    m = np.asarray([1, 16, 128, 490, 1024, 4096, 16384, 1 << 20], dtype=np.float64)
    eff = c.attention_efficiency(m)
    assert np.all(np.diff(eff) > 0) and np.all((eff > 0) & (eff < 1))
    assert eff[3] == pytest.approx(0.5)  # half performance at n_half
    # per rank, splitting a sequence over more ranks never lowers its rank-seconds
    for n in (64, 4096, 131072):
        rank_seconds = [s * c.seconds(n, s) for s in (1, 2, 4, 8)]
        assert rank_seconds == sorted(rank_seconds)
    # the fit recovers (peak, n_half) of exact curve points
    lengths = [128, 512, 2048, 8192, 16384]
    peak, half = fit_attention_efficiency(lengths, [600e12 * n / (n + 490.0) for n in lengths])
    assert peak == pytest.approx(600e12) and half == pytest.approx(490.0)


def test_latency_and_tile_overhead_keep_short_sequences_on_few_ranks():
    # Ring-step latency: one short sequence alone on 8 ranks spreads over all 8 in the plain
    # model (compute divides, the ring is cheap), stays on fewer ranks once each ring step costs
    # 100 us; a long sequence still spreads.
    short = [512]
    assert schedule(short, 8, 8, 16384, COST).cp_sizes_used == {8: 1}
    latency = dataclasses.replace(COST, ring_step_seconds=1e-4)
    plan = schedule(short, 8, 8, 16384, latency)
    check_plan(plan, short, 8, 8, 16384, latency)
    assert max(plan.cp_sizes_used) < 8
    assert plan.modeled_step_time < latency.run_seconds([padded_length(512, 8)], 8)
    assert schedule([16384], 8, 8, 16384, COST_LAT).cp_sizes_used == {8: 1}
    # Tile overhead: it is paid by every rank of a run, so it leaves a lone sequence's wall time
    # ordering alone but not the packing. Three short sequences on 4 ranks with a cheap ring: the
    # plain model puts all three on one 4-rank run (3/4 of the compute each rank would do alone);
    # with n_half = 2048 (or the latency) each keeps a rank of its own.
    cheap = dataclasses.replace(COST, kv_bytes_per_token=1e2)
    lengths = [512] * 3
    assert schedule(lengths, 4, 4, 2048, cheap).cp_sizes_used == {4: 3}
    for cost in (dataclasses.replace(cheap, attn_half_tokens=2048.0),
                 dataclasses.replace(cheap, ring_step_seconds=1e-4)):
        plan = schedule(lengths, 4, 4, 2048, cost)
        check_plan(plan, lengths, 4, 4, 2048, cost)
        assert plan.cp_sizes_used == {1: 3}, cost
        assert plan.modeled_step_time < 3 * cost.seconds(512, 4) + cost.run_fixed_seconds(4)
    # A mix of short sequences (a quality check on one fixed mix, as above): the plan made with
    # the terms is no slower under that model than the plan made without them.
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(6, 1.0, 200), 16, 4096).astype(int).tolist()
    aware = schedule(lengths, 16, 8, 4096, COST_LAT)
    blind = schedule(lengths, 16, 8, 4096, COST)
    check_plan(aware, lengths, 16, 8, 4096, COST_LAT)
    assert aware.modeled_step_time <= _step_time_under(blind, lengths, COST_LAT) * (1 + 1e-9)


def _step_time_under(plan, lengths, cost):
    """Step time of an existing plan's runs re-costed under another cost model."""
    total = 0.0
    for runs in plan.slots:
        total += max((cost.run_seconds([padded_length(lengths[i], r.size)
                                        for i in r.seq_indices], r.size) for r in runs),
                     default=0.0)
    return total
