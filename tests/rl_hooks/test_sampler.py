"""HFSampler: transformers' Qwen3-MoE, fed only through push_weights, samples with the policy's
log-probs and routes, and keeps its own copy of the weights (nothing shared with the trainer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_hooks import PolicyLossConfig, PolicyTrainer, RolloutBatch, make_loss
from tests.rl_hooks.helpers import config

pytest.importorskip("transformers")
from rl_hooks.sampler import HFSampler  # noqa: E402

# Qwen3-MoE expresses this model (no shared expert); one dense layer exercises mlp_only_layers.
# init_std 0.2 gives peaked, token-dependent distributions (a near-uniform model would hide a
# wrong weight); float32 on both sides, as the demo runs.
SETS = ["model.shared_expert_hidden_size=0", "model.first_k_dense=1", "model.num_layers=3",
        "model.dense_hidden_size=32", "model.init_std=0.2", "train.param_dtype=fp32",
        "optim.eps=1e-8", "optim.grad_clip=1.0"]
EOS, PAD = 2, 0
PROMPTS = [[1, 5, 6, 7, 3], [1, 8, 9, 3], [1, 4, 4, 4, 3], [1, 9, 9, 9, 3], [7]]
# float32 log-probs of the same weights through two implementations (sdpa vs our attention, HF's
# per-expert loop vs our grouped GEMM, log_softmax of [V] logits vs our chunked LM-head log-probs):
# the largest difference measured over 20 seeds x these 3 modes is 4e-6 (a few ulps of values
# near -6, through 3 layers); 1e-4 leaves 25x room, while a stale tensor moves log-probs by more
# than 1e-2 (checked below).
TOL = 1e-4


@pytest.fixture(scope="module")
def policy():
    return PolicyTrainer(config(*SETS), micro_batch_tokens=64)


def _sampler(policy) -> HFSampler:
    sampler = HFSampler(policy.cfg.model, eos_id=EOS, pad_id=PAD)
    policy.push_weights(sampler.load_bucket, bucket_bytes=8192, dtype=torch.float32)
    return sampler


def _batch(rollouts) -> RolloutBatch:
    return RolloutBatch.from_sequences(PROMPTS, [r.tokens for r in rollouts],
                                       rollout_logprobs=[r.logprobs for r in rollouts])


def _max_gap(policy, batch, temperature=1.0) -> float:
    out = policy.compute_logprobs(batch, temperature)
    return float((out.logprobs - batch.rollout_logprobs)[batch.loss_mask].abs().max())


def test_push_covers_every_sampler_weight(policy):
    sampler = HFSampler(policy.cfg.model, eos_id=EOS, pad_id=PAD)
    assert sorted(s.name for s in policy.weights_spec()) == sorted(sampler.names())
    with pytest.raises(KeyError, match="not a weight"):
        sampler.load_bucket([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="pushed shape"):
        sampler.load_bucket([("model.norm.weight", torch.zeros(3))])


@pytest.mark.parametrize("greedy, temperature", [(True, 1.0), (False, 1.0), (False, 0.7)])
def test_sampler_logprobs_equal_compute_logprobs(policy, greedy, temperature):
    torch.manual_seed(0)
    sampler = _sampler(policy)
    rollouts = sampler.generate(PROMPTS, 6, greedy=greedy, temperature=temperature)
    assert all(r.finished == (r.tokens[-1] == EOS) and EOS not in r.tokens[:-1] for r in rollouts)
    batch = _batch(rollouts)
    assert _max_gap(policy, batch, temperature) < TOL
    # Routes: the sampler's (prompt and response, all but the last token) are the trainer's.
    routes = torch.cat([r.routed_experts for r in rollouts])
    assert routes.dtype == torch.int16 and routes.shape == (batch.num_tokens, 2, 2)
    known = (routes >= 0).all(-1).all(-1)
    last = torch.zeros_like(known)
    last[batch.cu_seqlens[1:].long() - 1] = True
    # Only a last token can be unknown (never fed back; known when its batch ran on after it).
    assert known[~last].all() and not known.all()
    recorded = policy.compute_logprobs(batch, record_routes=True).routes
    assert torch.equal(routes[known].sort(-1).values, recorded[known].sort(-1).values)


def test_weights_travel_only_through_push():
    policy = PolicyTrainer(config(*SETS), micro_batch_tokens=64)  # this test trains it
    torch.manual_seed(1)
    sampler = _sampler(policy)
    model = policy.runtime.model
    ours = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in ours for p in sampler.model.parameters())
    before = sampler.generate(PROMPTS, 6, greedy=True)

    # The trainer changes (an optimizer step, then a large in-place edit): the sampler does not.
    rollout = RolloutBatch.from_sequences(PROMPTS, [r.tokens for r in before],
                                          advantages=[[1.0] * len(r.tokens) for r in before])
    policy.train_step(rollout, make_loss(PolicyLossConfig(kind="pg")), lr=1e-2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    again = sampler.generate(PROMPTS, 6, greedy=True)
    assert [r.tokens for r in again] == [r.tokens for r in before]
    assert [r.logprobs for r in again] == [r.logprobs for r in before]
    stale = _max_gap(policy, _batch(before))
    assert stale > 1e-2  # the check below would see a missing push

    # After the next push the sampler follows the new weights exactly.
    policy.push_weights(sampler.load_bucket, bucket_bytes=8192, dtype=torch.float32)
    for bucket in policy.export_weights(8192, torch.float32):
        for name, tensor in bucket:
            assert torch.equal(sampler.weight(name), tensor), name
    fresh = sampler.generate(PROMPTS, 6, greedy=True)
    assert _max_gap(policy, _batch(fresh)) < TOL
    assert [r.logprobs for r in fresh] != [r.logprobs for r in before]


def test_rollouts_make_a_valid_batch_with_replay(policy):
    """The sampler's output is a RolloutBatch the trainer accepts, routes included (R3)."""
    torch.manual_seed(2)
    sampler = _sampler(policy)
    rollouts = sampler.generate(PROMPTS, 6)
    batch = dataclasses.replace(_batch(rollouts),
                                routed_experts=torch.cat([r.routed_experts for r in rollouts]))
    policy.validate(batch)
