"""`longctx-moe plan`: the fastest parallel layouts of a model on N GPUs that fit their memory.

    longctx-moe plan --model configs/models/qwen3-30b-a3b.json --gpus 64 --gpu h100 \\
        --lengths lognormal:1500,1.2,32768 --tokens-per-step 4194304 --top 5 --out plan.json

Every candidate layout gets a modeled step time (timing.py); they are walked fastest first, each
judged by the configuration's own layout rules (build.check_layout without its group table; a
refused one is never proposed) and its memory measured from the program (memory.py, cached
under --cache: a model's first plan takes its probes, over --jobs worker processes, and later
plans at any GPU count reuse them), until --top of them fit. The fastest that did not fit are
listed with why. --lengths takes a lognormal spec or a packed dataset's directory; --rl measures
an RL policy's step. --rehearse-top K rehearses the K best layouts in full (longctx-moe
rehearse's step) and prints both memory figures side by side.
Exit status 0 with a plan, 1 when no layout fits, 2 for a bad command line or config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import numpy as np

from cp_attention.dynamic_cost import padded_length
from longctx_moe.rehearsal.gpus import GIB, GPUS

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "communication buffers", "rest")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="longctx-moe plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model's config.json (configs/models/) or a training YAML")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    p.add_argument("--lengths", default="lognormal:1500,1.2,32768",
                   help="lognormal:MEDIAN,SIGMA,MAX, or a packed dataset's directory (longctx-pack "
                        "--output): its documents' lengths, drawn at random")
    p.add_argument("--tokens-per-step", type=int, required=True, help="tokens of one optimizer step")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--precision", default="all",
                   help="the precisions to consider: all, or a comma list of fp32, fp32+fp8, bf16, fp32+host, "
                        "fp32+fp8+host, bf16+host (parameters' dtype, FP8 GEMMs, AdamW on the host)")
    p.add_argument("--rl", action="store_true",
                   help="memory of an RL policy's step (its rehearsal: rollouts' log-probs, the update, "
                        "the weight export); time is modeled as a training step's")
    p.add_argument("--rehearse-top", type=int, default=0, metavar="K",
                   help="rehearse the K best layouts in full and print both memory figures")
    p.add_argument("--cache", default="runs/plan-cache", help="where memory measurements are kept")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes for the memory probes' rehearsals (default: this machine's cores, "
                        "up to 4; 1 runs them in this process)")
    p.add_argument("--out", help="write the plan as JSON here")
    return p


def base_config(path: str):
    from longctx_moe.config import load_config

    if path.endswith(".json"):
        return load_config(None, [f"train.model_config={path}", "train.autocast_dtype=bf16"])
    return load_config(path)


def param_counts(cfg) -> tuple[int, int]:
    """(dense, expert) parameters of the whole model, counted on meta by the program's split."""
    import torch

    from longctx_moe.model import Transformer
    from longctx_moe.parallel.grad_reduce import split_params
    from longctx_moe.rehearsal.fake_world import cuda_ops

    with torch.device("meta"):
        model = Transformer(cfg.model, cuda_ops(cfg), balance=cfg.balance)
    dense, expert = split_params(model)
    return sum(p.numel() for p in dense), sum(p.numel() for p in expert)


def length_source(spec: str):
    """(draw, longest): draw(total) -> document lengths summing to about `total` tokens, from a
    `lognormal:MEDIAN,SIGMA,MAX` spec or a packed dataset's directory (its pieces' lengths as
    the loader reads them, drawn with replacement, seeded); ValueError in one line otherwise."""
    import os

    from longctx_moe.rehearsal.step import lognormal_lengths, parse_lognormal

    if not os.path.isdir(spec):
        median, sigma, longest = parse_lognormal(spec)
        return (lambda total: lognormal_lengths(total, median, sigma, longest)), longest
    from data_packing.loader import PackedDataset

    try:
        corpus = PackedDataset(spec, verify_tokenizer=False, verify="sizes").doc_lengths
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--lengths {spec!r}: not a packed dataset ({e}); give longctx-pack's --output "
                         "directory or lognormal:MEDIAN,SIGMA,MAX") from None
    if len(corpus) == 0:
        raise ValueError(f"--lengths {spec!r}: the dataset holds no documents")

    def draw(total: int) -> list[int]:
        rng = np.random.default_rng(0)
        need = max(1, int(np.ceil(total / corpus.mean() * 1.2)) + 8)
        picked = rng.choice(corpus, size=need, replace=True)
        n = int(np.searchsorted(np.cumsum(picked), total)) + 1
        return [int(x) for x in picked[:n]]

    return draw, int(corpus.max())


def micro_batches(layout, rank_tokens: int, tokens: int) -> int:
    """Micro-batches a rank runs per step: its share of the step's tokens over a micro-batch's."""
    return max(1, math.ceil(tokens / (layout.dp * layout.cp) / rank_tokens))


def rank_tokens(layout, longest: int, tokens: int) -> int:
    """Tokens one rank holds of a micro-batch: the longest document's share of its CP run, padded
    as the runtime pads it (a micro-batch holds whole documents; Dynamic-CP refuses a rank too
    small for the padded share), at least 4,096 where the step has them (GEMM-sized)."""
    share = padded_length(longest, layout.cp, layout.tp, layout.sequence_parallel) // layout.cp
    return max(share, min(4096, tokens // layout.world))


@dataclasses.dataclass
class Planned:
    layout: object
    time: dict
    memory: dict | None = None
    refused: str | None = None
    estimated: bool = False  # memory is a floor from measured layouts (floors.estimate), not measured

    @property
    def peak(self) -> float:
        return sum(self.memory.values()) if self.memory else 0.0

    def as_dict(self) -> dict:
        return {"layout": self.layout.as_dict(), "label": self.layout.label(), "time": self.time,
                "memory_bytes": self.memory, "peak_bytes": self.peak, "refused": self.refused,
                "memory_estimated": self.estimated}


def plan(cfg, gpus: int, gpu_kind: str, lengths_spec: str, tokens: int, top: int = 5,
         gpus_per_node: int = 8, cache_dir: str | None = None, progress=None,
         memory_bytes: int | None = None, rl: bool = False, precision: str = "all", jobs: int = 1) -> dict:
    """{"fit": [Planned] fastest first, "excluded": [Planned] faster ones that did not fit or were
    refused, "candidates", "judged", "measured"}. `jobs`: worker processes for the memory probes'
    rehearsals (probes.Probes; 1: in this process); probes.WorkersUnavailable where they cannot
    start (they are spawned: a script calls plan() under a main guard)."""
    from longctx_moe.plan.probes import Probes

    probes = Probes(jobs)
    try:
        return _plan(cfg, gpus, gpu_kind, lengths_spec, tokens, top, gpus_per_node, cache_dir, progress,
                     memory_bytes, rl, precision, probes)
    finally:
        probes.close()


def _plan(cfg, gpus, gpu_kind, lengths_spec, tokens, top, gpus_per_node, cache_dir, progress, memory_bytes, rl,
          precision, probes) -> dict:
    from longctx_moe.plan.floors import estimate
    from longctx_moe.plan.layouts import candidates, judge
    from longctx_moe.plan.memory import MemoryCache, per_rank, resident
    from longctx_moe.plan.timing import Workload, step_time

    gpu = dataclasses.replace(GPUS[gpu_kind], gpus_per_node=gpus_per_node)
    if memory_bytes is not None:  # a smaller or larger part of the same kind
        gpu = dataclasses.replace(gpu, memory_bytes=memory_bytes)
    cache = MemoryCache(cfg, cache_dir, rl, probes)
    if not cache.entries:  # a model's first plan probes: its workers import while candidates are timed
        probes.start()
    draw, longest = length_source(lengths_spec)
    docs = np.array(draw(tokens))
    counts = param_counts(cfg)
    max_cp = 2 ** math.ceil(math.log2(max(1, longest / 512)))  # tiles under 512 tokens never pay
    timed, works = [], {}
    for layout in candidates(gpus, cfg.model.num_experts, gpus_per_node, precision):
        if layout.cp > max_cp or tokens // layout.dp < longest:
            continue  # a replica's share must hold the longest document
        n = rank_tokens(layout, longest, tokens)
        work = works.setdefault(n, Workload(docs, n))
        timed.append(Planned(layout, step_time(cfg.model, gpu, gpu_kind, layout, work, counts)))
    timed.sort(key=lambda p: p.time["total_s"])
    fit, excluded, judged, measured = [], [], 0, -1
    slots: dict = {}
    for i, p in enumerate(timed):
        if len(fit) >= top:
            break
        if progress and (i % 100 == 0 or cache.measured != measured):
            measured = cache.measured
            progress(f"\rjudging {i + 1} of {len(timed)} layouts, {len(fit)} fit, {measured} memory probes")
        judged += 1
        p.refused = judge(cfg, p.layout)
        if p.refused is None:
            n = rank_tokens(p.layout, longest, tokens)
            m = micro_batches(p.layout, n, tokens)
            first, later = _passes(cfg, p.layout, n, draw, slots)
            floor = estimate(cache, cfg, p.layout, first, m, counts, later)
            if floor and sum(floor[0].values()) > gpu.memory_bytes:
                p.memory, p.estimated = floor[0], not floor[1]  # cannot fit: refused without a probe
                excluded.append(p)
                continue
            try:
                p.memory = resident(cache, cfg, p.layout)
                if p.peak <= gpu.memory_bytes:  # else refused on its weights and state alone
                    p.memory = per_rank(cache, cfg, p.layout, first, draw, m, later)
            except (RuntimeError, ValueError) as e:  # the program refused it on the rehearsed GPU
                p.memory, p.refused = None, f"its rehearsal stopped: {str(e).splitlines()[0]}"
            if p.refused is None and p.peak <= gpu.memory_bytes:
                fit.append(p)
                continue
        excluded.append(p)
    if progress:
        progress("\n")
    return {"fit": fit, "excluded": excluded, "candidates": len(timed), "judged": judged,
            "measured": cache.measured, "gpu": gpu, "cache": cache}


def _passes(cfg, layout, n: int, lengths_of, memo: dict) -> tuple[int, int]:
    """memory.passes of a micro-batch of `n` tokens a rank as the rehearsal draws it, memoised on
    what it depends on (a plan asks it of thousands of layouts)."""
    from longctx_moe.plan.memory import passes

    if not layout.dynamic_cp:
        return passes(cfg, layout, n, [])
    key = (layout.tp, layout.cp, layout.cp_backend, layout.cp_inner, n)
    if key not in memo:
        memo[key] = passes(cfg, layout, n, lengths_of(n * layout.cp))
    return memo[key]


def _line(p: Planned) -> str:
    t, m = p.time, p.memory or {}
    mem = " ".join(f"{m.get(k, 0) / GIB:6.1f}" for k in CATEGORIES)
    return (f"{p.layout.label():<48} {p.peak / GIB:6.1f} | {mem} | {t['total_s']:7.3f} {t['compute_s']:7.3f} "
            f"{t['comm_s']:6.3f} {t['imbalance_s']:6.3f} | {t['tokens_per_s_per_gpu']:8.0f} {t['mfu'] * 100:5.1f}%")


HEADER = (f"{'layout':<48} {'peak':>6} | {'param':>6} {'grad':>6} {'optim':>6} {'activ':>6} {'comm':>6} {'rest':>6} | "
          f"{'step s':>7} {'comp':>7} {'comm':>6} {'imbal':>6} | {'tok/s/GPU':>8} {'MFU':>6}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from longctx_moe.config import ConfigError
    from longctx_moe.plan.probes import WorkersUnavailable, default_jobs

    start = time.perf_counter()
    try:
        if args.gpus < 1 or args.tokens_per_step < 1 or args.top < 1:
            raise ValueError("--gpus, --tokens-per-step and --top must be >= 1")
        cfg = base_config(args.model)
        result = plan(cfg, args.gpus, args.gpu, args.lengths, args.tokens_per_step, args.top,
                      args.gpus_per_node, args.cache, progress=lambda s: print(s, end="", file=sys.stderr),
                      rl=args.rl, precision=args.precision, jobs=default_jobs() if args.jobs is None else args.jobs)
    except (ConfigError, ValueError, WorkersUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.model.num_layers}-layer model on {args.gpus} x {args.gpu}: {result['candidates']} candidate "
          f"layouts, {result['judged']} judged fastest first, {result['measured']} memory measurements taken "
          f"({time.perf_counter() - start:.1f} s); memory GiB per rank, step seconds")
    print(HEADER)
    for p in result["fit"]:
        print(_line(p))
    if result["excluded"]:
        print("faster layouts excluded:")
        for p in result["excluded"][:10]:
            why = p.refused or (f"needs {'at least ' if p.estimated else ''}{p.peak / GIB:.1f} GiB > "
                                f"{result['gpu'].memory_bytes / GIB:.1f} GiB"
                                f"{' (a floor from measured layouts)' if p.estimated else ''}")
            print(f"  {p.layout.label():<48} {p.time['total_s']:7.3f} s: {why}")
    rehearsed = _rehearse_top(cfg, result, args) if args.rehearse_top else []
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"fit": [p.as_dict() for p in result["fit"]],
                       "excluded": [p.as_dict() for p in result["excluded"]],
                       "rehearsed": rehearsed, "seconds": time.perf_counter() - start}, f, indent=1)
    return 0 if result["fit"] else 1


def _rehearse_top(cfg, result: dict, args) -> list[dict]:
    """The K best layouts rehearsed in full, rank 0 each, beside the planner's figures. The
    rehearsal runs one micro-batch, so the planner's figure beside it is its one-micro-batch one
    (the plan's own adds the gradients earlier micro-batches accumulate, when it has several)."""
    from longctx_moe.plan.layouts import config_of
    from longctx_moe.plan.memory import per_rank, rehearse_step

    lengths_of, longest = length_source(args.lengths)
    out = []
    print("planner (one micro-batch) vs rehearsal, rank 0 (GiB):")
    for p in result["fit"][:args.rehearse_top]:
        n = rank_tokens(p.layout, longest, args.tokens_per_step)
        first, later = _passes(cfg, p.layout, n, lengths_of, {})
        planned = per_rank(result["cache"], cfg, p.layout, first, lengths_of, 1, later)
        c = config_of(cfg, p.layout, max_tokens_per_rank=n)
        micro = n * p.layout.cp
        c = dataclasses.replace(c, data=dataclasses.replace(
            c.data, micro_batch_tokens=micro, global_batch_tokens=max(c.data.global_batch_tokens, micro)))
        report = rehearse_step(result["cache"].rl)(c, p.layout.world, 0, result["gpu"], lengths_of(micro))
        peak = sum(planned.values())
        err = peak / report.peak_bytes - 1
        before = sum(report.update_free_split.values())  # the rehearsal's peak before its update
        print(f"  {p.layout.label():<48} planner {peak / GIB:6.1f}  rehearsal {report.peak_bytes / GIB:6.1f} "
              f"({err * 100:+.1f}%; {before / GIB:.1f} before its update)  " + " ".join(f"{k} {planned.get(k, 0) / GIB:.1f}/{report.peak_split[k] / GIB:.1f}"
                                                   for k in CATEGORIES), flush=True)
        out.append({"label": p.layout.label(), "planner": peak, "rehearsal": report.peak_bytes,
                    "rehearsal_before_update": before,
                    "planner_split": planned, "rehearsal_split": report.peak_split, "rel_err": err})
    return out
