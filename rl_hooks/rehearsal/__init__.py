"""An RL policy's step rehearsed on one rank of a large job (`longctx-moe rehearse --rl`): the
policy side's counterpart of longctx_moe.rehearsal, which may not import this package; the
rehearse command finds it through the `longctx_moe.rehearsals` entry point.

    policy_step.py  compute_logprobs, a GRPO update and the weight export of one rank, measured
"""
