"""The training run: process setup, building the pieces, the step loop, checkpoints, metrics.

Entry points: `longctx-moe train --config FILE [--set k=v ...] [--nproc N]` (see cli.py) and
`torchrun --nproc-per-node N -m longctx_moe.train --config FILE [--set k=v ...]`, which runs
`main` below on every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_packing.batch import pad_multiple
from longctx_moe import host
from longctx_moe.checkpoint import (
    CheckpointError,
    find_resume_dir,
    load_rank_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from longctx_moe.config import Config, ConfigError, load_config, write_config
from longctx_moe.metrics import MetricsLogger, expert_load_stats, measure_peak_tflops
from longctx_moe.trainer import NonFiniteLossError, StepResult, Trainer, iterate_steps

# Errors a user can act on: printed as one line, no traceback.
USER_ERRORS = (ConfigError, CheckpointError, NonFiniteLossError)


@dataclass
class RunContext:
    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    run_dir: Path
    ckpt_dir: Path


# ---------------------------------------------------------------------- process setup


def init_distributed(device_kind: str) -> tuple[int, int, int]:
    """(rank, world, local world) from torchrun's environment; init the default group if needed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return 0, 1, 1


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def configure_cpu(cfg: Config, local_world_size: int) -> None:
    threads = cfg.train.num_threads or max(1, (os.cpu_count() or 1) // local_world_size)
    host.configure_cpu(threads, cfg.train.host_allocator)


def make_context(cfg: Config) -> RunContext:
    kind = "cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()) else "cpu"
    rank, world, local_world = init_distributed(kind)
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_cpu(cfg, local_world)
    run_dir = Path(cfg.train.run_dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    return RunContext(rank, world, local_world, device, run_dir, ckpt_dir)


# ---------------------------------------------------------------------- building


def check_data_against_model(cfg: Config) -> dict:
    """Read the packed corpus' metadata; the vocabulary must fit the model's embedding."""
    from data_packing.loader import read_metadata

    if not (Path(cfg.data.path) / "metadata.json").is_file():
        raise ConfigError(f"data.path='{cfg.data.path}' has no metadata.json; run `make data` "
                          "(or longctx-pack --output DIR) and set data.path=DIR")
    try:
        meta = read_metadata(cfg.data.path)
    except ValueError as e:
        raise ConfigError(f"data.path: {e}") from None
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"the corpus at data.path has vocab_size={meta['vocab_size']} > model.vocab_size="
                          f"{cfg.model.vocab_size}; set model.vocab_size={meta['vocab_size']}")
    return meta


def build_dims(cfg: Config, ctx: RunContext):
    from longctx_moe.parallel.dims import ParallelDims

    try:
        dims = ParallelDims.from_config(cfg.parallel, ctx.world_size, cfg.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    dims.build_groups(ctx.rank)
    return dims


def check_backends(cfg: Config, device: torch.device) -> None:
    """A backend that cannot run here fails at start-up with one line, not at the first forward."""
    from cp_attention.kernels import resolve_backend

    try:
        resolve_backend(cfg.model.attention_backend, device)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"model.attention_backend={cfg.model.attention_backend!r}: {e}") from None


def build_runtime(cfg: Config, dims: Any, device: torch.device):
    """Build the single-device model, apply the parallel layout (also on one rank: the capacity
    and drop policy of the dispatcher, the global-batch aux loss) and return its runtime."""
    from longctx_moe.model import build_model
    from longctx_moe.parallel.parallelize import parallelize

    check_backends(cfg, device)
    torch.manual_seed(cfg.train.seed)  # same init on every rank: replicas start identical
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[cfg.train.param_dtype]
    model = build_model(cfg.model).to(device=device, dtype=dtype)
    model.set_recompute(cfg.train.recompute)
    try:
        runtime = parallelize(model, dims, cfg.parallel, cfg.data.micro_batch_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.train.compile:
        from longctx_moe.compile import apply_compile

        apply_compile(model)
    return runtime


def build_loader(cfg: Config, dims: Any):
    from data_packing.loader import build_step_loader

    cfg.data.pad_multiple = pad_multiple(cfg.parallel.cp, cfg.parallel.tp)
    try:
        return build_step_loader(cfg.data, dims.rank_in("dp", dims.rank or 0), dims.size("dp"))
    except ValueError as e:  # the loader's messages name the data.* key and the fix
        raise ConfigError(str(e)) from None


# ---------------------------------------------------------------------- checkpoints


def _resume_expectations(cfg: Config) -> dict:
    return {"model": dataclasses.asdict(cfg.model), "parallel": dataclasses.asdict(cfg.parallel)}


def save(trainer: Trainer, loader: Any, ctx: RunContext) -> Path:
    state = trainer.state_dict()
    state["loader"] = loader.state_dict() if hasattr(loader, "state_dict") else None
    state["rng"] = rng_state()
    return save_checkpoint(ctx.ckpt_dir, trainer.step, state, _resume_expectations(trainer.cfg),
                           ctx.rank, ctx.world_size, trainer.cfg.checkpoint.keep_last)


def maybe_resume(trainer: Trainer, loader: Any, ctx: RunContext) -> Path | None:
    step_dir = find_resume_dir(ctx.ckpt_dir, trainer.cfg.checkpoint.resume)
    if step_dir is None:
        return None
    _, state = load_rank_state(step_dir, ctx.rank, ctx.world_size, _resume_expectations(trainer.cfg))
    trainer.load_state_dict(state, str(step_dir))
    if state.get("loader") is not None and hasattr(loader, "load_state_dict"):
        try:
            loader.load_state_dict(state["loader"])
        except ValueError as e:
            raise CheckpointError(f"checkpoint '{step_dir}': {e}") from None
    set_rng_state(state["rng"])
    return step_dir


# ---------------------------------------------------------------------- the loop


def peak_tflops(cfg: Config, ctx: RunContext) -> float:
    """Per-rank peak for MFU: configured, or measured once on rank 0 and shared with all ranks."""
    value = torch.tensor([cfg.logging.peak_tflops], dtype=torch.float64)
    if value.item() <= 0 and ctx.rank == 0:
        value.fill_(measure_peak_tflops(ctx.device))
    if ctx.world_size > 1:
        dist.broadcast(value, src=0)  # the default group: every rank of the run
    return float(value.item())


def step_record(res: StepResult, seconds: float, peak: float, world: int, step: int, epoch: Any) -> dict:
    record = {"step": step, "loss": res.loss, "ce_loss": res.ce_loss, "aux_loss": res.aux_loss,
              "z_loss": res.z_loss, "grad_norm": res.grad_norm, "lr": res.lr, "tokens": res.num_tokens,
              "target_tokens": res.num_targets, "step_time_s": seconds,
              "tokens_per_s": res.num_tokens / seconds,
              "mfu": None if res.flops is None else res.flops / seconds / (peak * 1e12 * world),
              "skipped": res.skipped, "epoch": epoch}
    if res.expert_counts is not None:
        record.update(expert_load_stats(res.expert_counts))
    if res.cp_sizes is not None:  # Dynamic-CP: how many documents ran at each CP size
        record["cp_sizes"] = {str(size): n for size, n in sorted(res.cp_sizes.items())}
    return record


def fit(trainer: Trainer, loader: Any, ctx: RunContext, logger: MetricsLogger, peak: float) -> list[dict]:
    """Run optimizer steps until train.steps; log every step, checkpoint as configured."""
    cfg, records = trainer.cfg, []
    total, every = cfg.train.steps, cfg.checkpoint.every_steps
    if trainer.step >= total:
        logger.message(f"the checkpoint is already at step {trainer.step} >= train.steps={total}: nothing to do; "
                       "raise train.steps to continue or set checkpoint.resume=none to start over")
        return records
    for batches in iterate_steps(loader, trainer.step, total):
        t0 = time.perf_counter()
        res = trainer.train_step(batches)
        record = step_record(res, time.perf_counter() - t0, peak, ctx.world_size, trainer.step,
                             getattr(loader, "epoch", None))
        records.append(record)
        logger.log(record, write=trainer.step % cfg.logging.log_every == 0 or trainer.step == total)
        if res.skipped:
            logger.message(f"step {trainer.step}: non-finite loss/grad norm, update skipped (train.nan_policy=skip)")
        if every and trainer.step % every == 0 and trainer.step != total:
            save(trainer, loader, ctx)
    if cfg.checkpoint.save_final:
        save(trainer, loader, ctx)
    return records


def run(cfg: Config) -> dict:
    """Train as configured; return a summary (run dir, metrics file, checkpoint dir, losses)."""
    ctx = make_context(cfg)
    dims = build_dims(cfg, ctx)
    check_data_against_model(cfg)
    runtime = build_runtime(cfg, dims, ctx.device)
    loader = build_loader(cfg, dims)
    trainer = Trainer(cfg, runtime, ctx.device)
    resumed = maybe_resume(trainer, loader, ctx)
    metrics_path = ctx.run_dir / cfg.logging.metrics_file
    if ctx.rank == 0:
        write_config(cfg, ctx.run_dir / "config.yaml")
        if resumed is None and metrics_path.exists():
            metrics_path.unlink()  # a fresh run: do not append to an old run's metrics
    peak = peak_tflops(cfg, ctx)
    logger = MetricsLogger(metrics_path if ctx.rank == 0 else None, cfg.train.steps, trainer.step,
                           cfg.logging.progress_bar)
    if resumed is not None:
        logger.message(f"resumed from {resumed} at step {trainer.step}")
    try:
        records = fit(trainer, loader, ctx, logger, peak)
    finally:
        logger.close()
    return {"run_dir": str(ctx.run_dir), "metrics": str(metrics_path), "checkpoints": str(ctx.ckpt_dir),
            "config": str(ctx.run_dir / "config.yaml"), "records": records, "rank": ctx.rank,
            "peak_tflops": peak}


def summarize(summary: dict) -> str:
    recs = [r for r in summary["records"] if not r["skipped"]]
    lines = [f"metrics:     {summary['metrics']}", f"checkpoints: {summary['checkpoints']}",
             f"config:      {summary['config']}"]
    if recs:
        k = max(1, len(recs) // 10)
        first = sum(r["loss"] for r in recs[:k]) / k
        last = sum(r["loss"] for r in recs[-k:]) / k
        tps = sorted(r["tokens_per_s"] for r in recs)[len(recs) // 2]
        lines.insert(0, f"loss {first:.4f} (first {k} steps) -> {last:.4f} (last {k} steps); "
                        f"median {tps:.0f} tokens/s over {len(summary['records'])} steps")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="longctx_moe.train", description="Train an MoE LM from a YAML config.")
    p.add_argument("--config", required=True, help="YAML file, e.g. configs/tiny_cpu.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, repeatable: --set model.num_experts=16")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run on this rank (torchrun starts one per rank). User errors: one line, exit status 2."""
    args = parse_args(argv)
    try:
        summary = run(load_config(args.config, args.overrides))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary["rank"] == 0:
        print(summarize(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
