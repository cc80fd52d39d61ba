"""Broken input records (a JSONL line that is not JSON or not UTF-8, a Parquet value of the wrong
type) are skipped and counted by default, with their record numbers in the stats and the one
warning line; --strict stops at the first one with a one-line error."""

import json

import numpy as np
import pytest

from data_packing.cli import main
from data_packing.loader import PackedDataset
from tests.data_packing.conftest import random_texts, run_pack

TEXTS = random_texts(12, seed=3)
DECODE_AT, MALFORMED_AT = (3, 9), (6,)  # 1-based record numbers of the broken lines


def _broken_jsonl(path) -> str:
    """TEXTS as JSONL with a non-UTF-8 line at each DECODE_AT and a cut-off line at MALFORMED_AT."""
    lines, good = [], iter(TEXTS)
    for n in range(1, len(TEXTS) + len(DECODE_AT) + len(MALFORMED_AT) + 1):
        if n in DECODE_AT:
            lines.append(b'{"text": "caf\xe9 latin-1 \xff"}')
        elif n in MALFORMED_AT:
            lines.append(b'{"text": "cut off')
        else:
            lines.append(json.dumps({"text": next(good)}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _packed_docs(out) -> dict:
    ds = PackedDataset(str(out))
    docs = {}
    for k, shard in enumerate(ds._shards):
        base = sum(len(s["doc_lengths"]) for s in ds._shards[:k])
        for j, (doc, _) in enumerate(shard["doc_source"].tolist()):
            docs.setdefault(doc, []).append(ds.doc_tokens(base + j))
    return {d: np.concatenate(parts) for d, parts in docs.items()}


@pytest.mark.parametrize("workers", [1, 2])
def test_broken_jsonl_lines_are_skipped_counted_and_named(tmp_path, capsys, workers):
    src = _broken_jsonl(tmp_path / "in.jsonl")
    rc = main(["--source", src, "--train-tokenizer", "300", "--seq-len", "64", "--workers", str(workers),
               "--output", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 0 and "\n" not in err
    assert "2 decode (a line that is not UTF-8, first at record 3, 9)" in err
    assert "1 malformed (not valid JSON, first at record 6)" in err
    stats = PackedDataset(str(tmp_path / "o")).meta["stats"]
    assert (stats["docs_dropped_decode"], stats["docs_dropped_malformed"], stats["docs_dropped"]) == (2, 1, 3)
    assert stats["docs_dropped_decode_records"] == [3, 9] and stats["docs_dropped_malformed_records"] == [6]
    assert stats["docs_in"] == len(TEXTS) + 3 and stats["docs_packed"] == len(TEXTS)
    # The good records pack exactly as they do from a file without the broken lines.
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    run_pack(tmp_path / "ref", sources=[str(clean)], tokenizer=str(tmp_path / "o" / "tokenizer.json"),
             seq_len=64)
    bad = sorted(i - 1 for i in (*DECODE_AT, *MALFORMED_AT))
    kept = [i for i in range(len(TEXTS) + 3) if i not in bad]
    ref, got = _packed_docs(tmp_path / "ref"), _packed_docs(tmp_path / "o")
    assert sorted(got) == kept
    for j, i in enumerate(kept):
        assert np.array_equal(got[i], ref[j])


@pytest.mark.parametrize("workers", [1, 2])
def test_strict_stops_at_the_first_broken_jsonl_line(tmp_path, capsys, workers):
    src = _broken_jsonl(tmp_path / "in.jsonl")
    rc = main(["--source", src, "--train-tokenizer", "300", "--seq-len", "64", "--workers", str(workers),
               "--output", str(tmp_path / "o"), "--no-progress", "--strict"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert f"cannot read {src!r} as json (record 3: 'utf-8' codec can't decode" in err
    assert err.endswith("or leave out --strict to skip and count such records")


def test_parquet_values_that_are_not_strings_are_counted_or_refused_with_strict(tmp_path, capsys):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": TEXTS[:4]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [7, 8]}), tmp_path / "b.parquet")  # a column of another type
    srcs = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    args = ["--source", *srcs, "--train-tokenizer", "300", "--seq-len", "64", "--workers", "1", "--no-progress"]
    assert main([*args, "--output", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err.strip()
    assert "2 bad_record (wrong type or shape, first at record 5, 6)" in err and "\n" not in err
    stats = PackedDataset(str(tmp_path / "o")).meta["stats"]
    assert stats["docs_dropped_bad_record_records"] == [5, 6] and stats["docs_packed"] == 4
    assert main([*args, "--output", str(tmp_path / "s"), "--strict"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("longctx-pack: error: input record 5 is wrong type or shape (bad_record) and --strict is set; "
                   "fix the input, or leave out --strict to skip and count such records")
