"""Corpus readers for `longctx-pack`: the bundled `stdlib` source and files read through `datasets`.

A `Corpus` is an indexable list of raw records (str text, bytes, list[int] ids, or a chat: list of
{"role", "content"} dicts; None when a record lacks the key). Records are interpreted and
validated in `documents.py`, so every bad record is counted there, never silently skipped.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass

from data_packing.jsonl import JsonlRecords, file_identity
from data_packing.parquet import ParquetRecords
from data_packing.tokenizer import sha256

STDLIB = "stdlib"
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class Corpus:
    name: str
    kind: str  # "text", "ids" or "chat": how `documents.py` reads each record
    records: object  # a sequence supporting len() and slicing
    column: str = "file"  # the field records are read from (named in warnings)

    def __len__(self) -> int:
        return len(self.records)

    def slice(self, start: int, stop: int) -> list:
        return list(self.records[start:stop])

    def chunks(self, lo: int, hi: int, max_docs: int, max_bytes: int = 64 << 20):
        """(start, stop) ranges covering [lo, hi): at most max_docs records each and, for JSONL,
        about max_bytes of input (a record larger than that is a chunk of its own)."""
        recs = getattr(self.records, "recs", self.records)  # through _Head
        start = lo
        while start < hi:
            stop = min(hi, start + max_docs)
            if isinstance(recs, JsonlRecords):
                stop = min(stop, recs.file_end(start))
                while stop - start > 1 and recs.byte_size(start, stop) > max_bytes:
                    stop = start + (stop - start) // 2
            yield start, stop
            start = stop

    def identity(self) -> str:
        """A hash of what the corpus is (names, sizes, modification times and, for JSONL, content),
        so a rerun on changed inputs never reuses shards built from the old ones."""
        recs = getattr(self.records, "recs", self.records)  # through _Head
        if isinstance(recs, JsonlRecords | ParquetRecords | _Files):
            root = os.path.commonpath(recs.paths) if recs.paths else ""
            listing = [(os.path.relpath(p, root), file_identity(p)) for p in recs.paths]
            hashes = getattr(recs, "hashes", None)  # content hashes (not for the stdlib)
            return sha256(repr((listing, hashes, len(self))).encode())
        return sha256(repr((recs.ds._fingerprint, recs.column, len(recs))).encode())


class _Files:
    """Lazily read files: slicing returns their bytes (read only when a shard needs them)."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, sl: slice) -> list[bytes]:
        out = []
        for p in self.paths[sl]:
            with open(p, "rb") as f:
                out.append(f.read())
        return out


def stdlib_files() -> list[str]:
    """The running Python's standard-library .py files, sorted by relative path (deterministic
    on one machine); installed packages (site-/dist-packages) are excluded."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def _expand(sources: list[str]) -> list[str]:
    paths = []
    for src in sources:
        matches = sorted(glob.glob(src)) if glob.has_magic(src) else [src]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise ValueError(f"input {src!r} does not exist (or the glob matches nothing); "
                             "pass existing files, a glob, a saved dataset directory, or `stdlib`")
        paths.extend(matches)
    return paths


def _load_dataset(paths: list[str]):
    import datasets

    datasets.disable_progress_bars()
    if len(paths) == 1 and os.path.isdir(paths[0]):
        try:
            ds = datasets.load_from_disk(paths[0])
        except Exception as e:  # noqa: BLE001 - report any reader failure as one line
            raise ValueError(f"cannot read {paths[0]!r} as a saved `datasets` directory "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"{paths[0]!r} is a DatasetDict without a 'train' split "
                                 f"(splits: {list(ds)}); save the split you want to pack")
            ds = ds["train"]
        return ds
    exts = {os.path.splitext(p)[1].lower() for p in paths}
    if len(exts) != 1 or next(iter(exts)) not in _FORMATS:
        raise ValueError(f"cannot tell the format of {paths[:3]}: use one kind of file with a "
                         f"suffix in {sorted(_FORMATS)} (or a saved dataset directory)")
    fmt = _FORMATS[exts.pop()]
    try:
        return datasets.load_dataset(fmt, data_files=paths, split="train")
    except Exception as e:  # noqa: BLE001
        cause = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        if e.__cause__ is not None:
            cause += f" <- {type(e.__cause__).__name__}: {str(e.__cause__).splitlines()[0][:160]}"
        raise ValueError(f"cannot read {paths if len(paths) > 1 else paths[0]!r} as {fmt} "
                         f"({cause}); check the file is valid and complete") from None


def _pick_column(ds, name: str, text_key: str, ids_key: str | None, messages_key: str):
    def first(key):
        return next((v for v in ds.select(range(min(len(ds), 64)))[key] if v is not None), "")

    return _choose(list(ds.column_names), name, text_key, ids_key, messages_key, first)


def _choose(cols: list[str], name: str, text_key: str, ids_key: str | None, messages_key: str,
            first) -> tuple[str, str]:
    """(column, record kind); first(key): the first non-null value of a column."""
    if ids_key is not None:
        if ids_key not in cols:
            raise ValueError(f"--ids-key {ids_key!r} is not a column of {name} (columns: {cols}); "
                             "pass the column holding token ids")
        return ids_key, "ids"
    if text_key in cols:
        return text_key, "chat" if isinstance(first(text_key), list) else "text"
    if messages_key in cols:
        return messages_key, "chat"
    raise ValueError(f"column {text_key!r} is not in {name} (columns: {cols}); pass --text-key "
                     "COLUMN, --ids-key COLUMN, or --messages-key COLUMN for chat records")


def open_corpus(sources: list[str], text_key: str = "text", ids_key: str | None = None,
                messages_key: str = "messages", max_docs: int | None = None, strict: bool = False) -> Corpus:
    """The records to pack, in a deterministic order, limited to the first `max_docs`. strict: a
    JSONL line that is not JSON raises ValueError (default: it becomes a dropped record)."""
    if sources == [STDLIB]:
        paths = stdlib_files()
        if not paths:
            raise ValueError("found no .py files under sysconfig's stdlib path; pass input files")
        recs = _Files(paths[:max_docs] if max_docs else paths)
        return Corpus(STDLIB, "text", recs)
    paths = _expand(sources)
    empty = [p for p in paths if os.path.isfile(p) and os.path.getsize(p) == 0]
    if empty:
        raise ValueError(f"input {empty[0]!r} is empty (0 bytes); pass a file with records or "
                         "leave it out")
    if all(p.lower().endswith(".jsonl") and os.path.isfile(p) for p in paths):
        return _open_jsonl(paths, text_key, ids_key, messages_key, max_docs, strict)
    if all(p.lower().endswith(".parquet") and os.path.isfile(p) for p in paths):
        return _open_parquet(paths, text_key, ids_key, messages_key, max_docs)
    ds = _load_dataset(paths)
    name = paths[0] if len(paths) == 1 else f"{len(paths)} files"
    if len(ds) == 0:
        raise ValueError(f"input {name!r} is empty (no records); pass a file with records or "
                         "leave it out")
    column, kind = _pick_column(ds, name, text_key, ids_key, messages_key)
    if max_docs:
        ds = ds.select(range(min(max_docs, len(ds))))
    return Corpus(name, kind, _Column(ds, column), column)


def _open_jsonl(paths, text_key, ids_key, messages_key, max_docs, strict: bool = False) -> Corpus:
    recs = JsonlRecords(paths, strict)
    name = paths[0] if len(paths) == 1 else f"{len(paths)} files"
    if len(recs) == 0:
        raise ValueError(f"input {name!r} is empty (no records, only blank lines); pass a file "
                         "with records or leave it out")
    first = [r for r in recs.peek() if isinstance(r, dict)]
    cols = list(dict.fromkeys(k for r in first for k in r))
    column, kind = _choose(cols, name, text_key, ids_key, messages_key,
                           lambda key: next((r[key] for r in first if r.get(key) is not None), ""))
    recs.use(column, ids=kind == "ids")
    return Corpus(name, kind, _Head(recs, max_docs) if max_docs else recs, column)


def _open_parquet(paths, text_key, ids_key, messages_key, max_docs) -> Corpus:
    recs = ParquetRecords(paths)
    name = paths[0] if len(paths) == 1 else f"{len(paths)} files"
    if len(recs) == 0:
        raise ValueError(f"input {name!r} is empty (no records); pass a file with records or "
                         "leave it out")
    first = lambda key: next((v for v in recs.peek(key) if v is not None), "")
    column, kind = _choose(recs.columns, name, text_key, ids_key, messages_key, first)
    recs.use(column, ids=kind == "ids")
    return Corpus(name, kind, _Head(recs, max_docs) if max_docs else recs, column)


class _Head:
    """The first n records of a record sequence (--max-docs)."""

    def __init__(self, recs, n: int):
        self.recs, self.n = recs, min(n, len(recs))
        self.paths = getattr(recs, "paths", None)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl: slice) -> list:
        start, stop, _ = sl.indices(self.n)
        return self.recs[start:stop]


class _Column:
    """One column of a `datasets.Dataset`, sliced without materialising the whole table."""

    def __init__(self, ds, column: str):
        self.ds, self.column = ds, column

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, sl: slice) -> list:
        start, stop, _ = sl.indices(len(self.ds))
        return self.ds.select(range(start, stop))[self.column] if stop > start else []
