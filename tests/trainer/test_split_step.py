"""Trainer.backward / update, the split form of train_step (a framework's forward_backward calls,
then one optimizer step): one backward + update is train_step bitwise; two backward calls add
their reduced gradients before the update; the order of calls is enforced."""

import pytest
import torch

from longctx_moe.build import model_of
from longctx_moe.config import load_config
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import Trainer
from tests.model.helpers import packed_batch, tiny_config


def _trainer() -> Trainer:
    cfg = load_config(None, ["optim.warmup_steps=0", "optim.lr=1e-2", "train.param_dtype=fp64",
                             "train.autocast_dtype=none"])
    cfg.model = tiny_config(expert_bias=True)
    torch.manual_seed(0)
    return Trainer(cfg, parallelize(model_of(cfg).double(), None, cfg.parallel))


def _batches(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [packed_batch(lens, 64, generator=gen) for lens in ([7, 12], [5, 9, 3])]


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_one_backward_and_update_is_train_step():
    whole, split = _trainer(), _trainer()
    res = whole.train_step(_batches(0))
    part = split.backward(_batches(0))
    grad_norm, skipped, _ = split.update(res.lr)
    assert (part.loss, grad_norm, skipped) == (res.loss, res.grad_norm, res.skipped)
    for name, p in _params(whole).items():
        assert torch.equal(p, _params(split)[name]), name


def test_two_backward_calls_add_their_gradients():
    trainer, ref = _trainer(), _trainer()
    trainer.backward(_batches(0))
    trainer.backward(_batches(1))
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    # The reference: each call's loss (normalised by its own target tokens) backpropagated into
    # the same .grad without the trainer's stash.
    for seed in (0, 1):
        ref.backward(_batches(seed))
        ref._pending = None  # the next call then sees nothing to stash: plain accumulation
        for n, p in ref.model.named_parameters():
            if p.grad is not None:
                grads.setdefault(f"ref:{seed}:{n}", p.grad.clone())
        ref.optimizer.zero_grad(set_to_none=True)
    for n, g in ((n, g) for n, g in grads.items() if not n.startswith("ref:")):
        want = grads[f"ref:0:{n}"] + grads[f"ref:1:{n}"]
        assert torch.allclose(g, want, rtol=0, atol=1e-12), n
    grad_norm, skipped, _ = trainer.update()
    assert grad_norm > 0 and not skipped and trainer.step == 1


def test_call_order_is_enforced():
    trainer = _trainer()
    with pytest.raises(RuntimeError, match="without a backward"):
        trainer.update()
    trainer.backward(_batches(0))
    with pytest.raises(RuntimeError, match="call update\\(\\) or discard_gradients\\(\\) first"):
        trainer.train_step(_batches(1))
    trainer.discard_gradients()
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.train_step(_batches(1))
