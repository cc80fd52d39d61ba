"""rl_hooks: the API that RL frameworks call to compute log-probs and update the policy.

    batch.py        RolloutBatch: the jagged rollout contract and its validation
    advantages.py   group-normalised advantages (GRPO, Dr.GRPO, RLOO) from per-sequence rewards
    losses.py       PPO / GSPO / CISPO / policy-gradient losses, aggregations, KL, corrections
    microbatch.py   a RolloutBatch split into balanced micro-batches per data-parallel rank
    api.py          PolicyTrainer: compute_logprobs, train_step, weight export, save / load, info
    export.py       weights as Hugging Face tensors of the model's family in byte-capped buckets (TP / EP gathered)
    sampler.py      HFSampler: transformers' Qwen3-MoE as a rollout engine fed by push_weights
    demo.py         the GRPO demo (`longctx-moe rl --config configs/grpo_tiny.yaml`)
    ray_group.py    RayPolicyGroup: the trainer's ranks as Ray actors behind one driver handle
    adapters/       verl DataProto, NeMo-RL BatchedDataDict and TRL rollout_func layouts <-> RolloutBatch
    plugins/        inside a framework: verl's training engine, NeMo-RL's policy worker
"""

from rl_hooks.batch import RolloutBatch, RolloutBatchError
from rl_hooks.losses import LossInputs, LossOutput, Normalizers, PolicyLossConfig, make_loss

__all__ = ["LossInputs", "LossOutput", "Normalizers", "PolicyLossConfig", "PolicyTrainer",
           "RayPolicyGroup", "RolloutBatch", "RolloutBatchError", "make_loss"]


def __getattr__(name: str):
    # PolicyTrainer pulls in the whole trainer; importing the batch contract or the losses alone
    # (e.g. in a rollout worker) should not.
    if name == "PolicyTrainer":
        from rl_hooks.api import PolicyTrainer

        return PolicyTrainer
    if name == "RayPolicyGroup":
        # Ray itself is imported only when a group is built (the optional `rl` extra).
        from rl_hooks.ray_group import RayPolicyGroup

        return RayPolicyGroup
    raise AttributeError(f"module 'rl_hooks' has no attribute {name!r}")
