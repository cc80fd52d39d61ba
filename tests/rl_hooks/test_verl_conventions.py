"""verl's data and metrics conventions where our API meets verl, checked with verl's own code
(verl 0.9.1 from the registry): its no-padding TensorDict and shifted nested log-probs, its
metric reduction, its GRPO advantage, routes and rollout IS weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_hooks.adapters import AdapterError, from_verl, logprobs_to_verl
from rl_hooks.adapters.verl import (
    logprobs_to_verl_nested,
    metrics_to_verl,
    nested_to_ours,
    ours_to_nested,
)
from rl_hooks.advantages import compute_advantages
from rl_hooks.api import LogProbs
from tests.rl_hooks import verl_cases as vc

pytest.importorskip("verl")


def _both():
    """(verl's padded fields, the same batch after verl's left_right_2_no_padding)."""
    from tensordict import TensorDict

    nested = vc.padded_batch()
    mask = nested["attention_mask"]
    padded = {k: nested[k] for k in ("attention_mask", "responses", "response_mask", "old_log_probs",
                                     "advantages", "prompts")}
    padded["input_ids"] = torch.cat([nested["prompts"], nested["responses"]], 1)
    padded["position_ids"] = torch.clip(mask.cumsum(1) - 1, min=0)
    return TensorDict(padded, batch_size=mask.shape[0]), nested


def test_from_verl_reads_the_no_padding_tensordict_verl_engines_get():
    padded, nested = _both()
    want, got = from_verl(padded), from_verl(nested)
    for name in ("tokens", "cu_seqlens", "loss_mask", "old_logprobs", "advantages"):
        assert torch.equal(getattr(got, name), getattr(want, name).to(getattr(got, name).dtype)), name


def test_nested_logprobs_are_shifted_as_verl_reads_them():
    """verl's no_padding_2_padding reads a response token's value from the position before it;
    our values put back through logprobs_to_verl_nested must land on the same tokens as the
    padded adapter puts them."""
    from verl.workers.utils.padding import no_padding_2_padding

    padded, nested = _both()
    batch = from_verl(nested)
    first = batch.cu_seqlens[:-1].long()
    values = torch.randn(batch.num_tokens, dtype=torch.float64).index_fill(0, first, 0)
    out = LogProbs(values, None, None)
    got = no_padding_2_padding(logprobs_to_verl_nested(out, nested), nested)
    want = logprobs_to_verl(out, padded)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(nested_to_ours(ours_to_nested(values, batch.cu_seqlens)), values)


def test_train_step_metrics_reduce_with_verls_reduce_metrics(policy_and_batch):
    from verl.utils.metric import reduce_metrics

    from rl_hooks import PolicyLossConfig, make_loss

    policy, batch = policy_and_batch
    metrics = policy.train_step(batch, make_loss(PolicyLossConfig(kind="ppo")), mini_batches=2)
    reduced = reduce_metrics(metrics_to_verl(metrics))
    assert all(k.startswith("actor/") for k in reduced)
    steps = metrics["steps"]
    assert reduced["actor/pg_loss"] == pytest.approx(np.mean([s["policy_loss"] for s in steps]))
    assert reduced["actor/grad_norm"] == pytest.approx(np.mean([s["grad_norm"] for s in steps]))
    assert reduced["actor/ratio_max"] == max(s["ratio_max"] for s in steps)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/lr"} <= set(reduced)


@pytest.fixture(scope="module")
def policy_and_batch():
    from rl_hooks.api import PolicyTrainer
    from tests.rl_hooks.helpers import config, rollout_batch

    return PolicyTrainer(config()), rollout_batch()


def test_routes_need_the_known_mask_and_unknown_ones_become_minus_one():
    padded, nested = _both()
    b, s = padded["input_ids"].shape
    routes = torch.randint(0, 4, (b, s, 2, 2))
    padded["routed_experts"] = routes
    with pytest.raises(AdapterError, match="^verl field 'routed_experts': .*routes_known") as err:
        from_verl(padded)
    assert "\n" not in str(err.value)
    known = padded["attention_mask"].bool().clone()
    known[0, padded["prompts"].shape[1] - 1] = False  # not reported by the rollout engine: verl wrote 0
    batch = from_verl(padded, routes_known=known)
    keep = padded["attention_mask"].bool()
    want = torch.where(known[..., None, None], routes, torch.full_like(routes, -1))[keep]
    assert torch.equal(batch.routed_experts.long(), want)
    assert int((batch.routed_experts == -1).all(-1).all(-1).sum()) == 1


def test_rollout_is_weights_are_refused_in_one_line():
    padded, nested = _both()
    for data in (padded, nested):
        data["rollout_is_weights"] = torch.ones_like(data["old_log_probs"])
        with pytest.raises(AdapterError, match="^verl field 'rollout_is_weights': .*tis_cap") as err:
            from_verl(data)
        assert "\n" not in str(err.value)


def test_nested_input_errors_name_the_field():
    _, nested = _both()
    del nested["prompts"]
    with pytest.raises(AdapterError, match="^verl field 'prompts': is missing"):
        from_verl(nested)
    with pytest.raises(AdapterError, match="^verl field 'log_probs': is a dense"):
        nested_to_ours(torch.zeros(3, 4))


def test_grpo_verl_gives_a_lone_sample_its_reward_as_verl_does():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25], dtype=torch.float64)
    groups = torch.tensor([7, 7, 7, 3, 9, 9])  # group 3 holds one sample
    want, _ = compute_grpo_outcome_advantage(rewards[:, None].clone(), torch.ones(6, 1),
                                             np.array(groups.tolist()))
    got = compute_advantages(rewards, groups, "grpo_verl")
    # verl's lone-sample divisor is torch.tensor(1.0) + eps in float32 (1 + 1e-6 rounded): 5e-8
    # relative; groups of two or more agree to float64 rounding.
    torch.testing.assert_close(got, want[:, 0], rtol=1e-7, atol=1e-12)
    assert got[3] == pytest.approx(2.0, rel=1e-5)
    assert compute_advantages(rewards, groups, "grpo")[3] == 0  # ours: nothing to compare with
