"""Per-step training metrics: expert-load statistics, MFU, peak memory, the JSONL writer (and
optional TensorBoard events) and the progress bar.

Legend: L MoE layers, E experts.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch


def expert_load_stats(counts_LE: torch.Tensor) -> dict[str, list[float]]:
    """Per-layer load balance from token counts [L, E] (any numeric dtype).

    min/max are each layer's least/most loaded expert relative to a perfectly even split
    (1.0 = even; max = E means one expert took everything); cv is std/mean of the counts.
    Layers that routed no tokens report zeros.
    """
    c = counts_LE.detach().to(torch.float64).cpu()
    if c.ndim != 2 or c.shape[1] == 0:
        return {"expert_load_min": [], "expert_load_max": [], "expert_load_cv": []}
    mean = c.mean(dim=1, keepdim=True)
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))
    rel = torch.where(mean > 0, c / safe, torch.zeros_like(c))
    cv = torch.where(mean[:, 0] > 0, c.std(dim=1, unbiased=False) / safe[:, 0], torch.zeros_like(mean[:, 0]))
    return {
        "expert_load_min": [round(v, 4) for v in rel.min(dim=1).values.tolist()],
        "expert_load_max": [round(v, 4) for v in rel.max(dim=1).values.tolist()],
        "expert_load_cv": [round(v, 4) for v in cv.tolist()],
    }


def ep_load_stats(counts_LE: torch.Tensor, ep: int, ran_LR: list | None = None) -> dict[str, list[float]]:
    """Per MoE layer, the busiest EP rank's rows relative to an even split over `ep` ranks (1.0 =
    even, ep = one rank got everything): `ep_load_max` from the counts, by the rank owning each
    expert (E / ep consecutive experts per rank); with expert lending, `ep_run_max` from the rows
    each rank ran (`ran_LR`, this rank's EP group). Layers that routed nothing report zeros."""
    def busiest(rows_LR: torch.Tensor) -> list[float]:
        mean = rows_LR.mean(dim=1)
        ratio = torch.where(mean > 0, rows_LR.max(dim=1).values / mean.clamp_min(1e-30), torch.zeros_like(mean))
        return [round(v, 4) for v in ratio.tolist()]

    c = counts_LE.detach().to(torch.float64).cpu()
    # the experts' axis named, not inferred: a model of dense layers only has no rows to infer from
    out = {"ep_load_max": busiest(c.view(c.shape[0], ep, c.shape[1] // ep).sum(-1))}
    if ran_LR is not None:
        out["ep_run_max"] = busiest(torch.tensor(ran_LR, dtype=torch.float64))
    return out


def measure_peak_tflops(device: torch.device, dtype: torch.dtype,
                        target_s: float = 0.01, max_size: int = 4096, repeats: int = 5) -> float:
    """Peak TFLOP/s of a square `dtype` matmul on `device` (the MFU denominator when none is
    configured), in the dtype the run computes in: the fastest of `repeats` products, since on a
    shared machine a slower one was preempted, not a truer peak. The size doubles from 256 until
    the faster of two products takes `target_s` (or reaches `max_size`): 10 ms is long enough to
    time and reaches the GEMM's plateau (1024^3 in float32 on one AVX2 core), and the whole probe
    stays around half a second on any core, while every other rank waits for rank 0's figure
    (on an AVX2 CPU without native bf16 a bf16 2048^3 matmul alone takes ~10 s). Uses the current thread
    count, so on CPU it is the peak of this rank's share."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(a: torch.Tensor, b: torch.Tensor) -> float:
        t0 = time.perf_counter()
        a @ b
        sync()
        return time.perf_counter() - t0

    size = 256
    while True:
        # Constant operands: a GEMM's speed does not depend on the values, and the global RNG
        # stays untouched (a resumed run's random streams must not depend on this probe).
        a = torch.full((size, size), 0.5, device=device, dtype=dtype)
        b = torch.full((size, size), 0.25, device=device, dtype=dtype)
        seconds(a, b)  # warm-up: thread pools, kernel selection
        if size >= max_size or min(seconds(a, b), seconds(a, b)) >= target_s:
            break
        size *= 2
    best = min(seconds(a, b) for _ in range(repeats))
    return 2 * size**3 / best / 1e12


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak-memory window; False where the peak cannot be reset (peak_memory_mb then
    reports the process's peak so far)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        # Linux: "5" resets the process's resident-set high-water mark (VmHWM) to its current RSS.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:  # not Linux, or /proc is read-only (some containers)
        return False


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory in MiB since reset_peak_memory: on CUDA the tensors allocated on `device`
    (torch.cuda.max_memory_allocated), on CPU the process's peak resident set (VmHWM, or
    getrusage's ru_maxrss, the process's lifetime peak, where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm_kib = _vm_hwm_kib()
    if hwm_kib is not None:
        return hwm_kib / 1024
    import resource  # POSIX only; Linux reports KiB, macOS bytes

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)


def _vm_hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def step_flops(model_cfg: Any, doc_lengths: list[int]) -> float | None:
    """Training FLOPs (fwd + bwd) of the documents of one step, from the model's own count.

    Returns None when the model package provides no FLOP model (MFU is then not reported).
    """
    try:
        from longctx_moe.model.flops import model_flops
    except ImportError:
        return None
    return float(model_flops(model_cfg, doc_lengths))


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Keep the records of steps <= `last_step` in the JSONL file `path` (removing it when
    `last_step` is 0) and return how many were dropped. A resumed run continues after its
    checkpoint's step: lines logged past it before a crash would otherwise appear twice. A
    line cut short by the crash is dropped too. Rewritten atomically (temp file, fsync, rename)."""
    path = Path(path)
    if not path.exists():
        return 0
    if last_step <= 0:
        path.unlink()
        return 0
    lines = path.read_text(errors="replace").splitlines()
    steps = [_step_of(line) for line in lines]
    kept = [line for line, step in zip(lines, steps, strict=True) if step is not None and step <= last_step]
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


class MetricsLogger:
    """Appends one JSON object per logged step to `path` (rank 0 only) and drives a tqdm bar;
    with `tensorboard_dir`, also writes each logged record's numbers as TensorBoard scalars."""

    def __init__(self, path: str | Path | None, total_steps: int, initial_step: int = 0,
                 progress_bar: bool = True, tensorboard_dir: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._file, self._tb = None, None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)  # line-buffered: survive a crash
            if tensorboard_dir is not None:
                # config validation refused logging.tensorboard where the package is missing
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(tensorboard_dir), purge_step=initial_step + 1)
        self._bar = None
        if progress_bar and self.path is not None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any], write: bool = True) -> None:
        if self._file is not None and write:
            self._file.write(json.dumps(_jsonable(record)) + "\n")
            if self._tb is not None:
                _write_scalars(self._tb, record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(_postfix(record), refresh=False)

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar (rank 0 only)."""
        if self._bar is not None:
            self._bar.write(text)
        elif self._file is not None:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()


def scalar_series(record: dict[str, Any]) -> dict[str, float]:
    """The plottable numbers of one record by name: scalars as they are, per-layer lists as
    `name/layer_i` (e.g. expert_load_cv/layer_0); the step, flags and text left out."""
    out = {}
    for key, value in record.items():
        if key in ("step", "epoch", "skipped"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, list):
            out.update({f"{key}/layer_{i}": float(v) for i, v in enumerate(value)
                        if isinstance(v, (int, float))})
    return out


def _write_scalars(writer, record: dict[str, Any]) -> None:
    for name, value in scalar_series(record).items():
        writer.add_scalar(name, value, record["step"])


def _postfix(record: dict[str, Any]) -> dict[str, str]:
    out = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
           "tok/s": f"{record['tokens_per_s']:.0f}"}
    if record.get("mfu") is not None:
        out["mfu"] = f"{100 * record['mfu']:.1f}%"
    if record.get("peak_memory_mb") is not None:
        out["mem"] = _megabytes(record["peak_memory_mb"])
    return out


def _megabytes(mb: float) -> str:
    return f"{mb / 1024:.1f}G" if mb >= 1024 else f"{mb:.0f}M"


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf: write them as strings so a diverged step stays readable.
    def fix(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return {k: fix(v) for k, v in record.items()}
