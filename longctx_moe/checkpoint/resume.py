"""The resume rules a run applies at start-up: which step (rank 0 picks, every rank agrees), the
load, and the steps after it set aside (see the package docstring)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx_moe.checkpoint.errors import CheckpointError, agree
from longctx_moe.checkpoint.steps import find_resume_dir, set_aside
from longctx_moe.checkpoint.trainer_state import load_trainer

if TYPE_CHECKING:
    from longctx_moe.process import RunContext
    from longctx_moe.trainer import Trainer

def maybe_resume(trainer: Trainer, loader: Any, ctx: RunContext) -> Path | None:
    """Collective: rank 0 picks the step directory (one notice if it falls back), every rank loads
    the slices it holds, and the ranks agree before going on, so a damaged file on one rank stops
    every rank with the same line. The steps after the resumed one (all of them with
    checkpoint.resume=none) are then set aside (see longctx_moe.checkpoint). An elastic restart
    (torchrun --max-restarts) always resumes: `none` meant the first attempt."""
    resume = trainer.cfg.checkpoint.resume
    if resume == "none" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"
    step_dir = _agreed_resume_dir(resume, ctx)
    error = None
    if step_dir is not None:
        try:
            load_trainer(trainer, loader, step_dir, ctx.rank, ctx.world_size)
        except CheckpointError as e:
            error = str(e)
    agree(error)
    if step_dir is not None or resume == "none":
        _set_aside_after(trainer.step, ctx)
    return step_dir


def _agreed_resume_dir(resume: str, ctx: RunContext) -> Path | None:
    found, error = None, None
    if ctx.rank == 0:  # one rank reads the directory: one notice, one answer for all
        try:
            found = find_resume_dir(ctx.ckpt_dir, resume)
        except CheckpointError as e:
            error = str(e)
    chosen = agree(error, None if found is None else str(found))[0]
    return None if chosen is None else Path(chosen)


def _set_aside_after(step: int, ctx: RunContext) -> None:
    """Collective: rank 0 moves the steps numbered above `step` to superseded/, so that the
    next resume cannot pick a step of the future this run abandoned."""
    error = None
    if ctx.rank == 0:
        try:
            moved = set_aside(ctx.ckpt_dir, step + 1)
        except OSError as e:
            error = (f"could not move the steps after {step} in '{ctx.ckpt_dir}' aside ({e.strerror}); "
                     "fix its permissions or set checkpoint.dir to another directory")
        else:
            if moved:
                print(f"notice: this run continues from step {step}: moved {', '.join(p.name for p in moved)} "
                      f"to {moved[0].parent}", flush=True)
    agree(error)
