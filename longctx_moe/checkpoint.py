"""Atomic, durable, verified checkpoints.

Layout under the checkpoint directory:

    step_00000100/            one directory per saved step
        meta.json             step, world size, the model/parallel config it was written with,
                              each rank file's size and sha256
        rank_00000.pt ...     each rank's model shard, optimizer, schedule, loader state, RNG
    latest                    text file naming the newest complete step directory
    superseded/step_...       steps set aside by a run that went back to an earlier step

Every rank writes its own file (model-parallel ranks hold different shards; data-parallel ranks
hold different loader positions and RNG streams) into `.step_N.tmp/` and fsyncs it; once every
rank has reported success, rank 0 writes meta.json, fsyncs the directory, renames it into place,
fsyncs the parent and replaces `latest`. A crash or a power cut therefore never leaves a
half-written step that `latest` names. Assumes a filesystem that every rank sees (one machine, or
a shared mount).

Resume (`find_resume_dir`) takes the step `latest` names. When `latest` is missing, or names a
step that is gone or has no readable meta.json (a crash between the rename and `latest`, a step
deleted by hand), it falls back to the newest complete step with a one-line notice. A step whose
meta.json is fine but whose rank file is missing, truncated or fails its checksum is a storage
fault, not a crash: loading stops with one line naming the file and the older step to use,
rather than silently throwing away progress.

A run that goes back to an earlier step (`checkpoint.resume=none` in a used directory, or a step
directory given by path) owns the steps after it no more: they are moved to `superseded/`
(replacing a same-named one there), never deleted, and `latest` stops naming them. So pruning to
the newest `keep_last` steps by number never deletes the step just written, and the next resume
loads what `latest` names. Delete `superseded/` by hand once it is not wanted.

Save and resume are collectives that agree before moving on (`agree`): one rank's failure (a
corrupt file, a full disk) makes every rank raise the same one-line CheckpointError, instead of
leaving its peers blocked in the next collective.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT_VERSION = 2  # 2: meta.json records each rank file's bytes and sha256
SUPERSEDED = "superseded"
_STEP_NAME = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: the message is one line naming the file and the fix."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# ---------------------------------------------------------------------- agreement across ranks


def _all_gather(obj: Any, group=None) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: str | None, payload: Any = None, cls: type[Exception] = CheckpointError, group=None) -> list[Any]:
    """Collective over `group`: every rank's payload, in rank order, when no rank passed an error.

    When some rank did, every rank raises `cls` with the lowest such rank's message, marked
    `agreed` (so only rank 0 needs to print it). Call this wherever a failing rank would
    otherwise skip a collective that its peers then wait in forever.
    """
    gathered = _all_gather((error, payload), group)
    first = next((e for e, _ in gathered if e is not None), None)
    if first is not None:
        exc = cls(first)
        exc.agreed = True  # type: ignore[attr-defined]
        raise exc
    return [p for _, p in gathered]


# ---------------------------------------------------------------------- RNG


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


# ---------------------------------------------------------------------- durable files


def _fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its directory's entry is on disk too.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some network and FUSE filesystems cannot sync a directory
            raise
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    _write_synced(tmp, text)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class _HashingWriter:
    """The file object torch.save writes to: hashes the bytes on their way, so the checksum
    costs no second read of a file that may be gigabytes."""

    def __init__(self, f):
        self._f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += memoryview(data).nbytes
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _write_rank_file(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": writer.bytes, "sha256": writer.sha256.hexdigest()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_error(path: Path, e: Exception) -> str:
    cause = getattr(e, "strerror", None) or type(e).__name__
    return (f"could not write checkpoint '{path}' ({cause}); free disk space or set checkpoint.dir "
            "to a writable directory")


# ---------------------------------------------------------------------- save


def save_checkpoint(ckpt_dir: str | Path, step: int, rank_state: dict[str, Any], meta: dict[str, Any],
                    rank: int, world_size: int, keep_last: int = 0, group=None) -> Path:
    """Collective over `group` (all ranks of the run): write this rank's `rank_state`, then
    rank 0 publishes the step directory atomically and prunes to the newest `keep_last`.
    A failure on any rank raises the same one-line CheckpointError on every rank."""
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    tmp = ckpt_dir / f".{final.name}.tmp"
    agree(_try(_fresh_dir, tmp) if rank == 0 else None, group=group)
    part = tmp / rank_file_name(rank)
    entry, error = None, None
    try:
        entry = _write_rank_file(part, rank_state)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as RuntimeError
        error = _write_error(part, e)
    entries = agree(error, entry, group=group)
    error = None
    if rank == 0:
        full_meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, **meta,
                     "files": {rank_file_name(r): e for r, e in enumerate(entries)}}
        error = _try(_publish, ckpt_dir, tmp, final, full_meta, keep_last)
    agree(error, group=group)
    return final


def _try(fn: Callable[..., None], path: Path, *args) -> str | None:
    """Run rank 0's file-system work; an OSError becomes the message every rank will raise."""
    try:
        fn(path, *args)
    except OSError as e:
        return _write_error(Path(e.filename) if e.filename else path, e)
    return None


def _fresh_dir(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    new_parent = not tmp.parent.exists()
    tmp.mkdir(parents=True)
    if new_parent:
        _fsync_dir(tmp.parent.parent)


def _publish(ckpt_dir: Path, tmp: Path, final: Path, meta: dict[str, Any], keep_last: int) -> None:
    _write_synced(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True))
    _fsync_dir(tmp)  # the rank files' entries, written by every rank
    set_aside(ckpt_dir, meta["step"])  # an older save of this step, or steps of an abandoned future
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    _atomic_write_text(ckpt_dir / "latest", final.name + "\n")
    _prune(ckpt_dir, keep_last, meta["step"])


def set_aside(ckpt_dir: str | Path, first_step: int) -> list[Path]:
    """Move the step directories numbered >= `first_step` to `superseded/` and forget `latest`
    if it named one of them; return their new paths. They belong to a run that went back."""
    ckpt_dir = Path(ckpt_dir)
    moved = []
    for number, path in _step_dirs(ckpt_dir):
        if number >= first_step:
            dest = ckpt_dir / SUPERSEDED / path.name
            dest.parent.mkdir(exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(path, dest)
            moved.append(dest)
    if moved:
        latest = ckpt_dir / "latest"
        if _read_latest(latest) in {p.name for p in moved}:
            latest.unlink()
        _fsync_dir(ckpt_dir / SUPERSEDED)
        _fsync_dir(ckpt_dir)
    return moved


def _prune(ckpt_dir: Path, keep_last: int, step: int) -> None:
    """Keep the newest `keep_last` complete steps by number; `step`, just written, is the newest
    (higher ones were set aside) and is never deleted. Drops leftovers of interrupted saves."""
    for leftover in ckpt_dir.glob(".step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep_last <= 0:
        return
    complete = [path for _, path in _complete_steps(ckpt_dir)]
    for old in complete[:-keep_last]:
        if old.name != step_dir_name(step):
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- finding a step


def _step_number(name: str) -> int | None:
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def _step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Every `step_N` directory (complete or not), sorted by N."""
    if not ckpt_dir.is_dir():
        return []
    found = [(_step_number(p.name), p) for p in ckpt_dir.iterdir() if p.is_dir()]
    return sorted((n, p) for n, p in found if n is not None)


def _complete_steps(ckpt_dir: Path) -> list[tuple[int, Path]]:
    return [(n, p) for n, p in _step_dirs(ckpt_dir) if _meta_or_none(p) is not None]


def _meta_or_none(step_dir: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((step_dir / "meta.json").read_text())
    except (OSError, ValueError):  # missing, unreadable, or not JSON (ValueError covers decoding)
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("step"), int) else None


def _read_latest(latest: Path) -> str | None:
    try:
        name = latest.read_text().strip()
    except (OSError, ValueError):
        return None
    return name if _step_number(name) is not None else None


def _print_notice(text: str) -> None:
    print(text, flush=True)


def find_resume_dir(ckpt_dir: str | Path, resume: str,
                    notify: Callable[[str], None] | None = None) -> Path | None:
    """The step directory to resume from: `resume` is auto | none | a path. With auto, a missing
    or dangling `latest` falls back to the newest complete step and calls `notify` (default:
    print) with a one-line notice."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if _meta_or_none(path) is None:
            raise CheckpointError(f"checkpoint.resume='{resume}' is not a checkpoint step directory (no readable "
                                  "meta.json); point it at e.g. runs/x/checkpoints/step_00000100 or use auto/none")
        return path
    return _latest_or_newest(Path(ckpt_dir), notify or _print_notice)


def _latest_or_newest(ckpt_dir: Path, notify: Callable[[str], None]) -> Path | None:
    latest = ckpt_dir / "latest"
    named = _read_latest(latest)
    if named is not None and _meta_or_none(ckpt_dir / named) is not None:
        return ckpt_dir / named
    complete = _complete_steps(ckpt_dir)
    if named is None and not latest.exists():
        if not complete:
            return None  # a first run
        why = f"'{latest}' is missing"
    elif named is None:
        why = f"'{latest}' is unreadable"
    else:
        why = f"'{latest}' names '{named}', which is missing or has no readable meta.json"
    if not complete:
        raise CheckpointError(f"{why} and '{ckpt_dir}' holds no complete step; set checkpoint.resume=none "
                              "to start over or checkpoint.resume=<a step directory>")
    notify(f"notice: {why}; resuming from the newest complete step {complete[-1][1]}")
    return complete[-1][1]


# ---------------------------------------------------------------------- loading


def read_meta(step_dir: Path) -> dict[str, Any]:
    meta = _meta_or_none(step_dir)
    if meta is None:
        raise CheckpointError(f"'{step_dir / 'meta.json'}' is missing or unreadable; the checkpoint is incomplete: "
                              f"{_older_step_hint(step_dir)}")
    if meta.get("format", 1) > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint '{step_dir}' has format {meta['format']}, newer than this code's "
                              f"{FORMAT_VERSION}; update longctx_moe or resume from another checkpoint")
    return meta


def _older_step_hint(step_dir: Path) -> str:
    """What to do instead of loading `step_dir`: the newest complete step before it, named."""
    number = _step_number(step_dir.name)
    older = [p for n, p in _complete_steps(step_dir.parent) if number is None or n < number]
    if older:
        return f"resume from the older step with --set checkpoint.resume={older[-1]}"
    return "no older step exists there: set checkpoint.resume=none to start over"


def load_rank_state(step_dir: str | Path, rank: int, world_size: int,
                    expect: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, this rank's state) of a step directory, checked against the current run.

    `expect` holds meta entries (e.g. the model config) that must match; a difference is a
    one-line CheckpointError naming the first differing key. The rank file's size and sha256
    are checked against meta.json before it is unpickled.
    """
    step_dir = Path(step_dir)
    meta = read_meta(step_dir)
    if meta.get("world_size") != world_size:
        raise CheckpointError(f"checkpoint '{step_dir}' was written by {meta.get('world_size')} ranks but this run has "
                              f"{world_size}; resume with the same world size or set checkpoint.resume=none")
    _check_expected(step_dir, meta, expect or {})
    path = step_dir / rank_file_name(rank)
    _verify_file(path, (meta.get("files") or {}).get(path.name))
    return meta, _torch_load(path)


def _verify_file(path: Path, entry: dict[str, Any] | None) -> None:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing; {_older_step_hint(path.parent)}")
    if entry is None:
        return  # format 1: written before checksums
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file '{path}' has {size} bytes but meta.json records {entry['bytes']} "
                              f"(truncated or overwritten); {_older_step_hint(path.parent)}")
    if _sha256(path) != entry["sha256"]:
        raise CheckpointError(f"checkpoint file '{path}' fails its sha256 check (its bytes changed after the save); "
                              f"{_older_step_hint(path.parent)}")


def _torch_load(path: Path) -> dict[str, Any]:
    try:
        # Our own files: they hold loader and RNG state that the weights-only unpickler rejects.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails any way: MemoryError from a bad frame length, KeyError, ...
        raise CheckpointError(f"checkpoint file '{path}' cannot be unpickled ({type(e).__name__}): it is corrupt; "
                              f"{_older_step_hint(path.parent)}") from None


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
