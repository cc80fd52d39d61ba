"""Benchmark: what one training step of the bench model would make a GPU do, counted exactly on
this CPU: kernel launches, bytes moved by copies and casts, host-device syncs, per step, per layer,
by op and by module (longctx_moe.rehearsal.counts; its docstring says what each count holds).

The model and tokens are bench/gpu_check.py's time.trainer_step (the ~1B MoE of MOE_1B, one packed
row of 32,768 tokens of its heavy-tailed documents), on the CUDA path (world 1, the ops a CUDA
device resolves to, bf16 autocast), rehearsed on meta tensors.

    python bench/gpu_ops.py --out runs/bench/gpu_ops.json [--set execution.kernels=torch ...]
    python bench/gpu_ops.py --write-baseline   # bench/gpu_ops_baseline.json, before a reduction

JSON keys: launches_per_step, copy_bytes_per_step, host_syncs_per_step, h2d_copies_per_step,
layers (per layer: launches, copy_bytes, host_syncs), launches_ratio and copy_bytes_ratio (over
bench/gpu_ops_baseline.json), by_op, by_module, host_syncs (where each happens).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402

from bench.bench_io import write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, "bench", "gpu_ops_baseline.json")
_KEYS = ("launches_per_step", "copy_bytes_per_step", "host_syncs_per_step", "h2d_copies_per_step", "layers",
         "by_op", "by_module", "host_syncs")


def bench_config(sets: list[str], tokens: int):
    """gpu_check's trainer config of the ~1B MoE on cuda with `sets` over it."""
    import torch

    from bench import gpu_check

    gpu_check.EXTRA_SETS[:] = sets
    sizes = gpu_check.dataclasses.replace(gpu_check.FULL, step_tokens=tokens)
    return gpu_check.trainer_config(torch.device("cuda"), sizes), gpu_check._doc_lengths(tokens, seed=6)


def _table(rows: dict, title: str, limit: int) -> str:
    lines = [f"{title:<44} {'launches':>9} {'copy MiB':>10} {'syncs':>6}"]
    ranked = sorted(rows.items(), key=lambda kv: (-kv[1]["launches"], -kv[1]["copy_bytes"], kv[0]))
    for name, r in ranked[:limit]:
        if r["launches"] or r["copy_bytes"] or r["host_syncs"]:
            lines.append(f"{name[:44]:<44} {r['launches']:>9} {r['copy_bytes'] / 2**20:>10.1f} {r['host_syncs']:>6}")
    return "\n".join(lines)


def _by_module(by_module: dict) -> dict:
    """Modules with the layer index folded (layers.N.attn -> layers.*.attn), summed."""
    import re

    out: dict = {}
    for name, r in by_module.items():
        row = out.setdefault(re.sub(r"^layers\.\d+", "layers.*", name), dict.fromkeys(r, 0))
        for k, v in r.items():
            row[k] += v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the step's one packed row")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--rows", type=int, default=30, help="rows of each table")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--write-baseline", action="store_true", help=f"write the counts to {BASELINE}")
    args = p.parse_args(argv)
    from longctx_moe.rehearsal.counts import count_step

    cfg, lengths = bench_config(args.set, args.tokens)
    start = time.perf_counter()
    report = count_step(cfg, lengths)
    seconds = time.perf_counter() - start
    result = {k: report[k] for k in _KEYS}
    result.update(tokens=sum(lengths), docs=len(lengths), sets=args.set, num_layers=cfg.model.num_layers,
                  rehearsal_seconds=round(seconds, 1))
    base = json.load(open(BASELINE)) if os.path.exists(BASELINE) and not args.write_baseline else None
    if base and (base["tokens"] != result["tokens"] or any(s.startswith("model.") for s in args.set)):
        base = None  # the baseline is the bench model's at its tokens: another model has no ratio to it
    if base:
        result["launches_ratio"] = result["launches_per_step"] / base["launches_per_step"]
        result["copy_bytes_ratio"] = result["copy_bytes_per_step"] / base["copy_bytes_per_step"]
        result["host_syncs_baseline"] = base["host_syncs_per_step"]
    print(_table(report["by_op"], "op", args.rows))
    print()
    print(_table(_by_module(report["by_module"]), "module (layers folded)", args.rows))
    print()
    for where, n in report["host_syncs"].items():
        print(f"sync x{n}: {where}")
    print(f"\nper step: {result['launches_per_step']} launches, {result['copy_bytes_per_step'] / 2**30:.2f} GiB "
          f"copied, {result['host_syncs_per_step']} host syncs ({cfg.model.num_layers} layers), "
          f"{result['h2d_copies_per_step']} host-to-device copies"
          + (f"; x{result['launches_ratio']:.2f} launches, x{result['copy_bytes_ratio']:.2f} copy bytes of the "
             "baseline" if "launches_ratio" in result else ""))
    if args.write_baseline:
        write_json(BASELINE, {k: result[k] for k in ("launches_per_step", "copy_bytes_per_step",
                                                        "host_syncs_per_step", "h2d_copies_per_step", "layers",
                                                        "by_op", "host_syncs", "tokens", "docs", "sets")})
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
