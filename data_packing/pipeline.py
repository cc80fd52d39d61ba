"""One `longctx-pack` run: read -> tokenize -> pack -> write shards -> metadata.json.

Memory: each shard is built by streaming (`build.py`): tokens go to disk as they are produced and
packing plans over lengths only, so memory grows with the documents of one shard (~150 bytes
each), never with tokens. Without --num-shards, --memory-budget picks the shard count from
the number of input records.
Determinism: the output depends only on the inputs, the tokenizer and the packing arguments
(never on --workers, timing or the output path), so the same run gives byte-identical files.
Resumability: each shard carries a fingerprint of the run; a rerun skips shards whose fingerprint
matches and whose files are intact, rebuilds the others, and writes metadata.json once every
shard exists.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from data_packing import build, chat_template, storage
from data_packing.batch import pad_multiple
from data_packing.documents import (
    DROP_REASONS,
    DROP_WHY,
    FIRST_DROPPED,
    STRICT_REASONS,
    training_texts,
)
from data_packing.packing import ALGORITHMS, OVERFLOW_MODES, plan_rows
from data_packing.sources import STDLIB, open_corpus
from data_packing.stats import format_stats, summarize
from data_packing.tokenizer import (
    load_tokenizer,
    sha256,
    special_ids,
    tokenizer_bytes,
    train_bpe,
)

# Arguments that do not change the bytes written (left out of the fingerprint and metadata).
_RUNTIME_ONLY = ("output", "workers", "shard_index", "overwrite", "progress", "chunk_docs",
                 "memory_budget", "strict")
SPLIT_POSITIONS = ("restart", "continue")
# Shard sizing for --memory-budget, measured with bench/packing_scale.py: the process needs about
# BASE_BYTES whatever the corpus (interpreter, numpy, tokenizers, torch, read and write buffers,
# the largest document), and each document of a shard costs ~150 bytes while it is planned and
# written (lengths, input index, spool offsets, the plan's pieces); PLAN_BYTES_PER_DOC leaves
# room for the allocator's slack.
BASE_BYTES = 512 << 20
PLAN_BYTES_PER_DOC = 1024


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
    workers: int = field(default_factory=lambda: usable_cpus())
    max_docs: int | None = None
    num_shards: int | None = None  # None: picked by memory_budget
    memory_budget: str = "1G"
    split_positions: str = "restart"
    chat_template: str | None = None  # a Jinja chat template file (default: the tokenizer's)
    shard_index: int | None = None
    overwrite: bool = False
    progress: bool = True
    strict: bool = False  # stop at the first broken input record instead of counting it
    # Documents per encode_batch call: large, because every call waits for its longest document
    # (fewer, bigger calls keep the tokenizer threads busy); small enough for a live progress bar.
    chunk_docs: int = 1024

    @property
    def pad_multiple(self) -> int:
        return pad_multiple(self.cp_size, self.tp_size)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; a container's cpuset, not the host's
    count), the default --workers."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def validate(a: PackArgs) -> None:
    checks = [
        (a.seq_len >= 1, f"--seq-len must be >= 1, got {a.seq_len}"),
        (a.algorithm in ALGORITHMS, f"--algorithm {a.algorithm!r}: use one of {ALGORITHMS}"),
        (a.overflow in OVERFLOW_MODES, f"--overflow {a.overflow!r}: use one of {OVERFLOW_MODES}"),
        (a.cp_size >= 1 and a.tp_size >= 1, "--cp-size and --tp-size must be >= 1"),
        (a.seq_len >= a.pad_multiple, f"--seq-len {a.seq_len} is smaller than the pad multiple "
                                      f"lcm(2*CP, TP)={a.pad_multiple}; raise --seq-len"),
        (a.num_shards is None or a.num_shards >= 1, f"--num-shards must be >= 1, got {a.num_shards}"),
        (a.shard_index is None or a.num_shards is None or 0 <= a.shard_index < a.num_shards,
         f"--shard-index {a.shard_index} is outside [0, --num-shards={a.num_shards})"),
        (a.shard_index is None or a.shard_index >= 0, f"--shard-index must be >= 0, got {a.shard_index}"),
        (a.split_positions in SPLIT_POSITIONS,
         f"--split-positions {a.split_positions!r}: use one of {SPLIT_POSITIONS}"),
        (a.max_docs is None or a.max_docs >= 1, f"--max-docs must be >= 1, got {a.max_docs}"),
        (a.workers >= 1, f"--workers must be >= 1, got {a.workers}"),
        (not (a.tokenizer and a.train_tokenizer), "pass --tokenizer FILE or --train-tokenizer "
                                                  "VOCAB_SIZE, not both"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    parse_bytes(a.memory_budget)


def parse_bytes(text: str) -> int:
    """'1G', '512M', '2GiB', '1500000000' -> bytes (K/M/G/T are powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = int(float(num) * units[unit])
    except ValueError:
        value = -1
    if value <= BASE_BYTES:
        raise ValueError(f"--memory-budget {text!r} must be a size above {BASE_BYTES >> 20}M (the "
                         "memory a run needs whatever its size), e.g. 1G or 4G")
    return value


def resolve_num_shards(a: PackArgs, n_records: int) -> int:
    """--num-shards, or the fewest shards whose documents fit --memory-budget."""
    if a.num_shards is not None:
        return a.num_shards
    per_shard = (parse_bytes(a.memory_budget) - BASE_BYTES) // PLAN_BYTES_PER_DOC
    return max(1, -(-n_records // per_shard))


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


def _build_shard(a: PackArgs, corpus, prep: dict, fingerprint: str, k: int) -> dict:
    """Tokenize, pack and write shard k (streaming, see build.py); returns its counters."""
    lo, hi = _shard_range(len(corpus), k, a.num_shards)
    tmp = storage.begin_shard(a.output, k)
    job = dict(corpus=corpus, tok=prep["tok"], eos_id=prep["eos_id"] if a.append_eos else None,
               vocab_size=prep["vocab_size"], chat=corpus.kind == "chat", template=prep["template"],
               dtype=storage.token_dtype(prep["vocab_size"]), chunk_docs=a.chunk_docs, tmp=tmp,
               strict=a.strict)
    bar = _Progress(hi - lo, a.progress, f"shard {k}/{a.num_shards}")
    try:
        parts = build.spool_shard(job, lo, hi, a.workers, bar)
    finally:
        bar.close()
    lengths = np.concatenate([p.lengths for p in parts])
    plan = plan_rows(lengths, a.seq_len, a.algorithm, a.overflow, a.pad_multiple)
    files = build.write_shard_files(job, parts, plan, a.seed, k, a.pad_multiple, a.workers)
    dropped = {r: sum(p.dropped[r] for p in parts) for r in DROP_REASONS}
    counters = {f"docs_dropped_{r}": n for r, n in dropped.items()}
    counters.update(plan.counts, docs_in=hi - lo, tokens_in=int(lengths.sum()),
                    docs_packed=int(np.unique(plan.piece_doc).size))
    first = {r: sorted(i for p in parts for i in p.first_dropped.get(r, []))[:FIRST_DROPPED]
             for r in DROP_REASONS}
    storage.commit_shard(a.output, k, tmp, {"fingerprint": fingerprint, "shard": k, "files": files,
                                            "doc_range": [lo, hi], "counters": counters,
                                            "first_dropped": {r: v for r, v in first.items() if v}})
    return counters


def _fingerprint(a: PackArgs, corpus, tok_hash: str | None, template_hash: str | None) -> str:
    args = {k: v for k, v in asdict(a).items() if k not in _RUNTIME_ONLY}
    return sha256(storage.dumps({"args": args, "tokenizer": tok_hash, "format": storage.FORMAT_VERSION,
                                 "chat_template": template_hash, "corpus": corpus.identity(),
                                 "docs": len(corpus)}))


def _finish(a: PackArgs, fingerprint: str, prep: dict, kind: str) -> dict:
    """Summarize all shards and write metadata.json (atomically, last)."""
    dtype = storage.token_dtype(prep["vocab_size"])

    first: dict[str, list[int]] = {}

    def shards():  # one shard's index arrays at a time
        for k in range(a.num_shards):
            d = os.path.join(a.output, storage.shard_name(k))
            arrays = storage.load_shard(d, dtype, names=("row_docs", "doc_lengths", "doc_lengths_padded"))
            info = storage.read_json(os.path.join(d, storage.SHARD_INFO))
            arrays["counters"] = info["counters"]
            for reason, found in info.get("first_dropped", {}).items():
                first[reason] = first.get(reason, []) + found
            yield arrays

    stats = summarize(shards(), a.seq_len)
    for reason, found in first.items():  # 1-based record numbers over the inputs in order
        stats[f"docs_dropped_{reason}_records"] = [i + 1 for i in sorted(found)[:FIRST_DROPPED]]
    meta = {
        "format_version": storage.FORMAT_VERSION, "fingerprint": fingerprint,
        "args": {k: v for k, v in asdict(a).items() if k not in _RUNTIME_ONLY},
        "seed": a.seed, "seq_len": a.seq_len, "pad_multiple": a.pad_multiple,
        "cp_size": a.cp_size, "tp_size": a.tp_size, "vocab_size": prep["vocab_size"],
        "eos_id": prep["eos_id"], "pad_id": prep["pad_id"], "token_dtype": dtype,
        "record_kind": kind, "has_loss_mask": kind == "chat", "split_positions": a.split_positions,
        "chat_template_sha256": prep["template_hash"],
        "tokenizer_file": storage.TOKENIZER if prep["tok_hash"] else None,
        "tokenizer_sha256": prep["tok_hash"],
        "shards": [storage.shard_name(k) for k in range(a.num_shards)],
        "num_rows": stats["rows"], "num_docs": stats["pieces"], "stats": stats,
    }
    storage.write_bytes_atomic(os.path.join(a.output, storage.METADATA), storage.dumps(meta))
    return stats


def _all_shards_intact(a: PackArgs, fp: str) -> bool:
    return all(storage.finished_shard(a.output, k, fp) is not None for k in range(a.num_shards))


def _existing_output(a: PackArgs, fp: str) -> dict | None:
    """metadata.json of an identical finished run whose shards are all intact (nothing to do),
    else None; refuses to mix with a different finished run unless --overwrite (which clears it
    first). A finished run with a missing or damaged shard loses its metadata.json, so it never
    loads as complete while that shard is rebuilt."""
    meta_path = os.path.join(a.output, storage.METADATA)
    if os.path.exists(meta_path):
        meta = storage.read_json(meta_path)
        if meta.get("fingerprint") == fp:
            if _all_shards_intact(a, fp):
                return meta
            os.remove(meta_path)
        elif not a.overwrite:
            raise FileExistsError(f"{a.output} holds a finished run with different inputs or "
                                  "arguments; use a new --output or pass --overwrite")
    if a.overwrite:
        _clear_output(a.output)
    return None


def _prepare(a: PackArgs):
    """(corpus, {tok, tok_bytes, tok_hash, vocab_size, eos_id, pad_id, template, template_hash})."""
    corpus = open_corpus(a.sources, a.text_key, a.ids_key, a.messages_key, a.max_docs, a.strict)
    tok, tok_bytes, vocab_size, eos_id, pad_id = _prepare_tokenizer(a, corpus)
    name = lambda i: tok.id_to_token(i) if tok is not None and i is not None else None
    template = chat_template.resolve(a, corpus.kind, tok, name(eos_id), name(pad_id))
    prep = dict(tok=tok, tok_bytes=tok_bytes, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id,
                tok_hash=sha256(tok_bytes) if tok_bytes is not None else None, template=template,
                template_hash=sha256(template.source.encode()) if template else None)
    return corpus, prep


@dataclass
class Run:
    """One run after its inputs are open: what every shard build needs."""

    args: PackArgs
    corpus: object
    prep: dict
    fingerprint: str
    t0: float
    seconds_prepare: float
    cpu0: float  # CPU seconds used by this process and its workers before the run

    def todo(self) -> list[int]:
        """Shards this invocation builds: not yet finished (or damaged), among --shard-index."""
        a = self.args
        mine = range(a.num_shards) if a.shard_index is None else [a.shard_index]
        return [k for k in mine if storage.finished_shard(a.output, k, self.fingerprint) is None]


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished worker processes."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def prepare(a: PackArgs) -> tuple[Run, dict | None]:
    """Open the inputs, pick the shard count, check the output directory. Returns the run and,
    when an identical finished output is already there, the result to report (nothing to do)."""
    validate(a)
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    corpus, prep = _prepare(a)
    a.num_shards = resolve_num_shards(a, len(corpus))
    validate(a)  # --shard-index against the shard count picked by --memory-budget
    os.makedirs(a.output, exist_ok=True)
    _check_tokenizer(a.output, prep["tok_bytes"], a.overwrite)
    fp = _fingerprint(a, corpus, prep["tok_hash"], prep["template_hash"])
    run = Run(a, corpus, prep, fp, t0, time.perf_counter() - t0, cpu0)
    meta = _existing_output(a, fp)
    if meta is not None:
        return run, {"stats": meta["stats"], "timing": {}, "complete": True,
                     "skipped_shards": a.num_shards, "num_shards": a.num_shards}
    if prep["tok_bytes"] is not None:
        storage.write_bytes_atomic(os.path.join(a.output, storage.TOKENIZER), prep["tok_bytes"])
    return run, None


def build_shard(run: Run, k: int) -> dict:
    """Build shard k of a prepared run (any process that sees the output directory)."""
    return _build_shard(run.args, run.corpus, run.prep, run.fingerprint, k)


def finish(run: Run, built: list[dict], t_pack: float) -> dict:
    """metadata.json once every shard exists; the run's result (stats, timing, counters)."""
    a = run.args
    mine = a.num_shards if a.shard_index is None else 1
    docs = sum(c["docs_in"] for c in built)
    tokens = sum(c["tokens_in"] for c in built)
    dropped = {r: sum(c[f"docs_dropped_{r}"] for c in built) for r in DROP_REASONS}
    complete = _all_shards_intact(a, run.fingerprint)
    stats = _finish(a, run.fingerprint, run.prep, run.corpus.kind) if complete else {}
    timing = {"seconds_total": round(time.perf_counter() - run.t0, 3),
              "cpu_seconds_total": round(_cpu_seconds() - run.cpu0, 3),
              "seconds_tokenizer": round(run.seconds_prepare, 3),
              "seconds_tokenize_pack_write": round(t_pack, 3),
              "docs_per_s": round(docs / max(t_pack, 1e-9), 1),
              "tokens_per_s": round(tokens / max(t_pack, 1e-9), 1)}
    skipped = mine - len(built)
    storage.write_bytes_atomic(os.path.join(a.output, "run_stats.json"),
                               storage.dumps({"timing": timing, "skipped_shards": skipped}))
    return {"stats": stats, "timing": timing, "complete": complete, "skipped_shards": skipped,
            "num_shards": a.num_shards, "dropped": dropped, "record_key": run.corpus.column}


def pack(a: PackArgs) -> dict:
    """Run longctx-pack in this process (and its --workers); returns {"stats", "timing",
    "complete", "skipped_shards", "num_shards", "dropped", "record_key"}."""
    run, done = prepare(a)
    if done is not None:
        return done
    t1 = time.perf_counter()
    built = [build_shard(run, k) for k in run.todo()]
    return finish(run, built, time.perf_counter() - t1)


def drop_warning(result: dict) -> str | None:
    """One line summarising the records this run dropped, by reason, or None."""
    dropped = {r: n for r, n in (result.get("dropped") or {}).items() if n}
    if not dropped:
        return None
    why = {**DROP_WHY, "missing_value": f"no {result.get('record_key')!r} field or null"}
    stats = result.get("stats") or {}

    def where(r: str) -> str:
        records = stats.get(f"docs_dropped_{r}_records")
        return f", first at record {', '.join(map(str, records))}" if records and r in STRICT_REASONS else ""

    parts = ", ".join(f"{n} {r} ({why[r]}{where(r)})" for r, n in sorted(dropped.items()))
    return (f"longctx-pack: warning: dropped {sum(dropped.values())} record(s): {parts}; "
            "see docs_dropped_* in metadata.json stats")


def report(result: dict, a: PackArgs) -> str:
    if not result["complete"]:
        return (f"longctx-pack: shard(s) written to {a.output}; metadata.json is written when all "
                f"{result['num_shards']} shards exist (run the remaining --shard-index values)")
    head = (f"longctx-pack: {a.output} complete ({result['num_shards']} shard(s), "
            f"{result['skipped_shards']} already done)")
    return head + "\n" + format_stats(result["stats"], result["timing"])
