"""Benchmark: communication hidden behind compute, synchronous vs overlapped, in the same run.

R gloo ranks (CPU), the real Transformer with a shared expert, EP = R (attention DP = R), one
optimizer step's work: forward + backward of two micro-batches per rank, then the gradient
reduction. Three parallelized copies of the same model take turns round by round:

- sync:       parallel.moe_overlap=false; gradient buckets all-reduced after the backward
- overlapped: parallel.moe_overlap=true (shared expert while tokens travel, both passes);
              the same buckets launched from the last backward's hooks
- in_flight:  overlapped, and parallel.micro_batches_in_flight=2: the two micro-batches'
              forwards run interleaved (each computes while the other's all-to-alls travel,
              parallel/interleave.py), then their backwards one after the other

Exposed communication is the wall time the rank's threads (the main thread; in_flight's two
forward threads, which never compute at once) spend inside the labelled communication ranges
(longctx_moe.parallel.comm / grad_reduce): `comm.a2a`, `comm.a2a_launch`, `comm.a2a_wait` and
`comm.counts` for the all-to-all, `comm.grad*` for the gradient all-reduce, timed by wrapping the
`record_function` that labels them (torch.profiler records the main thread only, so it would miss
in_flight's forward waits). Per round: the mean over ranks of the exposed times, the slowest
rank's step time; the table gives medians and min..max over rounds, the ratio of the medians
(mode / sync), and the per-round paired ratios (the modes run back to back, their order reversed every
other round). Every round checks that the copies' losses and gradients are bitwise equal (exit
status 1 if not). JSON: `ratios` / `paired_ratios` overlapped over sync, `ratios_in_flight` /
`paired_ratios_in_flight` in_flight over sync, `summary` per mode.

    python bench/moe_overlap.py --rounds 15 --out overlap.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from longctx_moe.model import build_model  # noqa: E402
from longctx_moe.model.config import ModelConfig  # noqa: E402
from longctx_moe.parallel import comm, grad_reduce  # noqa: E402
from longctx_moe.parallel.config import ParallelConfig  # noqa: E402
from longctx_moe.parallel.dims import ParallelDims  # noqa: E402
from longctx_moe.parallel.parallelize import parallelize  # noqa: E402
from tests.launcher import run_distributed  # noqa: E402
from tests.model.helpers import packed_batch  # noqa: E402

MODES = ("sync", "overlapped", "in_flight")
A2A = ("comm.a2a", "comm.a2a_launch", "comm.a2a_wait", "comm.counts")
GRAD = ("comm.grad", "comm.grad_launch", "comm.grad_wait")


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.dim, num_layers=args.layers,
                       num_heads=8, num_kv_heads=4, head_dim=args.dim // 8,
                       num_experts=args.experts, top_k=args.top_k,
                       expert_hidden_size=args.expert_hidden,
                       shared_expert_hidden_size=args.shared_hidden, loss_chunk_tokens=1024)


def _runtimes(rank, world, args):
    """Both copies of the model, identical weights, on one mesh."""
    mcfg = model_config(args)
    base = ParallelConfig(ep=world, grad_bucket_mb=args.bucket_mb)
    dims = ParallelDims.from_config(base, world, mcfg)
    dims.build_groups(rank)
    out = {}
    for mode in MODES:
        torch.manual_seed(0)
        cfg = ParallelConfig(ep=world, grad_bucket_mb=args.bucket_mb, moe_overlap=mode != "sync",
                             micro_batches_in_flight=2 if mode == "in_flight" else 1)
        out[mode] = parallelize(build_model(mcfg), dims, cfg)
    return out


def _batches(rank, args):
    """Two micro-batches of `--tokens` tokens each, documents of random lengths."""
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(2):
        lens, left = [], args.tokens
        while left:
            n = min(left, int(torch.randint(64, 1024, (1,), generator=gen)))
            lens.append(n)
            left -= n
        batches.append(packed_batch(lens, args.vocab, generator=gen))
    return batches


def _step(runtime, batches, overlap: bool):
    """One step's forward / backward / gradient reduction; the losses [micro-batches]."""
    runtime.model.zero_grad(set_to_none=True)
    losses = []
    for i, (batch, _, out) in enumerate(runtime.forwards(batches, runtime.shard)):
        loss = out.ce_sum / batch.num_target_tokens() + out.aux_loss + out.z_loss
        if overlap and i == len(batches) - 1:
            runtime.start_gradient_reduction()
        loss.backward()
        losses.append(loss.detach())
    runtime.reduce_gradients()
    return torch.stack(losses)


class _LabelTimer:
    """Wall seconds spent inside each labelled range, summed over every thread: stands in for
    the `record_function` of the communication modules (and still enters it)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._real = comm.record_function

    @contextlib.contextmanager
    def __call__(self, label: str):
        t0 = time.perf_counter()
        try:
            with self._real(label):
                yield
        finally:
            with self._lock:
                self.seconds[label] += time.perf_counter() - t0

    def install(self) -> None:
        comm.record_function = grad_reduce.record_function = self


def _timed_step(runtime, batches, overlap: bool, timer: _LabelTimer):
    """(losses, step seconds of the slowest rank, {label: this rank's exposed seconds})."""
    dist.barrier()
    timer.seconds.clear()
    t0 = time.perf_counter()
    losses = _step(runtime, batches, overlap)
    dt = time.perf_counter() - t0
    step = torch.tensor([dt])
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    exposed = {k: v for k, v in timer.seconds.items() if k.startswith("comm.")}
    return losses, float(step), exposed


def _bitwise_equal(a, b, la, lb) -> bool:
    grads = zip(a.model.parameters(), b.model.parameters(), strict=True)
    return torch.equal(la, lb) and all(torch.equal(p.grad, q.grad) for p, q in grads)


def _bench_rank(rank, world, args):
    torch.set_num_threads(args.threads)
    runtimes, batches = _runtimes(rank, world, args), _batches(rank, args)
    timer = _LabelTimer()
    timer.install()
    for mode in MODES:  # warm-up: allocator, gloo pairs, kernels
        _step(runtimes[mode], batches, mode != "sync")
    rounds = []
    for i in range(args.rounds):
        row, losses = {}, {}
        for mode in MODES if i % 2 == 0 else MODES[::-1]:  # ABBA: drift hits both modes alike
            losses[mode], step, exposed = _timed_step(runtimes[mode], batches, mode != "sync", timer)
            row[mode] = {"step_s": step, "a2a_s": sum(exposed.get(k, 0.0) for k in A2A),
                         "grad_s": sum(exposed.get(k, 0.0) for k in GRAD), "labels": exposed}
        row["bitwise_equal"] = all(_bitwise_equal(runtimes["sync"], runtimes[m], losses["sync"], losses[m])
                                   for m in MODES[1:])
        rounds.append(row)
    return rounds


def summarize(per_rank: list[list[dict]], args) -> dict:
    """Per round: exposed times averaged over ranks, step time of the slowest rank (already
    MAX-reduced); then medians and min..max over rounds."""
    out = {"config": vars(args), "rounds": [], "summary": {}}
    for i in range(args.rounds):
        rnd = {"bitwise_equal": all(r[i]["bitwise_equal"] for r in per_rank)}
        for mode in MODES:
            rnd[mode] = {k: statistics.mean(r[i][mode][k] for r in per_rank)
                         for k in ("a2a_s", "grad_s")}
            rnd[mode]["step_s"] = per_rank[0][i][mode]["step_s"]
        out["rounds"].append(rnd)
    for mode in MODES:
        out["summary"][mode] = {k: _stats([r[mode][k] for r in out["rounds"]])
                                for k in ("step_s", "a2a_s", "grad_s")}
    s = out["summary"]["sync"]
    for mode, suffix in (("overlapped", ""), ("in_flight", "_in_flight")):
        o = out["summary"][mode]
        out["ratios" + suffix] = {k: o[k]["median"] / s[k]["median"] if s[k]["median"] else None
                                  for k in ("step_s", "a2a_s", "grad_s")}
        # Paired per round (the modes ran back to back): robust to load that drifts over rounds.
        out["paired_ratios" + suffix] = {
            k: _stats([r[mode][k] / r["sync"][k] for r in out["rounds"] if r["sync"][k]])
            for k in ("step_s", "a2a_s", "grad_s")}
    out["bitwise_equal"] = all(r["bitwise_equal"] for r in out["rounds"])
    return out


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def format_table(res: dict) -> str:
    lines = [f"{'mode':<11} {'step ms':>22} {'exposed a2a ms':>22} {'exposed grad AR ms':>22}"]
    cell = lambda st: f"{1e3 * st['median']:.1f} ({1e3 * st['min']:.1f}..{1e3 * st['max']:.1f})"
    for mode in MODES:
        s = res["summary"][mode]
        lines.append(f"{mode:<11} {cell(s['step_s']):>22} {cell(s['a2a_s']):>22} "
                     f"{cell(s['grad_s']):>22}")
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"
    pair = lambda st: f"{st['median']:.2f} ({st['min']:.2f}..{st['max']:.2f})"
    for name, suffix in (("ovl", ""), ("inf", "_in_flight")):
        r, pr = res["ratios" + suffix], res["paired_ratios" + suffix]
        lines.append(f"{name + ' / sync':<11} {fmt(r['step_s']):>22} {fmt(r['a2a_s']):>22} "
                     f"{fmt(r['grad_s']):>22}")
        lines.append(f"{'  paired':<11} {pair(pr['step_s']):>22} {pair(pr['a2a_s']):>22} "
                     f"{pair(pr['grad_s']):>22}")
    lines.append(f"median (min..max) over {len(res['rounds'])} rounds; exposed = mean over ranks "
                 f"of wall time blocked in communication; bitwise equal: "
                 f"{'yes' if res['bitwise_equal'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch per rank")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=256)
    p.add_argument("--shared-hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=1.0, help="parallel.grad_bucket_mb")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    per_rank = run_distributed(_bench_rank, args.ranks, args=(args,), timeout=3600)
    res = summarize(per_rank, args)
    print(format_table(res))
    write_json(args.out, res, indent=2)
    return 0 if res["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
