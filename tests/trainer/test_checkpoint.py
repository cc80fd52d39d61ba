"""Checkpoints: exact resume, atomic layout, and one-line errors for corrupt or mismatched ones."""

from pathlib import Path

import pytest
import torch

from longctx_moe.checkpoint import CheckpointError, find_resume_dir, load_rank_state
from longctx_moe.config import load_config
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.train import RunContext, maybe_resume, save
from longctx_moe.trainer import Trainer, iterate_steps
from tests.trainer.toy import ToyMoE, ToyStepLoader

STEPS, SPLIT = 6, 3


def make(tmp: Path, dtype: str, resume: str = "auto", experts: int = 4):
    cfg = load_config(None, [f"train.param_dtype={dtype}", "train.autocast_dtype=none", f"train.steps={STEPS}",
                             "optim.warmup_steps=2", "optim.lr=1e-2", "model.expert_bias=true",
                             f"checkpoint.resume={resume}", "checkpoint.keep_last=1"])
    torch.manual_seed(0)
    model = ToyMoE(experts=experts).to({"fp32": torch.float32, "fp64": torch.float64}[dtype])
    ctx = RunContext(0, 1, 1, torch.device("cpu"), tmp, tmp / "ckpt")
    return Trainer(cfg, parallelize(model)), ToyStepLoader(), ctx


def train(trainer, loader, until):
    for batches in iterate_steps(loader, trainer.step, until):
        trainer.train_step(batches)


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_resume_continues_bitwise(tmp_path, dtype):
    ref, ref_loader, _ = make(tmp_path / "ref", dtype)
    train(ref, ref_loader, STEPS)

    first, loader, ctx = make(tmp_path / "run", dtype)
    train(first, loader, SPLIT)
    torch.manual_seed(123)  # RNG state is part of the checkpoint: it must be restored
    step_dir = save(first, loader, ctx)
    assert step_dir.name == "step_00000003" and (ctx.ckpt_dir / "latest").read_text().strip() == step_dir.name
    assert not list(ctx.ckpt_dir.glob(".*tmp"))  # published atomically, nothing half-written left
    rng_at_save = torch.get_rng_state()
    torch.manual_seed(999)

    second, loader2, ctx2 = make(tmp_path / "run", dtype)
    assert maybe_resume(second, loader2, ctx2) == step_dir
    assert second.step == SPLIT and loader2.position == SPLIT and torch.equal(torch.get_rng_state(), rng_at_save)
    train(second, loader2, STEPS)
    for (name, a), b in zip(ref.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # bitwise: same ops in the same order
    sa, sb = ref.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    assert second.model.expert_bias_E.abs().sum() > 0  # the buffer moved and was carried over


def test_keep_last_prunes_and_resume_none_starts_fresh(tmp_path):
    trainer, loader, ctx = make(tmp_path, "fp32")
    for until in (1, 2):
        train(trainer, loader, until)
        save(trainer, loader, ctx)
    assert sorted(p.name for p in ctx.ckpt_dir.glob("step_*")) == ["step_00000002"]
    assert find_resume_dir(ctx.ckpt_dir, "none") is None
    fresh, loader2, ctx2 = make(tmp_path, "fp32", resume="none")
    assert maybe_resume(fresh, loader2, ctx2) is None and fresh.step == 0


def test_corrupt_and_mismatched_checkpoints_give_one_line_errors(tmp_path):
    trainer, loader, ctx = make(tmp_path, "fp32")
    train(trainer, loader, 1)
    step_dir = save(trainer, loader, ctx)

    other, loader2, ctx2 = make(tmp_path, "fp32", experts=6)  # a different model shape
    with pytest.raises(CheckpointError, match="router_DE.*shape") as e:
        maybe_resume(other, loader2, ctx2)
    assert "\n" not in str(e.value)

    with pytest.raises(CheckpointError, match="written by 1 ranks but this run has 2"):
        load_rank_state(step_dir, 0, 2)
    with pytest.raises(CheckpointError, match="model.num_experts=8 but the config has 16"):
        load_rank_state(step_dir, 0, 1, {"model": {"num_experts": 16}})

    part = step_dir / "rank_00000.pt"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # truncated write
    with pytest.raises(CheckpointError, match="corrupt") as e:
        maybe_resume(*make(tmp_path, "fp32"))
    assert "\n" not in str(e.value)

    (ctx.ckpt_dir / "latest").write_text("step_00000099\n")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        maybe_resume(*make(tmp_path, "fp32"))
