"""One rank's checkpoint file: safetensors, written and read with its checksums computed alongside.

The checksum is a sha256 per HASH_BLOCK bytes of the file (meta.json: `block_bytes`,
`block_sha256`): one sha256 stream runs at ~1.7 GB/s on a core, slower than reading a file from
the page cache, so a whole-file digest made every verified load wait on one core; blocks are
hashed on several threads at once, the guarantee per byte unchanged. Writing streams each
tensor's bytes to the file with no copy while the pool hashes the blocks already written;
reading fills each tensor's own memory while the pool hashes the blocks already read (hashlib
releases the GIL), and checks size and every block's sha256 against meta.json before any tensor
of the file is used. Files recorded with one whole-file `sha256` (older checkpoints) are
verified that way. No pickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.steps import older_step_hint

# torch dtype -> safetensors dtype name (https://github.com/huggingface/safetensors, format).
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _safetensors_chunks(tensors: dict[str, torch.Tensor], metadata: dict[str, str]):
    """The bytes of a safetensors file, in pieces: an 8-byte little-endian header length, the JSON
    header (padded to 8 bytes), then each tensor's bytes in header order (no copies)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        header[key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    yield struct.pack("<Q", len(raw)) + raw
    for t in tensors.values():
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())


HASH_BLOCK = 64 << 20  # bytes per sha256 block; the last block of a file may be shorter
HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))


def _sha256_of(pieces: list[memoryview]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


class _BlockHasher:
    """The sha256 of each `block`-byte block of a byte stream fed in order, in pieces of any size.
    A block is handed to the pool once complete (views of its pieces, no copy: the caller keeps
    the memory alive), so blocks are hashed in parallel while the stream goes on."""

    def __init__(self, pool: ThreadPoolExecutor, block: int | None = None):
        self.pool, self.block = pool, block or HASH_BLOCK
        self.pieces: list[memoryview] = []
        self.filled = 0
        self.futures: list = []

    def feed(self, view: memoryview) -> None:
        while view.nbytes:
            take = min(view.nbytes, self.block - self.filled)
            self.pieces.append(view[:take])
            self.filled, view = self.filled + take, view[take:]
            if self.filled == self.block:
                self._submit()

    def _submit(self) -> None:
        self.futures.append(self.pool.submit(_sha256_of, self.pieces))
        self.pieces, self.filled = [], 0

    def hexdigests(self) -> list[str]:
        if self.filled:
            self._submit()
        return [f.result() for f in self.futures]


class _StreamHasher:
    """One sha256 over the whole stream (files recorded before block checksums), hashed on a
    one-worker pool while the stream goes on: its queue keeps the pieces in order."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool, self.digest, self.last = pool, hashlib.sha256(), None

    def feed(self, view: memoryview) -> None:
        self.last = self.pool.submit(self.digest.update, view)

    def hexdigest(self) -> str:
        if self.last is not None:
            self.last.result()  # the last piece queued: every earlier one is hashed
        return self.digest.hexdigest()


def write_rank_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write one safetensors file (contiguous CPU tensors) and fsync it; return its size and the
    sha256 of each HASH_BLOCK-byte block. The bytes go straight from the tensors to the file, and
    the pool hashes each block already written while the next bytes go out: the checksums cost
    no second pass."""
    size = 0
    with open(path, "wb") as f, ThreadPoolExecutor(HASH_WORKERS) as pool:
        hasher = _BlockHasher(pool, HASH_BLOCK)
        for chunk in _safetensors_chunks(tensors, metadata):
            view = memoryview(chunk)
            hasher.feed(view)
            f.write(chunk)
            size += view.nbytes
        digests = hasher.hexdigests()
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "block_bytes": HASH_BLOCK, "block_sha256": digests}


def block_sha256_file(path: Path, block: int | None = None) -> list[str]:
    """The sha256 of each `block`-byte block of the file at `path` (what meta.json records)."""
    out, block = [], block or HASH_BLOCK
    with open(path, "rb") as f:
        while chunk := f.read(block):
            out.append(hashlib.sha256(chunk).hexdigest())
    return out



_READ_BLOCK = 32 << 20  # bytes per read: hashed on the pool while the next is read
_TORCH_DTYPES = {name: dtype for dtype, name in ST_DTYPES.items()}


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
    """Reads a file front to back into given buffers; `hasher` (a _BlockHasher or _StreamHasher)
    gets every byte read, in order, and hashes on its pool while the next bytes are read."""

    def __init__(self, f, hasher):
        self.f, self.hasher, self.pos = f, hasher, 0

    def into(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            n = self.f.readinto(view[done:done + _READ_BLOCK])
            if not n:
                break
            self.hasher.feed(view[done:done + n])
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


def read_verified(path: Path, entry: dict[str, Any] | None) -> RankFile:
    """The rank file at `path`, read once, its size and checksums checked against `entry` (None:
    no checksum recorded, meta.json edited by hand; the parser's own errors apply)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing; {older_step_hint(path.parent)}")
    size = path.stat().st_size
    if entry is not None and size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file '{path}' has {size} bytes but meta.json records {entry['bytes']} "
                              f"(truncated or overwritten); {older_step_hint(path.parent)}")
    blocks = entry is None or "block_sha256" in entry
    parsed, error = None, None
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(HASH_WORKERS if blocks else 1) as pool:
        if blocks:
            hasher = _BlockHasher(pool, int(entry["block_bytes"]) if entry is not None else None)
        else:
            hasher = _StreamHasher(pool)
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
        matches = entry is None or (hasher.hexdigests() == entry["block_sha256"] if blocks
                                    else hasher.hexdigest() == entry["sha256"])
    if not matches:
        raise CheckpointError(f"checkpoint file '{path}' fails its sha256 check (its bytes changed after the save); "
                              f"{older_step_hint(path.parent)}")
    if error is not None:
        raise error
    return parsed
