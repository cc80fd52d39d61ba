"""Benchmark: expert-parallel token dispatch on R gloo ranks (CPU).

Measures forward+backward of one MoE layer's dispatch (router output fixed, real GroupedExperts)
for the all-to-all dispatcher with fp32 / bf16 / fp8 payloads and for the all-gather dispatcher
(the named peer), and the payload bytes each rank puts on the wire per forward. Prints a table
with medians and ratios to the peer; `--out FILE` writes JSON with the keys bytes_fp32,
bytes_bf16, bytes_fp8, bytes_allgather, a2a_tokens_per_s, a2a_bf16_tokens_per_s,
a2a_fp8_tokens_per_s, allgather_tokens_per_s.

    python bench/moe_dispatch.py --ranks 4 --tokens 2048 --out dispatch.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from longctx_moe.model.experts import GroupedExperts  # noqa: E402
from longctx_moe.parallel.dispatch import AllGatherDispatcher, AllToAllDispatcher  # noqa: E402
from longctx_moe.parallel.expert_parallel import shard_experts  # noqa: E402
from tests.launcher import run_distributed  # noqa: E402

VARIANTS = [  # name, dispatcher class, payload dtype
    ("a2a", AllToAllDispatcher, "none"),
    ("a2a_bf16", AllToAllDispatcher, "bf16"),
    ("a2a_fp8", AllToAllDispatcher, "fp8"),
    ("allgather", AllGatherDispatcher, "none"),
]


def _time_variant(rank, world, args, cls, dtype):
    """Median over iterations of the slowest rank's fwd+bwd seconds; this rank's wire bytes."""
    torch.manual_seed(0)
    experts = GroupedExperts(args.experts, args.dim, args.hidden)
    torch.nn.init.normal_(experts.w_gate_up, std=0.02)
    torch.nn.init.normal_(experts.w_down, std=0.02)
    shard_experts(experts, rank, world)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.dim, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(args.tokens, args.experts, generator=g), dim=1)
    idx = torch.topk(probs, args.top_k, dim=1).indices
    w = probs.gather(1, idx)
    kw = {"dispatch_dtype": dtype} if cls is AllToAllDispatcher else {}
    disp = cls(args.experts, dist.group.WORLD, **kw)
    times = []
    for it in range(args.warmup + args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        disp(x, idx, w, experts).sum().backward()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if it >= args.warmup:
            times.append(dt.item())
    return statistics.median(times), disp.wire_bytes


def _bench_rank(rank, world, args):
    torch.set_num_threads(args.threads)
    return {name: _time_variant(rank, world, args, cls, dt) for name, cls, dt in VARIANTS}


def summarize(per_rank: list[dict], args) -> dict:
    """Tokens/s over the whole group and total wire bytes per forward, for each variant."""
    total_tokens = args.tokens * args.ranks
    out = {"config": vars(args), "rows": {}}
    for name, _, _ in VARIANTS:
        median_s = per_rank[0][name][0]  # identical on every rank (MAX-reduced per iteration)
        wire = sum(r[name][1] for r in per_rank)
        out["rows"][name] = {"median_s": median_s, "tokens_per_s": total_tokens / median_s,
                             "wire_bytes": wire}
    rows = out["rows"]
    out.update(bytes_fp32=rows["a2a"]["wire_bytes"], bytes_bf16=rows["a2a_bf16"]["wire_bytes"],
               bytes_fp8=rows["a2a_fp8"]["wire_bytes"], bytes_allgather=rows["allgather"]["wire_bytes"],
               a2a_tokens_per_s=rows["a2a"]["tokens_per_s"],
               a2a_bf16_tokens_per_s=rows["a2a_bf16"]["tokens_per_s"],
               a2a_fp8_tokens_per_s=rows["a2a_fp8"]["tokens_per_s"],
               allgather_tokens_per_s=rows["allgather"]["tokens_per_s"])
    return out


def format_table(res: dict) -> str:
    peer = res["rows"]["allgather"]
    lines = [f"{'variant':<11} {'median ms':>10} {'tokens/s':>11} {'x peer':>7} "
             f"{'wire MB/fwd':>12} {'x peer bytes':>13}"]
    for name, r in res["rows"].items():
        lines.append(f"{name:<11} {1e3 * r['median_s']:>10.2f} {r['tokens_per_s']:>11.0f} "
                     f"{r['tokens_per_s'] / peer['tokens_per_s']:>7.2f} "
                     f"{r['wire_bytes'] / 1e6:>12.3f} {r['wire_bytes'] / peer['wire_bytes']:>13.3f}")
    lines.append("peer = all-gather dispatcher; wire = payload bytes all ranks send to other ranks "
                 "per forward (backward moves the same rows)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128, help="expert hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    per_rank = run_distributed(_bench_rank, args.ranks, args=(args,), timeout=1800)
    res = summarize(per_rank, args)
    print(format_table(res))
    write_json(args.out, res, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
