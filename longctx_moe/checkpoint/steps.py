"""The checkpoint directory: step names, meta.json, complete steps, `latest`, pruning, setting
aside, and the step a resume takes (see the package docstring for the rules)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longctx_moe.checkpoint.durable import fsync_dir
from longctx_moe.checkpoint.errors import CheckpointError

FORMAT_VERSION = 4  # 2: meta.json records each rank file's bytes and sha256; 3: tensors by global slice, safetensors; 4: a sha256 per block of each rank file
SUPERSEDED = "superseded"
_STEP_NAME = re.compile(r"step_(\d+)")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


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
        fsync_dir(ckpt_dir / SUPERSEDED)
        fsync_dir(ckpt_dir)
    return moved


def prune(ckpt_dir: Path, keep_last: int, step: int) -> None:
    """Keep the newest `keep_last` complete steps by number; `step`, just written, is the newest
    (higher ones were set aside) and is never deleted. Drops leftovers of interrupted saves."""
    for leftover in ckpt_dir.glob(".step_*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep_last <= 0:
        return
    complete = [path for _, path in complete_steps(ckpt_dir)]
    torn = [path for number, path in _step_dirs(ckpt_dir) if number < step and path not in complete]
    for old in [*torn, *complete[:-keep_last]]:
        if old.name != step_dir_name(step):
            _remove_step(old)


def _remove_step(step_dir: Path) -> None:
    """Delete a step directory, meta.json first and durably: a kill part-way through leaves a
    directory that no reader takes for a complete step."""
    try:
        (step_dir / "meta.json").unlink()
        fsync_dir(step_dir)
    except FileNotFoundError:
        pass
    shutil.rmtree(step_dir, ignore_errors=True)


def step_number(name: str) -> int | None:
    match = _STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def _step_dirs(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Every `step_N` directory (complete or not), sorted by N."""
    if not ckpt_dir.is_dir():
        return []
    found = [(step_number(p.name), p) for p in ckpt_dir.iterdir() if p.is_dir()]
    return sorted((n, p) for n, p in found if n is not None)


def complete_steps(ckpt_dir: Path) -> list[tuple[int, Path]]:
    return [(n, p) for n, p in _step_dirs(ckpt_dir) if _incomplete_reason(p) is None]


def _incomplete_reason(step_dir: Path) -> str | None:
    """None when `step_dir` is complete: a readable meta.json and every file it lists present at
    its recorded size (checksums are checked when a file is read). Else why not, in words."""
    meta = meta_or_none(step_dir)
    if meta is None:
        return "has no readable meta.json"
    files = meta.get("files")
    for name, entry in sorted(files.items() if isinstance(files, dict) else []):
        try:
            size = (step_dir / name).stat().st_size
        except OSError:
            return f"is torn: its '{name}' is missing"
        if isinstance(entry, dict) and size != entry.get("bytes"):
            return f"is torn: its '{name}' has {size} bytes but meta.json records {entry.get('bytes')}"
    return None


def meta_or_none(step_dir: Path) -> dict[str, Any] | None:
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
    return name if step_number(name) is not None else None


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
        if meta_or_none(path) is None:
            raise CheckpointError(f"checkpoint.resume='{resume}' is not a checkpoint step directory (no readable "
                                  "meta.json); point it at e.g. runs/x/checkpoints/step_00000100 or use auto/none")
        return path
    return _latest_or_newest(Path(ckpt_dir), notify or _print_notice)


def _latest_or_newest(ckpt_dir: Path, notify: Callable[[str], None]) -> Path | None:
    latest = ckpt_dir / "latest"
    named = _read_latest(latest)
    reason = None if named is None else _incomplete_reason(ckpt_dir / named)
    if named is not None and reason is None:
        return ckpt_dir / named
    complete = complete_steps(ckpt_dir)
    if named is None and not latest.exists():
        if not complete and not _step_dirs(ckpt_dir):
            return None  # a first run
        why = f"'{latest}' is missing"
    elif named is None:
        why = f"'{latest}' is unreadable"
    elif (ckpt_dir / named).is_dir():
        why = f"'{latest}' names '{named}', which {reason}"
    else:
        why = f"'{latest}' names '{named}', which is missing"
    newest = complete[-1][0] if complete else -1
    torn = [f"{p} {_incomplete_reason(p)}" for n, p in _step_dirs(ckpt_dir) if n > newest and p.name != named]
    if torn:
        why += f"; skipping {', '.join(torn)}"
    if not complete:
        raise CheckpointError(f"{why} and '{ckpt_dir}' holds no complete step; set checkpoint.resume=none "
                              "to start over or checkpoint.resume=<a step directory>")
    notify(f"notice: {why}; resuming from the newest complete step {complete[-1][1]}")
    return complete[-1][1]

def read_meta(step_dir: Path) -> dict[str, Any]:
    meta = meta_or_none(step_dir)
    if meta is None:
        raise CheckpointError(f"'{step_dir / 'meta.json'}' is missing or unreadable; the checkpoint is incomplete: "
                              f"{older_step_hint(step_dir)}")
    if meta.get("format", 1) > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint '{step_dir}' has format {meta['format']}, newer than this code's "
                              f"{FORMAT_VERSION}; update longctx_moe or resume from another checkpoint")
    return meta


def older_step_hint(step_dir: Path) -> str:
    """What to do instead of loading `step_dir`: the newest complete step before it, named."""
    number = step_number(step_dir.name)
    older = [p for n, p in complete_steps(step_dir.parent) if number is None or n < number]
    if older:
        return f"resume from the older step with --set checkpoint.resume={older[-1]}"
    return "no older step exists there: set checkpoint.resume=none to start over"
