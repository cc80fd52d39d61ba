"""Memory across training steps: the trainer keeps no tensors alive from one step to the next, the
CPU peak-memory window really restarts at every step, oneDNN's shape caches are capped, and the
heap's free pages are handed back when the resident set creeps up (docs/PERFORMANCE.md, "Memory
over a run": the RSS growth of `make train` was those caches and the heap holes around them)."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cp_attention.kernels._buckets import plan_buckets
from longctx_moe import host
from longctx_moe.build import model_of
from longctx_moe.config import load_config
from longctx_moe.host import ONEDNN_CACHE_CAPACITY, HeapTrim, bound_onednn_caches, configure_cpu
from longctx_moe.metrics import reset_peak_memory
from longctx_moe.model.config import BalanceConfig
from longctx_moe.parallel.parallelize import parallelize
from longctx_moe.trainer import Trainer
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch, tiny_config
from tests.trainer.test_train_run import ROOT


def _live_tensors() -> int:
    # Attention's bucket plans (index tensors per document layout) are an LRU cache of 64 by
    # design: bounded, and not what this test looks for.
    plan_buckets.cache_clear()
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _live_tensors_across_steps(rank: int, world: int) -> tuple[int, int]:
    """(live tensors after 2 steps, after 4 more), in a process of its own (run_distributed
    spawns a fresh interpreter): in the pytest process, bounded caches that earlier tests filled
    give up entries as these steps add theirs, and the count moves for reasons not this test's."""
    cfg = load_config(None, ["optim.warmup_steps=0", "train.autocast_dtype=bf16"])
    cfg.model = tiny_config(expert_bias=True)
    cfg.balance = BalanceConfig(aux_loss_type="seq", z_loss_coeff=1e-3)
    torch.manual_seed(0)
    trainer = Trainer(cfg, parallelize(model_of(cfg), None, cfg.parallel))
    gen = torch.Generator().manual_seed(0)
    vocab = cfg.model.vocab_size

    def step(i: int) -> None:
        lens = [[5 + i, 17, 9 + 2 * i], [30 - i, 4 + i]]
        trainer.train_step([packed_batch(d, vocab, generator=gen) for d in lens])

    for i in range(2):  # optimizer state and lazily built buffers exist from here on
        step(i)
    before = _live_tensors()
    for i in range(2, 6):
        step(i)
    return before, _live_tensors()


@pytest.mark.slow
def test_train_steps_keep_no_tensors_alive():
    """Steps of new shapes each time (other documents, other micro-batch lengths) leave the
    number of live tensors where the first steps left it: no graph, loss or metric is kept."""
    [(before, after)] = run_distributed(_live_tensors_across_steps, 1, timeout=300)
    assert after == before


def test_onednn_cache_caps_are_set_unless_given(monkeypatch):
    """configure_cpu caps oneDNN's and ideep's shape caches (host.py: their default 1024 entries
    of ~270 KB each grew `make train` by ~500 MB), and leaves a value the user set alone."""
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # restored (or removed) after the test
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    threads = torch.get_num_threads()
    configure_cpu(threads, "default")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"
    with pytest.raises(ValueError, match=">= 1"):
        bound_onednn_caches(0)  # ideep crashes on a capacity of 0


def _peaks_by_step(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["peak_memory_mb"] for r in records]


@pytest.mark.slow
@pytest.mark.long(seconds=180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU peak is VmHWM, Linux only")
def test_peak_memory_levels_off_over_300_steps(tmp_path):
    """make train's model and corpus, one 4,096-token micro-batch of packed documents per step
    (new GEMM and attention shapes for hundreds of steps): the peak RSS of steps 201-300 stays
    within 7% of steps 101-200's. Measured on AMD EPYC: with the heap trim 1.017-1.033 (three
    runs; 1.003 under the AVX2 settings), without it (train.host_heap_trim=0) 1.094-1.122 (three
    runs), still climbing (docs/PERFORMANCE.md). The trim lets the resident set grow 10% before it
    fires, so shorter runs do not tell the two apart."""
    if not reset_peak_memory(torch.device("cpu")):
        pytest.skip("/proc/self/clear_refs is not writable here: a step's peak cannot be measured")
    data = tmp_path / "stdlib"
    pack = [sys.executable, "-m", "data_packing.cli", "--source", "stdlib", "--train-tokenizer", "4096",
            "--seq-len", "1024", "--max-docs", "400", "--seed", "0", "--no-progress", "--output", str(data)]
    subprocess.run(pack, check=True, capture_output=True, cwd=ROOT, timeout=600)
    sets = [f"data.path={data}", f"train.run_dir={tmp_path / 'run'}", "train.steps=300",
            "data.global_batch_tokens=4096", "data.micro_batch_tokens=4096", "checkpoint.every_steps=0",
            "logging.progress_bar=false", "logging.peak_tflops=1.0"]
    cmd = [sys.executable, "-m", "longctx_moe.cli", "train", "--config", str(ROOT / "configs/tiny_cpu.yaml"),
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    peaks = _peaks_by_step(tmp_path / "run")
    assert len(peaks) == 300
    growth = max(peaks[200:]) / max(peaks[100:200])
    assert growth <= 1.07, f"peak RSS of steps 201-300 is {growth:.3f}x that of steps 101-200"


def test_heap_trim_slack_is_checked():
    with pytest.raises(ValueError, match=">= 0"):
        HeapTrim(-0.1)
    assert not HeapTrim(0).after_step()  # 0: never trims


class _FakeProcess:
    """A resident set the test sets before each step end; malloc_trim drops it to 900 MB."""

    def __init__(self):
        self.rss, self.trims = 1000.0, 0

    def malloc_trim(self, pad):
        self.trims += 1
        self.rss = 900.0


def test_heap_trim_reference_is_the_step_after_each_trim(monkeypatch):
    """The first step sets the reference; growth up to the slack keeps it; past it the heap is
    trimmed once, and the next step's resident set (its working set faulted back in) becomes the
    reference, not the low point right after the trim, which would trim again at every step."""
    proc = _FakeProcess()
    monkeypatch.setattr(host, "_libc", lambda: proc)
    monkeypatch.setattr(host, "resident_mb", lambda: proc.rss)
    trim = HeapTrim(0.1)
    assert trim.enabled
    got = []
    for rss in (1000, 1100, 1101, 1150, 1120, 1160, 1200):
        proc.rss = rss
        got.append(trim.after_step())
    # 1000: reference; up to 1100 kept; 1101 trims; 1150 the new reference; 1160, 1200 within 10%
    assert got == [False, False, True, False, False, False, False] and proc.trims == 1
    assert trim.reference_mb == 1150


def test_heap_trim_is_off_without_glibc(monkeypatch):
    monkeypatch.setattr(host, "_libc", lambda: None)
    trim = HeapTrim(0.1)
    assert not trim.enabled and not trim.after_step()
