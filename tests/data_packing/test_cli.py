"""longctx-pack end to end: the bundled stdlib run, determinism, resume, atomic writes, inputs."""

import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_packing import storage
from data_packing.config import DataConfig
from data_packing.loader import PackedDataset, StepLoader, read_metadata
from data_packing.tokenizer import load_tokenizer
from tests.data_packing.conftest import random_texts, run_pack, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _same_tree(a, b):
    """Every file except the timing log is byte-identical."""
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if os.path.isdir(pa):
            _same_tree(pa, pb)
        elif name != "run_stats.json":
            assert filecmp.cmp(pa, pb, shallow=False), f"{name} differs"


def _reconstruct(out):
    """{input doc index: token ids} rebuilt from the pieces stored in every row."""
    ds = PackedDataset(str(out))
    pieces = {}
    for k, shard in enumerate(ds._shards):
        base = sum(len(s["doc_lengths"]) for s in ds._shards[:k])
        for j, (doc, start) in enumerate(shard["doc_source"].tolist()):
            pieces.setdefault(doc, []).append((start, ds.doc_tokens(base + j)))
    return {d: np.concatenate([t for _, t in sorted(p, key=lambda x: x[0])]) for d, p in pieces.items()}


@pytest.mark.slow
def test_makefile_command_and_loader(tmp_path):
    out = tmp_path / "stdlib_tiny"
    cmd = [sys.executable, "-m", "data_packing", "--source", "stdlib", "--train-tokenizer", "4096",
           "--seq-len", "1024", "--max-docs", "400", "--seed", "0", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "docs_in" in proc.stdout and "padding_pct" in proc.stdout
    meta = read_metadata(str(out))
    assert meta["vocab_size"] == 4096 and meta["seq_len"] == 1024
    assert {meta["eos_id"], meta["pad_id"]} <= set(range(4096))
    s = meta["stats"]
    assert s["docs_in"] == 400 == s["docs_packed"] + s["docs_dropped"]
    assert s["tokens_lost"] == 0 and s["tokens_out"] == s["tokens_in"]
    step = StepLoader(DataConfig(path=str(out), micro_batch_tokens=2048), 0, 2).next_step()
    assert step and all(0 < b.num_tokens <= 2048 for b in step)


@pytest.mark.slow
def test_byte_identical_and_independent_of_workers(tmp_path):
    # Two processes (the tokenizer's thread pool is sized once per process), 1 vs 2 workers.
    kw = dict(sources=["stdlib"], train_tokenizer=300, seq_len=512, max_docs=30, seed=3)
    run_pack(tmp_path / "a", workers=2, **kw)
    cmd = [sys.executable, "-m", "data_packing", "--source", "stdlib", "--train-tokenizer", "300",
           "--seq-len", "512", "--max-docs", "30", "--seed", "3", "--workers", "1",
           "--no-progress", "--output", str(tmp_path / "b")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _same_tree(tmp_path / "a", tmp_path / "b")


def test_text_roundtrip_every_document_once(tmp_path):
    texts = random_texts(120) + [""]  # the empty one is counted, not packed
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    res = run_pack(tmp_path / "o", sources=[src], train_tokenizer=400, seq_len=64, cp_size=2,
                   tp_size=3, append_eos=True, overflow="split")
    meta = read_metadata(str(tmp_path / "o"))
    assert meta["pad_multiple"] == 12 and res["stats"]["docs_dropped_empty"] == 1
    tok = load_tokenizer(meta["tokenizer_file"])
    docs = _reconstruct(tmp_path / "o")
    assert sorted(docs) == list(range(120))
    for i, ids in docs.items():
        assert ids[-1] == meta["eos_id"]
        assert tok.decode(ids[:-1].tolist(), skip_special_tokens=False) == texts[i]
    ds = PackedDataset(str(tmp_path / "o"))
    for r in range(len(ds)):  # physical (padded) size of every row fits seq_len
        shard_row = ds.row(r)[1]
        assert int((-(-shard_row // 12) * 12).sum()) <= 64


def test_interrupted_run_never_loads_and_rerun_skips(tmp_path, monkeypatch):
    texts = random_texts(90, seed=1)
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    kw = dict(sources=[src], train_tokenizer=300, seq_len=128, num_shards=3)
    run_pack(tmp_path / "ref", **kw)
    real_rename = os.rename

    def crash_on_second_shard(src_path, dst_path):
        if dst_path.endswith(storage.shard_name(1)):
            raise KeyboardInterrupt("simulated crash while writing shard 1")
        real_rename(src_path, dst_path)

    monkeypatch.setattr(storage.os, "rename", crash_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        run_pack(tmp_path / "o", **kw)
    monkeypatch.setattr(storage.os, "rename", real_rename)
    with pytest.raises(ValueError, match="no metadata.json"):
        PackedDataset(str(tmp_path / "o"))
    res = run_pack(tmp_path / "o", **kw)
    assert res["complete"] and res["skipped_shards"] == 1
    _same_tree(tmp_path / "o", tmp_path / "ref")  # the crashed attempt's temp dir is gone too
    assert run_pack(tmp_path / "o", **kw)["skipped_shards"] == 3  # nothing left to do


def test_shard_index_jobs_assemble_the_same_output(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in random_texts(60, seed=2)])
    kw = dict(sources=[src], train_tokenizer=300, seq_len=128, num_shards=2)
    run_pack(tmp_path / "ref", **kw)
    assert not run_pack(tmp_path / "o", shard_index=1, **kw)["complete"]
    assert not os.path.exists(tmp_path / "o" / storage.METADATA)
    assert run_pack(tmp_path / "o", shard_index=0, **kw)["complete"]
    _same_tree(tmp_path / "o", tmp_path / "ref")


def test_input_formats_agree(tmp_path):
    import datasets

    texts = random_texts(40, seed=4)
    ds = datasets.Dataset.from_dict({"body": texts})
    half = len(texts) // 2
    write_jsonl(tmp_path / "p1.jsonl", [{"body": t} for t in texts[:half]])
    write_jsonl(tmp_path / "p2.jsonl", [{"body": t} for t in texts[half:]])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = sorted(f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow"))
    variants = {"glob": [str(tmp_path / "p*.jsonl")], "parquet": [str(tmp_path / "d.parquet")],
                "saved": [str(tmp_path / "saved")],
                "arrow": [str(tmp_path / "saved" / a) for a in arrow]}
    results = {}
    for name, srcs in variants.items():
        run_pack(tmp_path / name, sources=srcs, text_key="body", train_tokenizer=300, seq_len=128)
        results[name] = _reconstruct(tmp_path / name)
    ref = results.pop("glob")
    assert len(ref) == len(texts)
    for name, got in results.items():
        assert sorted(got) == sorted(ref), name
        assert all(np.array_equal(got[i], ref[i]) for i in ref), name


def test_chat_records_mask_assistant_turns(tmp_path):
    chats = [[{"role": "user", "content": f"question {i} λ"},
              {"role": "assistant", "content": f"answer {i} " * (i + 1)}] for i in range(12)]
    chats.append("not a chat")  # malformed record: counted as bad_record
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats])
    res = run_pack(tmp_path / "o", sources=[src], train_tokenizer=300, seq_len=64)
    assert res["stats"]["docs_dropped_bad_record"] == 1
    ds = PackedDataset(str(tmp_path / "o"))
    tok = load_tokenizer(ds.meta["tokenizer_file"])
    assert ds.has_loss_mask
    sup = {}
    for k, shard in enumerate(ds._shards):
        base = sum(len(s["doc_lengths"]) for s in ds._shards[:k])
        for j, (doc, start) in enumerate(shard["doc_source"].tolist()):
            ids, mask = ds.doc_tokens(base + j), ds.doc_loss_mask(base + j)
            sup.setdefault(doc, []).append((start, ids[mask]))
    for i in range(12):
        ids = np.concatenate([t for _, t in sorted(sup[i], key=lambda x: x[0])])
        assert tok.decode(ids.tolist()) == f"answer {i} " * (i + 1) + "\n"


def test_ids_input_and_bad_records(tmp_path):
    recs = [{"ids": [1, 2, 3]}, {"ids": None}, {"ids": [5, 99999]}, {"ids": []}, {"ids": [7] * 50}]
    src = write_jsonl(tmp_path / "i.jsonl", recs)
    res = run_pack(tmp_path / "o", sources=[src], ids_key="ids", vocab_size=100, seq_len=16,
                   overflow="drop")
    s = res["stats"]
    assert (s["docs_dropped_missing_value"], s["docs_dropped_bad_record"], s["docs_dropped_empty"],
            s["docs_dropped_overflow"], s["docs_packed"]) == (1, 1, 1, 1, 1)
    assert s["tokens_lost"] == 50 and s["tokens_out"] == 3
    assert PackedDataset(str(tmp_path / "o")).row(0)[0].tolist() == [1, 2, 3]


def test_invalid_utf8_is_counted():
    from data_packing.documents import tokenize_records
    from data_packing.tokenizer import train_bpe

    tok = train_bpe(["hello world"] * 10, 300)
    res = tokenize_records([b"ok \xc3\xa9", b"bad \xff\xfe", b"", None, 3], 0, "text", tok, None, 300)
    assert res.index == [0]
    assert dict(res.dropped) == {"invalid_utf8": 1, "empty": 1, "missing_value": 1, "bad_record": 1}


def test_bad_inputs_give_one_line_errors(tmp_path, capsys):
    from data_packing.cli import main

    good = write_jsonl(tmp_path / "g.jsonl", [{"text": t} for t in random_texts(10)])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "trunc')
    cases = [
        (["--source", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--source", str(tmp_path / "bad.parquet")], "cannot read"),
        (["--source", str(tmp_path / "bad.jsonl"), "--strict"], "cannot read"),  # else counted
        (["--source", good, "--text-key", "body"], "pass --text-key"),
        (["--source", good], "no tokenizer"),
        (["--source", good, "--train-tokenizer", "300", "--seq-len", "4", "--cp-size", "4"], "pad multiple"),
    ]
    for extra, match in cases:
        rc = main(extra + ["--output", str(tmp_path / "o"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and match in err and "\n" not in err, (extra, err)


def test_different_tokenizer_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in random_texts(20)])
    run_pack(tmp_path / "o", sources=[src], train_tokenizer=300, seq_len=128)
    from data_packing.tokenizer import train_bpe

    other = tmp_path / "other.json"
    train_bpe(["completely different words"] * 5, 300).save(str(other))
    with pytest.raises(ValueError, match="tokenizer differs"):
        run_pack(tmp_path / "o", sources=[src], tokenizer=str(other), seq_len=128)
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_pack(tmp_path / "o", sources=[src], train_tokenizer=300, seq_len=64)
    meta_path = tmp_path / "o" / storage.TOKENIZER
    meta_path.write_text(meta_path.read_text().replace('"<|pad|>"', '"<|PAD|>"'))
    with pytest.raises(ValueError, match="differs from the tokenizer recorded"):
        PackedDataset(str(tmp_path / "o"))


def test_stats_file_matches_metadata(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in random_texts(30)])
    res = run_pack(tmp_path / "o", sources=[src], train_tokenizer=300, seq_len=64)
    meta = json.loads((tmp_path / "o" / "metadata.json").read_text())
    assert meta["stats"] == res["stats"]
    s = res["stats"]
    assert s["rows"] == meta["num_rows"] > 0 and 0 <= s["padding_pct"] < 100
    assert s["row_attn_cost_p50"] <= s["row_attn_cost_p99"] <= s["row_attn_cost_max"] <= 64 ** 2
