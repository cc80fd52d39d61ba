"""Adapters between RL frameworks' batch layouts and RolloutBatch (and results back).

    verl.py      DataProto.batch: left-padded prompts + right-padded responses, [B, R] log-probs
    nemo_rl.py   BatchedDataDict: right-padded [B, S] sequences, [B, S] log-probs (0 at position 0)
    trl.py       GRPOTrainer rollout_func output: per-completion token lists

Each `from_<framework>` strips the framework's padding exactly and keeps every per-token value on
its own token (the three frameworks' padded layouts align log-probs as we do: the value of a token
is its log-prob given the tokens before it); each `logprobs_to_<framework>` puts compute_logprobs'
output back in the framework's padded layout, zeros at padding. verl's no-padding TensorDict is
read too, and its engines' nested per-token outputs are shifted by one (`logprobs_to_verl_nested`).
Malformed input raises AdapterError, one line naming the framework's field. None of the frameworks
is imported (the verl engine, which imports verl, is rl_hooks/plugins/verl).
"""

from rl_hooks.adapters._common import AdapterError
from rl_hooks.adapters.nemo_rl import (
                                       entropy_to_nemo_rl,
                                       from_nemo_rl,
                                       logprobs_to_nemo_rl,
                                       routes_to_nemo_rl,
)
from rl_hooks.adapters.trl import entropy_to_trl, from_trl, logprobs_to_trl
from rl_hooks.adapters.verl import (
    entropy_to_verl,
    entropy_to_verl_nested,
    from_verl,
    logprobs_to_verl,
    logprobs_to_verl_nested,
    loss_config_from_verl,
    metrics_to_verl,
    routes_to_verl,
)

__all__ = ["AdapterError", "entropy_to_nemo_rl", "entropy_to_trl", "entropy_to_verl",
           "from_nemo_rl", "from_trl", "from_verl", "logprobs_to_nemo_rl", "logprobs_to_trl",
           "logprobs_to_verl", "routes_to_nemo_rl", "routes_to_verl", "entropy_to_verl_nested",
           "logprobs_to_verl_nested", "loss_config_from_verl", "metrics_to_verl"]
