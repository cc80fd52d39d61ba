"""Dynamic-CP on gloo against one process, float64.

Each step's documents (every DP replica's micro-batches) are rescheduled onto power-of-two CP
sub-groups of the DP x CP block. Two references:

- the single-process model on the plan's own micro-batches (one per run of ranks), with the
  seq aux loss, the z-loss and the expert bias on: router statistics are per micro-batch by
  definition, so this is the reference whose micro-batches are the ones Dynamic-CP runs;
- static CP and the single-process model on the loader's micro-batches, with the balance losses
  off: then the objective is a token mean that does not depend on how documents are grouped,
  and the three runs must agree.

Tolerances: 1e-10 for one step (float64; only the summation order differs); 10 steps track the
reference within 1e-6 (the bound of test_train_parallel: a top-k tie flipped by rounding is the
only way to diverge).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cp_attention.dynamic import schedule
from longctx_moe.build import model_of
from longctx_moe.config import load_config
from longctx_moe.parallel.dims import ParallelDims
from longctx_moe.parallel.dynamic_cp import documents, pack_slot
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import Trainer
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch

STEPS = 10
TOL_STEP, TOL_RUN = 1e-10, 1e-6
CAPACITY = 12  # tokens per rank and slot: a 40-token document needs CP 4, a 13-token one CP 2
# per DP replica, two micro-batches: 1-token documents, short ones, long ones that need CP
DOCS = [[[1, 40, 3], [7, 2]], [[13, 1], [25, 5, 1]]]
BASE = ["train.param_dtype=fp64", "train.autocast_dtype=none", f"train.steps={STEPS}",
        "optim.warmup_steps=2", "optim.lr=1e-2", "optim.grad_clip=0.5", "model.vocab_size=64",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=8", "model.num_experts=4", "model.top_k=2", "model.expert_hidden_size=16",
        "model.first_k_dense=1", "model.dense_hidden_size=32", "model.shared_expert_hidden_size=16",
        "execution.loss_chunk_tokens=16"]
AUX_ON = ["balance.aux_loss_type=seq", "balance.aux_loss_coeff=0.1", "balance.z_loss_coeff=0.01",
          "model.expert_bias=true", "balance.expert_bias_update_rate=0.01"]
AUX_OFF = ["balance.aux_loss_coeff=0", "balance.z_loss_coeff=0"]
DYNAMIC = ["parallel.dynamic_cp=true", f"parallel.max_tokens_per_rank={CAPACITY}"]
# (layout, max_cp). world 4: DP2 x CP2 attention, EP2 experts (ring, Ulysses, and hierarchical
# with an all-to-all of 2: runs of 2 ranks run Ulysses, the whole block 2 x a ring of 2 across
# DP), sub-groups up to the whole block; world 8: DP2 x CP4 / EP4, sub-groups up to 8 ranks.
# The hierarchical layout's model has a sliding-window layer (5 keys: shorter than the 40-token
# document's zigzag chunks on the ring of 2, longer than the short documents) and a full one.
WINDOWED = ["model.sliding_window=5", "model.layer_types=[sliding_attention, full_attention]"]
WORLD4 = [(["parallel.cp=2", "parallel.ep=2"], 4),
          (["parallel.cp=2", "parallel.ep=2", "parallel.cp_backend=ulysses"], 4),
          (["parallel.cp=2", "parallel.ep=2", "parallel.cp_backend=hierarchical",
            "parallel.hierarchical_sizes=[2, 1]", *WINDOWED], 4)]
WORLD8 = [(["parallel.cp=4", "parallel.ep=4"], 8)]


def _steps(pad: int = 8):
    """STEPS x DP replicas x micro-batches of random documents, slots padded to `pad` (2 * CP
    of every layout here; one padding for all runs, since the random tokens depend on it)."""
    gen = torch.Generator().manual_seed(5)
    return [[[packed_batch(d, 64, pad_multiple=pad, generator=gen) for d in replica]
             for replica in DOCS] for _ in range(STEPS)]


def _trainer(sets, dims):
    cfg = load_config(None, BASE + sets)
    torch.manual_seed(cfg.train.seed)
    parallel = cfg.parallel
    if dims is None:  # one process: the same settings without the layout
        parallel = dataclasses.replace(parallel, cp=1, ep=1, dynamic_cp=False, max_cp=0,
                                       max_tokens_per_rank=0, cp_backend="ring")
    return Trainer(cfg, parallelize(model_of(cfg).double(), dims, parallel))


def _grads(trainer):
    """This rank's gradients of the first step, after its reduction and clipping (the trainer
    zeroes them after the update: read them just before it)."""
    out = {}
    step = trainer.optimizer.step

    def capture():
        if not out:
            out.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                        if p.grad is not None})
        step()

    trainer.optimizer.step = capture
    return out


def _plan(replicas, block, max_cp, model_sets=()):
    """(the step's documents, the Dynamic-CP plan every rank makes of them)."""
    docs = [d for replica in replicas for d in documents(replica)]
    return docs, schedule([d.tokens.numel() for d in docs], block, max_cp, CAPACITY,
                          _cost(model_sets), tp=1)


def _plan_micro_batches(replicas, block, max_cp, model_sets=()):
    """The single-process equivalent of one Dynamic-CP step: one micro-batch per run."""
    docs, plan = _plan(replicas, block, max_cp, model_sets)
    runs = [run for slot in plan.slots for run in slot if run.seq_indices]
    return [pack_slot([docs[i] for i in run.seq_indices], 1) for run in runs], plan


def _slot_micro_batches(replicas, block, max_cp):
    """The single-process equivalent of one Dynamic-CP step with the global-batch aux loss: one
    micro-batch per slot, holding every run's documents (the slot's statistics are global)."""
    docs, plan = _plan(replicas, block, max_cp)
    return [pack_slot([docs[i] for run in slot for i in run.seq_indices], 1)
            for slot in plan.slots]


def _cost(model_sets=()):
    from longctx_moe.parallel.parallelize import _dynamic_cp

    cfg = load_config(None, BASE + list(model_sets))
    fake = dataclasses.replace(cfg.parallel, dynamic_cp=True)
    return _dynamic_cp(model_of(cfg), ParallelDims.from_config(cfg.parallel, 1), fake, 1).cost


def _rank(rank, world, layouts):
    out = []
    for sets, max_cp in layouts:
        row = []
        dynamic = DYNAMIC + [f"parallel.max_cp={max_cp}"]
        for extra in (AUX_ON + dynamic, AUX_OFF + dynamic, AUX_OFF):
            cfg = load_config(None, BASE + sets + extra)
            dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
            dims.build_groups(rank)
            trainer = _trainer(sets + extra, dims)
            mine = [replica[dims.rank_in("dp")] for replica in _steps()]
            grads = _grads(trainer)
            steps = mine if extra[0] == AUX_ON[0] else mine[:1]  # STEPS steps once per layout
            results = [trainer.train_step(mbs) for mbs in steps]
            row.append(([(r.loss, r.grad_norm) for r in results], grads, results[0].cp_sizes,
                        dims.rank_in("ep"), dims.ep))
        out.append(row)
    return out


def _reference(extra, per_step):
    trainer = _trainer(extra, None)
    grads = _grads(trainer)
    results = [trainer.train_step(mbs) for mbs in per_step]
    return [(r.loss, r.grad_norm) for r in results], grads


def _close_grads(got, want, ep_rank, ep, tol):
    for name, g in got.items():
        w = want[name]
        if g.shape != w.shape:  # an expert weight: this rank's slice
            n = g.shape[0]
            w = w[ep_rank * n:(ep_rank + 1) * n]
        assert (g - w).abs().max() < tol, name


def _check(world, layouts, block):
    got = run_distributed(_rank, world, args=(layouts,), timeout=600)
    steps = _steps()
    for i, (sets, max_cp) in enumerate(layouts):
        model_sets = [s for s in sets if s.startswith("model.")]
        planned = [_plan_micro_batches(step, block, max_cp, model_sets) for step in steps]
        assert any(1 in p.cp_sizes_used and max(p.cp_sizes_used) > 1 for _, p in planned)
        ref_aux, ref_aux_grads = _reference(model_sets + AUX_ON, [mbs for mbs, _ in planned])
        ref_off, ref_off_grads = _reference(model_sets + AUX_OFF,
                                            [[mb for replica in steps[0] for mb in replica]])
        assert planned[0][1].num_slots > 1 and len(planned[0][0]) > 2  # slots, runs per slot
        assert len({ref_aux[0][0], ref_aux[-1][0]}) == 2  # the run trains
        for rank_out in got:
            (dyn_aux, g_aux, sizes, ep_rank, ep), (dyn_off, g_off, _, _, _), (static, g_st, _, _, _) = rank_out[i]
            assert sizes == planned[0][1].cp_sizes_used, (sets, sizes)
            # aux on: Dynamic-CP equals one process on the plan's micro-batches, for STEPS steps
            assert abs(dyn_aux[0][0] - ref_aux[0][0]) < TOL_STEP, sets
            _close_grads(g_aux, ref_aux_grads, ep_rank, ep, TOL_STEP)
            for (loss, norm), (ref_loss, ref_norm) in zip(dyn_aux, ref_aux, strict=True):
                assert abs(loss - ref_loss) < TOL_RUN and abs(norm - ref_norm) < TOL_RUN, sets
            # aux off: Dynamic-CP = static CP = one process on the loader's micro-batches
            for run, grads in ((dyn_off, g_off), (static, g_st)):
                assert abs(run[0][0] - ref_off[0][0]) < TOL_STEP, sets
                _close_grads(grads, ref_off_grads, ep_rank, ep, TOL_STEP)


@pytest.mark.multirank
def test_dynamic_cp_world4_ring_matches_one_process_and_static_cp_float64():
    _check(4, WORLD4[:1], block=4)


@pytest.mark.slow
def test_dynamic_cp_world4_ulysses_and_hierarchical_match_one_process_and_static_cp_float64():
    _check(4, WORLD4[1:], block=4)


@pytest.mark.slow
def test_dynamic_cp_world8_dp2_cp4_ep4_matches_one_process_float64():
    _check(8, WORLD8, block=8)


def _in_flight_rank(rank, world):
    """Two steps of Dynamic-CP (aux, z-loss and expert bias on) one slot at a time and with two
    slots in flight, whose forwards interleave around the all-to-alls while each runs its
    attention on its own sub-groups: (loss, norm, CP sizes) per step and the parameters."""
    from longctx_moe.parallel import runtime

    sets, max_cp = WORLD4[0]
    out, pairs = [], []
    interleave = runtime.run_interleaved
    runtime.run_interleaved = lambda jobs: pairs.append(len(jobs)) or interleave(jobs)
    for in_flight in (1, 2):
        extra = AUX_ON + DYNAMIC + [f"parallel.max_cp={max_cp}",
                                    f"parallel.micro_batches_in_flight={in_flight}"]
        cfg = load_config(None, BASE + sets + extra)
        dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
        dims.build_groups(rank)
        trainer = _trainer(sets + extra, dims)
        results = [trainer.train_step(step[dims.rank_in("dp")]) for step in _steps()[:2]]
        out.append(([(r.loss, r.grad_norm, r.cp_sizes) for r in results],
                    [p.detach().clone() for p in trainer.model.parameters()],
                    pairs.count(2)))  # slots that really ran in flight together
    runtime.run_interleaved = interleave
    return out


@pytest.mark.slow
def test_dynamic_cp_two_slots_in_flight_equal_one_at_a_time_bitwise():
    """Interleaving only moves when each slot's work runs, not what it computes: bitwise."""
    for (one, params_one, _), (two, params_two, paired) in run_distributed(_in_flight_rank, 4,
                                                                           timeout=600):
        assert paired >= 2  # a pair of slots per step
        assert one == two, (one, two)
        assert any(max(sizes) > 1 and min(sizes) == 1 for _, _, sizes in one)  # mixed CP sizes
        assert all(torch.equal(p, q) for p, q in zip(params_one, params_two, strict=True))


SP_LAYOUT = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2"]
# per DP replica, one micro-batch: a 40-token document fills the 4-rank block in one slot, and a
# 1-token one runs alone in another while three ranks idle
SP_DOCS = [[[40, 2]], [[1]]]


def _sp_steps():
    gen = torch.Generator().manual_seed(6)
    return [[[packed_batch(d, 64, pad_multiple=8, generator=gen) for d in replica]
             for replica in SP_DOCS] for _ in range(2)]


def _sp_rank(rank, world):
    extra = AUX_OFF + DYNAMIC + ["parallel.max_cp=4"]
    cfg = load_config(None, BASE + SP_LAYOUT + extra)
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
    dims.build_groups(rank)
    trainer = _trainer(SP_LAYOUT + extra, dims)
    results = [trainer.train_step(step[dims.rank_in("dp")]) for step in _sp_steps()]
    return [(r.loss, r.grad_norm, r.cp_sizes) for r in results]


@pytest.mark.slow
def test_dynamic_cp_with_sequence_parallel_tp_matches_one_process_float64():
    """TP2 x CP2 x DP2 with sequence parallelism: an idle rank's stand-in batch must split over
    TP like any other (it held one token, which sequence parallelism refused). Balance losses
    off, so one process on the loader's micro-batches is the reference for loss and norm."""
    steps = _sp_steps()
    plans = [_plan(step, 4, 4)[1] for step in steps]
    assert any(not run.seq_indices for p in plans for slot in p.slots for run in slot)  # idle
    ref, _ = _reference(AUX_OFF, [[mb for replica in step for mb in replica] for step in steps])
    for per_step in run_distributed(_sp_rank, 8, timeout=600):
        for (loss, norm, sizes), (ref_loss, ref_norm), plan in zip(per_step, ref, plans,
                                                                    strict=True):
            assert sizes == plan.cp_sizes_used
            assert abs(loss - ref_loss) < TOL_RUN and abs(norm - ref_norm) < TOL_RUN


GLOBAL_AUX = ["balance.aux_loss_type=switch", "balance.aux_loss_coeff=0.1", "balance.z_loss_coeff=0.01",
              "model.expert_bias=true", "parallel.aux_loss_scope=global_batch"]
GLOBAL_STEPS = 3


def _global_aux_rank(rank, world):
    sets, max_cp = WORLD4[0]
    extra = GLOBAL_AUX + DYNAMIC + [f"parallel.max_cp={max_cp}"]
    cfg = load_config(None, BASE + sets + extra)
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model, cfg.balance)
    dims.build_groups(rank)
    trainer = _trainer(sets + extra, dims)
    grads = _grads(trainer)
    results = [trainer.train_step(step[dims.rank_in("dp")]) for step in _steps()[:GLOBAL_STEPS]]
    return [(r.loss, r.grad_norm) for r in results], grads, dims.rank_in("ep"), dims.ep


@pytest.mark.slow
def test_dynamic_cp_global_batch_aux_loss_matches_one_process_per_slot_float64():
    """aux_loss_scope=global_batch under Dynamic-CP: the router statistics of a slot are summed
    over every rank of the block (all its runs, idle ranks adding nothing) and the slot weighs its
    targets over the global batch's: one process running one micro-batch per slot."""
    per_step = [_slot_micro_batches(step, 4, WORLD4[0][1]) for step in _steps()[:GLOBAL_STEPS]]
    assert max(len(mbs) for mbs in per_step) > 1  # several slots: the weighting matters
    ref, ref_grads = _reference(GLOBAL_AUX, per_step)
    for losses, grads, ep_rank, ep in run_distributed(_global_aux_rank, 4, timeout=600):
        assert abs(losses[0][0] - ref[0][0]) < TOL_STEP
        _close_grads(grads, ref_grads, ep_rank, ep, TOL_STEP)
        for (loss, norm), (ref_loss, ref_norm) in zip(losses, ref, strict=True):
            assert abs(loss - ref_loss) < TOL_RUN and abs(norm - ref_norm) < TOL_RUN


def test_cost_settings_reach_the_runtime_cost_model():
    """Every parallel.dcp_* key changes the scheduler's DynamicCPCost (none is accepted and
    ignored), and out-of-range values are refused with the key's name."""
    import pytest

    from cp_attention.dynamic_cost import DynamicCPCost
    from longctx_moe.model.flops import active_matmul_params
    from longctx_moe.parallel.parallelize import _dynamic_cp

    sets = ["parallel.dcp_tflops=100", "parallel.dcp_bandwidth_gbps=50",
            "parallel.dcp_ring_latency_us=30", "parallel.dcp_attn_half_tokens=1000"]
    cfg = load_config(None, BASE + sets)
    parallel = dataclasses.replace(cfg.parallel, dynamic_cp=True)
    model = model_of(cfg)
    cost = _dynamic_cp(model, ParallelDims.from_config(cfg.parallel, 1), parallel, 1).cost
    m = cfg.model
    want = DynamicCPCost.from_model(
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, active_params_per_token=active_matmul_params(m),
        flops_per_s=100e12, bandwidth=50e9, ring_latency=30e-6, attn_half_tokens=1000.0)
    # us -> s rounds differently from 30e-6 written out: equal to the last bit or two
    assert dataclasses.astuple(cost) == pytest.approx(dataclasses.astuple(want), rel=1e-12)
    assert cost.ring_step_seconds == pytest.approx(2 * m.num_layers * 30e-6)
    default = _cost()  # the H100-class defaults of ParallelConfig
    assert default.ring_step_seconds == pytest.approx(2 * m.num_layers * 12e-6)
    assert default.attn_half_tokens == 490.0
    assert cost.a2a_size == 1  # ring CP exchanges no heads
    # The all-to-all spans the whole run under Ulysses, the inner groups under hierarchical CP.
    for backend, extra, a2a in (("ulysses", {}, 4), ("hierarchical", {"hierarchical_sizes": [2, 2]}, 2)):
        layout = dataclasses.replace(cfg.parallel, cp=4, dynamic_cp=True, cp_backend=backend, **extra)
        dims = ParallelDims.from_config(layout, 8, cfg.model)
        assert _dynamic_cp(model, dims, layout, 1).cost.a2a_size == a2a, backend
    for key in ("dcp_ring_latency_us", "dcp_attn_half_tokens"):
        with pytest.raises(ValueError, match=f"parallel.{key}"):
            load_config(None, BASE + [f"parallel.{key}=-1"]).parallel.validate()
