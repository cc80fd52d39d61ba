"""PolicyTrainer.offload() / onload() on one process (rl_hooks/offload.py).

On this CPU the device is the host, so a plain run moves nothing (and says so). The tests switch
the residency to `moves=True`: every storage of the trainer is then copied to a host buffer and
freed in place (resized to 0 bytes), and brought back, by the code a GPU runs. What this proves:
the walk finds every storage an update reads (a missed one would still hold its bytes, a freed one
that is not brought back fails the update), the bytes come back exactly, and the tensors keep
their identity (optimizer keys, slab views). What it cannot prove: pinned memory and the ordering
of asynchronous CUDA copies (bench/gpu_check.sh, when a GPU is lent).
"""

from __future__ import annotations

import pytest
import torch

from rl_hooks import PolicyLossConfig, PolicyTrainer, make_loss
from rl_hooks.offload import PARTS
from tests.rl_hooks.helpers import config, rollout_batch

PRECISIONS = {"fp32": ["train.param_dtype=fp32", "train.autocast_dtype=none"],
              "bf16": ["train.param_dtype=fp32", "train.autocast_dtype=bf16"]}


def _policy(precision: str, moves: bool = True) -> PolicyTrainer:
    policy = PolicyTrainer(config(*PRECISIONS[precision], "optim.weight_decay=0.1"))
    policy.export_gate.residency.moves = moves
    return policy


def _loss():
    return make_loss(PolicyLossConfig(kind="ppo"))


def _state(policy) -> list[torch.Tensor]:
    """Parameters, then every optimizer state tensor, in a fixed order."""
    opt = policy.trainer.optimizer
    opt = getattr(opt, "optimizer", opt)
    out = [p.detach().clone() for p in policy.runtime.model.parameters()]
    for group in opt.param_groups:
        for p in group["params"]:
            out += [v.clone() for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]
    return out


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_an_update_after_the_round_trip_is_bitwise_the_update_without_it(precision):
    batch = rollout_batch(0)
    plain, moved = _policy(precision), _policy(precision)
    assert _bitwise(_state(plain), _state(moved))  # the same start (the config's seed)
    for policy in (plain, moved):
        policy.train_step(batch, _loss())  # the optimizer's state exists from here
    before = moved.export_gate.residency.device_bytes()
    sent = moved.offload()
    # every storage the trainer holds is freed, and each of its bytes went to the host
    assert moved.export_gate.residency.device_bytes() == 0
    assert sum(sent.values()) == before and sent["params"] > 0 and sent["optimizer"] > 0
    assert moved.offloaded == PARTS
    back = moved.onload()
    assert back == sent and moved.offloaded == ()
    for policy in (plain, moved):
        policy.train_step(rollout_batch(1), _loss())
    assert _bitwise(_state(plain), _state(moved))


def test_gradients_pending_between_backward_and_step_come_back_exactly():
    batch = rollout_batch(2)
    plain, moved = _policy("fp32"), _policy("fp32")
    for policy in (plain, moved):
        policy.forward_backward(batch, _loss())
    sent = moved.offload()
    assert sent["grads"] > 0 and moved.export_gate.residency.device_bytes() == 0
    moved.onload()
    for policy in (plain, moved):
        policy.optimizer_step()
    assert _bitwise(_state(plain), _state(moved))


def test_parts_move_alone_and_what_is_away_refuses_the_calls_that_need_it():
    policy = _policy("fp32")
    batch = rollout_batch(3)
    with pytest.raises(RuntimeError, match=r"onload\(\) without offload\(\)"):
        policy.onload()
    policy.train_step(batch, _loss())
    policy.offload(params=False, grads=False)
    assert policy.offloaded == ("optimizer",)
    policy.compute_logprobs(batch)  # scoring reads the parameters only
    with pytest.raises(RuntimeError, match="an update while the trainer's optimizer are offloaded"):
        policy.train_step(batch, _loss())
    policy.offload()  # the parameters too; the optimizer stays away
    with pytest.raises(RuntimeError, match="reads the parameters while"):
        policy.compute_logprobs(batch)
    with pytest.raises(RuntimeError, match="reads the parameters while"):
        list(policy.export_weights())
    policy.onload(params=True, grads=False, optimizer=False)
    assert set(policy.offloaded) == {"grads", "optimizer"}
    policy.onload()
    policy.train_step(batch, _loss())
    with pytest.raises(RuntimeError, match=r"onload\(\) without offload\(\)"):
        policy.onload()


def test_on_the_host_the_calls_move_nothing_and_say_so_once(capsys):
    policy = _policy("fp32", moves=False)
    policy.train_step(rollout_batch(0), _loss())
    before = _state(policy)
    assert policy.offload() == {p: 0 for p in PARTS}
    assert policy.export_gate.residency.device_bytes() > 0  # still where it was: the host
    with pytest.raises(RuntimeError, match="an update while"):
        policy.train_step(rollout_batch(0), _loss())
    policy.onload()
    policy.offload()
    policy.onload()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("offload:")]
    assert said == ["offload: the trainer runs on the host (cpu); offload() and onload() move nothing"]
    assert _bitwise(before, _state(policy))


def test_nemo_rl_workers_colocated_loop_trains_as_a_resident_one(tmp_path):
    """NeMo-RL's GRPO loop around a colocated generation: the optimizer leaves before the refit,
    everything after it; scoring brings the parameters back, training the rest."""
    from rl_hooks.plugins.nemo_rl import LongctxMoePolicyWorker
    from tests.rl_hooks.test_nemo_rl_worker import (
        LOSS,
        nemo_batch,
        policy_config,
        with_logprob_fields,
    )
    from tests.rl_hooks.verl_cases import save_hf_model

    cfg = policy_config(save_hf_model(tmp_path, "float64"))
    resident, colocated = LongctxMoePolicyWorker(cfg), LongctxMoePolicyWorker(cfg)
    colocated.policy.export_gate.residency.moves = True
    out = {}
    for name, worker in (("resident", resident), ("colocated", colocated)):
        for seed in (0, 1):
            worker.prepare_for_lp_inference()
            data = nemo_batch(seed)
            logp = worker.get_logprobs(data)["logprobs"]
            worker.prepare_for_training()
            worker.train(with_logprob_fields(data, logp), dict(LOSS))
            worker.offload_before_refit()
            if worker is colocated:
                assert worker.policy.offloaded == ("grads", "optimizer")
            weights = {n: t.clone() for bucket in worker.stream_weights() for n, t in bucket}
            worker.offload_after_refit()
            if worker is colocated:
                assert worker.policy.export_gate.residency.device_bytes() == 0
                with pytest.raises(RuntimeError, match="reads the parameters while"):
                    worker.get_logprobs(data)
        out[name] = (logp, weights)
    assert torch.equal(out["resident"][0], out["colocated"][0])
    assert _bitwise(list(out["resident"][1].values()), list(out["colocated"][1].values()))
