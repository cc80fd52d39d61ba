"""Long-context training memory and speed: one training step on a single document of 8K ... 128K
tokens, longctx-moe with `train.recompute` none / selective / full vs Hugging Face transformers'
Qwen3-MoE, same model, same weights, same run; and the same step on 4 gloo ranks in named layouts.

    .venv/bin/python bench/long_context.py --out bench/results/long_context.json
    .venv/bin/python bench/long_context.py --lengths 8192,16384 --cp4-length 16384   # quicker
    .venv/bin/python bench/long_context.py --lengths 32768 --sides none \
        --multi-layouts cp4,cp2tp2 --out bench/results/long_context.json           # 4-rank part

Ours runs with `train.host_allocator=lean` by default (--allocator; single rank and every layout
alike): blocks above 1 MiB get their own mmap, so a CP rank's quarter-size activations do not
fragment the heap (longctx_moe/host.py). HF runs on glibc's defaults.

--routes uniform (ours only) replays every token's top-k experts from a uniform draw through the
trainer's router-replay seam, so expert loads are balanced as a router trained with a balance loss
keeps them. The default, live, lets the fresh router choose: on one long random document it sends
most tokens to a few experts, and under EP the ranks holding those experts keep more activations.

The model is bench/train_throughput.py's (hidden 512, 4 layers, 16 experts top-2, 8 query / 4 KV
heads of 64, vocab 16384), bf16 autocast where the CPU has native bf16 (else float32), fp32 master weights, fused AdamW, no torch.compile on
either side (a compile would be charged to the single timed step). The document is random token
ids: memory and time do not depend on the values.

Each (side, length) runs in a fresh process: one untimed 2,048-token step (kernels, allocator and
optimizer state come up), then the peak-RSS mark is reset (/proc/self/clear_refs) and one step on
the long document is timed. Peak memory = the process's peak RSS during that step minus its RSS
before the model was built, so it holds parameters, gradients, AdamW state and the step's
activations, the same measure on both sides. A watchdog stops a process whose RSS passes
--mem-cap-gib (default 20): that side is then "over the cap" at that length and is not run at
longer ones. Lengths go up until every side is over the cap or past --max-step-s (a side whose
previous step, scaled by the quadratic growth of attention, would exceed it, stops there).

Multi-rank layouts (long_context_multi.py; --multi-layouts, each on 4 gloo ranks in spawned
processes at --cp4-length, with --multi-recompute (default none), the same warm-up and peak
measure per rank; each rank's watchdog at a quarter of --mem-cap-gib):
  cp4        parallel.cp=4 (ring), ep=4 (MoE Parallel Folding: a quarter of the experts per
             rank), distributed_optimizer (AdamW state of dense weights sharded over dp*cp = 4;
             experts have edp = 1 replica, so their state is not split further)
  cp2tp2     cp=2 (ring) x tp=2 with sequence_parallel, ep=4, distributed_optimizer (dense
             weights: TP halves, state sharded over dp*cp = 2; experts: edp = 1)
  cp4_plain  cp=4 (ring), ep=1, replicated AdamW: what the two features above buy
Each rank also reports its AdamW state bytes (numel * element_size of every tensor in
trainer.optimizer.state, split dense / expert) and those of a replicated AdamW over the same local
parameters (optim.build_optimizer, built and stepped once on zero gradients after the measured
step), and its parameter bytes. --reuse keeps 4-rank rows by (layout, length) where their settings
are the current ones.

--ep-spare-slots N (default 2) adds parallel.ep_spare_slots=N to the layouts with ep > 1: EP
ranks whose experts got more than their share of the routed rows lend rows of their hottest
experts to lighter ranks for the step (longctx_moe/parallel/expert_lending.py). The rows then
report, per MoE layer, both the share of rows each EP rank's own experts got (ep_rank_shares)
and the share each rank ran (ep_rank_run_shares). --ep-spare-slots 0 measures without lending.

Derived figures:
  bytes per token  least-squares slope of peak memory over the lengths a side ran;
  longest in cap   the longest length a side ran under the cap; when a side never hit the cap
                   the figure is extrapolated from its line (marked "extrapolated") and is a
                   lower bound for HF only if HF did hit it;
  <layout>_peak_over_single
                   the layout's largest per-rank peak over the single-rank peak of the same
                   recompute mode (--multi-recompute) at --cp4-length (that single row runs if
                   missing);
  dist_optimizer_bytes_ratio
                   cp4's per-rank AdamW bytes (largest rank) over a replicated AdamW's on the
                   same rank: 1/4 for the dense share, 1 for the experts' (edp = 1).
  ep_rank_shares   (per layout row) per MoE layer, the share of the step's routed rows the
                   experts of each EP rank received: what puts one rank's peak above the others'.

JSON (--out): routes, allocator, ep_spare_slots, longest_ours_tokens, longest_hf_tokens,
longest_ratio, bytes_per_token_ours (recompute none), bytes_per_token_hf, selective_recompute_tokens_per_s_ratio (selective / none,
median over the lengths both ran), cp4_peak_over_single, cp2tp2_peak_over_single,
tokens_per_s_ratio_32k (ours none / HF at 32K), multi_recompute, optimizer_bytes_per_rank
{layout: bytes}, replicated_optimizer_bytes_per_rank, dist_optimizer_bytes_ratio,
dist_optimizer_replicas {layout: {dense, expert}}, peak_over_single {layout: ratio}, plus every
measured row (rows; multi_rows with per-rank detail, ep_rank_shares and ep_rank_run_shares; every row's
expert_counts), the per-mode slopes and what was extrapolated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from long_context_multi import LAYOUTS, WORLD, layout_sets, run_multi  # noqa: E402
from long_context_report import fmt_multi, fmt_row, multi_table, table  # noqa: E402

from bench.bench_io import compute_dtype, write_json  # noqa: E402
from longctx_moe.host import resident_mb  # noqa: E402

SIDES = ("none", "selective", "full", "hf")  # the first three are ours, by train.recompute
RECOMPUTE = SIDES[:3]
ROUTES = ("live", "uniform")
WARMUP_TOKENS = 2048
GIB = 2**30
CPU = torch.device("cpu")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072",
                   help="document lengths in tokens, ascending")
    p.add_argument("--sides", default=",".join(SIDES), help=f"subset of {','.join(SIDES)}")
    p.add_argument("--mem-cap-gib", type=float, default=20.0)
    p.add_argument("--max-step-s", type=float, default=600.0,
                   help="do not start a step predicted to take longer than this")
    p.add_argument("--cp4-length", type=int, default=32768,
                   help="document length of the 4-rank runs (0: skip them)")
    p.add_argument("--multi-layouts", default=",".join(LAYOUTS),
                   help=f"4-rank layouts to run at --cp4-length, a subset of {','.join(LAYOUTS)}")
    p.add_argument("--multi-recompute", default="none", choices=RECOMPUTE,
                   help="train.recompute of the 4-rank layouts and of the single-rank row they are "
                        "divided by")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: torch's default)")
    p.add_argument("--allocator", default="lean", choices=("tuned", "lean", "default"),
                   help="train.host_allocator of ours, single rank and every layout alike (HF runs "
                        "on glibc's defaults)")
    p.add_argument("--routes", default="live", choices=ROUTES,
                   help="live: the fresh router picks the experts; uniform: every token's top-k experts "
                        "drawn uniformly (router replay), the balanced load of a trained router (ours only)")
    p.add_argument("--ep-spare-slots", type=int, default=2,
                   help="parallel.ep_spare_slots of the layouts with ep > 1: overloaded EP ranks lend "
                        "rows of their hottest experts to lighter ones (0: off)")
    p.add_argument("--out", help="write the results as JSON here (rewritten after every measurement)")
    p.add_argument("--reuse", help="a JSON this bench wrote earlier (even an interrupted run's): its "
                                   "rows are kept and their (side, length) and 4-rank (layout, length) "
                                   "pairs not run again")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------- memory


def rss_bytes() -> int:
    return int(resident_mb() * 2**20)


def start_watchdog(cap_bytes: int) -> None:
    """Stop this process once its RSS passes the cap: the step is then over the cap, and a
    machine shared with other work is not pushed into the OOM killer."""
    def watch():
        while True:
            if rss_bytes() > cap_bytes:
                print("OVERCAP", flush=True)
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------------- one step


def document(length: int, vocab: int, seed: int):
    """One micro-batch holding one document of `length` random tokens."""
    from data_packing.batch import PackedBatch, labels_from_tokens, position_ids_from_cu

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (length,), generator=g)
    cu = torch.tensor([0, length], dtype=torch.int32)
    return PackedBatch(tokens=tokens, labels=labels_from_tokens(tokens, cu, cu), cu_seqlens=cu,
                       cu_seqlens_padded=cu.clone(), position_ids=position_ids_from_cu(cu, cu, length),
                       max_seqlen=length)


def bench_config(side: str, extra=()):
    from train_throughput import model_config

    sets = ["train.compile=false"] + list(extra)
    if side != "hf":
        sets.append(f"train.recompute={side}")
    return model_config(sets)


def build_side(side: str, cfg, dims=None, routes: str = "live"):
    """The step function of one side: ours through the trainer, HF through bench/train_throughput's
    HF runner (same architecture, same weights)."""
    from train_throughput import hf_runner

    from longctx_moe.build import build_runtime, model_of
    from longctx_moe.trainer import Trainer

    if side == "hf":

        torch.manual_seed(cfg.train.seed)
        return hf_runner(cfg, model_of(cfg), compute_dtype(cfg.train.autocast_dtype))
    trainer = Trainer(cfg, build_runtime(cfg, dims, CPU))
    return step_fn(trainer, routes)


def step_fn(trainer, routes: str):
    """One optimizer step of the trainer on a list of micro-batches, returning its StepResult; with
    routes "uniform", every token's experts are replayed from a uniform draw."""
    if routes == "live":
        return trainer.train_step
    return lambda batches: trainer.train_step(batches, UniformRoutes(trainer.cfg.model, batches))


class UniformRoutes:
    """The supervised objective with router replay: each token's top-k distinct experts in every
    MoE layer drawn uniformly (seeded, so every rank draws the same routes for the whole batch
    and shards them as it shards the tokens). Expert loads are then balanced up to sampling noise,
    as a router trained with a balance loss keeps them; a fresh router on one long document is
    not (it sends most tokens to a few experts)."""

    head = None

    def __init__(self, model_cfg, batches):
        from longctx_moe.trainer import CrossEntropy

        self._ce = CrossEntropy()
        layers = model_cfg.num_layers - model_cfg.first_k_dense
        g = torch.Generator().manual_seed(0)
        self.routes = [torch.rand(b.tokens.numel(), layers, model_cfg.num_experts, generator=g)
                       .argsort(-1)[..., :model_cfg.top_k].contiguous() for b in batches]

    def replay(self, i: int) -> torch.Tensor:
        return self.routes[i]

    def micro_loss(self, i, out, shard, g):
        return self._ce.micro_loss(i, out, shard, g)


def measured_step(run, length: int, vocab: int, base: int) -> dict:
    from longctx_moe.metrics import peak_memory_mb, reset_peak_memory

    run([document(WARMUP_TOKENS, vocab, seed=1)])
    if not reset_peak_memory(CPU):
        raise SystemExit("bench/long_context.py needs /proc/self/clear_refs (Linux) to reset the peak RSS")
    batch = document(length, vocab, seed=0)
    t0 = time.perf_counter()
    out = run([batch])  # ours: a StepResult; HF: the loss
    seconds = time.perf_counter() - t0
    counts = getattr(out, "expert_counts", None)
    return {"step_s": seconds, "tokens_per_s": length / seconds, "loss": float(getattr(out, "ce_loss", out)),
            "peak_bytes": int(peak_memory_mb(CPU) * 2**20) - base,
            "expert_counts": counts.tolist() if counts is not None else None}


def worker(args) -> None:
    from longctx_moe.host import configure_cpu

    configure_cpu(args.threads, args.allocator if args.worker != "hf" else "default")
    start_watchdog(int(args.mem_cap_gib * GIB))
    cfg = bench_config(args.worker)
    base = rss_bytes()
    run = build_side(args.worker, cfg, routes=args.routes)
    res = measured_step(run, args.length, cfg.model.vocab_size, base)
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------- the driver


def run_one(side: str, length: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--length", str(length),
           "--mem-cap-gib", str(args.mem_cap_gib), "--threads", str(args.threads),
           "--allocator", args.allocator, "--routes", args.routes]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if "OVERCAP" in proc.stdout:
        return {"side": side, "length": length, "over_cap": True}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"side": side, "length": length, "over_cap": proc.returncode in (-9, 137),
                "error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return {"side": side, "length": length, "over_cap": False, **json.loads(lines[-1][len("RESULT "):])}


def predicted_seconds(rows: list[dict], length: int) -> float:
    """The next step's time if the last one's grows with attention's n^2 (an upper bound for a
    step that is part linear)."""
    last = rows[-1]
    return last["step_s"] * (length / last["length"]) ** 2


def slope(rows: list[dict]) -> tuple[float, float] | None:
    """Least-squares (bytes per token, intercept) of peak memory over length."""
    if len(rows) < 2:
        return None
    xs, ys = [r["length"] for r in rows], [r["peak_bytes"] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return k, my - k * mx


def longest(rows: list[dict], cap: float) -> tuple[int | None, bool]:
    """(longest tokens under the cap, extrapolated?)."""
    ok = [r for r in rows if not r["over_cap"] and "error" not in r]
    if not ok:
        return None, False
    if any(r["over_cap"] for r in rows):
        return max(r["length"] for r in ok), False
    fit = slope(ok)
    if fit is None or fit[0] <= 0:
        return max(r["length"] for r in ok), False
    return int((cap - fit[1]) / fit[0]), True


def summarize(rows: list[dict], multi: list[dict], args) -> dict:
    cap = args.mem_cap_gib * GIB
    by_side = {s: [r for r in rows if r["side"] == s] for s in SIDES}
    ran = {s: [r for r in rs if not r["over_cap"] and "error" not in r] for s, rs in by_side.items()}
    fits = {s: slope(rs) for s, rs in ran.items()}
    reach = {s: longest(rs, cap) for s, rs in by_side.items() if rs}
    ours = [(reach[s][0], s) for s in ("none", "selective", "full") if s in reach and reach[s][0]]
    best_ours = max(ours) if ours else (None, None)
    hf_len = reach.get("hf", (None, False))[0]

    def at(side, length):
        return next((r for r in ran[side] if r["length"] == length), None)

    sel = [at("selective", r["length"])["tokens_per_s"] / r["tokens_per_s"]
           for r in ran["none"] if at("selective", r["length"])]
    r32_ours, r32_hf = at("none", 32768), at("hf", 32768)
    # 4-rank layouts at the --cp4-length (rows of other lengths, kept by --reuse, stay in
    # multi_rows but not in the derived figures)
    done = {m["layout"]: m for m in multi if m["length"] == args.cp4_length and "error" not in m}
    single = at(args.multi_recompute, args.cp4_length)
    over = {k: m["max_peak_bytes"] / single["peak_bytes"] for k, m in done.items()} if single else {}
    cp4 = done.get("cp4")
    return {
        "longest_ours_tokens": best_ours[0], "longest_ours_recompute": best_ours[1],
        "longest_hf_tokens": hf_len,
        "longest_ratio": best_ours[0] / hf_len if best_ours[0] and hf_len else None,
        "longest_extrapolated": {s: reach[s][1] for s in reach},
        "longest_by_side": {s: reach[s][0] for s in reach},
        "bytes_per_token_ours": fits["none"][0] if fits.get("none") else None,
        "bytes_per_token_hf": fits["hf"][0] if fits.get("hf") else None,
        "bytes_per_token_by_side": {s: (f[0] if f else None) for s, f in fits.items()},
        "selective_recompute_tokens_per_s_ratio": statistics.median(sel) if sel else None,
        "cp4_peak_over_single": over.get("cp4"),
        "cp2tp2_peak_over_single": over.get("cp2tp2"),
        "peak_over_single": over,
        "single_peak_bytes_at_multi_length": single["peak_bytes"] if single else None,
        "optimizer_bytes_per_rank": {k: m["optimizer_bytes"] for k, m in done.items()},
        "replicated_optimizer_bytes_per_rank": {k: m["replicated_optimizer_bytes"] for k, m in done.items()},
        "dist_optimizer_bytes_ratio": (cp4["optimizer_bytes"] / cp4["replicated_optimizer_bytes"]
                                       if cp4 else None),
        "dist_optimizer_bytes_ratio_by_kind": by_kind_ratio(cp4) if cp4 else None,
        "dist_optimizer_replicas": {k: m["replicas"] for k, m in done.items()},
        "tokens_per_s_ratio_32k": r32_ours["tokens_per_s"] / r32_hf["tokens_per_s"] if r32_ours and r32_hf else None,
        "mem_cap_gib": args.mem_cap_gib, "allocator": args.allocator, "routes": args.routes,
        "ep_spare_slots": args.ep_spare_slots,
        "multi_recompute": args.multi_recompute, "rows": rows, "multi_length": args.cp4_length,
        "multi_rows": multi, "layouts": {k: {"sets": v[0], "what": v[1]} for k, v in LAYOUTS.items()},
        "threads": args.threads or torch.get_num_threads(), "torch": torch.__version__,
        "compute_dtype": compute_dtype().name, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
    }


def by_kind_ratio(m: dict) -> dict:
    """Sharded / replicated AdamW bytes of the dense and the expert parameters (largest rank):
    1 / the replicas each kind is sharded over (dims dp_cp and edp), up to the per-slab step."""
    big = lambda key, kind: max(r[key][kind] for r in m["per_rank"])
    return {kind: (big("optimizer_bytes", kind) / big("replicated_optimizer_bytes", kind)
                   if big("replicated_optimizer_bytes", kind) else None) for kind in ("dense", "expert")}


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GIB:.0f} GiB"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; choose from {','.join(SIDES)}")
    layouts = [x for x in args.multi_layouts.split(",") if x]
    if set(layouts) - set(LAYOUTS):
        raise SystemExit(f"--multi-layouts: unknown {sorted(set(layouts) - set(LAYOUTS))}; "
                         f"choose from {','.join(LAYOUTS)}")
    prior = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    if prior and prior.get("allocator", "tuned") != args.allocator:
        raise SystemExit(f"--reuse {args.reuse} was measured with --allocator "
                         f"{prior.get('allocator', 'tuned')}; pass that, or start a new file")
    if prior and prior.get("routes", "live") != args.routes:
        raise SystemExit(f"--reuse {args.reuse} was measured with --routes {prior.get('routes', 'live')}; "
                         "pass that, or start a new file")
    if prior and prior.get("multi_recompute", "none") != args.multi_recompute and prior.get("multi_rows"):
        raise SystemExit(f"--reuse {args.reuse} ran its 4-rank layouts with --multi-recompute "
                         f"{prior.get('multi_recompute', 'none')}; pass that, or start a new file")
    if args.routes != "live" and "hf" in sides:
        raise SystemExit("--routes uniform replays routes through our trainer, which HF's model has no "
                         "seam for; leave hf out of --sides")
    rows = prior.get("rows", [])
    # 4-rank rows keyed by (layout, length), kept where they ran the layout's current settings
    # (not another --ep-spare-slots, nor an older file's layout of the same name); failed ones
    # run again
    multi = [m for m in prior.get("multi_rows", []) if "error" not in m and m["layout"] in LAYOUTS
             and m["sets"] == layout_sets(m["layout"], args.ep_spare_slots)]
    stopped = {r["side"] for r in rows if r["over_cap"] or "error" in r}
    for n in lengths:
        for side in sides:
            done = [r for r in rows if r["side"] == side and not r["over_cap"] and "error" not in r]
            if side in stopped or any(r["side"] == side and r["length"] == n for r in rows):
                continue
            if done and predicted_seconds(done, n) > args.max_step_s:
                print(f"{side}: {n} tokens would take ~{predicted_seconds(done, n):.0f} s > --max-step-s; stopping it")
                stopped.add(side)
                continue
            row = run_one(side, n, args)
            row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            rows.append(row)
            write_json(args.out, summarize(rows, multi, args) | {"partial": True})
            print(f"{side:>9} {n:>7} tokens: {fmt_row(row)}", flush=True)
            if row["over_cap"] or "error" in row:
                stopped.add(side)
    n = args.cp4_length
    mode = args.multi_recompute
    if n and layouts and not any(r["side"] == mode and r["length"] == n and "error" not in r
                                 and not r["over_cap"] for r in rows):
        row = run_one(mode, n, args)  # the single-rank peak the layouts are divided by
        row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        rows = [r for r in rows if not (r["side"] == mode and r["length"] == n)] + [row]
        print(f"{mode:>9} {n:>7} tokens: {fmt_row(row)}", flush=True)
    for layout in layouts if n else ():
        if any(m["layout"] == layout and m["length"] == n for m in multi):
            continue
        m = run_multi(layout, n, args.threads, args.mem_cap_gib / WORLD, args.allocator, args.routes, mode,
                      args.ep_spare_slots)
        m["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        multi.append(m)
        write_json(args.out, summarize(rows, multi, args) | {"partial": True})
        print(f"{layout:>9} {n:>7} tokens: {fmt_multi(m)}", flush=True)
    res = summarize(rows, multi, args)
    print()
    print(table(res, sides, lengths))
    if n and layouts:
        print()
        print(multi_table(res, layouts, WORLD))
    keys = ("longest_ours_tokens", "longest_hf_tokens", "longest_ratio", "bytes_per_token_ours",
            "bytes_per_token_hf", "selective_recompute_tokens_per_s_ratio", "cp4_peak_over_single",
            "cp2tp2_peak_over_single", "dist_optimizer_bytes_ratio", "tokens_per_s_ratio_32k")
    print("\n" + "\n".join(f"{k}: {res[k]}" for k in keys))
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
