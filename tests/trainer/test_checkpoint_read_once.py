"""Verified loading reads each rank file once: its bytes come from one pass of reads (no
separate checksum pass, no second path such as a file mapping), the sha256 is computed from
those same bytes, and several files are read at once. Checksums still stop a damaged file
(tests/trainer/test_checkpoint.py)."""

import builtins
import hashlib
import threading
import time

import pytest

import longctx_moe.checkpoint.reader as checkpoint_reader
from longctx_moe.checkpoint.resume import maybe_resume
from tests.trainer.test_checkpoint import make, saved_steps


class _CountingFile:
    def __init__(self, f, counts):
        self._f, self._counts = f, counts

    def readinto(self, buf):
        n = self._f.readinto(buf)
        self._counts["read"] += n
        return n

    def read(self, *args):
        data = self._f.read(*args)
        self._counts["read"] += len(data)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_each_rank_file_is_read_once_and_hashed_from_those_bytes(tmp_path, monkeypatch):
    _, _, ctx = saved_steps(tmp_path, [1])
    part = ctx.ckpt_dir / "step_00000001" / "rank_00000.safetensors"
    counts = {"opens": 0, "read": 0, "hashed": 0}
    real_open, real_sha = builtins.open, hashlib.sha256

    def counting_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        if str(path) == str(part):
            counts["opens"] += 1
            return _CountingFile(f, counts)
        return f

    class CountingSha:
        def __init__(self):
            self._h = real_sha()

        def update(self, data):
            counts["hashed"] += memoryview(data).nbytes
            self._h.update(data)

        def hexdigest(self):
            return self._h.hexdigest()

    import safetensors

    def no_mapping(*args, **kwargs):
        raise AssertionError("the rank file was opened a second way")

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(hashlib, "sha256", CountingSha)
    monkeypatch.setattr(safetensors, "safe_open", no_mapping)
    trainer, loader, ctx2 = make(tmp_path)
    assert maybe_resume(trainer, loader, ctx2) is not None and trainer.step == 1
    size = part.stat().st_size
    assert counts == {"opens": 1, "read": size, "hashed": size}


def test_prefetch_reads_several_files_at_once(tmp_path, monkeypatch):
    _, _, ctx = saved_steps(tmp_path, [1])
    reader = checkpoint_reader.CheckpointReader(ctx.ckpt_dir / "step_00000001")
    real = checkpoint_reader.read_verified
    inside, most, lock = [0], [0], threading.Lock()

    def slow_read(path, entry):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.2)  # long enough for the other file's read to start meanwhile
        try:
            return real(ctx.ckpt_dir / "step_00000001" / "rank_00000.safetensors", entry)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(checkpoint_reader, "read_verified", slow_read)
    # Two names for the one file of this single-rank step: the reader treats them as two files.
    reader.meta["files"]["copy.safetensors"] = reader.meta["files"]["rank_00000.safetensors"]
    reader.prefetch(["rank_00000.safetensors", "copy.safetensors"])
    assert most[0] == 2
    assert reader.file("copy.safetensors").metadata() == reader.file("rank_00000.safetensors").metadata()


@pytest.mark.parametrize("misaligned", [False, True])
def test_tensors_are_read_back_exactly_from_the_bytes(tmp_path, misaligned):
    import torch

    from longctx_moe.checkpoint.rank_file import read_verified, write_rank_file

    tensors = {"a": torch.arange(3, dtype=torch.uint8)} if misaligned else {}  # 3 bytes: the next starts unaligned
    tensors.update(b=torch.randn(5, 7, dtype=torch.float64), c=torch.randn(4).bfloat16(), d=torch.tensor(True))
    path = tmp_path / "f.safetensors"
    entry = write_rank_file(path, tensors, {"state": "{}"})
    handle = read_verified(path, entry)
    for key, t in tensors.items():
        assert torch.equal(handle.get_tensor(key), t) and handle.get_tensor(key).dtype == t.dtype
    assert torch.equal(handle.get_slice("b")[1:3, 2:5], tensors["b"][1:3, 2:5])
