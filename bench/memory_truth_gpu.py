"""The rehearsal's peak memory against a GPU's: the ~1B bench MoE (bench/gpu_check.py MOE_1B,
its time.trainer_step config) on one packed row of 32,768 tokens, one Trainer step on one GPU
after a warm-up step (torch.cuda.max_memory_allocated of that step), and the same config, the same
documents, the real run's resolved ops and compute dtype rehearsed on meta (world 1, the GPU's
kind); both peaks and real / rehearsed go into --out.

    python bench/memory_truth_gpu.py --out $OUT/memory_truth.json              # on the GPU
    python bench/memory_truth_gpu.py --rehearse-only --gpu h200 --out r.json   # anywhere

--rehearse-only runs the rehearsal half alone, with the ops a CUDA GPU resolves the config to
(fake_world.cuda_ops); --quick takes the tiny model at 2,048 tokens (the CPU smoke run).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import gpu_check  # noqa: E402
from bench.bench_io import write_json  # noqa: E402
from longctx_moe.rehearsal.gpus import GIB, GPUS  # noqa: E402


def gpu_kind(name: str) -> str | None:
    """The GPUS key of a CUDA device name ("NVIDIA H200" -> "h200"), None when none matches."""
    return next((k for k in sorted(GPUS) if k in name.lower()), None)


def real_step(cfg, lengths: list[int], device: torch.device):
    """(peak bytes of a Trainer step after a warm-up step, the run's Ops, its ComputeDtype)."""
    trainer = gpu_check.build_trainer(cfg, device)
    batch = gpu_check._batch(lengths, cfg.model.vocab_size, "cpu")  # on the host, as the loader gives it
    trainer.train_step([batch])  # the first step creates the optimizer's state
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    trainer.train_step([batch])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    ops, compute = trainer.model.ops, trainer.compute
    del trainer, batch
    gc.collect()
    torch.cuda.empty_cache()
    return peak, ops, compute


def _rehearse_in_child(conn, cfg, lengths, gpu, ops, compute) -> None:
    from longctx_moe.rehearsal.step import rehearse_rank

    try:
        report = rehearse_rank(cfg, 1, 0, GPUS[gpu], lengths, ops=ops, compute=compute)
        conn.send(("ok", report.as_dict()))
    except Exception as e:  # noqa: BLE001 - the parent records it
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def rehearse(cfg, lengths: list[int], gpu: str, ops=None, compute=None) -> dict:
    """rehearse_rank's report of `cfg` on one GPU of kind `gpu`, in a process of its own (the
    fake group is this process's default group; the real run may hold another)."""
    from longctx_moe.rehearsal.fake_world import in_own_process

    kind, payload = in_own_process(_rehearse_in_child, cfg, lengths, gpu, ops, compute)
    if kind != "ok":
        raise RuntimeError(f"rehearsal failed: {payload}")
    return payload


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="the GPU of the real step (cuda or cuda:N)")
    ap.add_argument("--gpu", choices=sorted(GPUS), help="the rehearsed GPU's kind (default: from the "
                    "device's name; required with --rehearse-only)")
    ap.add_argument("--rehearse-only", action="store_true", help="the rehearsal half alone, with a CUDA "
                    "GPU's resolved ops (runs without a GPU)")
    ap.add_argument("--quick", action="store_true", help="the tiny model at 2,048 tokens")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, repeatable (as gpu_check.py --set)")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        ap.error(f"--device {args.device}: the real step measures CUDA memory; give cuda or cuda:N")
    if not args.rehearse_only and not torch.cuda.is_available():
        ap.error(f"torch {torch.__version__} sees no CUDA device; run on a GPU, or --rehearse-only --gpu KIND")
    name = torch.cuda.get_device_name(device) if not args.rehearse_only else None
    gpu = args.gpu or (gpu_kind(name) if name else None)
    if gpu is None:
        ap.error(f"--gpu: name the rehearsed GPU's kind ({', '.join(sorted(GPUS))}); "
                 + (f"{name!r} matches none" if name else "--rehearse-only has no device to name it"))
    sizes = gpu_check.QUICK if args.quick else gpu_check.FULL
    gpu_check.EXTRA_SETS.extend(args.overrides)
    cfg = gpu_check.trainer_config(device, sizes)
    lengths = gpu_check._doc_lengths(sizes.step_tokens, seed=6)  # time.trainer_step's documents
    res: dict = {"gpu": gpu, "device_name": name, "quick": args.quick, "sets": args.overrides,
                 "tokens": sum(lengths), "docs": len(lengths), "model": sizes.model}
    ops = compute = None
    if not args.rehearse_only:
        t = time.perf_counter()
        peak, ops, compute = real_step(cfg, lengths, device)
        res.update(real_peak_bytes=peak, real_peak_gib=peak / GIB, real_s=time.perf_counter() - t)
        write_json(args.out, res, indent=2)  # kept should the rehearsal fail
    t = time.perf_counter()
    report = rehearse(cfg, lengths, gpu, ops, compute)
    res.update(rehearsed_peak_bytes=report["peak_bytes"], rehearsed_peak_gib=report["peak_bytes"] / GIB,
               rehearsed_split_gib={k: v / GIB for k, v in report["peak_split"].items()},
               rehearsed_peak_moment=report["peak_moment"], rehearse_s=time.perf_counter() - t,
               ops=(ops.as_dict() if ops is not None else "fake_world.cuda_ops (a CUDA GPU's resolution)"))
    if "real_peak_bytes" in res:
        res["mem_ratio_gpu"] = res["real_peak_bytes"] / res["rehearsed_peak_bytes"]
    write_json(args.out, res, indent=2)
    print(" ".join(f"{k}={res[k]:.3f}" for k in ("real_peak_gib", "rehearsed_peak_gib", "mem_ratio_gpu")
                   if k in res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
