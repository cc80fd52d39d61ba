"""`longctx-pack`: tokenize and pack a corpus into memory-mapped rows (see `pipeline.py`)."""

from __future__ import annotations

import argparse
import os
import sys

from data_packing.packing import ALGORITHMS, OVERFLOW_MODES
from data_packing.pipeline import (
    SPLIT_POSITIONS,
    PackArgs,
    drop_warning,
    pack,
    report,
    usable_cpus,
)
from data_packing.tokenizer import thread_env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="longctx-pack", description="Tokenize documents and pack them into rows with exact "
        "document boundaries (memory-mapped shards + metadata.json).")
    p.add_argument("--source", nargs="+", dest="sources", default=["stdlib"], metavar="PATH",
                   help="`stdlib` (the Python standard library's .py files; default), JSONL/Parquet/"
                   "Arrow files or globs, or a saved `datasets` directory")
    p.add_argument("--output", required=True, help="output directory")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="a `tokenizers` JSON file")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                     help="train a byte-level BPE of this vocabulary size on the input")
    p.add_argument("--vocab-size", type=int, help="vocabulary size of --ids-key data without a tokenizer")
    p.add_argument("--text-key", default="text")
    p.add_argument("--ids-key", help="column of pre-tokenized ids (no tokenization)")
    p.add_argument("--messages-key", default="messages", help="column of chat records "
                   "(lists of {role, content}); loss only on assistant tokens")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template (or a "
                   "tokenizer_config.json holding one) for chat records; default: the "
                   "tokenizer_config.json beside --tokenizer, else a built-in <|role|> rendering")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--algorithm", choices=ALGORITHMS, default="bfd")
    p.add_argument("--overflow", choices=OVERFLOW_MODES, default="split",
                   help="documents longer than --seq-len: split into pieces, truncate, or drop")
    p.add_argument("--cp-size", type=int, default=1,
                   help="context-parallel degree: documents are padded to lcm(2*CP, TP)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel degree (see --cp-size)")
    p.add_argument("--split-positions", choices=SPLIT_POSITIONS, default="restart",
                   help="position ids of the pieces of a split document: restart at 0 in each "
                   "piece, or continue from the piece's offset in the document (RoPE sees the "
                   "true position)")
    p.add_argument("--append-eos", action="store_true", help="end every document with EOS")
    p.add_argument("--eos-token", help="EOS token of --tokenizer (default: a common name)")
    p.add_argument("--pad-token", help="padding token (default: <|pad|>, else EOS)")
    p.add_argument("--seed", type=int, default=0, help="seeds the order of rows inside each shard")
    p.add_argument("--workers", type=int, default=usable_cpus(),
                   help="processes for tokenizing, writing and checksums (does not change the "
                   "output)")
    p.add_argument("--max-docs", type=int, help="only the first N input documents (dry runs)")
    p.add_argument("--num-shards", type=int, help="split the input into this many contiguous "
                   "shards, packed independently (default: picked by --memory-budget)")
    p.add_argument("--memory-budget", default="1G", metavar="SIZE",
                   help="memory a run may use (e.g. 1G, 4G); picks the shard count when "
                   "--num-shards is not given")
    p.add_argument("--shard-index", type=int, help="build only this shard (parallel jobs)")
    p.add_argument("--ray", metavar="ADDRESS", help="build the shards as Ray tasks (extra `ray`): "
                   "`local` starts Ray on this machine with --workers CPUs, `auto` or an address "
                   "joins a cluster (inputs and --output on a filesystem every node sees)")
    p.add_argument("--overwrite", action="store_true", help="replace an incompatible output")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--strict", action="store_true", help="stop at the first broken input record "
                   "(a line that is not JSON or not UTF-8, a value of the wrong type) instead of "
                   "skipping it and counting it in docs_dropped_*")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = vars(build_parser().parse_args(argv))
    ray_address = ns.pop("ray")
    args = PackArgs(**ns)
    # This command owns its process: size the tokenizer's threads before their first use.
    os.environ.update(thread_env(args.workers))
    try:
        if ray_address is None:
            result = pack(args)
        else:
            from data_packing.ray_runner import pack_on_ray

            result = pack_on_ray(args, ray_address)
    except (ValueError, FileExistsError) as e:
        print(f"longctx-pack: error: {e}", file=sys.stderr)
        return 2
    warning = drop_warning(result)
    if warning:
        print(warning, file=sys.stderr)
    print(report(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
