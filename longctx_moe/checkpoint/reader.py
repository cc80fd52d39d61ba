"""Reading a checkpoint step under any parallel layout.

`CheckpointReader(step_dir, expect)` checks meta.json (format, the expected model config), then
serves any slice of any tensor: `read(key, global_shape, offsets, shape)` copies the overlapping
parts of the pieces that meta.json's index lists, from whichever rank files hold them. Each file is
read once and verified (rank_file.py); `prefetch` reads several files at once. A damaged,
truncated or missing file is a one-line CheckpointError naming it and the older step to resume from.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.rank_file import RankFile, read_verified
from longctx_moe.checkpoint.steps import older_step_hint, rank_file_name, read_meta


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
                self._open[name] = read_verified(path, (self.meta.get("files") or {}).get(name))
            except CheckpointError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:  # a header no checksum vouched for
                raise CheckpointError(f"checkpoint file '{path}' cannot be read as safetensors ({type(e).__name__}): it is "
                                      f"corrupt; {older_step_hint(path.parent)}") from None
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
                                  f"{older_step_hint(self.step_dir)}") from None


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
