"""rl_hooks: the API that RL frameworks call to compute logprobs, update the policy, export weights."""
