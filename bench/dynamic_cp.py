"""Benchmark: Dynamic-CP scheduling (cp_attention.dynamic.schedule) against three static CP = 8
baselines (an idealised one, the one our trainer runs, and token-balanced packing) on simulated
DP x CP blocks of 8, 64 and 512 ranks (tp = 1).

    .venv/bin/python bench/dynamic_cp.py [--calibrate] [--measure] [--steps K] [--out FILE]

Steps. Every step holds 65,536 tokens per rank (a global batch of 64K x ranks tokens: sequences
are drawn, seeded, until that total is reached); a rank holds at most 16,384 tokens per slot
(micro-batch), so a 128K sequence needs the largest CP size, 8. K steps (default 16, seeds
seed + ranks + 1000 k) are drawn per corpus and size and every plan is made for each: one step is
one sample (its few longest sequences set most of its time), so figures are medians over the K
steps, and ratios come with their min and max.
Corpora:
  stdlib  the running Python's standard-library .py files (data_packing.sources.stdlib_files),
          length = file bytes / 3.5 (a tokenize-free proxy: byte-level BPE tokenizers average
          3-4 bytes per token on code), clipped to [1, 131072], drawn with replacement;
  rl      RL-rollout-like lengths, lognormal with median 4,096 tokens (mu = ln 4096) and
          sigma = 1.2 (mean ~8.4K, ~4% over 32K), clipped to [16, 131072].
Constants (DynamicCPCost, all for a Qwen3-30B-A3B-shaped MoE, overlap 0.5):
  h100       DynamicCPCost.h100(): 400 TFLOP/s achieved, 200 GB/s NVLink (runs of <= 8 ranks
             stay in one node), 12 us per ring step (NCCL's p2p latency model over NVLink),
             attention tile efficiency eff(m) = m / (m + 490) (the fit to FlashAttention-3's
             H100 figures, FA3_H100; printed and stored as h100_attention_fit);
  h100_ib    the same with 25 GB/s and 22 us per ring step, as when CP runs cross nodes over
             InfiniBand;
  h100_plain h100 without the two terms (no latency, eff = 1): the model before them;
  measured   (--calibrate) on this machine, same model shape: GEMM FLOP/s (2048^3 matmul, the
             faster of float32 and bfloat16); causal attention (SDPA forward + backward) in the
             faster dtype at tile lengths 128..16384 (8192 tokens per call), fitted to
             eff(L) = L / (L + n_half) for the long-tile FLOP/s and n_half; gloo send/recv
             between 2 local processes: one-way latency of a 64-byte message (half the 10th
             percentile round trip) as the ring-step latency, 8 MB round trips for the
             bandwidth. Timings are the fastest of their repeats (round trips: 10th
             percentile), so that a machine shared with other jobs measures itself, not them.
Plans per (corpus, ranks, constants), all under the same cost model and step-time model (sum
over micro-batch slots of the slowest run: the MoE all-to-alls sync every slot), every sequence
padded with padded_length(n, s) for the size s it runs on:
  dynamic  schedule(raise_cp=True): each sequence on its own power-of-two CP size <= 8;
  static   idealised static CP, schedule(static_cp=8): the block's aligned 8-rank runs are the
           replicas, every sequence runs on one of them, and the sequences go, densest first,
           wherever they raise the modeled step time least (a run with room in any open slot,
           or a new slot only when that is cheapest), i.e. balanced directly on the slot-
           synchronous step model, with no fixed slot count: a stronger baseline than the
           trainer's, not what it runs;
  loader   static CP as the trainer runs it (data_packing.loader.StepLoader, parallel.cp=8):
           dp = ranks / 8 replicas; balance.balance_step(sizes = lengths padded to 16, costs,
           dp, budget = 16,384 x 8 = 131,072 tokens per micro-batch, the same tokens per rank)
           gives every replica M micro-batches, M the fewest the budget allows; a micro-batch is
           split zigzag over its replica's 8 ranks, and micro-batch m of every replica runs at
           the same time, so step = sum over m of max over replicas of the micro-batch's cost
           (sum of DynamicCPCost.seconds(n, 8) over its sequences), in the order balance_step
           hands them out. Balancer costs: balance.doc_cost with the cost keys that make it
           equal DynamicCPCost.seconds(n, 8) exactly (loader_cost_keys), i.e. a trainer whose
           data.cost_per_token / data.cost_per_token_pair are set for this model; the defaults
           describe the tiny default model (attention pair / token ratio 6.2e-4 against this
           model's ~1.2e-4, no ring term), so the balancer would even out a different cost from
           the one the step is charged, and the gap would mix a mis-set key into the baseline.
           A step with fewer documents than dp x M micro-batches makes balance_step raise
           (the loader then merges it with the next step); here every plan gets the same step,
           so the missing micro-batches are left empty (zero-token, zero-cost placeholders:
           that replica idles through the slot's all-to-alls) and counted in the row's
           empty_micro_batches (0 in every row of the default run);
  tokens   static CP = 8 with token-balanced packing: the loader plan with TOKEN_KEYS
           (data.cost_per_token_pair = 0), so balance_step evens out tokens, not work, as
           trainers do that pack every micro-batch to the same token count: equal tokens,
           unequal attention work across replicas (the static baseline of Megatron-Core's
           published Dynamic-CP gains);
  min      schedule(raise_cp=False): every sequence on its smallest fitting size.
Columns (medians over the steps; ratios "median [min-max]"): imb d/s/l/t = max/mean per-rank
cost of dynamic / static / loader / tokens; GB = ring bytes received by all ranks (loader and
tokens = static by construction: the same sequences on 8 ranks with the same padding); bytes =
static / dynamic GB; step = modeled step time in seconds; speedup = static / dynamic step;
vs ldr = loader / dynamic step; vs tok = tokens / dynamic step; bound = static
step / a lower bound on any plan's step (max of total work at the smallest sizes / ranks and the
costliest single sequence), i.e. the most any scheduler could gain over the idealised static
plan under this model.
plan_seconds_10k: wall time of schedule() for 10,000 rl sequences on 512 ranks (median of 5);
plan_cpu_seconds_10k: its CPU time (process_time), close to the wall time on a quiet machine
where the wall time on a shared one grows with the load.
Document exchange: the MB of documents each rank receives per step when the trainer moves them
to the ranks of their dynamic runs (one all-to-all from the replica whose loader holds each,
the loader plan's assignment here), against an all-gather of every replica's documents.
--measure: the real trainer on 4 gloo ranks here (tiny config, the stdlib corpus packed at 8192
tokens), static CP=4 against Dynamic-CP (max CP 4, 2048 tokens per rank), alternating per round;
a 2-core machine running 4 ranks says little about GPUs: reported as measured.

JSON (--out): for rl at 64 ranks with h100 constants, medians over the steps, against the
idealised static plan: modeled_speedup (static / dynamic step), cp_bytes_ratio (static / dynamic
bytes), imbalance_dynamic, imbalance_static, speedup_bound, with modeled_speedup_range and
cp_bytes_ratio_range ([min, max]); against the loader plan: modeled_speedup_vs_loader,
cp_bytes_ratio_vs_loader, imbalance_static_loader; against token-balanced packing:
modeled_speedup_vs_token_packing (and _range), imbalance_static_token_packing; steps_drawn;
plan_seconds_10k, plan_cpu_seconds_10k; exchange_mb_per_rank and allgather_mb_per_rank (the
document exchange, mean over ranks); calibration (measured figures and the fitted constants,
or null); h100_attention_fit (the FA3 figures, their fwd+bwd combination and fit);
constants_used (every constant set's DynamicCPCost fields); settings; rows (per corpus, size
and constants: the spreads, and every step's comparison under "steps").
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# bench/cp_attention.py would shadow the cp_attention package: keep bench/ off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))  # last: finds dynamic_cp_measure, never bench/cp_attention.py

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from dynamic_cp_measure import calibrate, measure_wallclock, print_calibration  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from cp_attention.dynamic import schedule  # noqa: E402
from cp_attention.dynamic_cost import (  # noqa: E402
    H100_IB_RING_LATENCY,
    DynamicCPCost,
    fit_attention_efficiency,
    padded_length,
)
from data_packing.balance import balance_step, doc_cost  # noqa: E402
from longctx_moe.parallel.dynamic_cp import needed_documents  # noqa: E402

MAX_CP, CAPACITY, TOKENS_PER_RANK = 8, 16384, 65536
# What the Dynamic-CP exchange moves per token: token id, label and position, int64 each (loss
# weights, where a batch has them, add 8 more).
EXCHANGE_BYTES_PER_TOKEN = 24
WORLDS = (8, 64, 512)
RL_MU, RL_SIGMA, RL_CLIP = math.log(4096), 1.2, (16, 131072)
BYTES_PER_TOKEN = 3.5
# The model every constant set describes: Qwen3-30B-A3B's shape (DynamicCPCost.h100).
MODEL = dict(num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
             active_params_per_token=3.3e9)
# The public figures behind H100_ATTN_HALF_TOKENS (cp_attention.dynamic): FlashAttention-3, bf16,
# head dim 128, H100 80GB SXM5, batch x length = 16K tokens, TFLOP/s.
FA3_H100 = {"source": "Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, speed figures (bf16, "
                      "head dim 128, H100 SXM5): forward with causal mask, backward",
            "lengths": [512, 1024, 2048, 4096, 8192, 16384],
            "fwd_causal": [292, 423, 521, 579, 602, 616], "bwd": [316, 424, 501, 542, 559, 561]}


def stdlib_lengths() -> np.ndarray:
    from data_packing.sources import stdlib_files

    sizes = np.asarray([os.path.getsize(p) for p in stdlib_files()], dtype=np.float64)
    return np.clip(np.round(sizes / BYTES_PER_TOKEN), 1, 131072).astype(np.int64)


def draw_step(corpus: str, world: int, seed: int, pool: np.ndarray | None) -> list[int]:
    """Sequences of one step: drawn until world * TOKENS_PER_RANK tokens (the last overshoots)."""
    rng = np.random.default_rng(seed)
    target, out, total = world * TOKENS_PER_RANK, [], 0
    while total < target:
        if corpus == "rl":
            batch = np.clip(rng.lognormal(RL_MU, RL_SIGMA, 1024), *RL_CLIP).astype(np.int64)
        else:
            batch = rng.choice(pool, 1024)
        for n in batch.tolist():
            out.append(n)
            total += n
            if total >= target:
                break
    return out


def lower_bound(lengths: list[int], world: int, cost: DynamicCPCost) -> float:
    """No plan beats max(work at the smallest sizes / ranks, the costliest sequence): raising a
    sequence never lowers its rank-seconds (compute is divided; ring time and the tile overhead
    b*n*n_half of every rank are added). The runs' fixed ring-step costs are left out of the
    work: a bound, not an estimate."""
    work = worst = 0.0
    for n in lengths:
        s = next(s for s in (1, 2, 4, 8) if padded_length(n, s) // s <= CAPACITY)
        pad = padded_length(n, s)
        work += s * cost.seconds(pad, s)
        worst = max(worst, min(cost.run_seconds([padded_length(n, t)], t) for t in (1, 2, 4, 8)
                               if t >= s))
    return max(work / world, worst)


def summary(plan) -> dict:
    return {"step_s": plan.modeled_step_time, "slots": plan.num_slots,
            "imbalance": plan.imbalance, "cp_bytes": plan.cp_bytes,
            "cp_sizes_used": {str(k): v for k, v in plan.cp_sizes_used.items()}}


def loader_cost_keys(cost: DynamicCPCost) -> tuple[float, float]:
    """(data.cost_per_token, data.cost_per_token_pair) for which balance.doc_cost(L) equals
    cost.seconds(L, MAX_CP): seconds = (a*L + b*L^2) / s + b*n_half*L + ring*L and doc_cost =
    per_token*L + pair*L*(L+1)/2, so pair = 2b/s and per_token = a/s + b*n_half + ring - b/s
    (ring: unhidden seconds of CP traffic per token). The run's fixed ring-step cost is the
    same for every non-empty micro-batch: nothing to balance."""
    s = MAX_CP
    ring = cost.comm_seconds(1, s)
    return cost.a / s + cost.b * cost.attn_half_tokens + ring - cost.b / s, 2.0 * cost.b / s


def loader_micro_batches(sizes: np.ndarray, costs: np.ndarray, dp: int,
                         budget: int) -> list[list[list[int]]]:
    """balance_step's micro[replica][m] (positions into sizes), with as many zero-token,
    zero-cost placeholders appended as a step could need, then dropped again. Where
    balance_step succeeds they change nothing (they sort after every real document, seed no
    micro-batch and add no tokens or cost); where it would raise for want of documents they
    fill the micro-batches that stay empty (module docstring, loader)."""
    n = len(sizes)
    # balance_step starts at M0 = ceil(tokens / (dp * budget)) micro-batches per replica and adds
    # one while its fill fails, which it cannot once every document seeds its own micro-batch:
    # it never needs more than max(dp * M0, n + dp), so dp * (M0 + 1) placeholders suffice.
    extra = dp * (math.ceil(int(sizes.sum()) / (dp * budget)) + 1)
    assign = balance_step(np.concatenate([sizes, np.zeros(extra, np.int64)]),
                          np.concatenate([costs, np.zeros(extra)]), dp, budget)
    return [[[i for i in mb if i < n] for mb in replica] for replica in assign.micro]


# data.cost_per_token, data.cost_per_token_pair of a balancer that evens out tokens only.
TOKEN_KEYS = (1.0, 0.0)


def loader_assignment(lengths: list[int], world: int, cost: DynamicCPCost,
                      keys: tuple[float, float] | None = None) -> list[list[list[int]]]:
    """micro[replica][m]: the sequences the trainer's loader (static CP = MAX_CP) gives each
    replica's micro-batches. keys: the balancer's cost keys (default: those that match `cost`;
    TOKEN_KEYS: the tokens plan)."""
    sizes = np.asarray([padded_length(n, MAX_CP) for n in lengths], dtype=np.int64)
    keys = keys or loader_cost_keys(cost)
    return loader_micro_batches(sizes, doc_cost(sizes, *keys), world // MAX_CP,
                                CAPACITY * MAX_CP)


def loader_plan(lengths: list[int], world: int, cost: DynamicCPCost,
                micro: list[list[list[int]]]) -> dict:
    """The trainer's static CP = MAX_CP on the loader's micro-batches `micro` (module
    docstring, loader): step time, per-rank imbalance and ring bytes under the same cost model
    as the schedule() plans."""
    dp, budget = world // MAX_CP, CAPACITY * MAX_CP
    sizes = np.asarray([padded_length(n, MAX_CP) for n in lengths], dtype=np.int64)
    seconds = cost.seconds(sizes.astype(np.float64), MAX_CP)  # every rank of the replica pays it
    fixed = cost.run_fixed_seconds(MAX_CP)  # the ring steps of a non-empty micro-batch
    mb_s = np.asarray([[seconds[mb].sum() + (fixed if mb else 0.0) for mb in replica]
                       for replica in micro])  # [dp, M]
    rank_cost = mb_s.sum(axis=1)  # per replica = per rank: its MAX_CP ranks carry the same
    return {"step_s": float(mb_s.max(axis=0).sum()), "slots": mb_s.shape[1],
            "imbalance": float(rank_cost.max() / rank_cost.mean()),
            "cp_bytes": float(MAX_CP * cost.cp_bytes(sizes.astype(np.float64), MAX_CP).sum()),
            "cp_sizes_used": {str(MAX_CP): len(lengths)}, "dp_replicas": dp,
            "budget_tokens": budget,
            "empty_micro_batches": sum(not mb for replica in micro for mb in replica)}


def exchange_tokens(plan, lengths: list[int], world: int,
                    micro: list[list[list[int]]]) -> dict:
    """Tokens each rank receives when the trainer moves the step's documents to the ranks of
    their runs (longctx_moe.parallel.dynamic_cp: one all-to-all from the replica whose loader
    holds each document; here the loader's assignment `micro`), mean and max over ranks, and
    what an all-gather of the documents over dp would give every rank (the other replicas'
    documents)."""
    owner = [0] * len(lengths)
    for replica, mbs in enumerate(micro):
        for mb in mbs:
            for i in mb:
                owner[i] = replica
    needs = needed_documents(plan, world)
    got = [sum(lengths[i] for i in needs[q] if owner[i] != q // MAX_CP) for q in range(world)]
    held = [sum(lengths[i] for mb in mbs for i in mb) for mbs in micro]
    gather = [sum(lengths) - held[q // MAX_CP] for q in range(world)]
    return {"all_to_all_mean": float(np.mean(got)), "all_to_all_max": max(got),
            "all_gather_mean": float(np.mean(gather))}


def compare(corpus: str, world: int, lengths: list[int], name: str, cost: DynamicCPCost) -> dict:
    dyn = schedule(lengths, world, MAX_CP, CAPACITY, cost)
    static = schedule(lengths, world, MAX_CP, CAPACITY, cost, static_cp=MAX_CP)
    small = schedule(lengths, world, MAX_CP, CAPACITY, cost, raise_cp=False)
    micro = loader_assignment(lengths, world, cost)
    loader = loader_plan(lengths, world, cost, micro)
    tokens = loader_plan(lengths, world, cost, loader_assignment(lengths, world, cost, TOKEN_KEYS))
    bound = lower_bound(lengths, world, cost)
    return {"corpus": corpus, "ranks": world, "constants": name, "sequences": len(lengths),
            "tokens": int(sum(lengths)), "dynamic": summary(dyn), "static": summary(static),
            "static_loader": loader, "static_tokens": tokens, "min_size": summary(small),
            "lower_bound_s": bound,
            "speedup": static.modeled_step_time / dyn.modeled_step_time,
            "bytes_ratio": static.cp_bytes / max(dyn.cp_bytes, 1.0),
            "speedup_vs_loader": loader["step_s"] / dyn.modeled_step_time,
            "bytes_ratio_vs_loader": loader["cp_bytes"] / max(dyn.cp_bytes, 1.0),
            "speedup_vs_tokens": tokens["step_s"] / dyn.modeled_step_time,
            "speedup_bound": static.modeled_step_time / bound,
            "exchange_tokens": exchange_tokens(dyn, lengths, world, micro)}


RATIOS = ("speedup", "bytes_ratio", "speedup_vs_loader", "bytes_ratio_vs_loader",
          "speedup_vs_tokens", "speedup_bound")
PLANS = ("dynamic", "static", "static_loader", "static_tokens", "min_size")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(steps: list[dict]) -> dict:
    """One (corpus, ranks, constants) over its drawn steps: median, min and max of every ratio
    and of each plan's step time, imbalance, ring bytes and slots; the steps themselves too."""
    out = {k: steps[0][k] for k in ("corpus", "ranks", "constants")}
    out["sequences"] = spread([s["sequences"] for s in steps])
    out.update({k: spread([s[k] for s in steps]) for k in RATIOS})
    out.update({p: {f: spread([s[p][f] for s in steps])
                    for f in ("step_s", "imbalance", "cp_bytes", "slots")} for p in PLANS})
    out["exchange_tokens"] = {f: spread([s["exchange_tokens"][f] for s in steps])
                              for f in steps[0]["exchange_tokens"]}
    out["steps"] = steps
    return out


def plan_seconds_10k(cost: DynamicCPCost, repeats: int = 5) -> tuple[float, float]:
    """(wall, CPU) seconds of schedule() for 10,000 rl sequences on 512 ranks, medians of
    `repeats`; on a shared machine the CPU time is close to a quiet one's wall time."""
    rng = np.random.default_rng(10_000)
    lengths = np.clip(rng.lognormal(RL_MU, RL_SIGMA, 10_000), *RL_CLIP).astype(np.int64)
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        schedule(lengths.tolist(), 512, MAX_CP, CAPACITY, cost)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def h100_attention_fit() -> dict:
    """n_half of the cited FlashAttention-3 figures (FA3_H100): forward (causal) and backward
    combined by their FLOPs (backward 2.5x the forward), then fitted."""
    fwd, bwd = np.asarray(FA3_H100["fwd_causal"]), np.asarray(FA3_H100["bwd"])
    combined = 3.5 / (1.0 / fwd + 2.5 / bwd)
    peak, half = fit_attention_efficiency(FA3_H100["lengths"], combined * 1e12)
    return {"source": FA3_H100["source"], "fwd_bwd_tflops": combined.round(1).tolist(),
            "fit_tflops": peak / 1e12, "fit_half_tokens": half}


def _med_range(x: dict, width: int = 6) -> str:
    return f"{x['median']:.3f} [{x['min']:.2f}-{x['max']:.2f}]".rjust(width)


def print_table(rows: list[dict]) -> None:
    """One line per (corpus, ranks, constants): medians over the drawn steps, and for the
    ratios their [min-max] too."""
    print(f"{'corpus':<7}{'ranks':>6} {'constants':<11}{'imb d/s/l/t':>24}{'GB dyn':>8}"
          f"{'GB sta':>8} {'bytes':>19} {'step d/s/l/t':>24} {'speedup':>19} {'vs ldr':>19} "
          f"{'vs tok':>19} {'bound':>6}")
    for r in rows:
        imb = "/".join(f"{r[p]['imbalance']['median']:.3f}" for p in PLANS[:4])
        step = "/".join(f"{r[p]['step_s']['median']:.3g}" for p in PLANS[:4])
        print(f"{r['corpus']:<7}{r['ranks']:>6} {r['constants']:<11}{imb:>24}"
              f"{r['dynamic']['cp_bytes']['median'] / 1e9:>8.0f}"
              f"{r['static']['cp_bytes']['median'] / 1e9:>8.0f} {_med_range(r['bytes_ratio'], 19)}"
              f" {step:>24} {_med_range(r['speedup'], 19)} {_med_range(r['speedup_vs_loader'], 19)}"
              f" {_med_range(r['speedup_vs_tokens'], 19)} {r['speedup_bound']['median']:>5.2f}x")
    empty = [(r["corpus"], r["ranks"], r["constants"], k) for r in rows
             for k, step in enumerate(r["steps"]) for p in ("static_loader", "static_tokens")
             if step[p]["empty_micro_batches"]]
    if empty:
        print(f"loader plans with empty micro-batches (too few documents): {empty}")


def print_exchange(rows: list[dict]) -> None:
    """Per corpus and size (h100 plans): MB of documents each rank receives per step, moved to
    their runs by the all-to-all (mean, max) against an all-gather over dp."""
    mb = EXCHANGE_BYTES_PER_TOKEN / 1e6
    parts = []
    for r in rows:
        if r["constants"] == "h100":
            x = {k: v["median"] * mb for k, v in r["exchange_tokens"].items()}
            parts.append(f"{r['corpus']}/{r['ranks']} {x['all_to_all_mean']:.1f} (max "
                         f"{x['all_to_all_max']:.1f}) vs {x['all_gather_mean']:.0f}")
    print("document exchange, MB received per rank and step (int64 token, label, position), "
          "all-to-all mean (max) vs all-gather over dp: " + "; ".join(parts))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibrate", action="store_true",
                    help="measure GEMM, attention and gloo bandwidth here; add 'measured' rows")
    ap.add_argument("--measure", action="store_true",
                    help="also train static CP=4 vs Dynamic-CP on 4 gloo ranks here (minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=16,
                    help="steps drawn per corpus and size (seeds seed + ranks + 1000 k)")
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args(argv)
    calibration = calibrate(MODEL) if args.calibrate else None
    constants = {"h100": DynamicCPCost.h100(),
                 "h100_ib": DynamicCPCost.h100(bandwidth=25e9, ring_latency=H100_IB_RING_LATENCY),
                 "h100_plain": DynamicCPCost.h100(ring_latency=0.0, attn_half_tokens=0.0)}
    if calibration:
        constants["measured"] = DynamicCPCost(**calibration["constants"])
    pool = stdlib_lengths()
    rows = []
    for corpus in ("stdlib", "rl"):
        for world in WORLDS:
            steps = [draw_step(corpus, world, args.seed + world + 1000 * k, pool)
                     for k in range(args.steps)]
            rows += [aggregate([compare(corpus, world, lengths, name, cost) for lengths in steps])
                     for name, cost in constants.items()]
    plan_10k, plan_10k_cpu = plan_seconds_10k(constants["h100"])
    print(f"max CP {MAX_CP}, {CAPACITY} tokens per rank per slot, {TOKENS_PER_RANK} tokens per "
          f"rank per step; medians over {args.steps} drawn steps, ratios with [min-max]; plans "
          f"d(ynamic) / s(tatic, idealised) / l(oader) / t(oken-balanced loader); step times in "
          f"modeled seconds")
    print_table(rows)
    print(f"plan 10,000 rl sequences on 512 ranks: {plan_10k:.3f} s wall, {plan_10k_cpu:.3f} s "
          f"CPU (medians of 5)")
    print_exchange(rows)
    fa3 = h100_attention_fit()
    print(f"h100 n_half: fit of eff(L) = L / (L + n_half) to FlashAttention-3 fwd+bwd "
          f"{fa3['fwd_bwd_tflops']} TFLOP/s at L = {FA3_H100['lengths']}: "
          f"{fa3['fit_half_tokens']:.0f} tokens (long-tile {fa3['fit_tflops']:.0f} TFLOP/s); "
          f"used: {constants['h100'].attn_half_tokens:.0f}")
    if calibration:
        print_calibration(calibration)
    measured = measure_wallclock() if args.measure else None
    if measured:
        print(f"measured, 4 gloo ranks ({measured['setting']}): static {measured['static_step_s']:.3f}"
              f" s/step, dynamic {measured['dynamic_step_s']:.3f} s/step -> "
              f"{measured['speedup']:.2f}x; per-round medians {measured['rounds']}; dynamic CP "
              f"sizes used (documents) {measured['dynamic_cp_sizes']}")
    head = next(r for r in rows if (r["corpus"], r["ranks"], r["constants"]) == ("rl", 64, "h100"))
    med = {k: v["median"] for k, v in head.items() if isinstance(v, dict) and "median" in v}
    result = {"modeled_speedup": med["speedup"], "cp_bytes_ratio": med["bytes_ratio"],
              "imbalance_dynamic": head["dynamic"]["imbalance"]["median"],
              "imbalance_static": head["static"]["imbalance"]["median"],
              "modeled_speedup_range": [head["speedup"]["min"], head["speedup"]["max"]],
              "cp_bytes_ratio_range": [head["bytes_ratio"]["min"], head["bytes_ratio"]["max"]],
              "modeled_speedup_vs_loader": med["speedup_vs_loader"],
              "cp_bytes_ratio_vs_loader": med["bytes_ratio_vs_loader"],
              "imbalance_static_loader": head["static_loader"]["imbalance"]["median"],
              "modeled_speedup_vs_token_packing": med["speedup_vs_tokens"],
              "modeled_speedup_vs_token_packing_range": [head["speedup_vs_tokens"]["min"],
                                                         head["speedup_vs_tokens"]["max"]],
              "imbalance_static_token_packing": head["static_tokens"]["imbalance"]["median"],
              "steps_drawn": args.steps,
              "plan_seconds_10k": plan_10k, "plan_cpu_seconds_10k": plan_10k_cpu,
              "speedup_bound": med["speedup_bound"], "calibration": calibration,
              "exchange_mb_per_rank": head["exchange_tokens"]["all_to_all_mean"]["median"]
              * EXCHANGE_BYTES_PER_TOKEN / 1e6,
              "allgather_mb_per_rank": head["exchange_tokens"]["all_gather_mean"]["median"]
              * EXCHANGE_BYTES_PER_TOKEN / 1e6,
              "h100_attention_fit": fa3,
              "constants_used": {k: dataclasses.asdict(c) for k, c in constants.items()},
              "measured_4_ranks": measured,
              "settings": {"max_cp": MAX_CP, "capacity_tokens": CAPACITY,
                           "tokens_per_rank_per_step": TOKENS_PER_RANK, "rl_mu": RL_MU,
                           "rl_sigma": RL_SIGMA, "rl_clip": RL_CLIP,
                           "stdlib_bytes_per_token": BYTES_PER_TOKEN, "model": MODEL,
                           "seed": args.seed, "steps": args.steps},
              "rows": rows}
    write_json(args.out, result, indent=2)
    return result


if __name__ == "__main__":
    main()
