"""Every RNG stream (torch CPU, Python, NumPy and, where present, CUDA) is bitwise the same after a
resume as in the uninterrupted run: one-time probes and warm-ups draw from generators of their
own, never from the global ones a run saves and restores."""

import random

import numpy as np
import pytest
import torch

from longctx_moe.checkpoint.reader import CheckpointReader
from longctx_moe.checkpoint.rng import rng_state
from longctx_moe.config import load_config
from longctx_moe.metrics import measure_peak_tflops
from longctx_moe.model.grouped_gemm import grouped_mm_works
from longctx_moe.train import run
from tests.trainer.test_train_run import ROOT

STEPS, SPLIT = 4, 2
SETS = ["data.global_batch_tokens=1024", "data.micro_batch_tokens=512", "optim.warmup_steps=2",
        "logging.peak_tflops=1.0", "logging.progress_bar=false", "train.num_threads=1",
        "model.vocab_size=512", "checkpoint.keep_last=0", "checkpoint.every_steps=2", f"train.steps={STEPS}"]


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("probe", ["grouped_mm", "peak_tflops"])
def test_probes_leave_every_global_rng_untouched(device, probe):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    if device == "cuda":
        torch.cuda.init()
    before = rng_state()
    if probe == "grouped_mm":
        grouped_mm_works.cache_clear()  # as in a fresh process: the probe runs
        grouped_mm_works(device, torch.float32)
    else:
        measure_peak_tflops(torch.device(device), torch.float32, target_s=0.001, max_size=256, repeats=1)
    assert rng_state() == before


def _fresh_process_run(cfg, until=None):
    grouped_mm_works.cache_clear()  # each run of `longctx-moe train` is a new process
    torch.manual_seed(123)  # whatever the process drew before; the run seeds and restores its own
    return run(cfg, until=until)


def test_resumed_run_ends_with_every_rng_stream_of_the_uninterrupted_one(tmp_path, corpus):
    cfg = lambda name: load_config(ROOT / "configs/tiny_cpu.yaml",  # noqa: E731
                                   [*SETS, f"train.run_dir={tmp_path / name}", f"data.path={corpus}"])
    _fresh_process_run(cfg("whole"))
    _fresh_process_run(cfg("split"), until=SPLIT)
    _fresh_process_run(cfg("split"))
    step = f"step_{STEPS:08d}"
    whole, split = (CheckpointReader(tmp_path / n / "checkpoints" / step).rank_state(0)["rng"]
                    for n in ("whole", "split"))
    assert set(whole) >= {"torch", "python", "numpy"} and set(whole) == set(split)
    for stream in whole:
        assert whole[stream] == split[stream], stream
