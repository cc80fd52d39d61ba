"""Learning-rate schedule (warmup + cosine/linear/constant) and the optimizer's parameter groups."""

import math

import pytest
import torch

from longctx_moe.config import OptimConfig
from longctx_moe.optim import LRSchedule, build_optimizer, lr_at
from tests.trainer.toy import ToyMoE


def test_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule="cosine")
    lrs = [lr_at(s, cfg, 14) for s in range(14)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    mid = 4 + (13 - 4) / 2  # cosine is at its midpoint halfway through the decay
    assert lr_at(int(mid), cfg, 14) > 0.55 > lr_at(int(mid) + 1, cfg, 14)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 9))
    assert lrs[7] == pytest.approx(expected)


def test_linear_constant_and_no_warmup():
    lin = OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert [lr_at(s, lin, 5) for s in range(5)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    const = OptimConfig(lr=2.0, warmup_steps=2, schedule="constant")
    assert [lr_at(s, const, 5) for s in range(5)] == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0])


def test_schedule_sets_param_groups_and_resumes():
    model = ToyMoE()
    cfg = OptimConfig(lr=1.0, warmup_steps=2, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert id(model.router_DE) in decayed and id(model.norm) not in decayed  # matrices only
    assert opt.param_groups[1]["weight_decay"] == 0.0
    sched = LRSchedule(opt, cfg, 10)
    assert sched.apply() == 0.5 and all(g["lr"] == 0.5 for g in opt.param_groups)
    sched.advance()
    other = LRSchedule(opt, cfg, 10)
    other.load_state_dict(sched.state_dict())
    assert other.apply() == 1.0


def test_optimizer_is_fused_where_available():
    opt = build_optimizer(ToyMoE(), OptimConfig())
    assert opt.defaults.get("fused") is True  # fused AdamW runs on CPU since torch 2.4
    opt64 = build_optimizer(ToyMoE().to(torch.float64), OptimConfig(impl="foreach"))
    assert opt64.defaults.get("foreach") is True
