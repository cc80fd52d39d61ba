"""Process setup for a run: the process group, the device, CPU threads, the run's directories,
and ending a rank whose launcher died."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from longctx_moe import host
from longctx_moe.config import Config, ConfigError

# Set by `longctx-moe train --nproc` (cli.launch_local) to its own pid: see die_with_launcher.
LAUNCHER_PID_ENV = "LONGCTX_MOE_LAUNCHER_PID"


@dataclass
class RunContext:
    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    run_dir: Path
    ckpt_dir: Path
    host: str | None = None  # what configure_cpu set in this process (one line), None: nothing


# ---------------------------------------------------------------------- process setup


def die_with_launcher() -> None:
    """Under torch's elastic launcher (torchrun, `longctx-moe train --nproc`), end this rank when
    the launcher process dies, even by SIGKILL: an orphaned rank would keep training and writing
    the run directory. The launcher's own SIGTERM/SIGINT handling already stops its ranks; this
    covers the signals it cannot catch. Linux only (prctl)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):  # it died before prctl: the signal will not come
        os.kill(os.getpid(), signal.SIGTERM)


def init_distributed(device_kind: str, timeout_s: float) -> tuple[int, int, int]:
    """(rank, world, local world) from torchrun's environment; init the default group if needed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        import_before_init()
        # A rank blocked in a collective whose peer died raises after timeout_s instead of
        # holding its device until the job's wall-clock limit.
        timeout = timedelta(seconds=timeout_s)
        backend = process_group_backend(device_kind)
        store = _attempt_store(world, timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return 0, 1, 1


def import_before_init() -> None:
    """Import torch.distributed.nn before the default group exists. Its functions take
    `group=group.WORLD` as a default argument, evaluated at import; imported later (torch._dynamo
    imports it on first use), they keep the default group alive past destroy_process_group, to be
    destroyed by the interpreter's exit after the peer ranks have gone, which now and then
    aborted a finished rank ("terminate called without an active exception")."""
    import torch.distributed.nn  # noqa: F401


def process_group_backend(device_kind: str) -> str:
    """gloo on CPU; on CUDA NCCL for device tensors and gloo for host ones. The runtime reduces a
    few host tensors by design (loss sums and counts in float64, token plans, the export's
    go-on flag, the MFU peak): NCCL alone would refuse them ("no backend for device cpu")."""
    return "cpu:gloo,cuda:nccl" if device_kind == "cuda" else "gloo"


def _attempt_store(world: int, timeout: timedelta):
    """Under torchrun's agent, its TCPStore with keys of this restart attempt only; None elsewhere.

    The agent keeps one store for all attempts of `--max-restarts` (torch 2.13's rendezvous
    assumes a new store per retry), so a restarted rank can read a dead peer's address that
    the attempt before published, connect to nothing and fail ("Connection refused")."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"longctx_moe/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def configure_cpu(cfg: Config, local_world_size: int, owned: bool) -> str | None:
    """The process-wide CPU settings of train.host_tuning (longctx_moe.host): all of them in a
    process of ours (`owned`), only the ones the config names in one an RL framework made.
    Returns the line saying what was set (None: nothing)."""
    t = cfg.train
    try:
        settings = host.host_settings(t.host_tuning, t.num_threads, t.host_allocator, owned=owned,
                                      default_threads=max(1, (os.cpu_count() or 1) // local_world_size))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return host.apply_host(settings)


def make_context(cfg: Config, owned: bool = False) -> RunContext:
    """The run's ranks, device and directories; CPU settings as configure_cpu (`owned`: this
    process is ours, `longctx-moe train`'s, not an RL framework's)."""
    kind = "cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()) else "cpu"
    rank, world, local_world = init_distributed(kind, cfg.train.process_group_timeout_s)
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    line = configure_cpu(cfg, local_world, owned)
    run_dir = Path(cfg.train.run_dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    return RunContext(rank, world, local_world, device, run_dir, ckpt_dir, line)
