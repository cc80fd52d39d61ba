"""Parquet input read as a stream with pyarrow: one column, record batches of bounded size.

Opening reads only the footers (row counts) and hashes each file's content (part of the run's
identity, as for JSONL). Records are read by index range with `iter_batches`, continuing the last
reader when ranges follow each other (the normal case: a shard reads its records in order), so a
row group of any size is never loaded whole. A list column of integers becomes numpy arrays
straight from Arrow's offsets and values (no Python ints).
"""

from __future__ import annotations

import hashlib

import numpy as np

# Rows per Arrow record batch: bounded memory for any row-group size.
_BATCH_ROWS = 1024
_HASH_BLOCK = 8 << 20


def _file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


class ParquetRecords:
    """The `key` column of some Parquet files, indexable by slice (None for nulls)."""

    def __init__(self, paths: list[str]):
        import pyarrow.parquet as pq

        self.paths, self.key, self.ids = paths, None, False
        self._rows, self.columns = [], None
        for p in paths:
            try:
                meta = pq.ParquetFile(p).metadata
            except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
                raise ValueError(f"cannot read {p!r} as parquet ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:160]}); check the file is valid and "
                                 "complete") from None
            self._rows.append(meta.num_rows)
            names = meta.schema.to_arrow_schema().names
            self.columns = names if self.columns is None else [c for c in self.columns if c in names]
        self.hashes = [_file_hash(p) for p in paths]
        self._first = np.cumsum([0] + self._rows)
        self._cursor = None  # (file, next global index, batch iterator, leftover rows)

    def __len__(self) -> int:
        return int(self._first[-1])

    def use(self, key: str, ids: bool) -> None:
        self.key, self.ids, self._cursor = key, ids, None

    def __getstate__(self):  # a live reader does not travel to other processes
        return {**self.__dict__, "_cursor": None}

    def _iter_from(self, f: int, row: int):
        """Record batches of file f's column from `row` on, and how many rows to skip first."""
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.paths[f])
        return pf.iter_batches(batch_size=_BATCH_ROWS, columns=[self.key]), row

    def _rows_of(self, lo: int, hi: int):
        """Arrow arrays covering records [lo, hi) in order."""
        while lo < hi:
            f = int(np.searchsorted(self._first, lo, side="right")) - 1
            base, end = int(self._first[f]), min(hi, int(self._first[f + 1]))
            if self._cursor is None or self._cursor[:2] != (f, lo):
                batches, skip = self._iter_from(f, lo - base)
                self._cursor = (f, base, batches, None)
                pending = None
                while skip > 0:  # from the file's start: only on a jump backwards or a first read
                    col = next(batches).column(0)
                    if len(col) > skip:
                        pending = col.slice(skip)
                    skip -= len(col)
                self._cursor = (f, lo, batches, pending)
            f, pos, batches, pending = self._cursor
            while pos < end:
                col = pending if pending is not None else next(batches).column(0)
                take = min(len(col), end - pos)
                yield col.slice(0, take)
                pending = col.slice(take) if take < len(col) else None
                pos += take
            self._cursor = (f, pos, batches, pending)
            lo = end

    def __getitem__(self, sl: slice) -> list:
        start, stop, _ = sl.indices(len(self))
        out = []
        for col in self._rows_of(start, stop):
            out.extend(self._values(col))
        return out

    def _values(self, col) -> list:
        import pyarrow as pa

        if not (self.ids and (pa.types.is_list(col.type) or pa.types.is_large_list(col.type))
                and pa.types.is_integer(col.type.value_type) and col.values.null_count == 0):
            return col.to_pylist()
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(col))]

    def peek(self, key: str, n: int = 64) -> list:
        """The first n values of column `key`."""
        saved = (self.key, self.ids)
        self.use(key, False)
        try:
            return self[0:min(n, len(self))]
        finally:
            self.use(*saved)
