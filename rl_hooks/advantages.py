"""Group-normalised advantages from per-sequence rewards, and their broadcast to tokens.

Sequences sampled from the same prompt share a group id (any int64, not necessarily contiguous or
sorted). Every estimator compares a reward with the rest of its group:
  * "grpo":   (r - mean_g) / (std_g + eps), std unbiased (torch.std's default, as DeepSeekMath and
              verl). A group of one sequence gets advantage 0: there is nothing to compare with
              (verl instead passes such a reward through unnormalised).
  * "drgrpo": r - mean_g (Dr.GRPO, arXiv:2503.20783: no division by the std, which over-weights
              groups whose rewards barely differ).
  * "rloo":   r_i - mean of the other members = n / (n - 1) * (r_i - mean_g); 0 for a group of one.
  * "grpo_verl": "grpo" as verl computes it (verl/trainer/ppo/core_algos.py
              compute_grpo_outcome_advantage): the same for groups of two or more, but a group of
              one gets mean 0 and std 1, so its advantage is r / (1 + eps), the raw reward. Use it
              where a run must match verl's numbers (e.g. batches from rl_hooks.adapters.verl);
              "grpo" gives 0 there because a lone sample says nothing about its prompt's baseline.

Shapes: S sequences, G groups, T tokens.
"""

from __future__ import annotations

import torch

from rl_hooks.batch import RolloutBatch

ESTIMATORS = ("grpo", "drgrpo", "rloo", "grpo_verl")


def compute_advantages(rewards_S: torch.Tensor, group_ids_S: torch.Tensor,
                       estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages: float [S] in the dtype of rewards_S (float32 or float64).

    rewards_S: float [S]; group_ids_S: integer [S], same id = same prompt. Group statistics are
    computed in float64 whatever the input dtype, so small groups of large rewards lose nothing.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; use one of {ESTIMATORS}")
    if not rewards_S.is_floating_point() or group_ids_S.is_floating_point():
        raise ValueError(f"rewards are {rewards_S.dtype} and group_ids {group_ids_S.dtype}; "
                         "pass float rewards and integer group ids")
    if rewards_S.ndim != 1 or group_ids_S.shape != rewards_S.shape:
        raise ValueError(f"rewards {tuple(rewards_S.shape)} and group_ids "
                         f"{tuple(group_ids_S.shape)} must be flat and of one length S")
    r_S = rewards_S.double()
    _, group_S = torch.unique(group_ids_S, return_inverse=True)
    num_groups = int(group_S.max()) + 1 if group_S.numel() else 0
    n_G = torch.bincount(group_S, minlength=num_groups).double()
    sum_G = torch.zeros(num_groups, dtype=torch.float64, device=r_S.device)
    mean_S = (sum_G.index_add(0, group_S, r_S) / n_G)[group_S]
    dev_S = r_S - mean_S
    n_S = n_G[group_S]
    single_S = n_S == 1
    if estimator == "drgrpo":
        adv_S = dev_S
    elif estimator == "rloo":
        adv_S = dev_S * n_S / (n_S - 1)
    else:
        # Two-pass variance (mean first): no cancellation when rewards are large and close.
        var_G = sum_G.index_add(0, group_S, dev_S.square()) / (n_G - 1)
        adv_S = dev_S / (var_G.sqrt()[group_S] + eps)
    # A group of one has nothing to compare with; the 0/0 above becomes 0 here (verl: r / (1 + eps)).
    lone_S = r_S / (1 + eps) if estimator == "grpo_verl" else torch.zeros_like(adv_S)
    return torch.where(single_S, lone_S, adv_S).to(rewards_S.dtype)


def token_advantages(batch: RolloutBatch, adv_S: torch.Tensor) -> torch.Tensor:
    """Per-token advantages: float [T] in adv_S's dtype; each loss token gets its sequence's
    advantage, every other token 0. adv_S: float [S], e.g. from compute_advantages."""
    if adv_S.shape != (batch.num_seqs,):
        raise ValueError(f"advantages have shape {tuple(adv_S.shape)}, the batch has "
                         f"{batch.num_seqs} sequences; give one advantage per sequence")
    adv_T = adv_S[batch.seq_of_token()]
    return torch.where(batch.loss_mask, adv_T, torch.zeros_like(adv_T))
