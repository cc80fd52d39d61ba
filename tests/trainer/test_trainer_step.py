"""One optimizer step: loss normalisation over micro-batches, NaN handling, expert-bias hook."""

import math

import pytest
import torch

from longctx_moe.config import load_config
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import CrossEntropy, NonFiniteLossError, Trainer
from tests.trainer.toy import ToyMoE, make_batch


def fp64_config(**extra):
    sets = ["train.param_dtype=fp64", "train.autocast_dtype=none", "optim.warmup_steps=0",
            "optim.schedule=constant", "optim.grad_clip=0"]
    return load_config(None, sets + [f"{k}={v}" for k, v in extra.items()])


def toy_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return ToyMoE().to(dtype)


def grads_after(trainer, batches):
    """Run forward/backward like train_step but keep the gradients (no optimizer update)."""
    targets = [mb.num_target_tokens() for mb in batches]
    g, _, _ = trainer.step_totals(batches, [None] * len(batches), targets)
    sums, _, _ = trainer._accumulate([(mb, None) for mb in batches], targets, g, CrossEntropy())
    return [p.grad.clone() for p in trainer.model.parameters()], sums


def test_accumulated_micro_batches_equal_one_big_batch_float64():
    gen = torch.Generator().manual_seed(1)
    docs = [[5, 1, 9], [2], [11, 7], [3, 3, 3, 4]]  # micro-batches of very different sizes
    micro = [make_batch(d, 64, gen) for d in docs]
    big_tokens = torch.cat([m.tokens for m in micro])
    gen_big = torch.Generator().manual_seed(1)
    big = make_batch([n for d in docs for n in d], 64, gen_big)
    assert torch.equal(big.tokens, big_tokens)  # the same documents, one packed row
    cfg = fp64_config()
    g_micro, s_micro = grads_after(Trainer(cfg, parallelize(toy_model())), micro)
    g_big, s_big = grads_after(Trainer(cfg, parallelize(toy_model())), [big])
    # float64, only summation order differs: agreement to ~1e-13 relative.
    assert torch.allclose(s_micro, s_big, rtol=1e-12, atol=1e-14)
    for a, b in zip(g_micro, g_big, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
    # A per-micro-batch mean (the mistake this normalisation avoids) gives a different loss.
    with torch.no_grad():
        naive = sum(float(toy_model()(m).ce_sum) / m.num_target_tokens() for m in micro if m.num_target_tokens()) / 4
    assert not math.isclose(naive, float(s_big[1]), rel_tol=1e-6)


def test_train_step_reports_normalised_losses_and_updates():
    gen = torch.Generator().manual_seed(2)
    batches = [make_batch([6, 4], 64, gen), make_batch([9], 64, gen)]
    cfg = fp64_config(**{"model.expert_bias": "true"})
    model = toy_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(cfg, parallelize(model))
    res = trainer.train_step(batches)
    with torch.no_grad():
        outs = [toy_model()(b) for b in batches]
    g = sum(b.num_target_tokens() for b in batches)
    assert res.num_targets == g == 5 + 3 + 8
    assert res.num_tokens == 19
    ce = sum(float(o.ce_sum) for o in outs) / g
    aux = sum(float(o.aux_loss + o.z_loss) * b.num_target_tokens() for o, b in zip(outs, batches, strict=True)) / g
    assert res.ce_loss == pytest.approx(ce, rel=1e-12)
    assert res.loss == pytest.approx(ce + aux, rel=1e-12)
    assert not res.skipped and trainer.step == 1 and model.bias_updates == 1
    assert res.expert_counts.sum() == 19
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss_is_detected_with_its_step(policy):
    gen = torch.Generator().manual_seed(3)
    batches = [make_batch([5, 5], 64, gen)]
    model = toy_model()
    trainer = Trainer(fp64_config(**{"train.nan_policy": policy}), parallelize(model))
    trainer.train_step(batches)  # step 1 is fine
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    if policy == "stop":
        with pytest.raises(NonFiniteLossError, match="at step 2"):
            trainer.train_step(batches)
        return
    res = trainer.train_step(batches)
    assert res.skipped and math.isnan(res.loss) and trainer.step == 2
    for a, b in zip(before, model.parameters(), strict=True):  # no update, no NaN spread by AdamW
        assert torch.equal(a, b) or (torch.isnan(a) == torch.isnan(b)).all()
    assert all(p.grad is None for p in model.parameters())


def test_all_padding_step_is_an_error():
    gen = torch.Generator().manual_seed(4)
    batch = make_batch([1, 1], 64, gen)  # documents of length 1 have no targets
    with pytest.raises(ValueError, match="no target tokens"):
        Trainer(fp64_config(), parallelize(toy_model())).train_step([batch])
