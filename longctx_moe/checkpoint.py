"""Atomic, resumable checkpoints.

Layout under the checkpoint directory:

    step_00000100/            one directory per saved step
        meta.json             step, world size, the model/parallel config it was written with
        rank_00000.pt ...     each rank's model shard, optimizer, schedule, loader state, RNG
    latest                    text file naming the newest complete step directory

Every rank writes its own file (model-parallel ranks hold different shards; data-parallel ranks
hold different loader positions and RNG streams). A step is written into `.step_N.tmp/` and
renamed into place by rank 0 only after every rank has finished, so a crash never leaves a
half-written step that `latest` points to. Assumes the directory is on a filesystem that every
rank sees (one machine, or a shared mount).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: the message is one line naming the file and the fix."""


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from; numpy's state is stored as plain lists."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(ckpt_dir: str | Path, step: int, rank_state: dict[str, Any], meta: dict[str, Any],
                    rank: int, world_size: int, keep_last: int = 0, group=None) -> Path:
    """Collective over `group` (all ranks of the run): write this rank's `rank_state`, then
    rank 0 publishes the step directory atomically and prunes to the newest `keep_last`."""
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f".{step_dir_name(step)}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(group)
    part = tmp / f"rank_{rank:05d}.pt"
    torch.save(rank_state, part.with_suffix(".pt.tmp"))
    os.replace(part.with_suffix(".pt.tmp"), part)
    _barrier(group)
    if rank == 0:
        full_meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, **meta}
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(ckpt_dir / "latest", final.name + "\n")
        _prune(ckpt_dir, keep_last)
    _barrier(group)
    return final


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    steps = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def find_resume_dir(ckpt_dir: str | Path, resume: str) -> Path | None:
    """The step directory to resume from: `resume` is auto | none | a path."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "meta.json").is_file():
            raise CheckpointError(f"checkpoint.resume='{resume}' is not a checkpoint step directory (no meta.json); "
                                  "point it at e.g. runs/x/checkpoints/step_00000100 or use auto/none")
        return path
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    path = Path(ckpt_dir) / latest.read_text().strip()
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"'{latest}' names '{path.name}', which is missing or incomplete; "
                              "delete the latest file to start fresh or set checkpoint.resume to an existing step directory")
    return path


def read_meta(step_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((step_dir / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"'{step_dir / 'meta.json'}' is unreadable ({type(e).__name__}); "
                              "the checkpoint is corrupt: resume from another step directory") from None


def load_rank_state(step_dir: str | Path, rank: int, world_size: int,
                    expect: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, this rank's state) of a step directory, checked against the current run.

    `expect` holds meta entries (e.g. the model config) that must match; a difference is a
    one-line CheckpointError naming the first differing key.
    """
    step_dir = Path(step_dir)
    meta = read_meta(step_dir)
    if meta.get("world_size") != world_size:
        raise CheckpointError(f"checkpoint '{step_dir}' was written by {meta.get('world_size')} ranks but this run has "
                              f"{world_size}; resume with the same world size or set checkpoint.resume=none")
    _check_expected(step_dir, meta, expect or {})
    path = step_dir / f"rank_{rank:05d}.pt"
    try:
        # Our own files: they hold loader and RNG state that the weights-only unpickler rejects.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file '{path}' is missing; the step directory is incomplete: "
                              "resume from another step") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointError(f"checkpoint file '{path}' is corrupt ({type(e).__name__}); "
                              "resume from another step directory or set checkpoint.resume=none") from None
    return meta, state


def _check_expected(step_dir: Path, meta: dict, expect: dict) -> None:
    for section, want in expect.items():
        have = meta.get(section)
        if isinstance(want, dict) and isinstance(have, dict):
            # Keys only one side knows (a field added since) are not compared.
            for key in sorted(set(want) & set(have)):
                if want[key] != have[key]:
                    raise CheckpointError(
                        f"checkpoint '{step_dir}' has {section}.{key}={have[key]!r} but the config has "
                        f"{want[key]!r}; resume with the same {section} config or set checkpoint.resume=none")
        elif want != have:
            raise CheckpointError(f"checkpoint '{step_dir}' has {section}={have!r} but the run has {want!r}; "
                                  "resume with matching settings or set checkpoint.resume=none")


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
