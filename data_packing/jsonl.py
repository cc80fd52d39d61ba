"""JSON Lines input read as a stream: a byte offset per record, records read by index range.

Opening a file reads it once in small blocks to find where each record (non-blank line) starts and
to hash its content (the hash is part of the run's identity, so a file edited in place is never
mistaken for the one a shard was built from). Records are then read by index range with one seek
and one read per range, so memory holds one chunk of records, never the file.

Pre-tokenized records of the common shape `{"<ids key>": [1, 2, ...]}` skip the JSON parser: their
digits go straight to numpy (~3x faster than `json.loads` plus `np.array`); any other line is
parsed with `json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import numpy as np

# Read block of the indexing pass: small, so indexing a multi-GB file stays within a few MB.
_BLOCK = 8 << 20
_NUMBER_CHARS = b"0123456789, \t"


class NotARecord:
    """Stands for a line that is valid JSON but not an object: counted as a bad record."""

    def __repr__(self) -> str:
        return "NotARecord"


NOT_A_RECORD = NotARecord()


class Unreadable:
    """Stands for a line that is not JSON: `reason` "decode" (not UTF-8) or "malformed"; counted
    as a dropped record (documents.py) unless the reader is strict."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"Unreadable({self.reason})"


def _index_file(path: str) -> tuple[np.ndarray, int, str]:
    """(int64 [n] byte offset of each record, file size, sha256 of the content)."""
    starts, h, pos, prev = [], hashlib.sha256(), 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            u = np.frombuffer(block, np.uint8)
            nl = np.flatnonzero(u == 10)
            # A line starts after every newline (and at 0); keep it if its first byte is not a
            # newline or carriage return, i.e. the line is not blank.
            first = np.concatenate([[0] if prev == b"\n" else [], nl + 1]).astype(np.int64)
            first = first[first < len(u)]
            keep = (u[first] != 10) & (u[first] != 13)
            starts.append(first[keep] + pos)
            pos += len(block)
            prev = block[-1:]
    out = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    return out, pos, h.hexdigest()


class JsonlRecords:
    """The `key` field of every record of some JSONL files, indexable by slice (a list of raw
    values: None where the key is missing, NOT_A_RECORD for a non-object line, Unreadable for a
    line that is not JSON). strict: a line that is not JSON raises ValueError instead."""

    def __init__(self, paths: list[str], strict: bool = False):
        self.paths, self.key, self.ids_fast, self.strict = paths, None, False, strict
        idx = [_index_file(p) for p in paths]
        self._starts = [s for s, _, _ in idx]
        self._sizes = [n for _, n, _ in idx]
        self.hashes = [h for _, _, h in idx]
        self._first = np.cumsum([0] + [len(s) for s in self._starts])  # global index of each file's first

    def __len__(self) -> int:
        return int(self._first[-1])

    def use(self, key: str, ids: bool) -> None:
        """Return the `key` field from now on; ids: the field holds token ids (numpy arrays)."""
        self.key, self.ids_fast = key, ids
        self._prefixes = tuple(p.encode() for p in (f'{{"{key}": [', f'{{"{key}":['))

    def _lines(self, lo: int, hi: int):
        """(path, line number, bytes) of records [lo, hi), reading each file's part at once."""
        f_lo = int(np.searchsorted(self._first, lo, side="right")) - 1
        while lo < hi:
            base = int(self._first[f_lo])
            n_file = len(self._starts[f_lo])
            stop = min(hi, base + n_file)
            starts = self._starts[f_lo]
            a = int(starts[lo - base])
            b = int(starts[stop - base]) if stop - base < n_file else self._sizes[f_lo]
            with open(self.paths[f_lo], "rb") as f:
                f.seek(a)
                blob = f.read(b - a)
            lines = [ln for ln in blob.split(b"\n") if ln and ln != b"\r"]
            for j, line in enumerate(lines):
                yield self.paths[f_lo], lo + j - base + 1, line
            lo, f_lo = stop, f_lo + 1

    def byte_size(self, lo: int, hi: int) -> int:
        """Bytes of records [lo, hi) inside one file (chunking bound); hi > lo."""
        f = int(np.searchsorted(self._first, lo, side="right")) - 1
        base, starts = int(self._first[f]), self._starts[f]
        end = int(starts[hi - base]) if hi - base < len(starts) else self._sizes[f]
        return end - int(starts[lo - base])

    def file_end(self, i: int) -> int:
        """Index one past the last record of the file holding record i."""
        return int(self._first[int(np.searchsorted(self._first, i, side="right"))])

    def __getitem__(self, sl: slice) -> list:
        start, stop, _ = sl.indices(len(self))
        out = []
        with warnings.catch_warnings():
            # numpy warns (here: raises) when a number list has malformed parts; those lines
            # go through json instead.
            warnings.simplefilter("error", DeprecationWarning)
            for path, lineno, line in self._lines(start, stop):
                value = self._fast_ids(line) if self.ids_fast else None
                out.append(value if value is not None else self._parse(path, lineno, line))
        return out

    def _fast_ids(self, line: bytes) -> np.ndarray | None:
        line = line.rstrip()
        if not line.endswith(b"]}") or not line.startswith(self._prefixes):
            return None
        inner = line[line.index(b"[") + 1:-2]
        if inner.translate(None, _NUMBER_CHARS):
            return None
        if not inner.strip():
            return np.zeros(0, np.int64)
        try:
            return np.fromstring(inner, dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            return None

    def _parse(self, path: str, lineno: int, line: bytes, whole: bool = False):
        try:
            rec = json.loads(line)
        except ValueError as e:  # UnicodeDecodeError is a ValueError too
            if not self.strict:
                return Unreadable("decode" if isinstance(e, UnicodeDecodeError) else "malformed")
            raise ValueError(f"cannot read {path!r} as json (record {lineno}: {e}); check the file "
                             "is valid and complete, or leave out --strict to skip and count such "
                             "records") from None
        if whole:
            return rec
        if not isinstance(rec, dict):
            return NOT_A_RECORD
        value = rec.get(self.key)
        if self.ids_fast and isinstance(value, list) and all(type(v) is int for v in value):
            return np.asarray(value, dtype=np.int64)
        return value

    def peek(self, n: int = 64) -> list:
        """The first n records as parsed JSON (to choose the column and the record kind)."""
        return [self._parse(p, i, ln, whole=True) for p, i, ln in self._lines(0, min(n, len(self)))]


def file_identity(path: str) -> dict:
    """Size and modification time of an input file (its content hash comes from indexing)."""
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
