"""End to end: `longctx-moe train --nproc 4` on the default config with CP and EP folded over the
same 4 ranks (attention CP2 x DP2, MoE EP4) and the distributed optimizer, on a small packed
corpus."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from longctx_moe.config import load_config
from longctx_moe.train import run as train_run
from tests.launcher import run_distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
SHORT = [f"train.steps={STEPS}", "data.global_batch_tokens=1024", "data.micro_batch_tokens=512",
         "optim.warmup_steps=1", "logging.progress_bar=false", "train.num_threads=1",
         "checkpoint.every_steps=0", "logging.peak_tflops=1.0"]


def train_cli_on_four_ranks(tmp_path: Path, corpus: Path, layout: list[str]) -> Path:
    """`longctx-moe train --nproc 4` of the default config with the `layout` overrides, STEPS
    steps on the packed `corpus`; checks that it trained (finite, not blown up) and returns
    the run directory."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "longctx_moe.cli", "train", "--nproc", "4",
           "--config", str(ROOT / "configs/tiny_cpu.yaml")] + [a for s in _sets(layout, run_dir, corpus)
                                                               for a in ("--set", s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _check_trained(run_dir)


def _rank_run(rank, world, sets):
    train_run(load_config(ROOT / "configs/tiny_cpu.yaml", sets))


def train_on_four_forked_ranks(tmp_path: Path, corpus: Path, layout: list[str]) -> Path:
    """The same run as train_cli_on_four_ranks, by the trainer's entry point (longctx_moe.train.run)
    on 4 gloo ranks forked from the tests' preloaded server: the launcher and four fresh
    interpreters (the CLI test above runs them) cost more CPU than the 3 steps."""
    run_dir = tmp_path / "run"
    run_distributed(_rank_run, 4, args=(_sets(layout, run_dir, corpus),), timeout=400)
    return _check_trained(run_dir)


def _sets(layout: list[str], run_dir: Path, corpus: Path) -> list[str]:
    return [*layout, *SHORT, f"train.run_dir={run_dir}", f"data.path={corpus}"]


def _check_trained(run_dir: Path) -> Path:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert math.isfinite(r["loss"]) and r["loss"] > 0 and math.isfinite(r["grad_norm"])
    # the loss of a random init is ~ln(vocab); training must not blow it up in 3 steps
    assert records[-1]["loss"] <= records[0]["loss"] * 1.05
    return run_dir


@pytest.mark.slow
@pytest.mark.long
def test_cli_trains_cp2_ep4_on_four_ranks(tmp_path, corpus):
    run_dir = train_cli_on_four_ranks(
        tmp_path, corpus, ["parallel.cp=2", "parallel.ep=4", "parallel.distributed_optimizer=true"])
    meta = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 4
    # Dense AdamW state lives in 4 slabs (one per dp_cp rank); expert state is split by EP only
    # (edp = 1), like the experts themselves.
    pieces = {k: len(v["pieces"]) for k, v in meta["tensors"].items()}
    assert pieces["optim.exp_avg.embed.weight"] == 4 and pieces["model.embed.weight"] == 1
    experts = [k for k in pieces if k.startswith("optim.exp_avg.") and ".experts." in k]
    assert experts and all(pieces[k] == pieces["model." + k[len("optim.exp_avg."):]] == 4 for k in experts)
