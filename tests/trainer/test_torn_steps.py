"""Torn steps: a step directory whose meta.json survives but whose rank files do not (a kill
during pruning, a file deleted or cut short) is never resumed from, named in the notice that
skips it, and never named as the older step to resume from."""

import shutil
from pathlib import Path

import pytest

import longctx_moe.checkpoint.steps as checkpoint_steps
from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.resume import maybe_resume
from longctx_moe.checkpoint.steps import find_resume_dir
from longctx_moe.checkpoint.trainer_state import save
from tests.trainer.test_checkpoint import (
    DAMAGES,
    flip_16_tensor_bytes,
    make,
    names,
    saved_steps,
    train,
)

RANK0 = "rank_00000.safetensors"


class Killed(BaseException):
    """Stands for SIGKILL inside rmtree: nothing after it runs (not an Exception, so no handler)."""


REAL_RMTREE = shutil.rmtree


def _rmtree_killed_in_step_dirs(path, ignore_errors=False):
    # In a step directory: deletes the rank file before meta.json (scandir's order is
    # arbitrary), then dies. Elsewhere (the save's temporary directory): the real rmtree.
    if not Path(path).name.startswith("step_"):
        return REAL_RMTREE(path, ignore_errors=ignore_errors)
    (Path(path) / RANK0).unlink(missing_ok=True)
    raise Killed


def test_kill_inside_pruning_never_leaves_a_candidate_step(tmp_path, monkeypatch, capsys):
    trainer, loader, ctx = saved_steps(tmp_path, [1, 2], keep_last=2)
    train(trainer, loader, 3)
    monkeypatch.setattr(shutil, "rmtree", _rmtree_killed_in_step_dirs)
    with pytest.raises(Killed):
        save(trainer, loader, ctx)  # step 3 is published, then pruning step 1 dies
    monkeypatch.undo()
    assert names(ctx.ckpt_dir) == ["step_00000001", "step_00000002", "step_00000003"]
    # Steps 2 and 3 go too (a disk cleaned by hand): step 1 is no candidate, torn or half-pruned.
    (ctx.ckpt_dir / "latest").unlink()
    shutil.rmtree(ctx.ckpt_dir / "step_00000003")
    flip_16_tensor_bytes(ctx.ckpt_dir / "step_00000002" / RANK0)
    with pytest.raises(CheckpointError, match="no older step exists there") as e:
        maybe_resume(*make(tmp_path, keep_last=2))
    assert "step_00000001" not in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_torn_latest_step_is_named_and_skipped_with_a_notice(tmp_path, capsys, damage):
    _, _, ctx = saved_steps(tmp_path, [1, 2, 3])
    part = ctx.ckpt_dir / "step_00000003" / RANK0
    DAMAGES[damage][0](part)
    capsys.readouterr()
    trainer, loader, ctx2 = make(tmp_path)
    assert maybe_resume(trainer, loader, ctx2) == ctx.ckpt_dir / "step_00000002" and trainer.step == 2
    notice, moved = capsys.readouterr().out.strip().splitlines()  # the fallback, then the set-aside
    assert notice.startswith("notice: ") and "moved step_00000003 to" in moved
    assert f"names 'step_00000003', which is torn: its '{RANK0}'" in notice
    assert notice.endswith(f"resuming from the newest complete step {ctx.ckpt_dir / 'step_00000002'}")


def test_fallback_names_every_torn_step_it_skips(tmp_path, capsys):
    _, _, ctx = saved_steps(tmp_path, [1, 2, 3])
    (ctx.ckpt_dir / "latest").unlink()
    (ctx.ckpt_dir / "step_00000003" / RANK0).unlink()
    capsys.readouterr()
    assert find_resume_dir(ctx.ckpt_dir, "auto") == ctx.ckpt_dir / "step_00000002"
    notice = capsys.readouterr().out.strip()
    assert f"skipping {ctx.ckpt_dir / 'step_00000003'} is torn: its '{RANK0}' is missing" in notice


def test_pruning_removes_meta_json_before_any_rank_file(tmp_path, monkeypatch):
    trainer, loader, ctx = saved_steps(tmp_path, [1], keep_last=1)
    seen = []

    def rmtree(path, ignore_errors=False):
        if Path(path).name.startswith("step_"):
            seen.append(sorted(p.name for p in Path(path).iterdir()))
        REAL_RMTREE(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    train(trainer, loader, 2)
    save(trainer, loader, ctx)
    assert seen == [[RANK0]]  # step 1's directory held no meta.json when its files were deleted
    assert names(ctx.ckpt_dir) == ["step_00000002"]


def test_pruning_sweeps_torn_steps_below_the_new_one(tmp_path):
    trainer, loader, ctx = saved_steps(tmp_path, [1, 2], keep_last=3)
    (ctx.ckpt_dir / "step_00000001" / RANK0).unlink()
    assert [n for n, _ in checkpoint_steps.complete_steps(ctx.ckpt_dir)] == [2]
    train(trainer, loader, 3)
    save(trainer, loader, ctx)
    assert names(ctx.ckpt_dir) == ["step_00000002", "step_00000003"]
