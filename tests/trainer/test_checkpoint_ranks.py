"""Checkpoint outcomes agreed across ranks (gloo): one rank's damaged file or failed write stops
every rank with the same one-line error, printed once, instead of a hang in the next collective."""

import contextlib
import errno
import io
import json

import pytest
import torch.distributed as dist

import longctx_moe.checkpoint.save as checkpoint_save
from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.resume import maybe_resume
from longctx_moe.checkpoint.trainer_state import save
from longctx_moe.process import RunContext
from longctx_moe.train import report_user_error
from tests.launcher import run_distributed
from tests.trainer.test_checkpoint import make, train


def _rank_context(tmp, rank, world_size):
    # Each rank trains its own toy model (no gradient sync needed here); the checkpoint
    # collectives run over the default group of `world_size` ranks.
    trainer, loader, ctx = make(tmp, keep_last=0)
    return trainer, loader, RunContext(rank, world_size, world_size, ctx.device, tmp, tmp / "ckpt")


def _outcome(fn) -> tuple[str, str]:
    """(the CheckpointError's message, what report_user_error printed) of `fn()` on this rank."""
    try:
        fn()
    except CheckpointError as e:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            report_user_error(e)
        return str(e), err.getvalue()
    return "no error", ""


def _damaged_and_failed(rank, world_size, tmp):
    trainer, loader, ctx = _rank_context(tmp, rank, world_size)
    train(trainer, loader, 1)
    first = save(trainer, loader, ctx)
    train(trainer, loader, 2)
    save(trainer, loader, ctx)
    files = json.loads((ctx.ckpt_dir / "step_00000002" / "meta.json").read_text())["files"]

    # A full disk on rank 1 only: every rank's save fails alike, nothing is published.
    if rank == 1:
        def full_disk(path, *_):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        checkpoint_save.write_rank_file = full_disk
    train(trainer, loader, 3)
    failed_save = _outcome(lambda: save(trainer, loader, ctx))
    published = sorted(p.name for p in ctx.ckpt_dir.glob("step_*"))
    latest = (ctx.ckpt_dir / "latest").read_text().strip()
    dist.barrier()

    # A damaged file on rank 1 only: every rank's resume fails alike.
    if rank == 1:
        part = ctx.ckpt_dir / "step_00000002" / "rank_00001.safetensors"
        raw = bytearray(part.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        part.write_bytes(bytes(raw))
    dist.barrier()
    again, loader2, _ = _rank_context(tmp, rank, world_size)
    failed_load = _outcome(lambda: maybe_resume(again, loader2, ctx))
    return {"files": sorted(files), "failed_save": failed_save, "published": published, "latest": latest,
            "failed_load": failed_load, "first": str(first)}


@pytest.mark.slow
def test_one_ranks_failure_stops_every_rank_with_the_same_line(tmp_path):
    results = run_distributed(_damaged_and_failed, 2, args=(tmp_path,), timeout=240)
    ckpt = tmp_path / "ckpt"
    assert results[0]["files"] == ["rank_00000.safetensors", "rank_00001.safetensors"]  # both ranks' checksums recorded

    save_errors = [r["failed_save"][0] for r in results]
    assert save_errors[0] == save_errors[1] and "\n" not in save_errors[0]
    assert save_errors[0].startswith(f"could not write checkpoint '{ckpt / '.step_00000003.tmp' / 'rank_00001.safetensors'}' "
                                     "(No space left on device); free disk space")
    for r in results:
        assert r["published"] == ["step_00000001", "step_00000002"] and r["latest"] == "step_00000002"

    load_errors = [r["failed_load"][0] for r in results]
    assert load_errors[0] == load_errors[1] and "\n" not in load_errors[0]
    assert load_errors[0] == (f"checkpoint file '{ckpt / 'step_00000002' / 'rank_00001.safetensors'}' fails its sha256 check "
                              f"(its bytes changed after the save); resume from the older step with "
                              f"--set checkpoint.resume={ckpt / 'step_00000001'}")
    # Printed once, by rank 0.
    assert [r["failed_load"][1] for r in results] == [f"error: {load_errors[0]}\n", ""]
    assert [r["failed_save"][1] for r in results] == [f"error: {save_errors[0]}\n", ""]
