"""What a user sees of a run: the peak memory of every step in metrics.jsonl and the progress line,
`longctx-moe report RUN_DIR` drawing a real short run's metrics as PNGs, and logging.tensorboard
refused at config time where the package is missing."""

from __future__ import annotations

import importlib.util
import json
import mmap
import os

import pytest
import torch

from longctx_moe.cli import main as cli_main
from longctx_moe.config import ConfigError, load_config
from longctx_moe.metrics import MetricsLogger, _postfix, peak_memory_mb, reset_peak_memory
from longctx_moe.report import series
from longctx_moe.train import main as train_main
from tests.trainer.test_train_run import args, read_metrics

PANELS = ["aux_loss", "expert_load_cv", "grad_norm", "loss", "memory", "mfu", "tokens_per_s"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

matplotlib = pytest.importorskip("matplotlib", reason="longctx-moe report draws with matplotlib")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus):
    """A real 3-step run of configs/tiny_cpu.yaml (no checkpoints: only its metrics matter)."""
    out = tmp_path_factory.mktemp("report") / "run"
    assert train_main(args(out, corpus, 3, "checkpoint.every_steps=0", "checkpoint.save_final=false")) == 0
    return out


def test_every_record_carries_the_steps_peak_memory(run_dir):
    physical_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        # The peak resident set of this (training) process during the step: torch alone holds
        # more than 50 MiB, and no process holds more than the machine's memory.
        assert 50 < r["peak_memory_mb"] < physical_mb


def test_the_peak_is_reset_per_step():
    device = torch.device("cpu")
    if not reset_peak_memory(device):
        pytest.skip("this system cannot reset the peak resident set (/proc/self/clear_refs)")
    base = peak_memory_mb(device)
    # An anonymous mapping of our own, not malloc: the trainer's tuned allocator keeps freed
    # heap resident, which would blur what this test measures.
    block, page = mmap.mmap(-1, 64 << 20), b"\1" * (1 << 20)
    for _ in range(64):  # touched 1 MiB at a time: resident
        block.write(page)
    grown = peak_memory_mb(device)
    block.close()  # unmapped: no longer resident
    assert reset_peak_memory(device)
    assert grown - base >= 60 and peak_memory_mb(device) < grown - 30


def test_the_progress_line_shows_memory():
    record = {"loss": 2.0, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.5}
    assert _postfix({**record, "peak_memory_mb": 812.4})["mem"] == "812M"
    assert _postfix({**record, "peak_memory_mb": 20480.0})["mem"] == "20.0G"
    assert "mem" not in _postfix(record)  # records of runs before memory was logged


def test_report_writes_valid_pngs_of_a_real_run(run_dir, tmp_path, capsys):
    assert cli_main(["report", str(run_dir)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == [str(run_dir / f"report_{name}.png") for name in PANELS]
    for path in printed:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(path).shape
        assert (height, width) == (400, 700)
    # one series per MoE layer of the tiny config for the expert-load panel
    assert {n for n in series(read_metrics(run_dir)) if n.startswith("expert_load_cv/")} == \
        {"expert_load_cv/layer_0", "expert_load_cv/layer_1"}
    assert cli_main(["report", str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [f"report_{n}.png" for n in PANELS]


def test_report_of_an_older_run_leaves_out_what_it_did_not_record(tmp_path, capsys):
    lines = [json.dumps({"step": 1, "loss": 3.0, "grad_norm": 1.0, "tokens_per_s": 10.0,
                         "mfu": None, "skipped": False}),
             '{"step": 2, "loss": 2.'  # cut short by a crash
             ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert cli_main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert sorted(p.rsplit("report_", 1)[1] for p in captured.out.split()) == \
        ["grad_norm.png", "loss.png", "tokens_per_s.png"]
    assert "notice: memory: not recorded by this run, no plot" in captured.err


def test_report_of_a_directory_without_metrics_is_one_line(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl not found" in err


def test_tensorboard_is_refused_at_config_time_without_the_package(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ConfigError, match="logging.tensorboard needs the tensorboard package: pip install tensorboard"):
            load_config(None, ["logging.tensorboard=true"])
        return
    # With the package: the logger writes an event file next to metrics.jsonl.
    logger = MetricsLogger(tmp_path / "metrics.jsonl", 1, progress_bar=False,
                           tensorboard_dir=tmp_path / "tensorboard")
    logger.log({"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 1.0, "expert_load_cv": [0.1]})
    logger.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
