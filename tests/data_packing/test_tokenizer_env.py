"""The tokenizer's thread pool is sized by the process's owner: packing as a library (a caller's
process) leaves os.environ as it found it; `longctx-pack` sizes its own from --workers."""

import os

from data_packing.cli import main as pack_main
from data_packing.tokenizer import thread_env
from tests.data_packing.conftest import random_texts, run_pack, write_jsonl

VARS = ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")


def _corpus(tmp_path) -> str:
    return write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in random_texts(60, seed=3)])


def test_packing_as_a_library_leaves_the_environment_alone(tmp_path, monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    before = dict(os.environ)
    for workers in (1, 2):  # in this process, and in forked worker processes
        res = run_pack(tmp_path / f"w{workers}", sources=[_corpus(tmp_path)], train_tokenizer=300,
                       seq_len=128, workers=workers)
        assert res["complete"]
        assert dict(os.environ) == before


def test_longctx_pack_sizes_its_own_tokenizer_threads(tmp_path, monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)  # and restored after the test
    rc = pack_main(["--source", _corpus(tmp_path), "--train-tokenizer", "300", "--seq-len", "128",
                    "--workers", "2", "--no-progress", "--output", str(tmp_path / "out")])
    assert rc == 0
    assert {v: os.environ[v] for v in VARS} == {"RAYON_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "true"}
    assert thread_env(1) == {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
