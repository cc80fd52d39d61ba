"""Reading a checkpoint step (longctx_moe.checkpoint's format) under any parallel layout.

`CheckpointReader(step_dir, expect)` checks meta.json (format, the expected model config), then
serves any slice of any tensor: `read(key, global_shape, offsets, shape)` copies the overlapping
parts of the pieces that meta.json's index lists, from whichever rank files hold them. Each file is
read once, whole, into memory, its sha256 computed on a second thread while the next block is read
(both release the GIL), and checked with its size against meta.json before any tensor of it is
used; `prefetch` reads several files at once. A damaged, truncated or missing file is a one-line
CheckpointError naming it and the older step to resume from.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from longctx_moe.checkpoint import (
    _ST_DTYPES,
    FORMAT_VERSION,
    CheckpointError,
    _complete_steps,
    _meta_or_none,
    _step_number,
    rank_file_name,
)


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


class CheckpointReader:
    """One step directory, read by global slice under any layout. Each rank file is checked
    against meta.json (size, sha256) once, before the first read from it."""

    def __init__(self, step_dir: str | Path, expect: dict[str, Any] | None = None):
        """`expect`: meta entries (e.g. the model config) that must match; a difference is a
        one-line CheckpointError naming the first differing key."""
        self.step_dir = Path(step_dir)
        self.meta = read_meta(self.step_dir)
        if self.meta.get("format", 1) < 3:
            raise CheckpointError(f"checkpoint '{self.step_dir}' has format {self.meta.get('format', 1)} (pickled rank "
                                  "files of an older longctx_moe); resume it with that version or set checkpoint.resume=none")
        _check_expected(self.step_dir, self.meta, expect or {})
        self._index: dict[str, Any] = self.meta.get("tensors") or {}
        self._open: dict[str, Any] = {}

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self._index if k.startswith(prefix))

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["global_shape"])

    def _entry(self, key: str) -> dict[str, Any]:
        if key not in self._index:
            name = key.split(".", 1)[1] if key.startswith("model.") else key
            raise CheckpointError(f"checkpoint '{self.step_dir}' lacks tensor '{name}'; it was written for a different "
                                  "model: use the matching model config or set checkpoint.resume=none")
        return self._index[key]

    def file(self, name: str) -> RankFile:
        """Rank file `name`, read and verified on first use."""
        if name not in self._open:
            path = self.step_dir / name
            data = _read_verified(path, (self.meta.get("files") or {}).get(name))
            try:
                self._open[name] = RankFile(data)
            except (ValueError, KeyError, TypeError, RuntimeError, struct.error) as e:  # a header no checksum vouched for
                raise CheckpointError(f"checkpoint file '{path}' cannot be read as safetensors ({type(e).__name__}): it is "
                                      f"corrupt; {_older_step_hint(path.parent)}") from None
        return self._open[name]

    def prefetch(self, names: list[str], workers: int = 4) -> None:
        """Read and verify rank files `names` at once (reads and hashes release the GIL)."""
        todo = [n for n in dict.fromkeys(names) if n not in self._open]
        with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
            for name, handle in zip(todo, pool.map(self.file, todo), strict=True):
                self._open[name] = handle

    def files_of(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[str]:
        """The rank files holding a part of the slice [offsets, offsets + shape) of `key`."""
        out = []
        for piece in self._index.get(key, {}).get("pieces", []):
            if all(max(a, b) < min(a + n, b + m)
                   for a, n, b, m in zip(offsets, shape, piece["offsets"], piece["shape"], strict=True)):
                out.append(piece["file"])
        return out

    def read(self, key: str, global_shape: tuple[int, ...], offsets: tuple[int, ...],
             shape: tuple[int, ...], copy: bool = True) -> torch.Tensor:
        """The slice [offsets, offsets + shape) of tensor `key` (whose global shape must be
        `global_shape`), assembled from the pieces that overlap it, in the stored dtype.
        `copy=False`: where the slice is one stored piece, return the file's copy-on-write
        mapping of it, shared with any later read of the key (for a caller that copies it)."""
        entry = self._entry(key)
        if tuple(entry["global_shape"]) != tuple(global_shape):
            name = key.split(".", 1)[1] if key.startswith("model.") else key
            raise CheckpointError(f"checkpoint '{self.step_dir}' has '{name}' of shape {tuple(entry['global_shape'])} but "
                                  f"the model expects {tuple(global_shape)}; use the matching model config or set "
                                  "checkpoint.resume=none")
        for piece in entry["pieces"]:  # the slice is one stored piece (same layout): one copy
            if list(piece["offsets"]) == list(offsets) and list(piece["shape"]) == list(shape):
                # A view of the file's bytes, which every read of the key shares: a copy keeps
                # what the caller changes (AdamW state) out of later reads.
                data = self.file(piece["file"]).get_tensor(key)
                return data.clone() if copy else data
        out = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for piece in entry["pieces"]:
            covered += self._copy_overlap(key, piece, out, offsets)
        if covered != out.numel():
            raise CheckpointError(f"checkpoint '{self.step_dir}' holds {covered} of the {out.numel()} elements of "
                                  f"'{key}' this rank needs (meta.json's index is incomplete); resume from another step")
        return out

    def _copy_overlap(self, key: str, piece: dict[str, Any], out: torch.Tensor, offsets: tuple[int, ...]) -> int:
        """Copy the part of `piece` inside `out`'s slice; return the number of elements copied."""
        lo = [max(a, b) for a, b in zip(offsets, piece["offsets"], strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, out.shape, piece["offsets"], piece["shape"], strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return 0
        handle = self.file(piece["file"])
        src = tuple(slice(low - p, h - p) for low, h, p in zip(lo, hi, piece["offsets"], strict=True))
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets, strict=True))
        if list(piece["shape"]) == [h - low for low, h in zip(lo, hi, strict=True)]:
            data = handle.get_tensor(key)  # the whole piece (scalars too)
        else:
            data = handle.get_slice(key)[src]
        out[dst] = data
        return data.numel()

    def rank_state(self, rank: int) -> dict[str, Any]:
        """The JSON state rank `rank` saved (RNG, loader position)."""
        name = rank_file_name(rank)
        try:
            return json.loads(self.file(name).metadata()["state"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint file '{self.step_dir / name}' has no readable rank state: it is corrupt; "
                                  f"{_older_step_hint(self.step_dir)}") from None


_READ_BLOCK = 32 << 20  # bytes per read: hashed on one thread while the next is read on another


def _read_verified(path: Path, entry: dict[str, Any] | None) -> torch.Tensor:
    """uint8 [size]: the file's bytes, read once; its size and sha256 checked against `entry`."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing; {_older_step_hint(path.parent)}")
    size = path.stat().st_size
    if entry is not None and size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file '{path}' has {size} bytes but meta.json records {entry['bytes']} "
                              f"(truncated or overwritten); {_older_step_hint(path.parent)}")
    data = torch.empty(size, dtype=torch.uint8)
    view = memoryview(data.numpy())
    digest, pos = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as hasher:  # one worker: in order
        while pos < size:
            n = f.readinto(view[pos:pos + _READ_BLOCK])
            if not n:
                break
            hasher.submit(digest.update, view[pos:pos + n])
            pos += n
    if pos != size:
        raise CheckpointError(f"checkpoint file '{path}' ended after {pos} of its {size} bytes (changed while read); "
                              f"{_older_step_hint(path.parent)}")
    # No checksum recorded (meta.json edited by hand): the parser's own errors apply.
    if entry is not None and digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file '{path}' fails its sha256 check (its bytes changed after the save); "
                              f"{_older_step_hint(path.parent)}")
    return data


_TORCH_DTYPES = {name: dtype for dtype, name in _ST_DTYPES.items()}


class RankFile:
    """A safetensors file held in memory (uint8 `data`): tensors are views of its bytes."""

    def __init__(self, data: torch.Tensor):
        (n,) = struct.unpack("<Q", data[:8].numpy().tobytes())
        if n > data.numel() - 8:
            raise ValueError(f"header of {n} bytes in a file of {data.numel()}")
        header = json.loads(data[8:8 + n].numpy().tobytes())
        self._metadata = header.pop("__metadata__", None) or {}
        self._data, self._start, self._header = data, 8 + n, header

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self._header[key]
        begin, end = entry["data_offsets"]
        raw = self._data[self._start + begin:self._start + end]
        dtype = _TORCH_DTYPES[entry["dtype"]]
        if (self._start + begin) % dtype.itemsize:  # after an odd-sized tensor: realign by a copy
            raw = raw.clone()
        return raw.view(dtype).reshape(entry["shape"])

    def get_slice(self, key: str) -> torch.Tensor:
        return self.get_tensor(key)  # indexing a view copies nothing


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
