"""longctx-moe inside NeMo-RL: a policy worker (`LongctxMoePolicyWorker`, selected by NeMo-RL's
`Policy(worker_extension_cls_fqn="rl_hooks.plugins.nemo_rl.LongctxMoePolicyWorker")`) and its
ClippedPG loss settings mapped to ours (`loss_config_from_nemo_rl`)."""

from rl_hooks.plugins.nemo_rl.loss import loss_config_from_nemo_rl
from rl_hooks.plugins.nemo_rl.worker import LongctxMoePolicyWorker

__all__ = ["LongctxMoePolicyWorker", "loss_config_from_nemo_rl"]
