"""An export left early: on 2 gloo ranks, a rank that stops reading after one bucket (its
iterator closed, or dropped and settled by the policy's next call) stops its peer at the same
bucket with a one-line ExportAbandoned; the suspended export's tensors are released; and both
ranks go on: a full export equals the one-process reference and a log-prob pass runs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rl_hooks import PolicyTrainer
from rl_hooks.export import ExportAbandoned
from tests.launcher import run_distributed
from tests.rl_hooks.helpers import config, rollout_batch
from tests.rl_hooks.test_export import CAP, HF_SETS, _export


def _names(buckets) -> list[str]:
    return [n for b in buckets for n, _ in b]


def _leave_then_go_on(rank, world, how):
    policy = PolicyTrainer(config(*HF_SETS, "parallel.ep=2"))
    it = policy.export_weights(CAP, torch.float32)
    first = next(it)
    held = weakref.ref(first[0][1])  # a tensor of the first bucket, held by the suspended export
    del first
    error = None
    if rank == 0:  # the rank whose caller stops reading
        if how == "close":
            it.close()
        else:  # dropped: the vote it owes is cast by the policy's next call
            del it
            gc.collect()
        released = held() is None
    else:
        try:
            for _ in it:
                pass
        except ExportAbandoned as e:
            error = str(e)
        released = None
    full = _export(policy)  # both ranks go on: a whole export ...
    logp = policy.compute_logprobs(rollout_batch()).logprobs  # ... and any other call
    return error, released, _names(full), [t for b in full for _, t in b], logp


@pytest.mark.slow  # two gloo ranks
@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_rank_leaving_the_export_stops_its_peer_and_both_go_on(how):
    ref = PolicyTrainer(config(*HF_SETS))
    want = _export(ref)
    results = run_distributed(_leave_then_go_on, world_size=2, args=(how,), timeout=300)
    (err0, released, names0, tensors0, logp0), (err1, _, names1, tensors1, logp1) = results
    assert err0 is None and released  # the suspended export let go of its bucket
    assert err1 == ("export_weights stopped after bucket 1: another rank left the export early; call "
                    "export_weights again on every rank for all buckets")
    assert names0 == names1 == _names(want)
    for a, b, w in zip(tensors0, tensors1, [t for bucket in want for _, t in bucket], strict=True):
        assert torch.equal(a, w) and torch.equal(b, w)  # gathers only: exact
    assert torch.equal(logp0, logp1)
