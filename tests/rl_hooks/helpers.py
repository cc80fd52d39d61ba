"""Shared pieces of the PolicyTrainer tests: a tiny float64 config, rollout batches with the edge
cases users hit, and parameter updates that reveal gradients.

Gradients are read through one optimizer step: with AdamW's eps far above every gradient entry
and weight decay 0, the first update is -lr * g / (|g| + eps), an exact, monotone function of g
entrywise. With lr = eps it is g / (1 + |g| / eps): equal updates mean equal gradients, and a
difference of d in a gradient shows as a difference of about d in the update.
"""

from __future__ import annotations

import torch

from longctx_moe.config import load_config
from rl_hooks import RolloutBatch

VOCAB, LAYERS, TOP_K, EXPERTS = 50, 2, 2, 4  # the sizes tests/rl_hooks/test_batch.py fuzzes
EPS = 1e6

SETS = ["train.param_dtype=fp64", "train.autocast_dtype=none", "train.num_threads=1",
        "train.host_allocator=default", f"model.vocab_size={VOCAB}", "model.hidden_size=32",
        f"model.num_layers={LAYERS}", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=8", f"model.num_experts={EXPERTS}", f"model.top_k={TOP_K}",
        "model.expert_hidden_size=16", "model.shared_expert_hidden_size=8",
        "execution.loss_chunk_tokens=5", "balance.aux_loss_type=seq",
        # The router's balance losses are statistics of each micro-batch (Switch / DeepSeek
        # define them so): they are the one part of the objective that depends on the split,
        # so the split-invariance tests switch them off (aux_loss_scope=global_batch is the
        # split-free alternative).
        "balance.aux_loss_coeff=0", "balance.z_loss_coeff=0",
        f"optim.eps={EPS}", "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0",
        "optim.schedule=constant"]


def config(*extra: str):
    return load_config(None, SETS + list(extra))


def rollout_batch(seed: int = 0, rewards: bool = False) -> RolloutBatch:
    """Nine sequences: 1-token responses, an empty response, prompts longer than their
    responses and the reverse, lengths that no 2*CP multiple divides; old / ref / rollout
    log-probs near the policy's (about log(1/VOCAB)) so ratios stay in the clip range."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 1), (1, 7), (9, 3), (2, 1), (4, 0), (3, 6), (1, 1), (11, 2), (6, 5)]
    prompts = [torch.randint(0, VOCAB, (p,), generator=gen).tolist() for p, _ in shapes]
    responses = [torch.randint(0, VOCAB, (r,), generator=gen).tolist() for _, r in shapes]

    def per_token(scale):
        return [(torch.randn(r, generator=gen, dtype=torch.float64) * scale - 3.9).tolist()
                for _, r in shapes]

    fields = {"rollout_logprobs": per_token(0.05), "ref_logprobs": per_token(0.05)}
    if rewards:
        fields["rewards"] = torch.rand(len(shapes), generator=gen).tolist()
        fields["group_ids"] = [i // 3 for i in range(len(shapes))]
    else:
        fields["advantages"] = [(torch.randn(r, generator=gen)).tolist() for _, r in shapes]
    batch = RolloutBatch.from_sequences(prompts, responses, **fields)
    for name in ("rollout_logprobs", "ref_logprobs", "advantages"):
        value = getattr(batch, name)
        if value is not None:
            setattr(batch, name, value.double())
    return batch


def params(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.runtime.model.named_parameters()}


def updates(policy, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's first AdamW update (see the module docstring)."""
    return {n: before[n] - p.detach() for n, p in policy.runtime.model.named_parameters()}
