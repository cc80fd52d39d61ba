"""One rank's checkpoint file: safetensors, written and read with its sha256 computed alongside.

Writing streams each tensor's bytes to the file with no copy while a second thread hashes the
previous piece; reading fills each tensor's own memory block by block while a second thread
hashes the previous block (both release the GIL), and checks size and sha256 against meta.json
before any tensor of the file is used. No pickles.
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


def write_rank_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
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


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()



_READ_BLOCK = 32 << 20  # bytes per read: hashed on one thread while the next is read on another
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


def read_verified(path: Path, entry: dict[str, Any] | None) -> RankFile:
    """The rank file at `path`, read once, its size and sha256 checked against `entry` (None: no
    checksum recorded, meta.json edited by hand; the parser's own errors apply)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing; {older_step_hint(path.parent)}")
    size = path.stat().st_size
    if entry is not None and size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file '{path}' has {size} bytes but meta.json records {entry['bytes']} "
                              f"(truncated or overwritten); {older_step_hint(path.parent)}")
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
                              f"{older_step_hint(path.parent)}")
    if error is not None:
        raise error
    return parsed
