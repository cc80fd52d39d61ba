"""Fixtures for data_packing tests: small corpora written to disk and packed outputs."""

import json
import os

import numpy as np
import pytest

from data_packing.pipeline import PackArgs, pack


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def random_texts(n, seed=0):
    """Texts with heavy-tailed lengths and a mix of scripts (so byte-level BPE sees multi-byte)."""
    rng = np.random.default_rng(seed)
    words = ["def", "return", "self", "x", "=", "(", ")", ":", "λ", "数据", "\n", "    ", "é", "#"]
    lengths = np.maximum(1, rng.lognormal(3.5, 1.0, n).astype(int))
    return [" ".join(rng.choice(words, size=k)) for k in lengths]


def run_pack(output, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 1)
    return pack(PackArgs(output=str(output), **kw))


def ids_corpus(tmp_dir, n=300, seed=0, vocab=1000, mean=3.5):
    """JSONL of pre-tokenized documents with heavy-tailed lengths; returns (path, docs)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(mean, 1.0, n).astype(int))
    docs = [rng.integers(0, vocab, size=k).tolist() for k in lengths]
    return write_jsonl(os.path.join(tmp_dir, "ids.jsonl"), [{"ids": d} for d in docs]), docs


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory):
    """A packed dataset of 300 pre-tokenized docs at seq_len 256 (pad multiple 4)."""
    d = tmp_path_factory.mktemp("ids")
    path, docs = ids_corpus(d)
    out = d / "packed"
    run_pack(out, sources=[path], ids_key="ids", vocab_size=1000, seq_len=256, cp_size=2,
             num_shards=2)
    return str(out), docs
