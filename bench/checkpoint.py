"""Benchmark: checkpoint save and load, ours vs a plain `torch.save` of the full state.

One process, two model sizes: the tiny default run (configs/tiny_cpu.yaml's model) and a
~100M-parameter MoE. Each trainer has taken one AdamW step, so the state is the model, exp_avg
and exp_avg_sq (3x the parameters in fp32) plus schedule, RNG and step. Timed in the same run,
alternating so that both sides see the same machine load:

- ours, sync: `checkpoint.trainer_state.save_trainer` (CPU copy, safetensors by global slice,
  sha256, fsync of files and directories, atomic publication); load: `load_trainer` into a fresh
  trainer (checksum verified, every slice read, optimizer rebuilt);
- ours, async: the time training is blocked (`save_trainer(background=True)` returns after the
  CPU copy), and the time until the step is published;
- torch.save: the model's and optimizer's state dicts in one file, fsynced; load: torch.load
  (weights_only) and load_state_dict of both.

    python bench/checkpoint.py [--reps 3] [--sizes tiny,100m] [--dir /tmp] [--out FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from longctx_moe import host  # noqa: E402
from longctx_moe.build import model_of
from longctx_moe.checkpoint.trainer_state import load_trainer, save_trainer  # noqa: E402
from longctx_moe.config import load_config  # noqa: E402
from longctx_moe.parallel.parallelize import parallelize  # noqa: E402
from longctx_moe.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "tiny": [],  # configs/tiny_cpu.yaml: 1.9M parameters
    "100m": ["model.vocab_size=16384", "model.hidden_size=512", "model.num_layers=8", "model.num_heads=8",
             "model.num_kv_heads=4", "model.head_dim=64", "model.num_experts=12", "model.expert_hidden_size=512"],
}


def make_trainer(sets: list[str]) -> Trainer:
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", sets)
    torch.manual_seed(0)
    trainer = Trainer(cfg, parallelize(model_of(cfg)))
    for p in trainer.model.parameters():  # one step on random gradients: AdamW's state exists
        p.grad = torch.randn_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step = 1
    return trainer


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ours_sync(trainer: Trainer, root: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    step_dir = save_trainer(trainer, None, root, 0, 1, keep_last=1)
    return time.perf_counter() - t0, _dir_bytes(step_dir)


def ours_async(trainer: Trainer, root: Path) -> tuple[float, float]:
    """(seconds training is blocked, seconds until the step is published)."""
    t0 = time.perf_counter()
    pending = save_trainer(trainer, None, root, 0, 1, keep_last=1, background=True)
    blocked = time.perf_counter() - t0
    pending.finish()
    return blocked, time.perf_counter() - t0


def ours_load(sets: list[str], step_dir: Path) -> float:
    fresh = make_trainer(sets)
    t0 = time.perf_counter()
    load_trainer(fresh, None, step_dir, 0, 1)
    return time.perf_counter() - t0


def torch_save(trainer: Trainer, path: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
             "schedule": trainer.schedule.state_dict(), "step": trainer.step}
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0, path.stat().st_size


def torch_load(sets: list[str], path: Path) -> float:
    fresh = make_trainer(sets)
    t0 = time.perf_counter()
    state = torch.load(path, map_location="cpu", weights_only=True)
    fresh.model.load_state_dict(state["model"])
    fresh.optimizer.load_state_dict(state["optimizer"])
    return time.perf_counter() - t0


def bench_size(name: str, reps: int, work: Path) -> dict:
    sets = SIZES[name]
    trainer = make_trainer(sets)
    params = sum(p.numel() for p in trainer.model.parameters())
    times: dict[str, list[float]] = {k: [] for k in ("ours_save", "ours_load", "async_blocked", "async_total",
                                                     "torch_save", "torch_load")}
    sizes = {}
    for rep in range(reps + 1):  # the first round warms up (imports, page cache) and is dropped
        root = work / name
        shutil.rmtree(root, ignore_errors=True)
        seconds, sizes["ours_bytes"] = ours_sync(trainer, root)
        times["ours_save"].append(seconds)
        times["ours_load"].append(ours_load(sets, root / "step_00000001"))
        if rep == 0:
            times = {k: [] for k in times}
            shutil.rmtree(root)
            continue
        shutil.rmtree(root)
        blocked, total = ours_async(trainer, root)
        times["async_blocked"].append(blocked)
        times["async_total"].append(total)
        seconds, sizes["torch_bytes"] = torch_save(trainer, work / f"{name}.pt")
        times["torch_save"].append(seconds)
        times["torch_load"].append(torch_load(sets, work / f"{name}.pt"))
        shutil.rmtree(root)
        (work / f"{name}.pt").unlink()
    result = {"size": name, "params": params, **sizes, **{k: statistics.median(v) for k, v in times.items()}}
    result["spread"] = {k: [min(v), max(v)] for k, v in times.items()}  # over the rounds
    result["save_ratio"] = result["torch_save"] / result["ours_save"]
    result["load_ratio"] = result["torch_load"] / result["ours_load"]
    # The target's form: ours / the peer, per round (same load on both), median.
    result["load_over_torch_load"] = statistics.median(a / b for a, b in zip(times["ours_load"], times["torch_load"],
                                                                             strict=True))
    return result


def print_table(rows: list[dict]) -> None:
    head = (f"{'size':>5} {'params':>8} {'ours MB':>8} {'torch MB':>8} {'save s':>7} {'torch':>7} {'ratio':>6} "
            f"{'async blk':>9} {'async all':>9} {'load s':>7} {'torch':>7} {'ratio':>6}")
    print(head)
    for r in rows:
        print(f"{r['size']:>5} {r['params'] / 1e6:>7.1f}M {r['ours_bytes'] / 1e6:>8.1f} {r['torch_bytes'] / 1e6:>8.1f} "
              f"{r['ours_save']:>7.3f} {r['torch_save']:>7.3f} {r['save_ratio']:>6.2f} {r['async_blocked']:>9.3f} "
              f"{r['async_total']:>9.3f} {r['ours_load']:>7.3f} {r['torch_load']:>7.3f} {r['load_ratio']:>6.2f}")
    print("ratio = torch / ours (> 1: ours is faster); async blk = seconds training waits, async all = until published")
    for r in rows:
        lo, hi = r["spread"]["ours_load"]
        tlo, thi = r["spread"]["torch_load"]
        print(f"{r['size']}: load_over_torch_load {r['load_over_torch_load']:.2f} (median of rounds); load ours "
              f"{lo:.3f}-{hi:.3f} s, torch {tlo:.3f}-{thi:.3f} s (min-max over the rounds)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, from {', '.join(SIZES)}")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp directory)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    host.configure_cpu(args.threads, "tuned")  # the process settings of a training run
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        rows = [bench_size(name, args.reps, Path(work)) for name in args.sizes.split(",")]
    print_table(rows)
    write_json(args.out, {"reps": args.reps, "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
