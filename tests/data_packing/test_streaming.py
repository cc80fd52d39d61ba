"""longctx-pack at scale: streamed shards, --memory-budget, the JSONL reader, input identity,
damaged shards and what users see."""

import json
import os
import shutil

import numpy as np
import pytest

from data_packing import build, pipeline, storage
from data_packing.cli import main
from data_packing.config import DataConfig
from data_packing.jsonl import NOT_A_RECORD, JsonlRecords
from data_packing.loader import PackedDataset, StepLoader
from tests.data_packing.conftest import ids_corpus, random_texts, run_pack, write_jsonl
from tests.data_packing.test_cli import _reconstruct, _same_tree

IDS = dict(ids_key="ids", vocab_size=1000, seq_len=256, cp_size=2)


def test_chunk_sizes_do_not_change_the_output(tmp_path, monkeypatch):
    src, docs = ids_corpus(tmp_path, n=400, mean=4.0)
    run_pack(tmp_path / "ref", sources=[src], num_shards=2, **IDS)
    # Tiny read and write chunks: many spool appends and many gathers per shard.
    monkeypatch.setattr(build, "CHUNK_TOKENS", 97)
    run_pack(tmp_path / "small", sources=[src], num_shards=2, chunk_docs=7, **IDS)
    _same_tree(tmp_path / "small", tmp_path / "ref")
    got = _reconstruct(tmp_path / "small")
    assert sorted(got) == list(range(len(docs)))
    assert all(got[i].tolist() == docs[i] for i in range(len(docs)))


def test_memory_budget_picks_the_shard_count(tmp_path, monkeypatch):
    src, docs = ids_corpus(tmp_path, n=300)
    # 1 KiB of budget above the base per document: a 100 KiB budget holds 100 documents a shard.
    monkeypatch.setattr(pipeline, "BASE_BYTES", 0)
    monkeypatch.setattr(pipeline, "PLAN_BYTES_PER_DOC", 1024)
    res = run_pack(tmp_path / "o", sources=[src], memory_budget="100K", **IDS)
    assert res["num_shards"] == 3
    meta = json.loads((tmp_path / "o" / storage.METADATA).read_text())
    assert meta["args"]["num_shards"] == 3 and "memory_budget" not in meta["args"]
    # The same shard count by hand gives the same bytes; the loader reads every shard.
    run_pack(tmp_path / "hand", sources=[src], num_shards=3, **IDS)
    _same_tree(tmp_path / "o", tmp_path / "hand")
    loader = StepLoader(DataConfig(path=str(tmp_path / "o"), micro_batch_tokens=512), 0, 1)
    seen = sum(b.num_docs for _ in range(loader.steps_per_epoch) for b in loader.next_step())
    assert seen == loader.ds.num_docs
    with pytest.raises(ValueError, match="--memory-budget"):
        pipeline.parse_bytes("lots")


def test_workers_give_identical_bytes_and_shard_jobs_still_assemble(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in random_texts(150, seed=5)])
    tok = tmp_path / "tok.json"
    from data_packing.tokenizer import train_bpe

    train_bpe(random_texts(50), 300).save(str(tok))
    kw = dict(sources=[src], tokenizer=str(tok), seq_len=128, num_shards=2)
    run_pack(tmp_path / "w1", workers=1, **kw)
    run_pack(tmp_path / "w3", workers=3, **kw)
    _same_tree(tmp_path / "w1", tmp_path / "w3")
    assert not run_pack(tmp_path / "jobs", workers=2, shard_index=1, **kw)["complete"]
    assert run_pack(tmp_path / "jobs", workers=2, shard_index=0, **kw)["complete"]
    _same_tree(tmp_path / "jobs", tmp_path / "w1")


def test_jsonl_fast_ids_path_agrees_with_json(tmp_path):
    from data_packing.documents import tokenize_records

    lines = ['{"ids": [1, 2,3]}', '{"ids":[4]}', '', '{"x": 1, "ids": [5, 6]}', '{"ids": []}',
             '{"ids": [-1]}', '{"ids": [1.5]}', '[1, 2]', '{"other": 1}', '{"ids": [7, 8]}\r',
             '{"ids": null}']
    path = tmp_path / "r.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode())
    recs = JsonlRecords([str(path)])
    recs.use("ids", ids=True)
    got = recs[0:len(recs)]
    assert len(got) == len(lines) - 1  # the blank line is not a record
    as_lists = [v.tolist() if isinstance(v, np.ndarray) else v for v in got]
    assert as_lists == [[1, 2, 3], [4], [5, 6], [], [-1], [1.5], NOT_A_RECORD, None, [7, 8], None]
    res = tokenize_records(got, 0, "ids", None, None, 10)
    assert res.index == [0, 1, 2, 8]
    assert dict(res.dropped) == {"empty": 1, "bad_record": 3, "missing_value": 2}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1]}\n{"ids": [1,,2]}\n')
    recs = JsonlRecords([str(bad)], strict=True)  # without strict: a dropped record (test_bad_records.py)
    recs.use("ids", ids=True)
    with pytest.raises(ValueError, match=r"bad\.jsonl.*record 2"):
        recs[0:2]


def test_edited_input_is_not_reused(tmp_path):
    src = tmp_path / "i.jsonl"
    write_jsonl(src, [{"ids": [1, 2, 3]}, {"ids": [4, 5, 6]}])
    run_pack(tmp_path / "o", sources=[str(src)], ids_key="ids", vocab_size=10, seq_len=8)
    st = os.stat(src)
    # Same size, and the modification time put back: only the content hash can tell.
    src.write_text(src.read_text().replace("4, 5, 6", "4, 5, 7"))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(src) == st.st_size
    with pytest.raises(FileExistsError, match="different inputs"):
        run_pack(tmp_path / "o", sources=[str(src)], ids_key="ids", vocab_size=10, seq_len=8)
    res = run_pack(tmp_path / "o", sources=[str(src)], ids_key="ids", vocab_size=10, seq_len=8,
                   overwrite=True)
    assert res["skipped_shards"] == 0
    assert sorted(PackedDataset(str(tmp_path / "o")).doc_tokens(d).tolist()[-1] for d in (0, 1)) == [3, 7]


@pytest.fixture()
def packed_two_shards(tmp_path):
    src, _ = ids_corpus(tmp_path, n=120)
    kw = dict(sources=[src], num_shards=2, **IDS)
    run_pack(tmp_path / "ref", **kw)
    shutil.copytree(tmp_path / "ref", tmp_path / "o")
    return tmp_path, kw


def _one_line_error(path, **kw):
    with pytest.raises(ValueError) as e:
        PackedDataset(str(path), **kw)
    msg = str(e.value)
    assert "\n" not in msg and "rerun longctx-pack" in msg
    return msg


def test_deleted_shard_is_rebuilt_not_reported_complete(packed_two_shards, capsys):
    tmp, kw = packed_two_shards
    shutil.rmtree(tmp / "o" / storage.shard_name(1))
    argv = ["--source", kw["sources"][0], "--ids-key", "ids", "--vocab-size", "1000", "--seq-len",
            "256", "--cp-size", "2", "--num-shards", "2", "--workers", "1", "--no-progress",
            "--output", str(tmp / "o")]
    assert main(argv) == 0
    assert "(2 shard(s), 1 already done)" in capsys.readouterr().out
    _same_tree(tmp / "o", tmp / "ref")


@pytest.mark.parametrize("damage, named", [
    (lambda d: os.remove(d / "tokens.bin"), "tokens.bin is missing"),
    (lambda d: open(d / "row_tokens.npy", "r+b").truncate(100), "row_tokens.npy has 100 bytes"),
    (lambda d: os.remove(d / storage.SHARD_INFO), "shard.json is missing"),
])
def test_damaged_shard_is_named_and_rebuilt(packed_two_shards, damage, named):
    tmp, kw = packed_two_shards
    shard = tmp / "o" / storage.shard_name(0)
    damage(shard)
    assert named in _one_line_error(tmp / "o")
    with pytest.raises(ValueError, match=named):  # what the trainer's build_loader reports
        StepLoader(DataConfig(path=str(tmp / "o")), 0, 1)
    res = run_pack(tmp / "o", **kw)
    assert res["complete"] and res["skipped_shards"] == 1
    _same_tree(tmp / "o", tmp / "ref")


def test_checksums_catch_a_flipped_byte_unless_sizes_only(packed_two_shards):
    tmp, _ = packed_two_shards
    path = tmp / "o" / storage.shard_name(1) / "tokens.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "tokens.bin does not match its checksum" in _one_line_error(tmp / "o")
    PackedDataset(str(tmp / "o"), verify="sizes")  # the fast check compares sizes only
    with pytest.raises(ValueError, match="data.verify"):
        DataConfig(path="x", verify="none").validate()


def test_format_1_outputs_still_load(packed_two_shards):
    tmp, _ = packed_two_shards
    out = tmp / "o"
    meta = json.loads((out / storage.METADATA).read_text())
    meta["format_version"] = 1
    (out / storage.METADATA).write_text(json.dumps(meta))
    for k in range(2):  # format 1 recorded no file list
        info_path = out / storage.shard_name(k) / storage.SHARD_INFO
        info = json.loads(info_path.read_text())
        del info["files"]
        info_path.write_text(json.dumps(info))
    ref = PackedDataset(str(tmp / "ref"))
    old = PackedDataset(str(out))
    assert all(np.array_equal(old.row(i)[0], ref.row(i)[0]) for i in range(len(ref)))
    os.truncate(out / storage.shard_name(0) / "tokens.bin", 10)
    assert "holds 5 tokens" in _one_line_error(out)


def test_what_users_see(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    for name in ("empty.jsonl", "blank.jsonl"):
        rc = main(["--source", str(tmp_path / name), "--output", str(tmp_path / "o"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "is empty" in err and name in err and "\n" not in err
    recs = [{"text": "fine words"}, {"body": "no text key"}, {"text": 3}, {"text": None},
            {"text": ["x"]}, {"text": "more fine words"}]
    src = write_jsonl(tmp_path / "d.jsonl", recs)
    rc = main(["--source", src, "--train-tokenizer", "260", "--seq-len", "64", "--no-progress",
               "--workers", "1", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and len(err) == 1
    assert "dropped 4 record(s): 2 bad_record" in err[0] and "2 missing_value (no 'text' field" in err[0]


def test_parquet_streams_in_batches_and_matches_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_packing.parquet import ParquetRecords

    src, docs = ids_corpus(tmp_path, n=300)
    values = [d if i % 50 else None for i, d in enumerate(docs)]  # nulls count as missing
    pq.write_table(pa.table({"ids": pa.array(values, pa.list_(pa.int32()))}),
                   tmp_path / "d.parquet", row_group_size=37)
    recs = ParquetRecords([str(tmp_path / "d.parquet")])
    recs.use("ids", ids=True)
    as_list = lambda xs: [None if x is None else x.tolist() for x in xs]
    assert as_list(recs[10:200]) == values[10:200]  # across row groups
    assert as_list(recs[200:300]) == values[200:]  # continues the open reader
    assert as_list(recs[5:9]) == values[5:9]  # a jump backwards starts a new one
    write_jsonl(tmp_path / "d.jsonl", [{"ids": v} for v in values])
    run_pack(tmp_path / "pq", sources=[str(tmp_path / "d.parquet")], num_shards=2, **IDS)
    run_pack(tmp_path / "js", sources=[str(tmp_path / "d.jsonl")], num_shards=2, **IDS)
    for k in range(2):  # the same bytes; only the run fingerprint (the inputs differ) is not
        info = [json.loads((tmp_path / o / storage.shard_name(k) / storage.SHARD_INFO).read_text())
                for o in ("pq", "js")]
        assert info[0]["files"] == info[1]["files"] and info[0]["counters"] == info[1]["counters"]
    assert PackedDataset(str(tmp_path / "pq")).meta["stats"]["docs_dropped_missing_value"] == 6
