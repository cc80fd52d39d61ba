"""RayPolicyGroup on a local Ray cluster: 2 rank actors (gloo; EP2 over DP2, then CP2 x EP2) against
the in-process PolicyTrainer in float64 — log-probs, entropies, routes, a PPO step's metrics and
the weights after it (read through the export, which gathers the EP shards); push_weights' sink on
rank 0; errors raised with the rank named (and a group left with a rank stuck in a collective
refusing calls); a cluster without room; shutdown; and `rl_hooks` without Ray.

Tolerance 1e-10: float64, only the summation order differs (sums over ranks and micro-batches).
The weights after one step differ from the reference by the difference of the gradients (see
helpers.py: the first AdamW update with lr = eps is about the gradient itself).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from rl_hooks import PolicyLossConfig, PolicyTrainer, RolloutBatchError, make_loss
from tests.ray_local import local_ray_cluster
from tests.rl_hooks.helpers import EPS, config, rollout_batch

TOL = 1e-10
# The export names Qwen3-MoE tensors, which have no shared expert; EP2 on 2 ranks is DP2 for
# attention (the batch is split over the two ranks) and two experts per rank.
SETS = ["model.shared_expert_hidden_size=0", "parallel.ep=2"]
REFERENCE = ["model.shared_expert_hidden_size=0"]
LOSS = PolicyLossConfig(kind="ppo", kl_coef=0.1, tis_cap=2.0)
MICRO = 24  # tokens: several micro-batches per rank


@pytest.fixture(scope="module")
def cluster():
    # Four logical CPUs: the shared group below holds two for the whole module, which leaves room
    # for the groups a test builds for itself (ranks mostly wait, so two cores carry them).
    yield from local_ray_cluster("the Ray actor group needs ray (pip install 'longctx-moe[rl]')",
                                 num_cpus=4)


@pytest.fixture(scope="module")
def group(cluster):
    """A group holding two of the cluster's four CPUs (one bundle of 1 CPU per rank); no test
    shuts it down, so the tests do not depend on their order."""
    from rl_hooks.ray_group import RayPolicyGroup

    g = RayPolicyGroup(config(*SETS), num_ranks=2, micro_batch_tokens=MICRO)
    yield g
    g.shutdown()


def _step(policy, batch):
    """Log-probs of the batch, then one PPO step on perturbed old log-probs with routes replayed;
    (log-probs, step metrics, every weight after the step by HF name)."""
    out = policy.compute_logprobs(batch, return_entropy=True, record_routes=True)
    perturbed = out.logprobs + 0.05 * torch.cos(torch.arange(out.logprobs.numel()))
    rollouts = dataclasses.replace(batch, old_logprobs=perturbed, routed_experts=out.routes)
    metrics = policy.train_step(rollouts, make_loss(LOSS), lr=EPS)
    weights = {n: t.clone() for b in policy.export_weights(1 << 20, torch.float64) for n, t in b}
    return out, metrics, weights


@pytest.mark.slow
def test_group_matches_the_in_process_policy_float64(group):
    _check_against_reference(group)


def _check_against_reference(group):
    batch = rollout_batch()
    reference = PolicyTrainer(config(*REFERENCE), micro_batch_tokens=MICRO)
    before = {n: t.clone() for b in reference.export_weights(1 << 20, torch.float64) for n, t in b}
    want_out, want_metrics, want_weights = _step(reference, batch)
    got_out, got_metrics, got_weights = _step(group, batch)

    assert (got_out.logprobs - want_out.logprobs).abs().max() < TOL
    assert (got_out.entropy - want_out.entropy).abs().max() < TOL
    assert torch.equal(got_out.routes, want_out.routes)
    for key in ("loss", "policy_loss", "grad_norm", "clip_frac", "kl", "route_agreement"):
        assert abs(got_metrics[key] - want_metrics[key]) < TOL, key
    if group.info()["layout"]["dp"] == 2:
        assert got_metrics["tokens_per_dp_rank_max"] < batch.num_tokens  # split over the ranks
    assert list(got_weights) == list(want_weights)
    assert max((want_weights[n] - before[n]).abs().max() for n in before) > 1e-3  # the step moved them
    for name, w in want_weights.items():
        assert (got_weights[name] - w).abs().max() < TOL, name
    assert got_weights.keys() == {s.name for s in group.weights_spec(torch.float64)}


def _fail_on_rank_1(policy):
    if policy.ctx.rank == 1:
        raise ValueError("refused on purpose")
    return policy.ctx.rank


def _fail_on_rank_1_while_rank_0_waits(policy):
    import torch.distributed as dist

    _fail_on_rank_1(policy)
    dist.barrier()  # rank 0 waits here for a peer that will never come


def _world(policy):
    return policy.ctx.rank, policy.ctx.world_size, policy.dims.dp, policy.dims.ep


class _CountingSink:
    """A sink that runs inside the rank actor: counts the buckets and tensors it was given."""

    def __init__(self, path):
        self.path = path

    def __call__(self, bucket):
        with open(self.path, "a") as f:
            f.write(f"{len(bucket)}\n")


@pytest.mark.slow
def test_push_weights_runs_the_sink_on_rank_0_only(group, tmp_path):
    sink = _CountingSink(tmp_path / "buckets.txt")
    stats = group.push_weights(sink, bucket_bytes=8192, dtype=torch.float32)
    counts = [int(line) for line in (tmp_path / "buckets.txt").read_text().split()]
    assert len(counts) == stats["buckets"] > 1 and sum(counts) == stats["tensors"]


def _buckets_sent(policy) -> int:
    return policy.export_gate.sent


def test_an_export_the_driver_leaves_early_stops_every_rank_and_the_group_goes_on(group):
    from rl_hooks.ray_group import AHEAD

    spec = [s.name for s in group.weights_spec(torch.float32)]
    it = group.export_weights(bucket_bytes=8192, dtype=torch.float32)
    next(it)
    it.close()
    total = len(list(group.export_weights(bucket_bytes=8192, dtype=torch.float32)))
    assert total > 2 * AHEAD  # else stopping early would be indistinguishable from the end
    # The first export: rank 0 stopped a few buckets in (the read, the window ahead, the vote's).
    it = group.export_weights(bucket_bytes=8192, dtype=torch.float32)
    next(it)
    del it  # dropped by the driver: the same
    names = [n for b in group.export_weights(bucket_bytes=8192, dtype=torch.float32) for n, _ in b]
    assert names == spec  # the group goes on: whole exports after abandoned ones
    it = group.export_weights(bucket_bytes=8192, dtype=torch.float32)
    next(it)
    it.close()
    assert group.apply(_buckets_sent)[0] <= 2 + AHEAD < total


@pytest.mark.slow
def test_a_rank_error_is_raised_in_the_driver_with_the_rank_named(group):
    from rl_hooks.ray_group import RayGroupError

    assert group.apply(_world) == [(0, 2, 2, 2), (1, 2, 2, 2)]
    with pytest.raises(RayGroupError, match=r"_fail_on_rank_1 failed on rank 1: ValueError: refused on purpose") as e:
        group.apply(_fail_on_rank_1)
    assert e.value.rank == 1 and e.value.failed == [1] and isinstance(e.value.cause, ValueError)
    # No rank was left inside a collective: the group still serves calls.
    assert group.info()["world_size"] == 2
    bad = dataclasses.replace(rollout_batch(), routed_experts=torch.full((3, 1, 1), 7, dtype=torch.int16))
    with pytest.raises(RolloutBatchError):  # checked in the driver, before any rank runs
        group.compute_logprobs(bad)


@pytest.mark.slow
def test_layout_that_does_not_fit_the_ranks_is_refused_before_any_actor(group):
    from longctx_moe.config import ConfigError
    from rl_hooks.ray_group import RayPolicyGroup

    with pytest.raises(ConfigError, match="tp"):
        RayPolicyGroup(config("parallel.tp=4"), num_ranks=2)


@pytest.mark.slow
def test_a_cluster_without_room_for_the_ranks_is_named(group):
    from rl_hooks.ray_group import RayPolicyGroup

    # `group` holds two of the cluster's four CPUs: two bundles of 2 CPUs can never be placed.
    with pytest.raises(RuntimeError, match="could not be placed within 1s: the Ray cluster lacks"):
        RayPolicyGroup(config(*SETS), num_ranks=2, cpus_per_rank=2, ready_timeout_s=1)


@pytest.mark.slow
def test_shutdown_ends_the_group(cluster):
    from rl_hooks.ray_group import RayPolicyGroup

    own = RayPolicyGroup(config(*REFERENCE), num_ranks=1)  # its own: `group` stays for the others
    assert own.info()["world_size"] == 1
    own.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        own.info()
    own.shutdown()  # a second shutdown is harmless


@pytest.mark.slow
def test_rl_hooks_imports_without_ray_and_the_group_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import rl_hooks, rl_hooks.ray_group\n"
            "try:\n    rl_hooks.RayPolicyGroup(None, 2)\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "RayPolicyGroup needs Ray: pip install 'longctx-moe[rl]'"


@pytest.mark.slow
@pytest.mark.long(seconds=80)
def test_cp2_group_matches_the_in_process_policy_float64(cluster):
    from rl_hooks.ray_group import RayGroupError, RayPolicyGroup

    cfg = config(*SETS, "parallel.cp=2")
    with RayPolicyGroup(cfg, num_ranks=2, micro_batch_tokens=MICRO, grace_s=1) as cp:
        assert cp.info()["layout"]["cp"] == 2
        _check_against_reference(cp)
        # A failure that leaves a peer inside a collective: reported, then the group refuses calls
        # (shutdown at the end of the block kills the blocked actor).
        with pytest.raises(RayGroupError, match="failed on rank 1"):
            cp.apply(_fail_on_rank_1_while_rank_0_waits)
        with pytest.raises(RuntimeError, match="call shutdown"):
            cp.info()


def test_each_rank_finds_its_own_gpu_among_the_visible_ones(monkeypatch):
    from rl_hooks.ray_group import _device_index

    assert _device_index([], 3) == 3  # CPU ranks: the local rank
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # what Ray sets for an actor with GPU 2
    assert _device_index(["2"], 1) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # RAY_EXPERIMENTAL_NOSET_... style
    assert _device_index(["2"], 1) == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _device_index(["5"], 1) == 5
