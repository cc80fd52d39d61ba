"""`longctx-moe plan-groups`: print the process-group table of a layout without starting any process.

    python -m longctx_moe.parallel.plan_groups --world 16 --tp 2 --cp 2 --ep 4

Model numbers (--num-experts, --num-heads, ...) are checked only when given.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

from longctx_moe.parallel.config import CP_BACKENDS, ParallelConfig
from longctx_moe.parallel.dims import ParallelDims


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="longctx-moe plan-groups", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    for axis in ("tp", "cp", "ep", "etp"):
        p.add_argument(f"--{axis}", type=int, default=1)
    p.add_argument("--dp", type=int, default=-1, help="-1: world // (tp*cp)")
    p.add_argument("--cp-backend", default="ring", choices=CP_BACKENDS)
    p.add_argument("--hierarchical-sizes", type=int, nargs=2, metavar=("INNER", "OUTER"))
    p.add_argument("--dynamic-cp", action="store_true",
                   help="also plan the Dynamic-CP sub-groups (dcp<s>) of each DP x CP block")
    p.add_argument("--max-cp", type=int, default=0, help="largest Dynamic-CP size (0: cp)")
    p.add_argument("--num-experts", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--num-kv-heads", type=int)
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    return p


def format_table(dims: ParallelDims) -> str:
    """Human-readable group table: one line per group name."""
    head = (f"world {dims.world_size}: attention tp={dims.tp} cp={dims.cp} dp={dims.dp} | "
            f"moe etp={dims.etp} ep={dims.ep} edp={dims.edp}")
    if dims.hierarchical:
        head += f" | cp = inner {dims.cp_inner} x outer {dims.cp_outer}"
    lines = [head]
    table = dims.table()
    width = max(9, *map(len, table))
    for name, groups in table.items():
        lines.append(f"  {name:<{width}} " + " ".join("{" + ",".join(map(str, g)) + "}" for g in groups))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = ParallelConfig(tp=args.tp, cp=args.cp, dp=args.dp, ep=args.ep, etp=args.etp,
                         cp_backend=args.cp_backend, hierarchical_sizes=args.hierarchical_sizes,
                         dynamic_cp=args.dynamic_cp, max_cp=args.max_cp)
    model = {k: v for k, v in (("num_experts", args.num_experts), ("num_heads", args.num_heads),
                               ("num_kv_heads", args.num_kv_heads)) if v is not None}
    try:
        dims = ParallelDims.from_config(cfg, args.world, SimpleNamespace(**model))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(dims.table()) if args.json else format_table(dims))
    return 0


if __name__ == "__main__":
    sys.exit(main())
