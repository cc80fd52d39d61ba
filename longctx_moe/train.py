"""The training run: process setup, building the pieces, the step loop, checkpoints, metrics.

Entry points: `longctx-moe train --config FILE [--set k=v ...] [--nproc N]` (see cli.py) and
`torchrun --nproc-per-node N -m longctx_moe.train --config FILE [--set k=v ...]`, which runs
`main` below on every rank.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_packing.batch import pad_multiple
from longctx_moe import host
from longctx_moe.checkpoint import (
    AsyncSave,
    CheckpointError,
    agree,
    find_resume_dir,
    kill_point,
    publish_checkpoint,
    rng_state,
    set_aside,
    set_rng_state,
    stage_checkpoint,
    write_staged,
)
from longctx_moe.checkpoint_reader import CheckpointReader
from longctx_moe.config import Config, ConfigError, load_config, write_config
from longctx_moe.metrics import (
    MetricsLogger,
    expert_load_stats,
    measure_peak_tflops,
    truncate_metrics,
)
from longctx_moe.precision import announce
from longctx_moe.trainer import NonFiniteLossError, StepResult, Trainer, iterate_steps

# Errors a user can act on: printed as one line, no traceback.
USER_ERRORS = (ConfigError, CheckpointError, NonFiniteLossError)
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
        # A rank blocked in a collective whose peer died raises after timeout_s instead of
        # holding its device until the job's wall-clock limit.
        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if device_kind == "cuda" else "gloo"
        store = _attempt_store(world, timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return 0, 1, 1


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


def configure_cpu(cfg: Config, local_world_size: int) -> None:
    threads = cfg.train.num_threads or max(1, (os.cpu_count() or 1) // local_world_size)
    host.configure_cpu(threads, cfg.train.host_allocator)


def make_context(cfg: Config) -> RunContext:
    kind = "cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()) else "cpu"
    rank, world, local_world = init_distributed(kind, cfg.train.process_group_timeout_s)
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


def check_layout(cfg: Config, world_size: int):
    """The parallel layout on `world_size` ranks (ParallelDims, no groups yet) or a ConfigError."""
    from longctx_moe.parallel.dims import ParallelDims

    try:
        return ParallelDims.from_config(cfg.parallel, world_size, cfg.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_dims(cfg: Config, ctx: RunContext):
    dims = check_layout(cfg, ctx.world_size)
    dims.build_groups(ctx.rank)
    return dims


def check_backends(cfg: Config, device: torch.device) -> None:
    """A backend that cannot run here fails at start-up with one line, not at the first forward."""
    from cp_attention.kernels import resolve_backend

    try:
        resolve_backend(cfg.model.attention_backend, device)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"model.attention_backend={cfg.model.attention_backend!r}: {e}") from None
    from longctx_moe.kernels import check_kernels

    try:
        check_kernels(cfg.model.kernels, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_runtime(cfg: Config, dims: Any, device: torch.device):
    """Build the single-device model, apply the parallel layout (also on one rank: the capacity
    and drop policy of the dispatcher, the global-batch aux loss) and return its runtime."""
    from longctx_moe.model import build_model

    check_backends(cfg, device)
    torch.manual_seed(cfg.train.seed)  # same init on every rank: replicas start identical
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[cfg.train.param_dtype]
    if cfg.train.init_from:  # each rank reads only its slices into a model built on meta
        from longctx_moe.hf.load import load_hf_sharded
        from longctx_moe.model import Transformer

        with torch.device("meta"):
            model = Transformer(cfg.model).to(dtype=dtype)
        runtime = _parallelize(cfg, model, dims)
        load_hf_sharded(model, dims, cfg.train.init_from, device)
    else:
        model = build_model(cfg.model).to(device=device, dtype=dtype)
        runtime = _parallelize(cfg, model, dims)
    if cfg.train.compile:
        from longctx_moe.compile import apply_compile

        apply_compile(model)
    return runtime


def _parallelize(cfg: Config, model: Any, dims: Any):
    from longctx_moe.parallel.parallelize import parallelize

    model.set_recompute(cfg.train.recompute)
    try:
        return parallelize(model, dims, cfg.parallel, cfg.data.micro_batch_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_loader(cfg: Config, dims: Any):
    from data_packing.loader import build_step_loader

    layout = pad_multiple(cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel)
    try:
        return build_step_loader(cfg.data, dims.rank_in("dp", dims.rank or 0), dims.size("dp"), layout)
    except ValueError as e:  # the loader's messages name the data.* key and the fix
        raise ConfigError(str(e)) from None


# ---------------------------------------------------------------------- checkpoints


# model.* keys that change kernels or numerics, not the function the weights compute: a
# checkpoint resumes under other values. The parallel layout may change too (sharded_state.py).
HARMLESS_MODEL_KEYS = ("attention_backend", "kernels", "grouped_gemm", "expert_precision", "loss_chunk_tokens", "init_std")


def resume_expectations(cfg: Config) -> dict:
    """The meta entries a checkpoint must match to be resumed under `cfg`: the model's function."""
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in HARMLESS_MODEL_KEYS}
    return {"model": model}


def save(trainer: Trainer, loader: Any, ctx: RunContext) -> Path:
    return save_trainer(trainer, loader, ctx.ckpt_dir, ctx.rank, ctx.world_size, trainer.cfg.checkpoint.keep_last)


def save_trainer(trainer: Trainer, loader: Any, ckpt_dir: Path, rank: int, world_size: int, keep_last: int,
                 background: bool = False) -> Path | AsyncSave:
    """Collective: checkpoint the trainer (model and AdamW state by global slice, schedule, step)
    and this rank's loader position and RNG streams. `background`: return the AsyncSave whose
    thread writes the file (copies of the state are taken before this returns)."""
    from longctx_moe.sharded_state import trainer_pieces

    dims = trainer.dims
    rank_state = {"rng": rng_state(), "dp_rank": dims.rank_in("dp"), "loader": _loader_state(loader)}
    meta = {**resume_expectations(trainer.cfg), "parallel": dataclasses.asdict(trainer.cfg.parallel),
            "layout": _layout(dims),
            "trainer": {"step": trainer.step, "schedule": trainer.schedule.state_dict()}}
    pieces = trainer_pieces(trainer.model, trainer.optimizer, dims)
    staged = stage_checkpoint(ckpt_dir, trainer.step, pieces, rank, copy=background)
    if background:
        return AsyncSave(staged, rank_state, meta, world_size, keep_last)
    return publish_checkpoint(staged, write_staged(staged, rank_state), meta, world_size, keep_last)


class Checkpointer:
    """The run's saves: synchronous, or with checkpoint.async_save written on a background
    thread and published at the first step boundary where every rank's write has ended (the
    next save and the end of training wait for it). Every method is a collective."""

    def __init__(self, trainer: Trainer, loader: Any, ctx: RunContext):
        self.trainer, self.loader, self.ctx = trainer, loader, ctx
        self.pending: AsyncSave | None = None

    def save(self) -> None:
        self.finish()
        cfg = self.trainer.cfg.checkpoint
        saved = save_trainer(self.trainer, self.loader, self.ctx.ckpt_dir, self.ctx.rank, self.ctx.world_size,
                             cfg.keep_last, background=cfg.async_save)
        self.pending = saved if isinstance(saved, AsyncSave) else None

    def poll(self) -> None:
        if self.pending is not None and self.pending.ready():
            self.finish()

    def finish(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.finish()


def _layout(dims: Any) -> dict[str, int]:
    return {axis: dims.size(axis) for axis in ("tp", "cp", "dp", "ep")}


def _loader_state(loader: Any) -> dict | None:
    """The loader's position, plus the documents it has served this epoch (how a run under
    another data-parallel size finds the same place)."""
    if not hasattr(loader, "state_dict"):
        return None
    state = dict(loader.state_dict())
    if hasattr(loader, "_plan_for"):
        steps = loader._plan_for(loader.epoch)[:loader.step_in_epoch]
        state["samples_in_epoch"] = int(sum(len(s) for s in steps))
    return state


def maybe_resume(trainer: Trainer, loader: Any, ctx: RunContext) -> Path | None:
    """Collective: rank 0 picks the step directory (one notice if it falls back), every rank loads
    the slices it holds, and the ranks agree before going on, so a damaged file on one rank stops
    every rank with the same line. The steps after the resumed one (all of them with
    checkpoint.resume=none) are then set aside (see longctx_moe.checkpoint). An elastic restart
    (torchrun --max-restarts) always resumes: `none` meant the first attempt."""
    resume = trainer.cfg.checkpoint.resume
    if resume == "none" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"
    step_dir = _agreed_resume_dir(resume, ctx)
    error = None
    if step_dir is not None:
        try:
            load_trainer(trainer, loader, step_dir, ctx.rank, ctx.world_size)
        except CheckpointError as e:
            error = str(e)
    agree(error)
    if step_dir is not None or resume == "none":
        _set_aside_after(trainer.step, ctx)
    return step_dir


def _agreed_resume_dir(resume: str, ctx: RunContext) -> Path | None:
    found, error = None, None
    if ctx.rank == 0:  # one rank reads the directory: one notice, one answer for all
        try:
            found = find_resume_dir(ctx.ckpt_dir, resume)
        except CheckpointError as e:
            error = str(e)
    chosen = agree(error, None if found is None else str(found))[0]
    return None if chosen is None else Path(chosen)


def load_trainer(trainer: Trainer, loader: Any, step_dir: Path, rank: int, world_size: int) -> None:
    """Load checkpoint `step_dir`, written under any parallel layout, into this rank's trainer,
    loader and RNG. Raises CheckpointError (one line)."""
    from longctx_moe.sharded_state import load_trainer_pieces

    reader = CheckpointReader(step_dir, resume_expectations(trainer.cfg))
    old = reader.meta.get("layout") or {}
    same = old == _layout(trainer.dims) and reader.meta.get("world_size") == world_size
    try:
        load_trainer_pieces(trainer.model, trainer.optimizer, trainer.dims, reader)
        trainer.schedule.load_state_dict(reader.meta["trainer"]["schedule"])
        trainer.step = int(reader.meta["trainer"]["step"])
        # Same layout: every rank continues its own streams. Another one: the RNG of rank 0.
        set_rng_state(reader.rank_state(rank if same else 0)["rng"])
        _load_loader(loader, reader, old, trainer.dims, rank)
    except ValueError as e:  # optimizer groups or loader state of another run; one-line messages
        raise CheckpointError(f"checkpoint '{step_dir}': {e}") from None


def _load_loader(loader: Any, reader: CheckpointReader, old: dict, dims: Any, rank: int) -> None:
    """The loader's position: that of a rank of the same DP rank when DP is unchanged; under
    another DP size, the same epoch from the same number of documents served, with a notice."""
    if not hasattr(loader, "load_state_dict"):
        return
    dp_rank = dims.rank_in("dp")
    if old.get("dp") == dims.dp:
        # Rank ordering tp + TP*(cp + CP*dp): the first rank of DP rank d is d*TP*CP.
        state = reader.rank_state(dp_rank * old["tp"] * old["cp"])["loader"]
        if state is not None:
            loader.load_state_dict(state)
        return
    state = reader.rank_state(0)["loader"]
    if state is None or not hasattr(loader, "_plan_for"):
        return
    done = state.get("samples_in_epoch", 0)
    steps = loader._plan_for(state["epoch"])
    served, step = 0, 0
    while step < len(steps) and served < done:
        served, step = served + len(steps[step]), step + 1
    loader.load_state_dict({**state, "dp_size": dims.dp, "step_in_epoch": step})
    if rank == 0:
        print(f"notice: the data-parallel size changed from {old.get('dp')} to {dims.dp}: the loader continues "
              f"epoch {state['epoch']} at document {served} (step {step} of the epoch)", flush=True)


def _set_aside_after(step: int, ctx: RunContext) -> None:
    """Collective: rank 0 moves the steps numbered above `step` to superseded/, so that the
    next resume cannot pick a step of the future this run abandoned."""
    error = None
    if ctx.rank == 0:
        try:
            moved = set_aside(ctx.ckpt_dir, step + 1)
        except OSError as e:
            error = (f"could not move the steps after {step} in '{ctx.ckpt_dir}' aside ({e.strerror}); "
                     "fix its permissions or set checkpoint.dir to another directory")
        else:
            if moved:
                print(f"notice: this run continues from step {step}: moved {', '.join(p.name for p in moved)} "
                      f"to {moved[0].parent}", flush=True)
    agree(error)


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
        kill_point("step", trainer.step + 1, ctx.rank)
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


def check_dynamic_cp_fits(cfg: Config, runtime: Any, loader: Any) -> None:
    """Under Dynamic-CP, the corpus's longest document must fit the largest run."""
    if runtime.dynamic is not None:
        try:
            runtime.dynamic.check_longest(int(loader.ds.doc_lengths.max()), cfg.data.path)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def start_up(cfg: Config, ctx: RunContext) -> tuple[Any, Any]:
    """(runtime, loader): the layout, data and backend checks, the model and the loader.
    Collective: a problem on any rank stops every rank with the same one-line ConfigError."""
    built, error = None, None
    try:
        dims = build_dims(cfg, ctx)
        check_data_against_model(cfg)
        built = build_runtime(cfg, dims, ctx.device), build_loader(cfg, dims)
        check_dynamic_cp_fits(cfg, *built)
    except ConfigError as e:
        error = str(e)
    agree(error, cls=ConfigError)
    return built


def run(cfg: Config, until: int | None = None) -> dict:
    """Train as configured (stopping after step `until` if given, e.g. a test's interrupted
    run); return a summary (run dir, metrics file, checkpoint dir, losses)."""
    ctx = make_context(cfg)
    runtime, loader = start_up(cfg, ctx)
    trainer = Trainer(cfg, runtime, ctx.device)
    announce(trainer.compute, ctx.rank)
    resumed = maybe_resume(trainer, loader, ctx)
    metrics_path = ctx.run_dir / cfg.logging.metrics_file
    if ctx.rank == 0:
        write_config(cfg, ctx.run_dir / "config.yaml")
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
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary["rank"] == 0:
        print(summarize(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
