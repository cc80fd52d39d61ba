"""`longctx-moe train --nproc N`: errors printed once with exit status 2, ranks that die with
their launcher, and the process-group timeout."""

import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from longctx_moe.config import ConfigError, load_config
from longctx_moe.process import init_distributed
from tests.trainer.test_train_run import ROOT, args


def launch(run_dir: Path, corpus_dir: Path, steps: int, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "longctx_moe.cli", "train", "--nproc", "2", *args(run_dir, corpus_dir, steps, *extra)]
    return subprocess.Popen(cmd, cwd=ROOT, text=True, **popen)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:") or "Traceback" in line]


@pytest.mark.slow
def test_layout_error_is_printed_once_with_status_2(tmp_path, corpus):
    proc = launch(tmp_path / "run", corpus, 1, "parallel.tp=3", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert error_lines(err) == [err.strip()] and err.startswith("error: world_size=2 is not divisible by tp*cp=3")


@pytest.mark.slow
def test_error_found_by_the_ranks_is_printed_once_with_status_2(tmp_path, corpus):
    # A missing corpus is found by every rank at start-up: the ranks agree, rank 0 prints.
    proc = launch(tmp_path / "run", tmp_path / "no_corpus", 1, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert error_lines(err) == [f"error: data.path='{tmp_path / 'no_corpus'}' has no metadata.json; run `make data` "
                                "(or longctx-pack --output DIR) and set data.path=DIR"]


@pytest.mark.slow
def test_document_no_dynamic_cp_run_holds_is_refused_at_start_up(tmp_path, corpus):
    # Found before the first step (it would stop the step holding that document on every rank).
    proc = launch(tmp_path / "run", corpus, 1, "parallel.cp=2", "parallel.dynamic_cp=true",
                  "parallel.max_tokens_per_rank=4", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1 and "per rank on the largest Dynamic-CP run (max_cp=2), over the 4 " \
        "tokens one rank holds" in lines[0], err[-3000:]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent has not reaped it yet


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks follow their launcher through prctl")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launcher_stops_its_ranks(tmp_path, corpus, sig):
    run_dir = tmp_path / "run"
    with open(tmp_path / "out.txt", "w") as out:
        launcher = launch(run_dir, corpus, 100_000, stdout=out, stderr=subprocess.STDOUT)
    ranks = []
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 300, "no step was logged")
        ranks = _children(launcher.pid)
        assert len(ranks) == 2 and all(_running(p) for p in ranks)
        launcher.send_signal(sig)
        # Generous bounds: the point is that they end, not how fast (SIGTERM: torchrun stops
        # them itself; SIGKILL: the kernel sends each rank its parent-death signal).
        rc = launcher.wait(timeout=60)
        _wait_for(lambda: not any(_running(p) for p in ranks), 30, "the ranks kept running")
    finally:
        for pid in [launcher.pid, *ranks]:
            if _running(pid):
                subprocess.run(["kill", "-9", str(pid)], check=False)
        launcher.wait(timeout=30)
    if sig == signal.SIGTERM:  # the launcher's own exit: 128 + the signal, and one line
        assert rc == 128 + signal.SIGTERM
        assert error_lines((tmp_path / "out.txt").read_text()) == ["error: stopped by SIGTERM; the ranks were stopped too"]


def test_process_group_timeout_reaches_init_process_group(monkeypatch):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    init_distributed("cpu", load_config(None, ["train.process_group_timeout_s=42"]).train.process_group_timeout_s)
    assert seen == {"backend": "gloo", "timeout": timedelta(seconds=42)}
    assert load_config(None).train.process_group_timeout_s == 600
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match=r"^train.process_group_timeout_s=\S+ must be a number of seconds > 0"):
            load_config(None, [f"train.process_group_timeout_s={bad}"])


def test_negative_max_restarts_is_one_line_with_status_2(capsys):
    from longctx_moe.cli import main as cli_main

    assert cli_main(["train", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--max-restarts", "-1"]) == 2
    assert capsys.readouterr().err == "error: --max-restarts=-1 must be >= 0\n"


def test_a_lost_peer_is_recognised_from_gloos_words():
    from longctx_moe.train import lost_peer

    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                          "by peer [127.0.0.1]:3465. This is typically caused by a remote worker crashing.")
    assert lost_peer(closed) == "Connection closed by peer [127.0.0.1]:3465"
    assert lost_peer(RuntimeError("CUDA out of memory")) is None


def test_the_killed_rank_is_named_not_the_peer_that_lost_it(capsys):
    from types import SimpleNamespace

    from longctx_moe.cli import _report_failures

    failures = {0: SimpleNamespace(exitcode=1, pid=10), 1: SimpleNamespace(exitcode=-signal.SIGKILL, pid=11),
                2: SimpleNamespace(exitcode=-signal.SIGTERM, pid=12)}
    assert _report_failures(failures) == 1
    assert capsys.readouterr().err == "error: rank 1 (pid 11) was killed by SIGKILL; see its output above\n"


def _raise_in_cleanup(sig):
    """What torchrun's metrics wrapper does when the signal lands before its `start` is set: the
    SignalException is replaced by an UnboundLocalError raised from its `finally`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def run(_args):
        try:
            raise SignalException(f"got signal: {sig}", sigval=sig)
        finally:
            raise UnboundLocalError("cannot access local variable 'start'")
    return run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_hidden_behind_torchruns_cleanup_error_is_still_reported(monkeypatch, capsys, sig):
    import torch.distributed.run

    from longctx_moe.cli import launch_local

    monkeypatch.setattr(torch.distributed.run, "run", _raise_in_cleanup(sig))
    assert launch_local(2, ["--config", "unused.yaml"]) == 128 + sig
    assert capsys.readouterr().err == f"error: stopped by {sig.name}; the ranks were stopped too\n"


def test_other_launcher_errors_are_not_taken_for_a_signal(monkeypatch):
    import torch.distributed.run

    from longctx_moe.cli import launch_local

    def run(_args):
        raise UnboundLocalError("a bug of its own")
    monkeypatch.setattr(torch.distributed.run, "run", run)
    with pytest.raises(UnboundLocalError, match="a bug of its own"):
        launch_local(2, ["--config", "unused.yaml"])
