"""A Trainer's state in a checkpoint: the model and AdamW state by global slice, the schedule and
step, each rank's loader position and RNG streams; `Checkpointer`, the saves of a running loop."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.reader import CheckpointReader
from longctx_moe.checkpoint.rng import rng_state, set_rng_state
from longctx_moe.checkpoint.save import (
    AsyncSave,
    publish_checkpoint,
    stage_checkpoint,
    write_staged,
)
from longctx_moe.checkpoint.sharded_state import load_trainer_pieces, trainer_pieces
from longctx_moe.config import Config
from longctx_moe.model.config import ModelConfig

if TYPE_CHECKING:
    from longctx_moe.process import RunContext
    from longctx_moe.trainer import Trainer



def harmless_model_keys(model: ModelConfig) -> set[str]:
    """model.* keys whose value does not change the function the weights compute, so a checkpoint
    resumes under other values: init_std (it drew the first weights); max_position_embeddings
    except where it is YaRN's factor (rope_scaling gives none); dense_hidden_size where no layer
    is dense. The balance and execution sections are never compared (the losses that train the
    model and how it runs: an FP8 run continues in bf16, or on a CPU; a checkpoint that still
    holds model.aux_loss_* from before the balance section resumes alike); the parallel layout
    may change too (sharded_state.py)."""
    keys = {"init_std"}
    scaling = model.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn" or scaling.get("factor"):
        keys.add("max_position_embeddings")
    if model.first_k_dense == 0:
        keys.add("dense_hidden_size")
    return keys


def resume_expectations(cfg: Config) -> dict:
    """The meta entries a checkpoint must match to be resumed under `cfg`: the model's function."""
    harmless = harmless_model_keys(cfg.model)
    return {"model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in harmless}}


def save(trainer: Trainer, loader: Any, ctx: RunContext) -> Path:
    return save_trainer(trainer, loader, ctx.ckpt_dir, ctx.rank, ctx.world_size, trainer.cfg.checkpoint.keep_last)


def save_trainer(trainer: Trainer, loader: Any, ckpt_dir: Path, rank: int, world_size: int, keep_last: int,
                 background: bool = False) -> Path | AsyncSave:
    """Collective: checkpoint the trainer (model and AdamW state by global slice, schedule, step)
    and this rank's loader position and RNG streams. `background`: return the AsyncSave whose
    thread writes the file (copies of the state are taken before this returns)."""

    dims = trainer.dims
    rank_state = {"rng": rng_state(), "dp_rank": dims.rank_in("dp"), "loader": _loader_state(loader)}
    meta = {**resume_expectations(trainer.cfg), "parallel": dataclasses.asdict(trainer.cfg.parallel),
            "layout": _layout(dims),
            "trainer": {"step": trainer.step, "schedule": trainer.schedule.state_dict()}}
    pieces = trainer_pieces(trainer.model, trainer.optimizer)
    staged = stage_checkpoint(ckpt_dir, trainer.step, pieces, rank, copy=background)
    if background:
        return AsyncSave(staged, rank_state, meta, world_size, keep_last)
    return publish_checkpoint(staged, write_staged(staged, rank_state), meta, world_size, keep_last)


class Checkpointer:
    """The run's saves: synchronous, or with checkpoint.async_save written on a background
    thread and published at the first step boundary where every rank's write has ended (the
    next save and the end of training wait for it). Every method is a collective."""

    def __init__(self, trainer: Trainer, loader: Any, ctx: RunContext):
        self.trainer, self.loader, self.ctx = trainer, loader, ctx
        self.pending: AsyncSave | None = None

    def save(self) -> None:
        self.finish()
        cfg = self.trainer.cfg.checkpoint
        saved = save_trainer(self.trainer, self.loader, self.ctx.ckpt_dir, self.ctx.rank, self.ctx.world_size,
                             cfg.keep_last, background=cfg.async_save)
        self.pending = saved if isinstance(saved, AsyncSave) else None

    def poll(self) -> None:
        if self.pending is not None and self.pending.ready():
            self.finish()

    def finish(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.finish()


def _layout(dims: Any) -> dict[str, int]:
    return {axis: dims.size(axis) for axis in ("tp", "cp", "dp", "ep")}


def _loader_state(loader: Any) -> dict | None:
    """The loader's position, plus the documents it has served this epoch (how a run under
    another data-parallel size finds the same place)."""
    if not hasattr(loader, "state_dict"):
        return None
    state = dict(loader.state_dict())
    if hasattr(loader, "_plan_for"):
        steps = loader._plan_for(loader.epoch)[:loader.step_in_epoch]
        state["samples_in_epoch"] = int(sum(len(s) for s in steps))
    return state


def load_trainer(trainer: Trainer, loader: Any, step_dir: Path, rank: int, world_size: int) -> None:
    """Load checkpoint `step_dir`, written under any parallel layout, into this rank's trainer,
    loader and RNG. Raises CheckpointError (one line)."""

    reader = CheckpointReader(step_dir, resume_expectations(trainer.cfg))
    old = reader.meta.get("layout") or {}
    same = old == _layout(trainer.dims) and reader.meta.get("world_size") == world_size
    try:
        load_trainer_pieces(trainer.model, trainer.optimizer, reader)
        trainer.schedule.load_state_dict(reader.meta["trainer"]["schedule"])
        trainer.step = int(reader.meta["trainer"]["step"])
        # Same layout: every rank continues its own streams. Another one: the RNG of rank 0.
        set_rng_state(reader.rank_state(rank if same else 0)["rng"])
        _load_loader(loader, reader, old, trainer.dims, rank)
    except ValueError as e:  # optimizer groups or loader state of another run; one-line messages
        raise CheckpointError(f"checkpoint '{step_dir}': {e}") from None


def _load_loader(loader: Any, reader: CheckpointReader, old: dict, dims: Any, rank: int) -> None:
    """The loader's position: that of a rank of the same DP rank when DP is unchanged; under
    another DP size, the same epoch from the same number of documents served, with a notice."""
    if not hasattr(loader, "load_state_dict"):
        return
    dp_rank = dims.rank_in("dp")
    if old.get("dp") == dims.dp:
        # Rank ordering tp + TP*(cp + CP*dp): the first rank of DP rank d is d*TP*CP.
        state = reader.rank_state(dp_rank * old["tp"] * old["cp"])["loader"]
        if state is not None:
            loader.load_state_dict(state)
        return
    state = reader.rank_state(0)["loader"]
    if state is None or not hasattr(loader, "_plan_for"):
        return
    done = state.get("samples_in_epoch", 0)
    steps = loader._plan_for(state["epoch"])
    served, step = 0, 0
    while step < len(steps) and served < done:
        served, step = served + len(steps[step]), step + 1
    loader.load_state_dict({**state, "dp_size": dims.dp, "step_in_epoch": step})
    if rank == 0:
        print(f"notice: the data-parallel size changed from {old.get('dp')} to {dims.dp}: the loader continues "
              f"epoch {state['epoch']} at document {served} (step {step} of the epoch)", flush=True)


def load_model_state(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], where: str) -> None:
    """Load strictly; a missing, unexpected or reshaped tensor is a one-line CheckpointError."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    extra = sorted(set(state_dict) - set(own))
    if missing or extra:
        name = (missing or extra)[0]
        kind = "lacks" if missing else "has an unexpected"
        raise CheckpointError(f"checkpoint '{where}' {kind} tensor '{name}'; it was written for a different model: "
                              "use the matching model config or set checkpoint.resume=none")
    for name, t in own.items():
        if tuple(state_dict[name].shape) != tuple(t.shape):
            raise CheckpointError(f"checkpoint '{where}' has '{name}' of shape {tuple(state_dict[name].shape)} but the model "
                                  f"expects {tuple(t.shape)}; use the matching model config or set checkpoint.resume=none")
    model.load_state_dict(state_dict)
