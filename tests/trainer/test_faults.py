"""Fault test: `longctx-moe train --nproc 2 --max-restarts 2` with one rank SIGKILLed mid-save on
the first attempt and another mid-step on the restarted one (tests/trainer/kill_entry.py, which
wraps the trainer's functions in each rank from outside, makes the kills deterministic). Each time
the launcher stops the other ranks and relaunches all of them; they resume from the latest
complete checkpoint, the run completes, every step directory left is intact, and the losses equal
those of the uninterrupted run bitwise."""

import json
import os
import subprocess
import sys

import pytest
import torch

from longctx_moe.checkpoint.reader import CheckpointReader
from longctx_moe.config import load_config
from longctx_moe.train import run as train_run
from tests.launcher import run_distributed
from tests.trainer.kill_entry import KILL_ENV, MODULE
from tests.trainer.test_train_run import ROOT

STEPS = 8
NPROC = 2  # EP2: one expert shard per rank, so each rank's file holds what no other rank writes
SETS = ["data.global_batch_tokens=1024", "data.micro_batch_tokens=512", "optim.warmup_steps=2",
        "logging.peak_tflops=1.0", "logging.progress_bar=false", "train.num_threads=1", "model.vocab_size=512",
        "checkpoint.every_steps=2", "checkpoint.keep_last=0", "parallel.ep=2", f"train.steps={STEPS}",
        # aten's attention kernels, in the killed runs and the uninterrupted one alike (the same
        # kernels on both sides of the comparison)
        "execution.attention_kernels=torch"]


def _sets(run_dir, corpus) -> list[str]:
    return [*SETS, f"train.run_dir={run_dir}", f"data.path={corpus}"]


def _train(run_dir, corpus, kill: str) -> str:
    """`longctx-moe train --nproc 2 --max-restarts 2` with the kills `kill` (KILL_ENV's format): the
    CLI and its launcher as they are, each rank with the kills installed (kill_entry)."""
    cmd = [sys.executable, "-m", MODULE, "train", "--nproc", str(NPROC), "--max-restarts", "2",
           "--config", str(ROOT / "configs/tiny_cpu.yaml"), *[a for s in _sets(run_dir, corpus) for a in ("--set", s)]]
    env = {**os.environ, KILL_ENV: kill}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # survivors of a kill: one line each
    return proc.stdout


def _losses(run_dir) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _rank_run(rank, world, run_dir, corpus):
    train_run(load_config(ROOT / "configs/tiny_cpu.yaml", _sets(run_dir, corpus)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    """The same run on two gloo ranks without kills, forked from the preloaded test server: the
    trainer's code and settings as under the launcher, without its start-up of two fresh
    interpreters."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    with pytest.MonkeyPatch.context() as mp:  # the ranks take the parent's environment
        mp.delenv(KILL_ENV, raising=False)
        run_distributed(_rank_run, NPROC, args=(run_dir, corpus), timeout=600)
    return run_dir


def _assert_intact(ckpt_dir):
    """Every published step reads back whole: sizes and checksums of all its files, each tensor."""
    steps = sorted(p for p in ckpt_dir.glob("step_*"))
    assert steps and (ckpt_dir / "latest").read_text().strip() == steps[-1].name
    for step_dir in steps:
        reader = CheckpointReader(step_dir)
        for key in reader.keys():
            shape = reader.global_shape(key)
            assert torch.isfinite(reader.read(key, shape, (0,) * len(shape), shape).double()).all()
        for rank in range(NPROC):
            assert reader.rank_state(rank)["loader"] is not None
    assert not list(ckpt_dir.glob(".step_*.tmp"))  # a killed save's leftovers are swept by the next one


# The first attempt's rank 1 dies while saving step 4 (its file unwritten, the step unpublished):
# the restart resumes from step 2. That attempt's rank 0 dies as step 7 starts (its peer waits
# inside the step's first collective): the second restart resumes from step 6.
@pytest.mark.slow
@pytest.mark.long
def test_killed_ranks_restart_and_end_like_the_uninterrupted_run(tmp_path, corpus, uninterrupted):
    run_dir = tmp_path / "run"
    out = _train(run_dir, corpus, "save:4:1,step:7:0")
    ckpt = run_dir / "checkpoints"
    for restart, resumed in ((1, 2), (2, 6)):
        assert f"resumed from {ckpt / f'step_{resumed:08d}'} at step {resumed} (elastic restart {restart})" in out
    assert _losses(run_dir) == _losses(uninterrupted)  # every step, the last included: exact floats
    assert [s for s, _ in _losses(run_dir)] == list(range(1, STEPS + 1))
    _assert_intact(ckpt)


class _Killed(Exception):
    pass


def test_kill_points_fire_where_the_crash_tests_aim(tmp_path, monkeypatch):
    """kill_entry's wrappers reach the production code paths the kills name: write_staged stops
    before its rank file exists, the pruning after meta.json is gone and before the files are, a
    step before the trainer runs it; other steps, ranks and attempts pass untouched."""
    from types import SimpleNamespace

    from longctx_moe.checkpoint import save, steps
    from longctx_moe.trainer import Trainer
    from tests.trainer import kill_entry

    def kill(pid, sig):
        raise _Killed(sig)

    monkeypatch.setattr(kill_entry.os, "kill", kill)
    kill_entry.install_kills(monkeypatch.setattr)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the second attempt: the list's second kill
    monkeypatch.setenv(KILL_ENV, "step:1:0,save:4:1")

    def staged(rank):
        (tmp_path / ".step_00000004.tmp").mkdir(exist_ok=True)
        return save.Staged(tmp_path, 4, rank, {"w": torch.zeros(2)}, {}, {"w": [[2], [0]]})

    assert save.write_staged(staged(0), {})[0] is None  # rank 0 writes its file
    with pytest.raises(_Killed):
        save.write_staged(staged(1), {})
    assert not (tmp_path / ".step_00000004.tmp" / steps.rank_file_name(1)).exists()

    monkeypatch.setenv(KILL_ENV, "save:9:9,prune:2:0")
    old = tmp_path / steps.step_dir_name(2)
    old.mkdir()
    (old / "meta.json").write_text("{}")
    (old / steps.rank_file_name(0)).write_text("")
    with pytest.raises(_Killed):
        steps._remove_step(old)
    assert not (old / "meta.json").exists() and (old / steps.rank_file_name(0)).exists()

    monkeypatch.setenv(KILL_ENV, "save:9:9,step:7:0")
    with pytest.raises(_Killed):
        Trainer.train_step(SimpleNamespace(step=6), [])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the first attempt aims at save 9
    with pytest.raises(Exception) as passed:  # on into the real step, which this stand-in fails
        Trainer.train_step(SimpleNamespace(step=6), [])
    assert not isinstance(passed.value, _Killed)
