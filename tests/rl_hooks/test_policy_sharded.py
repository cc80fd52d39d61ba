"""PolicyTrainer(sharded=True), float64: each DP rank passes only its own share of the batch (as
verl and NeMo-RL dispatch it); log-probs and one optimizer step's parameter updates (which reveal
the gradients, helpers.py) equal one process on the whole batch, for the aggregations whose
normalisers are global counts (loss tokens, sequences, the longest sequence). Tolerance 1e-10:
float64, only the summation order differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_hooks import PolicyLossConfig, PolicyTrainer, make_loss
from tests.launcher import run_distributed
from tests.rl_hooks.helpers import EPS, config, params, rollout_batch, updates

TOL = 1e-10
# Dynamic-CP schedules the whole batch of the DP x CP block: the shares are gathered first. With
# 8 tokens per rank, the 9-13-token sequences run over both ranks and the others on one each.
DYNAMIC = ["parallel.dynamic_cp=true", "parallel.max_cp=2"]
LOSSES = [PolicyLossConfig(kind="ppo", agg=a, kl_coef=0.1)
          for a in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")]


def _run(sets, sharded: bool, rank: int = 0, world: int = 1):
    batch = rollout_batch()
    # the old log-probs' offset from the policy, per token of the whole batch
    batch.old_logprobs = 0.05 * torch.cos(torch.arange(batch.num_tokens, dtype=torch.float64))
    if sharded:  # a contiguous chunk per DP rank, unequal (9 sequences over 2 ranks)
        bounds = [batch.num_seqs * r // world for r in range(world + 1)]
        batch = batch.select(list(range(bounds[rank], bounds[rank + 1])))
    policy = PolicyTrainer(config(*sets), micro_batch_tokens=8 if sets == DYNAMIC else 24, sharded=sharded)
    logp = policy.compute_logprobs(dataclasses.replace(batch, old_logprobs=None)).logprobs
    steps, run_sizes = [], set()
    for cfg in LOSSES:
        rollouts = dataclasses.replace(batch, old_logprobs=logp + batch.old_logprobs)
        before = params(policy)
        res = policy.train_step(rollouts, make_loss(cfg), lr=EPS)
        steps.append(updates(policy, before))
        run_sizes |= {int(k[len("sequences_cp"):]) for k, v in res.items() if k.startswith("sequences_cp") and v}
        with torch.no_grad():
            for n, p in policy.runtime.model.named_parameters():
                p.copy_(before[n])
    return logp, steps, policy.dims.rank_in("ep"), run_sizes


def _sharded(rank, world, sets):
    return _run(sets, True, rank, world)


@pytest.mark.slow  # two or four gloo ranks
@pytest.mark.parametrize("sets", [[], ["parallel.ep=2"], DYNAMIC], ids=["dp2", "dp2-ep2", "dp2-dynamic-cp"])
def test_sharded_batches_give_the_whole_batch_updates(sets):
    want_logp, want_steps, _, _ = _run([], sharded=False)
    runs = run_distributed(_sharded, world_size=2, args=(sets,), timeout=300)
    got_logp = torch.cat([r[0] for r in runs])
    assert float((got_logp - want_logp).abs().max()) <= TOL
    if sets == DYNAMIC:
        assert all(r[3] == {1, 2} for r in runs)
    for _, steps, ep_rank, _ in runs:
        for got, want in zip(steps, want_steps, strict=True):
            for name, u in got.items():
                ref = want[name]
                if ".experts." in name and u.shape != ref.shape:  # this EP rank's experts
                    ref = ref.chunk(2)[ep_rank]
                assert u.abs().max() > 0 or ref.abs().max() == 0
                assert float((u - ref).abs().max()) <= TOL, name

