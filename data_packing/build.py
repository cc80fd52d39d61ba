"""Build one shard with memory bounded by a chunk, never by the corpus.

1. spool: records are tokenized a chunk at a time and their tokens appended to spool files inside
   the shard's temporary directory; only per-document integers (length, input index) stay in memory.
   With workers, contiguous parts of the shard's records are spooled by separate processes.
2. plan: `packing.plan_rows` places documents by length alone.
3. write: rows, in a seeded order, are gathered from the spool files a bounded number of tokens
   at a time (positioned reads, see SpoolReader) into `tokens.bin` at known offsets; with workers,
   ranges of rows are written by separate processes into the same preallocated file.

Every output file's size and checksum go into shard.json (`storage.file_digest`).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from data_packing import storage
from data_packing.batch import pad_to
from data_packing.documents import FIRST_DROPPED, tokenize_records
from data_packing.packing import PackPlan

# Tokens gathered per write: 4M tokens is an 8-16 MB buffer, and ~1 ms of write call overhead per
# 10 ms of copying.
CHUNK_TOKENS = 1 << 22
INDEX_FILES = ("row_docs", "row_tokens", "doc_lengths", "doc_lengths_padded", "doc_source")


@dataclass
class SpoolPart:
    """Good documents of records [lo, hi), in input order, tokens on disk."""

    tokens_path: str
    mask_path: str | None
    lengths: np.ndarray  # int64 [n]
    index: np.ndarray  # int64 [n]: input document index
    dropped: Counter
    first_dropped: dict[str, list[int]]  # reason -> the first few dropped input indices


def spool_part(job: dict, lo: int, hi: int, part: int, progress=None) -> SpoolPart:
    """Tokenize records [lo, hi) of job["corpus"] into spool files `.spool_<part>.*` in
    job["tmp"]. job: corpus, tok, eos_id, vocab_size, chat, dtype, chunk_docs, tmp."""
    corpus, dtype = job["corpus"], np.dtype(job["dtype"])
    tok_path = os.path.join(job["tmp"], f".spool_{part:05d}.tokens")
    mask_path = os.path.join(job["tmp"], f".spool_{part:05d}.mask") if job["chat"] else None
    lengths, index, dropped, first = [], [], Counter(), {}
    with open(tok_path, "wb") as ft, open(mask_path or os.devnull, "wb") as fm:
        for start, stop in corpus.chunks(lo, hi, job["chunk_docs"]):
            res = tokenize_records(corpus.slice(start, stop), start, corpus.kind, job["tok"],
                                   job["eos_id"], job["vocab_size"], job.get("template"), job.get("strict", False))
            for t in res.tokens:
                # ids were range-checked against the vocabulary, so the cast is exact
                ft.write(t.astype(dtype, copy=False).data)
            for m in res.masks or ():
                fm.write(m.data)
            lengths.append(np.fromiter((len(t) for t in res.tokens), np.int64, len(res.tokens)))
            index.append(np.asarray(res.index, np.int64))
            dropped.update(res.dropped)
            for reason, found in res.first_dropped.items():
                first[reason] = (first.get(reason, []) + found)[:FIRST_DROPPED]
            if progress is not None:
                progress.update(stop - start, int(lengths[-1].sum()))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)
    return SpoolPart(tok_path, mask_path, cat(lengths), cat(index), dropped, first)


class SpoolReader:
    """Token ranges of the concatenated spool parts.

    Pieces are read with one `preadv` each straight into the output buffer. Memory maps would
    cost more: every piece faults in whole pages (and the kernel maps up to 64 KB around each
    fault), so gathering thousands of short pieces pulls most of the spool into the resident set.
    """

    def __init__(self, parts: list[SpoolPart], dtype: str, mask: bool):
        self.parts, self.dtype, self.mask = parts, np.dtype(dtype), mask
        sizes = [len(p.lengths) for p in parts]
        self.part_of_doc = np.repeat(np.arange(len(parts), dtype=np.int32), sizes)
        self.offset = np.concatenate([np.cumsum(p.lengths) - p.lengths for p in parts]) \
            if parts else np.zeros(0, np.int64)  # first token of each document inside its part

    def gather(self, doc: np.ndarray, start: np.ndarray, plen: np.ndarray, mask: bool) -> np.ndarray:
        """Concatenated tokens (or loss-mask bytes) of pieces (doc, start, plen)."""
        dtype = np.dtype(np.uint8) if mask else self.dtype
        out = np.empty(int(plen.sum()), dtype)
        buf, fds, pos = memoryview(out).cast("B"), {}, 0
        try:
            src = (self.offset[doc] + start) * dtype.itemsize
            for p, s, n in zip(self.part_of_doc[doc].tolist(), src.tolist(),
                               (plen * dtype.itemsize).tolist(), strict=True):
                if p not in fds:
                    fds[p] = os.open(self.parts[p].mask_path if mask else self.parts[p].tokens_path,
                                     os.O_RDONLY)
                if os.preadv(fds[p], [buf[pos:pos + n]], s) != n:
                    raise OSError(f"spool part {p} of the shard being built is shorter than "
                                  "written; was the output directory modified meanwhile? rerun")
                pos += n
        finally:
            for fd in fds.values():
                os.close(fd)
        return out


def piece_order(plan: PackPlan, seed: int, shard: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows in their stored order, the plan's piece indices in stored order)."""
    n = plan.num_rows
    rows = np.random.default_rng([seed, shard, n]).permutation(n)
    counts = np.diff(plan.row_offsets)[rows]
    starts = plan.row_offsets[:-1][rows]
    order = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    return rows, order


def index_arrays(plan: PackPlan, rows, order, index: np.ndarray, pad_multiple: int) -> dict:
    """The shard's small per-row and per-piece arrays (storage.py describes them)."""
    doc, start, plen = plan.piece_doc[order], plan.piece_start[order], plan.piece_len[order]
    row_docs = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.diff(plan.row_offsets)[rows], out=row_docs[1:])
    row_tokens = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.add.reduceat(plen, row_docs[:-1]) if len(rows) else [], out=row_tokens[1:])
    return {"row_docs": row_docs, "row_tokens": row_tokens, "doc_lengths": plen.astype(np.int32),
            "doc_lengths_padded": pad_to(plen, pad_multiple).astype(np.int32),
            "doc_source": np.stack([index[doc] if len(doc) else doc, start], 1)}


def write_rows(reader: SpoolReader, pieces: tuple, first_token: int, path: str, mask: bool) -> None:
    """Write pieces (doc, start, plen arrays in stored order) into the preallocated file `path`
    from token `first_token` on, CHUNK_TOKENS at a time."""
    doc, start, plen = pieces
    cum = np.cumsum(plen)
    cuts = np.searchsorted(cum, np.arange(CHUNK_TOKENS, int(cum[-1]) if len(cum) else 0,
                                          CHUNK_TOKENS), side="right")
    bounds = [0] + sorted(set(cuts.tolist())) + [len(doc)]
    itemsize = 1 if mask else reader.dtype.itemsize
    with open(path, "r+b") as f:
        f.seek(first_token * itemsize)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if b > a:
                f.write(reader.gather(doc[a:b], start[a:b], plen[a:b], mask).data)


def row_ranges(row_tokens: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Up to `parts` contiguous row ranges with about equal tokens each."""
    total = int(row_tokens[-1])
    cuts = np.searchsorted(row_tokens, np.arange(1, parts) * total / parts)
    bounds = sorted(set([0] + cuts.tolist() + [len(row_tokens) - 1]))
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


# ---------------------------------------------------------------------- one shard, N processes

# The shard being built. Worker processes are forked after it is set, so they inherit the corpus,
# tokenizer, spool reader and plan instead of receiving them pickled with every task.
_JOB: dict = {}


def _spool_task(task: tuple[int, int, int]) -> SpoolPart:
    return spool_part(_JOB, *task)


def _write_task(task: tuple[str, bool, int, int]) -> None:
    name, mask, r0, r1 = task
    doc, start, plen = _JOB["pieces"]
    row_docs, row_tokens = _JOB["arrays"]["row_docs"], _JOB["arrays"]["row_tokens"]
    a, b = int(row_docs[r0]), int(row_docs[r1])
    write_rows(_JOB["reader"], (doc[a:b], start[a:b], plen[a:b]), int(row_tokens[r0]),
               os.path.join(_JOB["tmp"], name), mask)


def _digest_task(task: tuple[str, int]) -> str:
    path, block = task
    return storage.block_digests(path, range(block, block + 1))[0]


def _run(tasks: list, fn, workers: int, on_result=None) -> list:
    """fn over tasks, in order: in this process, or in `workers` forked processes."""
    if workers <= 1 or len(tasks) <= 1:
        results = []
        for t in tasks:
            results.append(fn(t))
            if on_result:
                on_result(t, results[-1])
        return results
    import multiprocessing

    # A forked child has none of the parent's Rust threads: tokenizers must not use its thread
    # pool there (it would wait forever). Each process tokenizes single-threaded instead.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(tasks))) as pool:
            results = []
            for t, r in zip(tasks, pool.imap(fn, tasks), strict=True):
                results.append(r)
                if on_result:
                    on_result(t, r)
            return results
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def spool_shard(job: dict, lo: int, hi: int, workers: int, progress) -> list[SpoolPart]:
    """Spool records [lo, hi): one part per process task (4 per worker, for balance)."""
    _JOB.clear()
    _JOB.update(job)
    n_parts = 1 if workers <= 1 else max(1, min(hi - lo, 4 * workers))
    cuts = [lo + (hi - lo) * i // n_parts for i in range(n_parts + 1)]
    tasks = [(cuts[i], cuts[i + 1], i) for i in range(n_parts)]
    if workers <= 1:
        return [spool_part(job, lo, hi, 0, progress)]

    def tick(task, part):
        progress.update(task[1] - task[0], int(part.lengths.sum()))

    return _run(tasks, _spool_task, workers, tick)


def write_shard_files(job: dict, parts: list[SpoolPart], plan: PackPlan, seed: int, k: int,
                      pad_multiple: int, workers: int) -> dict:
    """Write tokens.bin (+ loss_mask.bin) and the index arrays into job["tmp"], delete the spool;
    returns {file name: {"bytes", "sha256"}}."""
    index = np.concatenate([p.index for p in parts])
    rows, order = piece_order(plan, seed, k)
    arrays = index_arrays(plan, rows, order, index, pad_multiple)
    chat = job["chat"]
    _JOB.update(job, arrays=arrays, reader=SpoolReader(parts, job["dtype"], chat),
                pieces=(plan.piece_doc[order], plan.piece_start[order], plan.piece_len[order]))
    n_tok = int(arrays["row_tokens"][-1])
    names = [("tokens.bin", False)] + ([("loss_mask.bin", True)] if chat else [])
    tasks = []
    for name, mask in names:
        with open(os.path.join(job["tmp"], name), "wb") as f:
            f.truncate(n_tok * (1 if mask else np.dtype(job["dtype"]).itemsize))
        tasks += [(name, mask, a, b) for a, b in row_ranges(arrays["row_tokens"], 4 * workers)]
    _run(tasks, _write_task, workers)
    _JOB.clear()  # the plan and reader are not needed past here
    for p in parts:
        for path in (p.tokens_path, p.mask_path):
            if path:
                os.remove(path)
    for name, arr in arrays.items():
        np.save(os.path.join(job["tmp"], f"{name}.npy"), arr, allow_pickle=False)
    return file_digests(job["tmp"], [n for n, _ in names] + [f"{n}.npy" for n in arrays], workers)


def file_digests(folder: str, names: list[str], workers: int) -> dict:
    """{name: {"bytes", "sha256"}} of files in folder, blocks hashed by `workers` processes."""
    sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in names}
    tasks = [(os.path.join(folder, n), b) for n in names for b in range(storage.num_blocks(sizes[n]))]
    digests = _run(tasks, _digest_task, workers)
    out, i = {}, 0
    for n in names:
        nb = storage.num_blocks(sizes[n])
        out[n] = {"bytes": sizes[n], "sha256": storage.combine_digests(digests[i:i + nb])}
        i += nb
    return out
