"""End to end: a very short version of the default run (configs/tiny_cpu.yaml) on a packed corpus,
resumed from its checkpoint (also by rerunning the same command after a crash), and the same
through `longctx-moe train --nproc 2`."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longctx_moe.config import load_config
from longctx_moe.metrics import truncate_metrics
from longctx_moe.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["data.global_batch_tokens=1024", "data.micro_batch_tokens=512", "optim.warmup_steps=2",
         "logging.peak_tflops=1.0", "logging.progress_bar=false", "checkpoint.every_steps=2",
         "train.num_threads=1"]  # checkpoint.resume: the config's own (auto)


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
    # The resolved ops: printed once at start-up, one line each with its reason, and kept in the
    # run's config (as comments: a rerun resolves them again on its own device).
    printed = [line for line in out.splitlines() if line.startswith("ops: ")]
    assert len(printed) >= 10 and any(line.startswith("ops: norm = ") and "(" in line for line in printed)
    written = [line[2:] for line in (run_dir / "config.yaml").read_text().splitlines() if line.startswith("# ops: ")]
    assert written == printed
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


def test_rerunning_the_same_command_after_a_crash_resumes(tmp_path, corpus, capsys):
    run_dir = tmp_path / "run"
    assert train_main(args(run_dir, corpus, 3)) == 0
    first = read_metrics(run_dir)
    # A crash after step 3 was logged but before its checkpoint was published: step 3 is gone
    # and `latest` still names it.
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_00000003")
    capsys.readouterr()
    assert train_main(args(run_dir, corpus, 3)) == 0  # the very same command
    out = capsys.readouterr().out
    assert f"names 'step_00000003', which is missing; resuming from the newest " \
           f"complete step {ckpts / 'step_00000002'}" in out
    again = read_metrics(run_dir)
    assert [r["step"] for r in again] == [1, 2, 3]  # step 3 logged once, by the resumed run
    keys = ("loss", "grad_norm", "lr", "tokens")
    assert [again[2][k] for k in keys] == [first[2][k] for k in keys]
    # Once more: the run is complete; nothing is trained and the metrics stay.
    assert train_main(args(run_dir, corpus, 3)) == 0
    assert "nothing to do" in capsys.readouterr().out and read_metrics(run_dir) == again


def test_truncate_metrics_drops_records_past_the_step_and_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert truncate_metrics(path, 3) == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert truncate_metrics(path, 0) == 0 and not path.exists()  # a fresh run


def test_bad_data_path_is_one_line(tmp_path, capsys):
    assert train_main(args(tmp_path / "run", tmp_path / "missing", 1)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.path=") and "make data" in err and "\n" not in err


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "flex", "no_such_kernel"])
def test_unavailable_attention_backend_fails_at_start_up_in_one_line(tmp_path, corpus, capsys, backend):
    # On this CPU machine the GPU-only backends cannot run: the run must stop before building
    # anything else, with one line that names the key, the cause and a fix.
    assert train_main(args(tmp_path / "run", corpus, 1, f"execution.attention_backend={backend}")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: execution.attention_backend='{backend}'")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.long
def test_cli_launches_two_local_ranks(tmp_path, corpus):
    run_dir = tmp_path / "run2"
    launch = [sys.executable, "-m", "longctx_moe.cli", "train", "--nproc", "2"]
    proc = subprocess.run([*launch, *args(run_dir, corpus, 2)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"metrics:     {run_dir / 'metrics.jsonl'}" in proc.stdout
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    step_dir = run_dir / "checkpoints" / "step_00000002"
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["world_size"] == 2 and sorted(meta["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors"]

    # One damaged rank file: both ranks stop at resume, one line names the file, status 2 (and
    # the subprocess timeout bounds the time: no rank waits in a collective).
    part = step_dir / "rank_00001.safetensors"
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    part.write_bytes(bytes(raw))
    proc = subprocess.run([*launch, *args(run_dir, corpus, 3)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error") or "Traceback" in line]
    assert proc.returncode == 2 and errors == [
        f"error: checkpoint file '{part}' fails its sha256 check (its bytes changed after the save); "
        "no older step exists there: set checkpoint.resume=none to start over"], proc.stderr[-3000:]
