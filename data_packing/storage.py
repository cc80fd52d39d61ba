"""The on-disk packed format (version 2) and its atomic writer.

    OUT/
      metadata.json            written LAST; a directory without it is not a finished output
      tokenizer.json           the tokenizer the tokens came from (its sha256 is in metadata)
      shard_00000/             renamed into place only when complete
        tokens.bin             token ids of all rows, concatenated (uint16 or uint32, raw)
        loss_mask.bin          uint8 per token, 1 = supervised (chat corpora only)
        row_docs.npy           int64 [R+1]  pieces of row r: [row_docs[r], row_docs[r+1])
        row_tokens.npy         int64 [R+1]  tokens of row r: [row_tokens[r], row_tokens[r+1])
        doc_lengths.npy        int32 [D]    real length of each document piece, in row order
        doc_lengths_padded.npy int32 [D]    length padded to the CP/TP multiple (physical slot)
        doc_source.npy         int64 [D, 2] (input document index, first token inside it)
        shard.json             fingerprint of the run, this shard's counters, and the size and
                               checksum of every file above (`file_digest`)

Rows store real tokens only; padding is implied by doc_lengths_padded and never stored, so a
loader may re-pad to any multiple. Every file is written inside a temporary directory that is
renamed into place, and metadata.json is replaced atomically, so an interrupted run never leaves
a directory that loads as complete. Loading checks every file against shard.json: sizes always,
checksums too unless asked for the fast check; a damaged or missing file is named together with
what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no file sizes or checksums in shard.json
METADATA = "metadata.json"
TOKENIZER = "tokenizer.json"
SHARD_INFO = "shard.json"
VERIFY_MODES = ("full", "sizes")
# Checksum unit: a file's digest is the sha256 of its blocks' sha256 digests, so the blocks of one
# large file can be hashed by several processes.
DIGEST_BLOCK = 64 << 20


def shard_name(k: int) -> str:
    return f"shard_{k:05d}"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_bytes_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dumps(obj) -> bytes:
    """Canonical JSON (sorted keys) so equal content gives equal bytes."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def begin_shard(out_dir: str, k: int) -> str:
    """A fresh temporary directory for shard k (leftovers of an interrupted attempt removed)."""
    for name in os.listdir(out_dir):
        if name.startswith(f".tmp_{shard_name(k)}_"):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    tmp = os.path.join(out_dir, f".tmp_{shard_name(k)}_{os.getpid()}")
    os.makedirs(tmp)
    return tmp


def commit_shard(out_dir: str, k: int, tmp: str, info: dict) -> None:
    """Write shard.json into tmp and rename tmp to shard_k (replacing a damaged or stale one)."""
    with open(os.path.join(tmp, SHARD_INFO), "wb") as f:
        f.write(dumps(info))
    final = os.path.join(out_dir, shard_name(k))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)


def block_digests(path: str, blocks: range) -> list[str]:
    """sha256 of the given DIGEST_BLOCK-sized blocks of a file."""
    out = []
    with open(path, "rb") as f:
        for b in blocks:
            f.seek(b * DIGEST_BLOCK)
            h, left = hashlib.sha256(), DIGEST_BLOCK
            while left and (data := f.read(min(left, 8 << 20))):
                h.update(data)
                left -= len(data)
            out.append(h.hexdigest())
    return out


def num_blocks(size: int) -> int:
    return max(1, -(-size // DIGEST_BLOCK))


def combine_digests(digests: list[str]) -> str:
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def file_digest(path: str) -> str:
    return combine_digests(block_digests(path, range(num_blocks(os.path.getsize(path)))))


def shard_problem(shard_dir: str, files: dict, mode: str = "sizes") -> str | None:
    """What is wrong with a shard's files against shard.json's `files` entry, or None.
    mode "sizes" compares sizes only; "full" also recomputes every checksum."""
    for name, want in sorted(files.items()):
        path = os.path.join(shard_dir, name)
        if not os.path.exists(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != want["bytes"]:
            return f"{path} has {size} bytes, expected {want['bytes']}"
        if mode == "full" and "sha256" in want and file_digest(path) != want["sha256"]:
            return f"{path} does not match its checksum"
    return None


def finished_shard(out_dir: str, k: int, fingerprint: str) -> dict | None:
    """shard.json of shard k if it is complete, intact (file sizes) and built by the same run,
    else None (a damaged shard is then rebuilt). Raises when it belongs to a different run (the
    caller decides on --overwrite)."""
    shard_dir = os.path.join(out_dir, shard_name(k))
    path = os.path.join(shard_dir, SHARD_INFO)
    if not os.path.exists(path):
        return None
    try:
        info = read_json(path)
    except ValueError:
        return None  # a damaged shard.json: rebuild the shard
    if info.get("fingerprint") != fingerprint:
        raise FileExistsError(
            f"{shard_dir} was written by a run with different inputs or arguments; "
            "use a new --output or pass --overwrite")
    if "files" not in info or shard_problem(shard_dir, info["files"]) is not None:
        return None
    return info


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _format1_files(shard_dir: str) -> dict:
    """Format 1 recorded no file list: the files it always wrote, sizes as found (so only the
    token count against row_tokens.npy is checked)."""
    names = [f"{n}.npy" for n in ("row_docs", "row_tokens", "doc_lengths", "doc_lengths_padded",
                                  "doc_source")] + ["tokens.bin"]
    names += ["loss_mask.bin"] if os.path.exists(os.path.join(shard_dir, "loss_mask.bin")) else []
    return {n: {"bytes": os.path.getsize(os.path.join(shard_dir, n))
                if os.path.exists(os.path.join(shard_dir, n)) else -1} for n in names}


def _damaged(problem: str, shard_dir: str) -> ValueError:
    return ValueError(f"{problem}: shard {os.path.basename(shard_dir)} is damaged; delete "
                      f"{shard_dir} and rerun longctx-pack with the same arguments (it rebuilds "
                      "missing shards)")


def load_shard(shard_dir: str, dtype: str, mmap: bool = True, verify: str = "sizes",
               names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The arrays of one shard, each file checked against shard.json first (verify "sizes" or
    "full", see shard_problem); tokens (and loss_mask) memory-mapped when mmap. names: only these
    arrays (default: all)."""
    info_path = os.path.join(shard_dir, SHARD_INFO)
    try:
        info = read_json(info_path)
    except (OSError, ValueError):
        raise _damaged(f"{info_path} is missing or unreadable", shard_dir) from None
    files = info.get("files") or _format1_files(shard_dir)
    problem = shard_problem(shard_dir, files, verify)
    if problem is not None:
        raise _damaged(problem, shard_dir)
    out = {}
    for name in sorted(files, key=lambda n: not n.endswith(".npy")):  # row_tokens first
        key, ext = os.path.splitext(name)
        if names is not None and key not in names:
            continue
        path = os.path.join(shard_dir, name)
        if ext == ".npy":
            try:
                out[key] = np.load(path, allow_pickle=False)
            except ValueError as e:
                raise _damaged(f"{path} cannot be read ({e})", shard_dir) from None
        else:
            dt = "uint8" if key == "loss_mask" else dtype
            n = files[name]["bytes"] // np.dtype(dt).itemsize
            if "row_tokens" in out and n != int(out["row_tokens"][-1]):
                raise _damaged(f"{path} holds {n} tokens, row_tokens.npy says "
                               f"{int(out['row_tokens'][-1])}", shard_dir)
            if n == 0:
                out[key] = np.zeros(0, dtype=dt)
            elif mmap:
                out[key] = np.memmap(path, dtype=dt, mode="r", shape=(n,))
            else:
                out[key] = np.fromfile(path, dtype=dt)
    return out
