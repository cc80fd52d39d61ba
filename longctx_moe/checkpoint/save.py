"""A save: `stage_checkpoint` (collective), `write_staged` (any thread), `publish_checkpoint`
(collective), and `AsyncSave`, which runs the write on a background thread."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longctx_moe.checkpoint.durable import atomic_write_text, fsync_dir, write_error, write_synced
from longctx_moe.checkpoint.errors import agree
from longctx_moe.checkpoint.rank_file import write_rank_file
from longctx_moe.checkpoint.steps import (
    FORMAT_VERSION,
    prune,
    rank_file_name,
    set_aside,
    step_dir_name,
)

# ---------------------------------------------------------------------- save


@dataclass(frozen=True)
class Piece:
    """A rank's piece of a tensor: `tensor` sits at `offsets` inside a tensor of `global_shape`."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass
class Staged:
    """A save between its collective start (directory, which rank writes which piece) and its
    publication: `tensors` are this rank's own copies, safe from the training that goes on."""

    ckpt_dir: Path
    step: int
    rank: int
    tensors: dict[str, torch.Tensor]
    index: dict[str, Any]  # key -> global shape, dtype, pieces (file, offsets, shape)
    slices: dict[str, Any]  # this rank's written keys -> (global shape, offsets)

    @property
    def tmp(self) -> Path:
        return self.ckpt_dir / f".{step_dir_name(self.step)}.tmp"


def stage_checkpoint(ckpt_dir: str | Path, step: int, pieces: dict[str, Piece], rank: int, group=None,
                     copy: bool = False) -> Staged:
    """Collective: the temporary step directory, and which rank writes each piece (the lowest
    rank holding the same key and slice). `copy`: take CPU copies of this rank's pieces (a
    background write while training changes them), else only what safetensors needs."""
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir / f".{step_dir_name(step)}.tmp"
    agree(_try(_fresh_dir, tmp) if rank == 0 else None, group=group)
    mine = {k: (list(p.global_shape), list(p.offsets), list(p.tensor.shape), str(p.tensor.dtype).removeprefix("torch."))
            for k, p in pieces.items()}
    index, writes = _piece_index(agree(None, mine, group=group), rank)
    tensors = _own_tensors({k: pieces[k].tensor for k in writes}, copy)
    return Staged(ckpt_dir, step, rank, tensors, index, {k: mine[k][:2] for k in writes})


def _own_tensors(tensors: dict[str, torch.Tensor], copy: bool) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, no two sharing storage (safetensors refuses tied weights)."""
    out, seen = {}, set()
    for key, t in tensors.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr() if t.device.type == "cpu" else None
        if copy or ptr in seen or t.device.type != "cpu":
            t = t.to("cpu", copy=True)
        seen.add(ptr)
        out[key] = t.contiguous()
    return out


def _piece_index(everyone: list[dict[str, Any]], rank: int) -> tuple[dict[str, Any], list[str]]:
    """(the index of every tensor, the keys `rank` writes) from each rank's (global shape,
    offsets, shape, dtype) by key: a piece several ranks hold is written by the lowest."""
    index: dict[str, Any] = {}
    writes, seen = [], set()
    for r, slices in enumerate(everyone):
        for key, (global_shape, offsets, shape, dtype) in slices.items():
            if (key, tuple(offsets), tuple(shape)) in seen:
                continue
            seen.add((key, tuple(offsets), tuple(shape)))
            entry = index.setdefault(key, {"global_shape": global_shape, "dtype": dtype, "pieces": []})
            entry["pieces"].append({"file": rank_file_name(r), "offsets": offsets, "shape": shape})
            if r == rank:
                writes.append(key)
    return index, writes


def write_staged(staged: Staged, rank_state: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """Write and fsync this rank's file (no collective: may run on a background thread);
    returns (error message, file entry)."""
    part = staged.tmp / rank_file_name(staged.rank)
    metadata = {"format": str(FORMAT_VERSION), "state": json.dumps(rank_state),
                "slices": json.dumps(staged.slices)}
    try:
        return None, write_rank_file(part, staged.tensors, metadata)
    except (OSError, RuntimeError) as e:
        return write_error(part, e), None


def publish_checkpoint(staged: Staged, written: tuple[str | None, dict[str, Any] | None], meta: dict[str, Any],
                       world_size: int, keep_last: int, group=None) -> Path:
    """Collective: once every rank's file is written, rank 0 writes meta.json, renames the step
    into place, points `latest` at it and prunes."""
    entries = agree(*written, group=group)
    final = staged.ckpt_dir / step_dir_name(staged.step)
    error = None
    if staged.rank == 0:
        full_meta = {"format": FORMAT_VERSION, "step": staged.step, "world_size": world_size, **meta,
                     "files": {rank_file_name(r): e for r, e in enumerate(entries)}, "tensors": staged.index}
        error = _try(_publish, staged.ckpt_dir, staged.tmp, final, full_meta, keep_last)
    agree(error, group=group)
    return final


class AsyncSave:
    """A staged save whose rank file is written on a background thread while training goes on
    (checkpoint.async_save). `ready()` and `finish()` are collectives: call them at the same
    point on every rank; `finish` waits for the write and publishes the step."""

    def __init__(self, staged: Staged, rank_state: dict[str, Any], meta: dict[str, Any], world_size: int,
                 keep_last: int, group=None):
        self.staged, self._publish_args = staged, (meta, world_size, keep_last, group)
        self._written: tuple[str | None, dict[str, Any] | None] = (None, None)
        self._thread = threading.Thread(target=self._write, args=(rank_state,), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, rank_state: dict[str, Any]) -> None:
        self._written = write_staged(self.staged, rank_state)

    def ready(self) -> bool:
        """Collective: whether every rank's write has ended."""
        return all(agree(None, not self._thread.is_alive(), group=self._publish_args[3]))

    def finish(self) -> Path:
        self._thread.join()
        return publish_checkpoint(self.staged, self._written, *self._publish_args)


def _try(fn: Callable[..., None], path: Path, *args) -> str | None:
    """Run rank 0's file-system work; an OSError becomes the message every rank will raise."""
    try:
        fn(path, *args)
    except OSError as e:
        return write_error(Path(e.filename) if e.filename else path, e)
    return None


def _fresh_dir(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    new_parent = not tmp.parent.exists()
    tmp.mkdir(parents=True)
    if new_parent:
        fsync_dir(tmp.parent.parent)


def _publish(ckpt_dir: Path, tmp: Path, final: Path, meta: dict[str, Any], keep_last: int) -> None:
    write_synced(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
    fsync_dir(tmp)  # the rank files' entries, written by every rank
    set_aside(ckpt_dir, meta["step"])  # an older save of this step, or steps of an abandoned future
    os.replace(tmp, final)
    fsync_dir(ckpt_dir)
    atomic_write_text(ckpt_dir / "latest", final.name + "\n")
    prune(ckpt_dir, keep_last, meta["step"])
