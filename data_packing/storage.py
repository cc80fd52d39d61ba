"""The on-disk packed format (version 1) and its atomic writer.

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
        shard.json             fingerprint of the run + this shard's counters

Rows store real tokens only; padding is implied by doc_lengths_padded and never stored, so a
loader may re-pad to any multiple. Every file is written inside a temporary directory that is
renamed into place, and metadata.json is replaced atomically, so an interrupted run never leaves
a directory that loads as complete.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

FORMAT_VERSION = 1
METADATA = "metadata.json"
TOKENIZER = "tokenizer.json"


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


def write_shard(out_dir: str, k: int, arrays: dict[str, np.ndarray], info: dict) -> None:
    """Write one shard into a temp dir and rename it to shard_k. arrays: name -> array; `.bin`
    names are written raw, others with np.save."""
    final = os.path.join(out_dir, shard_name(k))
    tmp = os.path.join(out_dir, f".tmp_{shard_name(k)}_{os.getpid()}")
    for name in os.listdir(out_dir):  # leftovers of an interrupted attempt at this shard
        if name.startswith(f".tmp_{shard_name(k)}_"):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    os.makedirs(tmp)
    for name, arr in arrays.items():
        path = os.path.join(tmp, name)
        if name.endswith(".bin"):
            arr.tofile(path)
        else:
            np.save(path, arr, allow_pickle=False)
    with open(os.path.join(tmp, "shard.json"), "wb") as f:
        f.write(dumps(info))
    if os.path.exists(final):  # a stale shard of an incompatible run (caller allowed --overwrite)
        shutil.rmtree(final)
    os.rename(tmp, final)


def finished_shard(out_dir: str, k: int, fingerprint: str) -> dict | None:
    """shard.json of shard k if it is complete and was built by the same run, else None.
    Raises when it exists but belongs to a different run (the caller decides on --overwrite)."""
    path = os.path.join(out_dir, shard_name(k), "shard.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        info = json.load(f)
    if info.get("fingerprint") != fingerprint:
        raise FileExistsError(
            f"{os.path.dirname(path)} was written by a run with different inputs or arguments; "
            "use a new --output or pass --overwrite")
    return info


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def load_shard(shard_dir: str, dtype: str, mmap: bool = True) -> dict[str, np.ndarray]:
    """The arrays of one shard; tokens (and loss_mask) memory-mapped when mmap."""
    out = {}
    for name in ("row_docs", "row_tokens", "doc_lengths", "doc_lengths_padded", "doc_source"):
        out[name] = np.load(os.path.join(shard_dir, f"{name}.npy"), allow_pickle=False)
    n_tok = int(out["row_tokens"][-1])
    for name, dt in (("tokens", dtype), ("loss_mask", "uint8")):
        path = os.path.join(shard_dir, f"{name}.bin")
        if not os.path.exists(path):
            continue
        expected = n_tok * np.dtype(dt).itemsize
        if os.path.getsize(path) != expected:
            raise ValueError(f"{path} has {os.path.getsize(path)} bytes, expected {expected}: the "
                             "shard is corrupt; delete it and rerun longctx-pack")
        if n_tok == 0:
            out[name] = np.zeros(0, dtype=dt)
        elif mmap:
            out[name] = np.memmap(path, dtype=dt, mode="r", shape=(n_tok,))
        else:
            out[name] = np.fromfile(path, dtype=dt)
    return out
