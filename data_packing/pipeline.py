"""One `longctx-pack` run: read -> tokenize -> pack -> write shards -> metadata.json.

Determinism: the output depends only on the inputs, the tokenizer and the packing arguments
(never on --workers, timing or the output path), so the same run gives byte-identical files.
Resumability: each shard carries a fingerprint of the run; a rerun skips shards whose fingerprint
matches and writes metadata.json once every shard exists.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from data_packing import storage
from data_packing.batch import pad_multiple
from data_packing.documents import DROP_REASONS, tokenize_records, training_texts
from data_packing.packing import ALGORITHMS, OVERFLOW_MODES, pad_to, plan_rows
from data_packing.sources import STDLIB, open_corpus
from data_packing.stats import format_stats, summarize
from data_packing.tokenizer import (
    load_tokenizer,
    set_workers,
    sha256,
    special_ids,
    tokenizer_bytes,
    train_bpe,
)

# Arguments that do not change the bytes written (left out of the fingerprint and metadata).
_RUNTIME_ONLY = ("output", "workers", "shard_index", "overwrite", "progress", "chunk_docs")


@dataclass
class PackArgs:
    output: str
    sources: list[str] = field(default_factory=lambda: [STDLIB])
    tokenizer: str | None = None
    train_tokenizer: int | None = None
    vocab_size: int | None = None  # only for --ids-key input without a tokenizer
    text_key: str = "text"
    ids_key: str | None = None
    messages_key: str = "messages"
    seq_len: int = 8192
    algorithm: str = "bfd"
    overflow: str = "split"
    cp_size: int = 1
    tp_size: int = 1
    append_eos: bool = False
    eos_token: str | None = None
    pad_token: str | None = None
    seed: int = 0
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_docs: int | None = None
    num_shards: int = 1
    shard_index: int | None = None
    overwrite: bool = False
    progress: bool = True
    # Documents per encode_batch call: large, because every call waits for its longest document
    # (fewer, bigger calls keep the tokenizer threads busy); small enough for a live progress bar.
    chunk_docs: int = 1024

    @property
    def pad_multiple(self) -> int:
        return pad_multiple(self.cp_size, self.tp_size)


def validate(a: PackArgs) -> None:
    checks = [
        (a.seq_len >= 1, f"--seq-len must be >= 1, got {a.seq_len}"),
        (a.algorithm in ALGORITHMS, f"--algorithm {a.algorithm!r}: use one of {ALGORITHMS}"),
        (a.overflow in OVERFLOW_MODES, f"--overflow {a.overflow!r}: use one of {OVERFLOW_MODES}"),
        (a.cp_size >= 1 and a.tp_size >= 1, "--cp-size and --tp-size must be >= 1"),
        (a.seq_len >= a.pad_multiple, f"--seq-len {a.seq_len} is smaller than the pad multiple "
                                      f"lcm(2*CP, TP)={a.pad_multiple}; raise --seq-len"),
        (a.num_shards >= 1, f"--num-shards must be >= 1, got {a.num_shards}"),
        (a.shard_index is None or 0 <= a.shard_index < a.num_shards,
         f"--shard-index {a.shard_index} is outside [0, --num-shards={a.num_shards})"),
        (a.max_docs is None or a.max_docs >= 1, f"--max-docs must be >= 1, got {a.max_docs}"),
        (a.workers >= 1, f"--workers must be >= 1, got {a.workers}"),
        (not (a.tokenizer and a.train_tokenizer), "pass --tokenizer FILE or --train-tokenizer "
                                                  "VOCAB_SIZE, not both"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def _prepare_tokenizer(a: PackArgs, corpus):
    """(tokenizer or None, its JSON bytes or None, vocab_size, eos_id, pad_id)."""
    if a.train_tokenizer:
        tok = train_bpe(training_texts(corpus), a.train_tokenizer)
    elif a.tokenizer:
        tok = load_tokenizer(a.tokenizer)
    elif corpus.kind == "ids":
        if not a.vocab_size:
            raise ValueError("pre-tokenized input without a tokenizer needs --vocab-size "
                             "(or pass --tokenizer FILE)")
        return None, None, a.vocab_size, None, 0
    else:
        raise ValueError("no tokenizer: pass --tokenizer tokenizer.json or --train-tokenizer "
                         "VOCAB_SIZE (e.g. 4096)")
    eos_id, pad_id = special_ids(tok, a.eos_token, a.pad_token)
    if a.append_eos and eos_id is None:
        raise ValueError("--append-eos: the tokenizer has no end-of-document token; name one "
                         "with --eos-token")
    return tok, tokenizer_bytes(tok), tok.get_vocab_size(with_added_tokens=True), eos_id, pad_id


def _corpus_identity(corpus) -> str:
    """A hash of what the corpus is, so a rerun on changed inputs does not skip shards."""
    recs = corpus.records
    if hasattr(recs, "paths"):
        root = os.path.commonpath(recs.paths) if recs.paths else ""
        listing = [(os.path.relpath(p, root), os.path.getsize(p)) for p in recs.paths]
        return sha256(repr(listing).encode())
    return sha256(repr((recs.ds._fingerprint, recs.column, len(recs))).encode())


def _check_tokenizer(out: str, tok_bytes: bytes | None, overwrite: bool) -> None:
    path = os.path.join(out, storage.TOKENIZER)
    if tok_bytes is None or not os.path.exists(path) or overwrite:
        return
    with open(path, "rb") as f:
        old = sha256(f.read())
    if old != sha256(tok_bytes):
        raise ValueError(f"the tokenizer differs from the one already in {out} (sha256 {old[:12]} "
                         f"vs {sha256(tok_bytes)[:12]}); use a new --output or pass --overwrite")


def _clear_output(out: str) -> None:
    """--overwrite: drop metadata first so the directory never loads as complete meanwhile."""
    meta = os.path.join(out, storage.METADATA)
    if os.path.exists(meta):
        os.remove(meta)
    for name in os.listdir(out):
        if name.startswith(("shard_", ".tmp_shard_")):
            shutil.rmtree(os.path.join(out, name))


def _shard_range(n: int, k: int, num_shards: int) -> tuple[int, int]:
    return k * n // num_shards, (k + 1) * n // num_shards


def _tokenize_range(a: PackArgs, corpus, tok, eos_id, vocab_size, lo: int, hi: int, bar):
    """All good documents of [lo, hi) in order, with masks and drop counters."""
    tokens, masks, index, dropped = [], [], [], {r: 0 for r in DROP_REASONS}
    for start in range(lo, hi, a.chunk_docs):
        stop = min(hi, start + a.chunk_docs)
        res = tokenize_records(corpus.slice(start, stop), start, corpus.kind, tok,
                               eos_id if a.append_eos else None, vocab_size)
        tokens += res.tokens
        index += res.index
        if res.masks is not None:
            masks += res.masks
        for r, n in res.dropped.items():
            dropped[r] += n
        bar.update(stop - start, sum(len(t) for t in res.tokens))
    return tokens, (masks if corpus.kind == "chat" else None), index, dropped


def _shard_arrays(a: PackArgs, tokens, masks, index, plan, dtype: str) -> dict[str, np.ndarray]:
    """Row-major arrays of one shard; rows in a seeded order so in-order readers see a mix."""
    rows = np.random.default_rng([a.seed, a.shard_index or 0, plan.num_rows]).permutation(plan.num_rows)
    offs = plan.row_offsets
    order = np.concatenate([np.arange(offs[r], offs[r + 1]) for r in rows]) if len(rows) else \
        np.zeros(0, np.int64)
    doc, start, plen = plan.piece_doc[order], plan.piece_start[order], plan.piece_len[order]
    parts = [tokens[d][s:s + n] for d, s, n in zip(doc.tolist(), start.tolist(), plen.tolist(), strict=True)]
    # One copy straight into the stored dtype (ids were range-checked against the vocabulary).
    cat = lambda xs, dt: np.concatenate(xs, dtype=dt, casting="unsafe") if xs else np.zeros(0, dt)
    row_docs = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.diff(offs)[rows], out=row_docs[1:])
    row_tokens = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.add.reduceat(plen, row_docs[:-1]) if len(rows) else [], out=row_tokens[1:])
    arrays = {
        "tokens.bin": cat(parts, dtype), "row_docs": row_docs, "row_tokens": row_tokens,
        "doc_lengths": plen.astype(np.int32),
        "doc_lengths_padded": pad_to(plen, a.pad_multiple).astype(np.int32),
        "doc_source": np.stack([np.asarray(index, np.int64)[doc] if len(doc) else doc, start], 1),
    }
    if masks is not None:
        arrays["loss_mask.bin"] = cat([masks[d][s:s + n] for d, s, n in zip(
            doc.tolist(), start.tolist(), plen.tolist(), strict=True)], np.uint8)
    return arrays


class _Progress:
    """tqdm bar over documents with a tokens/s postfix (silent when not asked for)."""

    def __init__(self, total: int, enabled: bool, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="doc", desc=desc, disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)
        self.t0, self.tokens = time.perf_counter(), 0

    def update(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(docs)
        self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):,.0f} tok/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def _build_shard(a: PackArgs, corpus, tok, eos_id, vocab_size, fingerprint: str, k: int) -> dict:
    """Tokenize, pack and write shard k; returns its counters."""
    lo, hi = _shard_range(len(corpus), k, a.num_shards)
    bar = _Progress(hi - lo, a.progress, f"shard {k}/{a.num_shards}")
    try:
        tokens, masks, index, dropped = _tokenize_range(a, corpus, tok, eos_id, vocab_size, lo, hi, bar)
    finally:
        bar.close()
    lengths = np.asarray([len(t) for t in tokens], dtype=np.int64)
    plan = plan_rows(lengths, a.seq_len, a.algorithm, a.overflow, a.pad_multiple)
    arrays = _shard_arrays(PackArgs(**{**asdict(a), "shard_index": k}), tokens, masks, index, plan,
                           storage.token_dtype(vocab_size))
    counters = {f"docs_dropped_{r}": n for r, n in dropped.items()}
    counters.update(plan.counts, docs_in=hi - lo, tokens_in=int(lengths.sum()),
                    docs_packed=int(np.unique(plan.piece_doc).size))
    storage.write_shard(a.output, k, arrays, {"fingerprint": fingerprint, "shard": k,
                                              "doc_range": [lo, hi], "counters": counters})
    return counters


def _fingerprint(a: PackArgs, corpus, tok_hash: str | None) -> str:
    args = {k: v for k, v in asdict(a).items() if k not in _RUNTIME_ONLY}
    return sha256(storage.dumps({"args": args, "tokenizer": tok_hash, "format": storage.FORMAT_VERSION,
                                 "corpus": _corpus_identity(corpus), "docs": len(corpus)}))


def _finish(a: PackArgs, fingerprint: str, tok_hash, vocab_size, eos_id, pad_id, kind) -> dict:
    """Summarize all shards and write metadata.json (atomically, last)."""
    dtype = storage.token_dtype(vocab_size)
    shards = []
    for k in range(a.num_shards):
        d = os.path.join(a.output, storage.shard_name(k))
        arrays = storage.load_shard(d, dtype)
        arrays["counters"] = storage.read_json(os.path.join(d, "shard.json"))["counters"]
        shards.append(arrays)
    stats = summarize(shards, a.seq_len)
    meta = {
        "format_version": storage.FORMAT_VERSION, "fingerprint": fingerprint,
        "args": {k: v for k, v in asdict(a).items() if k not in _RUNTIME_ONLY},
        "seed": a.seed, "seq_len": a.seq_len, "pad_multiple": a.pad_multiple,
        "cp_size": a.cp_size, "tp_size": a.tp_size, "vocab_size": vocab_size,
        "eos_id": eos_id, "pad_id": pad_id, "token_dtype": dtype, "record_kind": kind,
        "has_loss_mask": kind == "chat",
        "tokenizer_file": storage.TOKENIZER if tok_hash else None, "tokenizer_sha256": tok_hash,
        "shards": [storage.shard_name(k) for k in range(a.num_shards)],
        "num_rows": stats["rows"], "num_docs": stats["pieces"], "stats": stats,
    }
    storage.write_bytes_atomic(os.path.join(a.output, storage.METADATA), storage.dumps(meta))
    return stats


def _existing_output(a: PackArgs, fp: str) -> dict | None:
    """metadata.json of an identical finished run (nothing to do), else None; refuses to mix
    with a different finished run unless --overwrite (which clears it first)."""
    meta_path = os.path.join(a.output, storage.METADATA)
    if os.path.exists(meta_path):
        meta = storage.read_json(meta_path)
        if meta.get("fingerprint") == fp:
            return meta
        if not a.overwrite:
            raise FileExistsError(f"{a.output} holds a finished run with different inputs or "
                                  "arguments; use a new --output or pass --overwrite")
    if a.overwrite:
        _clear_output(a.output)
    return None


def pack(a: PackArgs) -> dict:
    """Run longctx-pack; returns {"stats", "timing", "complete", "skipped_shards"}."""
    validate(a)
    set_workers(a.workers)
    t0 = time.perf_counter()
    corpus = open_corpus(a.sources, a.text_key, a.ids_key, a.messages_key, a.max_docs)
    tok, tok_bytes, vocab_size, eos_id, pad_id = _prepare_tokenizer(a, corpus)
    tok_hash = sha256(tok_bytes) if tok_bytes is not None else None
    t_tok = time.perf_counter() - t0
    os.makedirs(a.output, exist_ok=True)
    _check_tokenizer(a.output, tok_bytes, a.overwrite)
    fp = _fingerprint(a, corpus, tok_hash)
    meta = _existing_output(a, fp)
    if meta is not None:
        return {"stats": meta["stats"], "timing": {}, "complete": True, "skipped_shards": a.num_shards}
    if tok_bytes is not None:
        storage.write_bytes_atomic(os.path.join(a.output, storage.TOKENIZER), tok_bytes)
    skipped, docs, tokens = 0, 0, 0
    t1 = time.perf_counter()
    for k in range(a.num_shards) if a.shard_index is None else [a.shard_index]:
        if storage.finished_shard(a.output, k, fp) is not None:
            skipped += 1
            continue
        counters = _build_shard(a, corpus, tok, eos_id, vocab_size, fp, k)
        docs, tokens = docs + counters["docs_in"], tokens + counters["tokens_in"]
    t_pack = time.perf_counter() - t1
    complete = all(storage.finished_shard(a.output, k, fp) is not None for k in range(a.num_shards))
    stats = _finish(a, fp, tok_hash, vocab_size, eos_id, pad_id, corpus.kind) if complete else {}
    timing = {"seconds_total": round(time.perf_counter() - t0, 3), "seconds_tokenizer": round(t_tok, 3),
              "seconds_tokenize_pack_write": round(t_pack, 3),
              "docs_per_s": round(docs / max(t_pack, 1e-9), 1),
              "tokens_per_s": round(tokens / max(t_pack, 1e-9), 1)}
    storage.write_bytes_atomic(os.path.join(a.output, "run_stats.json"),
                               storage.dumps({"timing": timing, "skipped_shards": skipped}))
    return {"stats": stats, "timing": timing, "complete": complete, "skipped_shards": skipped}


def report(result: dict, a: PackArgs) -> str:
    if not result["complete"]:
        return (f"longctx-pack: shard(s) written to {a.output}; metadata.json is written when all "
                f"{a.num_shards} shards exist (run the remaining --shard-index values)")
    head = f"longctx-pack: {a.output} complete ({result['skipped_shards']} shard(s) already done)"
    return head + "\n" + format_stats(result["stats"], result["timing"])
