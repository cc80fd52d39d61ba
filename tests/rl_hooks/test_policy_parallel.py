"""PolicyTrainer on 4 gloo ranks against one process, float64: log-probs, entropies and routes
under CP2 x EP2 (ring, hierarchical, Ulysses, Dynamic-CP), TP2 x DP2 (with and without sequence
parallelism) and EP4 (with the distributed optimizer, and with two micro-batches in flight); one optimizer
step's parameter updates (which reveal the gradients, see helpers.py) equal the single-process
ones for every loss kind and aggregation, with routes replayed.

Every rank passes the same RolloutBatch; the trainer splits it over its DP ranks, so DP 1 (the
reference), 2 and 4 are compared on the same sequences. Tolerance 1e-10: float64, only the
summation order differs (sums over ranks and micro-batches).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_hooks import PolicyLossConfig, PolicyTrainer, RolloutBatch, make_loss
from rl_hooks.losses import AGGS, KINDS
from tests.launcher import run_distributed
from tests.rl_hooks.helpers import EPS, config, params, rollout_batch, updates

TOL = 1e-10
LAYOUTS = [
    ["parallel.cp=2", "parallel.ep=2"],
    ["parallel.cp=2", "parallel.ep=2", "parallel.cp_backend=hierarchical",
     "parallel.hierarchical_sizes=[2, 1]"],
    ["parallel.cp=2", "parallel.ep=2", "parallel.cp_backend=ulysses"],
    ["parallel.tp=2"],
    ["parallel.tp=2", "parallel.sequence_parallel=true"],
    ["parallel.ep=4", "parallel.distributed_optimizer=true"],
    # two micro-batches' forwards interleaved, in compute_logprobs and in train_step
    ["parallel.ep=4", "parallel.micro_batches_in_flight=2"],
    # Dynamic-CP: each mini-batch's sequences on runs of 1, 2 and 4 ranks of the DP2 x CP2 block
    ["parallel.cp=2", "parallel.ep=2", "parallel.dynamic_cp=true", "parallel.max_cp=4"],
    # ... with sequence parallelism: an idle rank's stand-in micro-batch splits over TP too
    ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
     "parallel.dynamic_cp=true"],
]
# Tokens one rank holds per micro-batch; under Dynamic-CP 6 sends the 8..13-token sequences to
# runs of 2 and 4 ranks (the split does not change the results: aux losses are off).
BUDGET, DYNAMIC_BUDGET = 24, 6
# With sequence parallelism on TP2 a sequence is padded to 2 (alone) or 4 (on 2 ranks): 8 tokens
# per rank sends the 8..13-token sequences to runs of 1 and 2 ranks.
SP_DYNAMIC_BUDGET = 8
# Every loss kind with every aggregation (KL and the train-inference corrections on the PPO ones)
LOSSES = [PolicyLossConfig(kind=k, agg=a, kl_coef=0.1 if k == "ppo" else 0.0,
                           tis_cap=2.0 if k == "ppo" else None,
                           eps_low=0.01 if k == "gspo" else 0.2, eps_high=0.01 if k == "gspo" else 0.2)
          for k in KINDS for a in AGGS]


def _losses_of(layout_index: int) -> list[int]:
    """Indices into LOSSES of the losses run under LAYOUTS[layout_index]. The first layout (the
    fast tier's) runs every loss; each other one runs every kind with one aggregation, rotated so
    that every (kind, aggregation) pair runs under two of the eight: a layout's bug still shows in
    every kind of loss, at a quarter of the steps."""
    if layout_index == 0:
        return list(range(len(LOSSES)))
    return [i * len(AGGS) + (i + layout_index) % len(AGGS) for i in range(len(KINDS))]


COLUMN_SHARDED = ("wo.weight", "w_down.weight")  # TP's row-parallel layers keep input columns


def _run(sets, losses, rank_info=False):
    """compute_logprobs, then one step per loss; the updates of this rank's parameters."""
    batch = rollout_batch()
    dynamic = "parallel.dynamic_cp=true" in sets
    budget = BUDGET
    if dynamic:
        budget = SP_DYNAMIC_BUDGET if "parallel.sequence_parallel=true" in sets else DYNAMIC_BUDGET
    policy = PolicyTrainer(config(*sets), micro_batch_tokens=budget)
    sizes_possible = {1, 2, 4} & set(range(1, policy.dims.dp * policy.dims.cp + 1))
    out = policy.compute_logprobs(batch, return_entropy=True, record_routes=True)
    steps = []
    for cfg in (LOSSES[i] for i in losses):
        perturbed = out.logprobs + 0.05 * torch.cos(torch.arange(out.logprobs.numel()))
        rollouts = dataclasses.replace(batch, old_logprobs=perturbed, routed_experts=out.routes)
        before = params(policy)
        metrics = policy.train_step(rollouts, make_loss(cfg), lr=EPS)
        if dynamic:  # every sequence counted once, at the size it ran
            sizes = {int(k[len("sequences_cp"):]): v for k, v in metrics.items()
                     if k.startswith("sequences_cp")}
            assert sum(sizes.values()) == batch.num_seqs and min(sizes.values()) > 0, sizes
            assert set(sizes) == sizes_possible, sizes
        steps.append({n: u for n, u in updates(policy, before).items()})
        # undo the step so each loss starts from the same weights
        with torch.no_grad():
            for n, p in policy.runtime.model.named_parameters():
                p.copy_(before[n])
    dims = policy.dims
    where = {"tp": dims.rank_in("tp"), "ep": dims.rank_in("ep")} if rank_info else None
    if dynamic:  # the schedule really mixes CP sizes
        assert set(policy.dynamic.plan(batch.seq_lengths(), budget).cp_sizes_used) == sizes_possible
    return out, steps, where


def _rank(rank, world, layouts, first):
    return [_run(sets, _losses_of(first + i), rank_info=True) for i, sets in enumerate(layouts)]


def _slice(name, got, want, where):
    """This rank's piece of the reference tensor `want` for a parameter shaped like `got`."""
    if got.shape == want.shape:
        return want
    if name.endswith(COLUMN_SHARDED) and got.shape[1] != want.shape[1]:
        n = got.shape[1]
        return want[:, where["tp"] * n:(where["tp"] + 1) * n]
    n = got.shape[0]
    # TP shards q/k/v and gate/up rows by tp rank; EP slices experts by ep rank
    part = where["ep"] if "experts" in name else where["tp"]
    return want[part * n:(part + 1) * n]


def _check_layouts(first, last=None):
    layouts = LAYOUTS[first:last]
    # The optimizer's state carries from one loss's step to the next (only the weights are put
    # back), so each sequence of losses gets its own single-process reference.
    refs = {}
    for i in range(first, first + len(layouts)):
        losses = tuple(_losses_of(i))
        if losses not in refs:
            refs[losses] = _run([], losses)
    results = run_distributed(_rank, world_size=4, args=(layouts, first), timeout=600)
    for rank_results in results:
        for i, (sets, (out, steps, where)) in enumerate(zip(layouts, rank_results, strict=True)):
            losses = tuple(_losses_of(first + i))
            ref_out, ref_steps, _ = refs[losses]
            assert (out.logprobs - ref_out.logprobs).abs().max() < TOL, sets
            assert (out.entropy - ref_out.entropy).abs().max() < TOL, sets
            assert torch.equal(out.routes, ref_out.routes), sets
            for k, got, want in zip(losses, steps, ref_steps, strict=True):
                cfg = LOSSES[k]
                assert any(v.abs().max() > 0 for v in want.values())
                for name, g in got.items():
                    w = _slice(name, g, want[name], where)
                    assert (g - w).abs().max() < TOL, (sets, cfg.kind, name)


@pytest.mark.multirank
def test_policy_calls_match_single_process_under_cp2_ep2_ring_float64():
    _check_layouts(0, 1)


@pytest.mark.slow
@pytest.mark.long
def test_policy_calls_match_single_process_under_other_cp_tp_ep_layouts_float64():
    _check_layouts(1)


SP_ONE = ["parallel.tp=2", "parallel.sequence_parallel=true"]


def _one_sequence_logprobs(sets):
    """Log-probs of a batch of one sequence: with DP2 one replica has nothing to run."""
    batch = RolloutBatch.from_sequences([[3, 1, 4, 1, 5]], [[9, 2, 6]],
                                        advantages=[[0.5, -1.0, 0.25]])
    policy = PolicyTrainer(config(*sets), micro_batch_tokens=BUDGET)
    return policy.compute_logprobs(batch, return_entropy=True).logprobs


@pytest.mark.slow
def test_sequence_parallel_rank_without_sequences_runs_a_stand_in():
    """TP2 x DP2 with sequence parallelism and one sequence: the idle replica's stand-in
    micro-batch splits over TP like any other (one token did not), and both replicas agree
    with one process."""
    want = _one_sequence_logprobs([])
    for got in run_distributed(_sp_one_rank, 4, timeout=300):
        assert (got - want).abs().max() < TOL


def _sp_one_rank(rank, world):
    return _one_sequence_logprobs(SP_ONE)
