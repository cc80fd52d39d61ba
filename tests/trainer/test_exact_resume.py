"""Multi-rank exact resume: on 4 gloo ranks, the real trainer run for 4 steps,
checkpointed, resumed and run for 4 more equals 8 uninterrupted steps bitwise (losses, weights,
AdamW state, expert bias, every rank's loader position), under CP2 x EP2 (folded) and TP2 x DP2, the
latter also with checkpoint.async_save."""

import pytest
import torch

from longctx_moe.checkpoint.reader import CheckpointReader
from longctx_moe.config import load_config
from longctx_moe.train import run
from tests.launcher import run_distributed
from tests.trainer.test_train_run import ROOT

STEPS, SPLIT = 8, 4
SETS = ["data.global_batch_tokens=1024", "data.micro_batch_tokens=512", "optim.warmup_steps=3",
        "logging.peak_tflops=1.0", "logging.progress_bar=false", "train.num_threads=1",
        "model.vocab_size=512", "model.expert_bias=true", "checkpoint.keep_last=0", f"train.steps={STEPS}"]


def _cfg(run_dir, corpus, layout):
    return load_config(ROOT / "configs/tiny_cpu.yaml",
                       [*SETS, *layout, f"train.run_dir={run_dir}", f"data.path={corpus}"])


def _runs(rank, world, tmp, corpus, layout):
    """The uninterrupted run, then the interrupted one and its resumption; the losses by step."""
    whole = run(_cfg(tmp / "whole", corpus, layout))
    first = run(_cfg(tmp / "split", corpus, layout), until=SPLIT)
    second = run(_cfg(tmp / "split", corpus, layout))
    losses = lambda summary: {r["step"]: r["loss"] for r in summary["records"]}  # noqa: E731
    return losses(whole), losses(first), losses(second)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.cp=2", "parallel.ep=2"], ["parallel.tp=2"],
                                    # saves every 3 steps written on background threads: the
                                    # published steps and the resume are the same
                                    ["parallel.tp=2", "checkpoint.async_save=true", "checkpoint.every_steps=3"]],
                         ids=["cp2xep2", "tp2xdp2", "tp2xdp2-async"])
def test_interrupted_run_equals_the_uninterrupted_one_bitwise(tmp_path, corpus, layout):
    whole, first, second = run_distributed(_runs, 4, args=(tmp_path, corpus, layout), timeout=1500)[0]
    assert sorted(first) == list(range(1, SPLIT + 1)) and sorted(second) == list(range(SPLIT + 1, STEPS + 1))
    assert {**first, **second} == whole  # exact float equality, step by step
    done = [CheckpointReader(tmp_path / name / "checkpoints" / f"step_{STEPS:08d}") for name in ("whole", "split")]
    assert done[0].keys() == done[1].keys() and any(k.startswith("optim.exp_avg_sq.") for k in done[0].keys())
    for key in done[0].keys():
        shape = done[0].global_shape(key)
        a, b = (r.read(key, shape, (0,) * len(shape), shape) for r in done)
        assert torch.equal(a, b), key
    # Every rank's loader position and RNG streams (one-time probes draw from generators of
    # their own, so the resumed processes' probes leave them as the uninterrupted run's).
    for rank in range(4):
        a, b = (r.rank_state(rank) for r in done)
        assert a["loader"] == b["loader"] and a["rng"] == b["rng"], rank
    assert done[0].rank_state(0)["loader"]["step_in_epoch"] + done[0].rank_state(0)["loader"]["epoch"] > 0
    if "checkpoint.every_steps=3" in layout:
        steps = sorted(p.name for p in (tmp_path / "split" / "checkpoints").glob("step_*"))
        assert steps == [f"step_{n:08d}" for n in (3, 4, 6, 8)]
