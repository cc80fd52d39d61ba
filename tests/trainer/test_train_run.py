"""End to end: a very short version of the default run (configs/tiny_cpu.yaml) on a packed corpus,
resumed from its checkpoint, and the same through `longctx-moe train --nproc 2`."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_packing.cli import main as pack_main
from longctx_moe.config import load_config
from longctx_moe.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["data.global_batch_tokens=1024", "data.micro_batch_tokens=512", "optim.warmup_steps=2",
         "logging.peak_tflops=1.0", "logging.progress_bar=false", "checkpoint.every_steps=2",
         "train.num_threads=1", "checkpoint.resume=auto"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "stdlib_small"
    rc = pack_main(["--source", "stdlib", "--train-tokenizer", "512", "--seq-len", "256", "--max-docs", "40",
                    "--seed", "0", "--no-progress", "--output", str(out)])
    assert rc in (0, None)
    return out


def args(run_dir, corpus, steps, *extra):
    sets = [*SHORT, f"train.steps={steps}", f"train.run_dir={run_dir}", f"data.path={corpus}", *extra]
    return ["--config", str(ROOT / "configs/tiny_cpu.yaml")] + [a for s in sets for a in ("--set", s)]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_short_default_run_then_exact_resume(tmp_path, corpus, capsys):
    run_dir = tmp_path / "run"
    assert train_main(args(run_dir, corpus, 5)) == 0
    out = capsys.readouterr().out
    assert f"metrics:     {run_dir / 'metrics.jsonl'}" in out and f"checkpoints: {run_dir / 'checkpoints'}" in out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert r["loss"] > 0 and r["grad_norm"] > 0 and 0 < r["mfu"] < 1 and r["tokens_per_s"] > 0
        assert len(r["expert_load_cv"]) == 2 and min(r["expert_load_min"]) <= 1 <= max(r["expert_load_max"])
        assert r["tokens"] <= 1024 and 0 < r["target_tokens"] < r["tokens"]
    assert load_config(run_dir / "config.yaml").train.steps == 5  # the resolved config
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000005"]  # keep_last=2

    # Resume a second run from step 4: its step 5 equals the uninterrupted one bitwise (real
    # model and loader, bf16 autocast, one thread: the same kernels in the same order).
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpts / "step_00000004", resumed / "checkpoints" / "step_00000004")
    (resumed / "checkpoints" / "latest").write_text("step_00000004\n")
    assert train_main(args(resumed, corpus, 5)) == 0
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [5]
    keys = ("loss", "grad_norm", "lr", "tokens", "expert_load_cv", "epoch")
    assert [again[0][k] for k in keys] == [records[4][k] for k in keys]


def test_bad_data_path_is_one_line(tmp_path, capsys):
    assert train_main(args(tmp_path / "run", tmp_path / "missing", 1)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.path=") and "make data" in err and "\n" not in err


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "flex", "no_such_kernel"])
def test_unavailable_attention_backend_fails_at_start_up_in_one_line(tmp_path, corpus, capsys, backend):
    # On this CPU machine the GPU-only backends cannot run: the run must stop before building
    # anything else, with one line that names the key, the cause and a fix.
    assert train_main(args(tmp_path / "run", corpus, 1, f"model.attention_backend={backend}")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: model.attention_backend='{backend}'")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_launches_two_local_ranks(tmp_path, corpus):
    run_dir = tmp_path / "run2"
    cmd = [sys.executable, "-m", "longctx_moe.cli", "train", "--nproc", "2", *args(run_dir, corpus, 2)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"metrics:     {run_dir / 'metrics.jsonl'}" in proc.stdout
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    meta = json.loads((run_dir / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["world_size"] == 2 and (run_dir / "checkpoints" / "step_00000002" / "rank_00001.pt").is_file()
