"""The training run: the step loop, its metrics, and the command line with its error handling.

Entry points: `longctx-moe train --config FILE [--set k=v ...] [--nproc N]` (see cli.py) and
`torchrun --nproc-per-node N -m longctx_moe.train --config FILE [--set k=v ...]`, which runs
`main` below on every rank. Process setup is process.py, building the run build.py, saving and
resuming longctx_moe/checkpoint/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from longctx_moe.build import start_up
from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.resume import maybe_resume
from longctx_moe.checkpoint.trainer_state import Checkpointer
from longctx_moe.config import Config, ConfigError, load_config, write_config
from longctx_moe.metrics import (
    MetricsLogger,
    expert_load_stats,
    measure_peak_tflops,
    truncate_metrics,
)
from longctx_moe.parallel.dims import destroy_process_groups
from longctx_moe.precision import announce
from longctx_moe.process import RunContext, die_with_launcher, make_context
from longctx_moe.trainer import NonFiniteLossError, StepResult, Trainer, iterate_steps

# Errors a user can act on: printed as one line, no traceback.
USER_ERRORS = (ConfigError, CheckpointError, NonFiniteLossError)


# ---------------------------------------------------------------------- the loop


def peak_tflops(cfg: Config, ctx: RunContext, dtype: torch.dtype) -> float:
    """Per-rank peak for MFU: configured, or measured once on rank 0 in the run's compute dtype
    (a fraction of a second) and shared with all ranks."""
    value = torch.tensor([cfg.logging.peak_tflops], dtype=torch.float64)
    if value.item() <= 0 and ctx.rank == 0:
        value.fill_(measure_peak_tflops(ctx.device, dtype))
    if ctx.world_size > 1:
        dist.broadcast(value, src=0)  # the default group: every rank of the run
    return float(value.item())


def step_record(res: StepResult, seconds: float, peak: float, world: int, step: int, epoch: Any) -> dict:
    record = {"step": step, "loss": res.loss, "ce_loss": res.ce_loss, "aux_loss": res.aux_loss,
              "z_loss": res.z_loss, "grad_norm": res.grad_norm, "lr": res.lr, "tokens": res.num_tokens,
              "target_tokens": res.num_targets, "step_time_s": seconds,
              "tokens_per_s": res.num_tokens / seconds,
              "mfu": None if res.flops is None else res.flops / seconds / (peak * 1e12 * world),
              "peak_memory_mb": res.peak_memory_mb, "skipped": res.skipped, "epoch": epoch}
    if res.expert_counts is not None:
        record.update(expert_load_stats(res.expert_counts))
    if res.ep_load is not None:
        record.update(res.ep_load)
    if res.cp_sizes is not None:  # Dynamic-CP: how many documents ran at each CP size
        record["cp_sizes"] = {str(size): n for size, n in sorted(res.cp_sizes.items())}
    return record


def fit(trainer: Trainer, loader: Any, ctx: RunContext, logger: MetricsLogger, peak: float,
        until: int | None = None) -> list[dict]:
    """Run optimizer steps until train.steps (or stop after step `until`, as a preempted run
    would: the schedule still spans train.steps); log every step, checkpoint as configured."""
    cfg, records = trainer.cfg, []
    total, every = cfg.train.steps, cfg.checkpoint.every_steps
    if trainer.step >= total:
        logger.message(f"the checkpoint is already at step {trainer.step} >= train.steps={total}: nothing to do; "
                       "raise train.steps to continue or set checkpoint.resume=none to start over")
        return records
    stop = total if until is None else min(until, total)
    saver = Checkpointer(trainer, loader, ctx)
    for batches in iterate_steps(loader, trainer.step, stop):
        saver.poll()
        t0 = time.perf_counter()
        res = trainer.train_step(batches)
        record = step_record(res, time.perf_counter() - t0, peak, ctx.world_size, trainer.step,
                             getattr(loader, "epoch", None))
        records.append(record)
        logger.log(record, write=trainer.step % cfg.logging.log_every == 0 or trainer.step == total)
        if res.skipped:
            logger.message(f"step {trainer.step}: non-finite loss/grad norm, update skipped (train.nan_policy=skip)")
        if every and trainer.step % every == 0 and trainer.step != stop:
            saver.save()
    if cfg.checkpoint.save_final:
        saver.save()
    saver.finish()
    return records


def run(cfg: Config, until: int | None = None) -> dict:
    """Train as configured (stopping after step `until` if given, e.g. a test's interrupted
    run); return a summary (run dir, metrics file, checkpoint dir, losses)."""
    ctx = make_context(cfg, owned=True)
    if ctx.rank == 0 and ctx.host:
        print(ctx.host, flush=True)  # what this run set process-wide (threads, denormals, malloc, oneDNN)
    runtime, loader = start_up(cfg, ctx)
    trainer = Trainer(cfg, runtime, ctx.device)
    announce(trainer.compute, ctx.rank)
    ops_lines = trainer.model.ops.lines()
    if ctx.rank == 0:
        print("\n".join(ops_lines), flush=True)
    resumed = maybe_resume(trainer, loader, ctx)
    metrics_path = ctx.run_dir / cfg.logging.metrics_file
    if ctx.rank == 0:
        write_config(cfg, ctx.run_dir / "config.yaml", ops_lines)
        # Records after the resumed step (logged before a crash, or by a run that went back)
        # would repeat: drop them; a fresh run (step 0) starts an empty file.
        truncate_metrics(metrics_path, trainer.step)
    peak = peak_tflops(cfg, ctx, trainer.compute.dtype)
    logger = MetricsLogger(metrics_path if ctx.rank == 0 else None, cfg.train.steps, trainer.step,
                           cfg.logging.progress_bar,
                           ctx.run_dir / "tensorboard" if cfg.logging.tensorboard else None)
    if resumed is not None:
        ignored = f"; train.init_from={cfg.train.init_from} is ignored (the checkpoint wins)" if cfg.train.init_from else ""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        again = f" (elastic restart {restart})" if restart else ""
        logger.message(f"resumed from {resumed} at step {trainer.step}{again}{ignored}")
    try:
        records = fit(trainer, loader, ctx, logger, peak, until)
    finally:
        logger.close()
    return {"run_dir": str(ctx.run_dir), "metrics": str(metrics_path), "checkpoints": str(ctx.ckpt_dir),
            "config": str(ctx.run_dir / "config.yaml"), "records": records, "rank": ctx.rank,
            "peak_tflops": peak, "compute_dtype": trainer.compute.name}


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


def report_user_error(e: Exception) -> None:
    """Print `error: ...` once where every rank raised the same error: a bad config (read alike
    by every rank before any group exists) or an outcome the ranks agreed on; any other error is
    printed by the rank that hit it."""
    grouped = dist.is_initialized()
    rank = dist.get_rank() if grouped else int(os.environ.get("RANK", "0"))
    agreed = getattr(e, "agreed", False)
    if rank == 0 or not (agreed or (isinstance(e, ConfigError) and not grouped)):
        print(f"error: {e}", file=sys.stderr, flush=True)
    if agreed and grouped:
        dist.barrier()  # torchrun stops the survivors when the first rank exits: let rank 0 print first


def lost_peer(e: Exception) -> str | None:
    """The transport's words when `e` is a collective that failed because a peer rank went away
    (gloo's TCP transport: connection closed or reset), else None."""
    text = str(e)
    if "gloo/transport/tcp" not in text or not any(w in text for w in ("closed by peer", "reset by peer", "Broken pipe")):
        return None
    return text.split("] ", 1)[-1].split(". ", 1)[0]


def main(argv: list[str] | None = None) -> int:
    """Run on this rank (torchrun starts one per rank). User errors: one line, exit status 2."""
    args = parse_args(argv)
    die_with_launcher()
    try:
        summary = run(load_config(args.config, args.overrides))
    except USER_ERRORS as e:
        report_user_error(e)
        return 2
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        # The peer that died is the cause (the launcher names it); this rank's traceback is noise.
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "0")
        print(f"error: rank {rank} lost a peer in a collective ({lost_peer(e)}): another rank stopped first",
              file=sys.stderr, flush=True)
        return 1
    finally:
        destroy_process_groups()
    if summary["rank"] == 0:
        print(summarize(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
