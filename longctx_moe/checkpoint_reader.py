"""Reading a checkpoint step (longctx_moe.checkpoint's format) under any parallel layout.

`CheckpointReader(step_dir, expect)` checks meta.json (format, the expected model config), then
serves any slice of any tensor: `read(key, global_shape, offsets, shape)` copies the overlapping
parts of the pieces that meta.json's index lists, from whichever rank files hold them. Each file is
read once, each tensor straight into memory of its own, its sha256 computed on a second thread while
the next block is read (both release the GIL), and checked with its size against meta.json before
any tensor of it is used; `prefetch` reads several files at once. A damaged, truncated or missing file is a one-line
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
            try:
                self._open[name] = _read_verified(path, (self.meta.get("files") or {}).get(name))
            except CheckpointError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:  # a header no checksum vouched for
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
        `copy=False`: where the slice is one stored piece, return the reader's own tensor of it,
        shared with any later read of the key (for a caller that reads each key once)."""
        entry = self._entry(key)
        if tuple(entry["global_shape"]) != tuple(global_shape):
            name = key.split(".", 1)[1] if key.startswith("model.") else key
            raise CheckpointError(f"checkpoint '{self.step_dir}' has '{name}' of shape {tuple(entry['global_shape'])} but "
                                  f"the model expects {tuple(global_shape)}; use the matching model config or set "
                                  "checkpoint.resume=none")
        for piece in entry["pieces"]:  # the slice is one stored piece (same layout): one copy
            if list(piece["offsets"]) == list(offsets) and list(piece["shape"]) == list(shape):
                # The reader's tensor, which every read of the key shares: a copy keeps what
                # the caller changes out of later reads.
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
_TORCH_DTYPES = {name: dtype for dtype, name in _ST_DTYPES.items()}


class RankFile:
    """A safetensors file read into memory: one tensor of its own per key (what the optimizer
    keeps needs no copy, and nothing holds the rest of the file alive)."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
        self._tensors, self._metadata = tensors, metadata

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def get_slice(self, key: str) -> torch.Tensor:
        return self._tensors[key]  # indexing it copies nothing


class _HashedReader:
    """Reads a file front to back into given buffers; a second thread hashes each block (in
    order) while the next one is read: both release the GIL, so the checksum costs no pass."""

    def __init__(self, f, hasher: ThreadPoolExecutor):
        self.f, self.hasher, self.digest, self.pos = f, hasher, hashlib.sha256(), 0

    def into(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            n = self.f.readinto(view[done:done + _READ_BLOCK])
            if not n:
                break
            self.hasher.submit(self.digest.update, view[done:done + n])
            done += n
        self.pos += done
        return done

    def bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[:self.into(memoryview(buf))])


def _parse_header(raw: bytes, size: int) -> tuple[int, int]:
    """(header length, bytes before the tensor data) of a safetensors file; ValueError if malformed."""
    if len(raw) < 8:
        raise ValueError(f"{size} bytes, shorter than a header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > size - 8:
        raise ValueError(f"a header of {n} bytes in a file of {size}")
    return n, 8 + n


def _read_tensors(r: _HashedReader, header: dict[str, Any], size: int) -> dict[str, torch.Tensor]:
    """Every tensor of `header`, in file order, each read straight into its own memory."""
    out = {}
    base = r.pos
    for key, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = e["data_offsets"]
        if begin != r.pos - base:
            r.bytes(begin - (r.pos - base))  # a gap (none in our files): hashed, not kept
        t = torch.empty(e["shape"], dtype=_TORCH_DTYPES[e["dtype"]])
        if t.numel() * t.element_size() != end - begin:
            raise ValueError(f"tensor '{key}' of shape {e['shape']} does not fill its {end - begin} bytes")
        if t.numel():
            r.into(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        out[key] = t
    return out


def _read_verified(path: Path, entry: dict[str, Any] | None) -> RankFile:
    """The rank file at `path`, read once, its size and sha256 checked against `entry` (None: no
    checksum recorded, meta.json edited by hand; the parser's own errors apply)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing; {_older_step_hint(path.parent)}")
    size = path.stat().st_size
    if entry is not None and size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file '{path}' has {size} bytes but meta.json records {entry['bytes']} "
                              f"(truncated or overwritten); {_older_step_hint(path.parent)}")
    parsed, error = None, None
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as hasher:  # one worker: in order
        r = _HashedReader(f, hasher)
        try:
            head = r.bytes(8)
            n, _ = _parse_header(head, size)
            header = json.loads(r.bytes(n))
            metadata = header.pop("__metadata__", None) or {}
            parsed = RankFile(_read_tensors(r, header, size), metadata)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
            error = e  # a checksum mismatch explains it better, if there is one: hash the rest
        r.bytes(size - r.pos)
    if entry is not None and r.digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file '{path}' fails its sha256 check (its bytes changed after the save); "
                              f"{_older_step_hint(path.parent)}")
    if error is not None:
        raise error
    return parsed


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
