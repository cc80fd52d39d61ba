"""Atomic, durable, verified checkpoints.

Layout under the checkpoint directory:

    step_00000100/            one directory per saved step
        meta.json             step, world size, the model/parallel config it was written with,
                              each rank file's size and sha256, and the index of every tensor:
                              its global shape, dtype and pieces (file, offsets, shape)
        rank_00000.safetensors ...  the pieces each rank wrote; its metadata holds the rank's
                              own state (RNG, loader position) as JSON
    latest                    text file naming the newest complete step directory
    superseded/step_...       steps set aside by a run that went back to an earlier step

Tensors are stored by global slice (sharded_state.py says which slice a rank holds), each piece
once: a piece that several ranks hold alike (replicas over DP, CP, ...) is written by the lowest
of them. A run under another layout (world size, TP, CP, EP) reads the slices it needs from
whichever files hold them (`checkpoint_reader.CheckpointReader`). No pickles: safetensors and
JSON only.

A save has three parts: `stage_checkpoint` (collective: the temporary directory, who writes which
piece), `write_staged` (this rank's file into `.step_N.tmp/`, fsynced; no collective, so
`AsyncSave` runs it on a background thread from copies of the tensors) and `publish_checkpoint`
(collective: once every rank has reported success, rank 0 writes meta.json, fsyncs the directory,
renames it into place, fsyncs the parent and replaces `latest`). A crash or a power cut therefore
never leaves a half-written step that `latest` names. Assumes a filesystem that every rank sees
(one machine, or a shared mount).

A step is complete when its meta.json is readable and every file it lists is there at its
recorded size. Resume (`find_resume_dir`) takes the step `latest` names. When `latest` is missing,
or names a step that is gone or not complete (a crash between the rename and `latest`, a kill
while pruning, a file deleted or cut short), it falls back to the newest complete step with a
one-line notice naming each step it skips. Pruning deletes a step's meta.json first, so a kill
part-way through never leaves a candidate. A rank file at its size that fails its checksum is a
storage fault: loading stops with one line naming the file and the older step to use, rather
than silently throwing away progress.

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

import base64
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT_VERSION = 3  # 2: meta.json records each rank file's bytes and sha256; 3: tensors by global slice, safetensors
SUPERSEDED = "superseded"
_STEP_NAME = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: the message is one line naming the file and the fix."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


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


def _tensor_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _b64_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as JSON-ready values (torch's states base64-encoded)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state = {"torch": _tensor_b64(torch.get_rng_state()), "python": [version, list(internal), py_gauss],
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_tensor_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_b64_tensor(state["torch"]))
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(internal), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_b64_tensor(s) for s in state["cuda"]])


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


# torch dtype -> safetensors dtype name (https://github.com/huggingface/safetensors, format).
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _safetensors_chunks(tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
    """The bytes of a safetensors file, in pieces: an 8-byte little-endian header length, the JSON
    header (padded to 8 bytes), then each tensor's bytes in header order (no copies)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    yield struct.pack("<Q", len(raw)) + raw
    for t in tensors.values():
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_rank_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write one safetensors file (contiguous CPU tensors) and fsync it; return its size and
    sha256. The bytes go straight from the tensors to the file, and a second thread hashes each
    piece while the next is written (both release the GIL): the checksum costs no second pass."""
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f, ThreadPoolExecutor(1) as hasher:  # one worker: pieces hashed in order
        for chunk in _safetensors_chunks(tensors, metadata):
            hasher.submit(digest.update, chunk)
            f.write(chunk)
            size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
        hasher.shutdown(wait=True)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_error(path: Path, e: Exception) -> str:
    cause = getattr(e, "strerror", None) or type(e).__name__
    return (f"could not write checkpoint '{path}' ({cause}); free disk space or set checkpoint.dir "
            "to a writable directory")


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
        kill_point("save", staged.step, staged.rank)
        return None, _write_rank_file(part, staged.tensors, metadata)
    except (OSError, RuntimeError) as e:
        return _write_error(part, e), None


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


# Test hook (tests/trainer/test_faults.py): "WHERE:STEP:RANK" makes that rank SIGKILL itself at
# that point of that step, on the first attempt of an elastic run only.
KILL_ENV = "LONGCTX_MOE_TEST_KILL"


def kill_point(where: str, step: int, rank: int) -> None:
    if os.environ.get(KILL_ENV) == f"{where}:{step}:{rank}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


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
    torn = [path for number, path in _step_dirs(ckpt_dir) if number < step and path not in complete]
    for old in [*torn, *complete[:-keep_last]]:
        if old.name != step_dir_name(step):
            _remove_step(old)


def _remove_step(step_dir: Path) -> None:
    """Delete a step directory, meta.json first and durably: a kill part-way through leaves a
    directory that no reader takes for a complete step."""
    try:
        (step_dir / "meta.json").unlink()
        _fsync_dir(step_dir)
    except FileNotFoundError:
        pass
    kill_point("prune", _step_number(step_dir.name) or 0, 0)
    shutil.rmtree(step_dir, ignore_errors=True)


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
    return [(n, p) for n, p in _step_dirs(ckpt_dir) if _incomplete_reason(p) is None]


def _incomplete_reason(step_dir: Path) -> str | None:
    """None when `step_dir` is complete: a readable meta.json and every file it lists present at
    its recorded size (checksums are checked when a file is read). Else why not, in words."""
    meta = _meta_or_none(step_dir)
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
    reason = None if named is None else _incomplete_reason(ckpt_dir / named)
    if named is not None and reason is None:
        return ckpt_dir / named
    complete = _complete_steps(ckpt_dir)
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


# ---------------------------------------------------------------------- loading


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
