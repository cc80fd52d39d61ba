"""Benchmark: the layout planner (`longctx-moe plan`), how fast it answers, how true its memory
and time are, and what it predicts for the published large-scale layouts.

Sections (`--sections`, default all):
  speed   a plan of each model of configs/models/ (`--models`) at each GPU count (`--gpus`),
          cold (an empty memory cache: every probe measured) and warm (the cache the cold plan
          left): seconds, candidates, probes, the best layout.
  memory  for each model at the first of `--rehearse-gpus` where one fits, its top `--rehearse-top` layouts rehearsed in full
          (rehearsal.step.rehearse_rank, rank 0) beside the planner's one-micro-batch figure:
          the largest relative error. Full-size rehearsals take minutes each; `--rehearse-layers`
          shrinks the models (both sides see the same shrink).
  h200    the modeled step of the ~1B bench model (bench/gpu_check.py's MOE_1B, one packed row of
          32,768 tokens, one GPU) against the H200 run's 282 ms (docs/PERFORMANCE.md, the GPU
          check), and the small bench model's step of the same run, which no constant was fit on.
  sanity  Qwen3-235B-A22B at 16K-128K on 256 H100 and DeepSeek-V3 at 4K on 1,024 H100:
          Megatron-Core's published TFLOP/s per GPU beside the planner's prediction for our code
          in the nearest layout we support (their TP and EP; pipeline parallelism, which we do
          not have, folded into DP) and in the one it prefers.

JSON keys: plan_seconds_1024 (the slowest cold plan at 1,024 GPUs), plan_seconds_1024_warm,
mem_vs_rehearsal_max_rel_err, h200_step_rel_err, models_planned (models answered at every GPU
count asked, cold, in under 30 s: a layout, or that none fits), models_with_a_layout (a layout
fits at every count), and each section's rows.

    python bench/planner.py --out runs/bench/planner.json
    python bench/planner.py --sections speed --models qwen3-30b-a3b --gpus 8 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_io import write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
LENGTHS = "lognormal:1500,1.2,32768"  # RL-like: median 1,500 tokens, a tail to 32K
TOKENS_PER_GPU = 16384  # tokens of a step per GPU in the speed and memory sections
ANSWER_S = 30.0  # what a plan may take, cold (the bound)
H200_STEP_S = 0.282  # the ~1B bench model's median step on one H200 (PERFORMANCE.md, the GPU check)
H200_SMALL_TOKENS_PER_S = 214.6e3  # the small bench model on that run
# (model, GPUs, sequence length, published TFLOP/s per GPU, their layout, the nearest of ours)
PUBLISHED = [
    ("qwen3-235b-a22b", 256, 16384, "237-357", "TP2 PP8 EP32", dict(tp=2, ep=32, cp=1)),
    ("qwen3-235b-a22b", 256, 32768, "237-357", "TP2 PP8 EP32", dict(tp=2, ep=32, cp=2)),
    ("qwen3-235b-a22b", 256, 65536, "237-357", "TP2 PP8 EP32", dict(tp=2, ep=32, cp=4)),
    ("qwen3-235b-a22b", 256, 131072, "237-357", "TP2 PP8 EP32", dict(tp=2, ep=32, cp=8)),
    ("deepseek-v3", 1024, 4096, "338", "TP2 PP16 EP64", dict(tp=2, ep=64, cp=1)),
]


def _model_path(name: str) -> str:
    return os.path.join(ROOT, "configs", "models", f"{name}.json")


def _plan(name: str, gpus: int, cache: str, tokens: int | None = None, lengths: str = LENGTHS, top: int = 3):
    from longctx_moe.plan.cli import base_config, plan
    from longctx_moe.plan.probes import default_jobs

    cfg = base_config(_model_path(name))
    start, cpu = time.perf_counter(), _cpu_seconds()
    result = plan(cfg, gpus, "h100", lengths, tokens or TOKENS_PER_GPU * gpus, top=top, cache_dir=cache,
                  jobs=default_jobs())  # as `longctx-moe plan` runs it
    result["cpu_s"] = _cpu_seconds() - cpu  # what the plan costs the cores, robust to a shared machine
    return cfg, result, time.perf_counter() - start


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its ended children (the plan's probe workers, which it
    ends before it returns)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _best(result) -> dict:
    if not result["fit"]:
        return {"best": None}
    p = result["fit"][0]
    return {"best": p.layout.label(), "best_step_s": p.time["total_s"], "best_peak_gib": p.peak / GIB,
            "best_mfu": p.time["mfu"]}


def speed(models: list[str], gpus: list[int]) -> list[dict]:
    rows = []
    for name in models:
        for n in gpus:
            cache = tempfile.mkdtemp(prefix="plan-cache-")  # cold: no measurement of this model yet
            try:
                _, cold, cold_s = _plan(name, n, cache)
                _, warm, warm_s = _plan(name, n, cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            row = {"model": name, "gpus": n, "cold_s": cold_s, "warm_s": warm_s,
                   "cold_cpu_s": cold["cpu_s"], "warm_cpu_s": warm["cpu_s"],
                   "candidates": cold["candidates"], "judged": cold["judged"],
                   "probes": cold["measured"], **_best(warm)}
            print(f"{name:<16} {n:>5} GPUs: cold {cold_s:6.1f} s ({cold['cpu_s']:.0f} CPU s, {cold['measured']} "
                  f"probes), warm {warm_s:5.1f} s ({warm['cpu_s']:.1f} CPU s), {row['best']}", flush=True)
            rows.append(row)
    return rows


def memory(models: list[str], gpu_counts: list[int], top: int, layers: int | None) -> list[dict]:
    """Each model at the first of `gpu_counts` where a layout fits (DeepSeek-V3 fits none under 64)."""
    from longctx_moe.plan.cli import _rehearse_top, base_config, plan

    rows = []
    for name in models:
        cfg = base_config(_model_path(name))
        if layers:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))
        for gpus in gpu_counts:
            tokens = TOKENS_PER_GPU * gpus
            result = plan(cfg, gpus, "h100", LENGTHS, tokens, top=top,
                          cache_dir=os.path.join(ROOT, "runs/plan-cache"))
            if result["fit"]:
                break
        args = argparse.Namespace(lengths=LENGTHS, tokens_per_step=tokens, rehearse_top=top)
        for r in _rehearse_top(cfg, result, args):
            rows.append({"model": name, "gpus": gpus, "layers": cfg.model.num_layers,
                         **{k: v for k, v in r.items() if k != "planner_split"}})
    return rows


def h200() -> dict:
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from gpu_check import FULL, MOE_1B, _doc_lengths

    from longctx_moe.config import load_config
    from longctx_moe.plan.cli import param_counts
    from longctx_moe.plan.layouts import Layout
    from longctx_moe.plan.timing import Workload, step_time
    from longctx_moe.rehearsal.gpus import GPUS

    def modeled(model: dict, lengths: list[int]) -> dict:
        cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()] + ["train.autocast_dtype=bf16"])
        lens = np.array(lengths)
        one = Layout(1, 1, "ring", 1, 1, 1, False, cfg.train.recompute, False, 1)
        return step_time(cfg.model, GPUS["h200"], "h200", one, Workload(lens, int(lens.sum())), param_counts(cfg))

    big = modeled(MOE_1B, _doc_lengths(FULL.step_tokens, seed=6))
    small_model = dict(vocab_size=16384, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
                       num_experts=16, top_k=2, expert_hidden_size=512)  # gpu_check.time_train_step's
    small = modeled(small_model, _doc_lengths(8 * 2048, seed=5))
    measured_small = 8 * 2048 / H200_SMALL_TOKENS_PER_S
    out = {"modeled_s": big["total_s"], "measured_s": H200_STEP_S, "rel_err": big["total_s"] / H200_STEP_S - 1,
           "small_modeled_s": small["total_s"], "small_measured_s": measured_small,
           "small_rel_err": small["total_s"] / measured_small - 1}
    print(f"H200 ~1B step: modeled {big['total_s'] * 1e3:.0f} ms vs {H200_STEP_S * 1e3:.0f} ms measured "
          f"({out['rel_err'] * 100:+.1f}%); small bench model {small['total_s'] * 1e3:.1f} ms vs "
          f"{measured_small * 1e3:.1f} ms ({out['small_rel_err'] * 100:+.0f}%)", flush=True)
    return out


def _tflops(p, world: int) -> float:
    """Model TFLOP/s per GPU of a planned layout (MFU x the H100's dense bf16 peak)."""
    from longctx_moe.rehearsal.gpus import GPUS

    return p.time["mfu"] * GPUS["h100"].bf16_flops / 1e12


def _only_nearest(every, near: dict):
    """`every` (layouts.candidates) narrowed to the layout `near` names: ring CP, no Dynamic-CP, the
    distributed optimizer, any recompute mode."""
    def nearest(*a, **k):
        return [c for c in every(*a, **k) if c.tp == near["tp"] and c.ep == near["ep"] and c.cp == near["cp"]
                and c.etp == 1 and c.cp_backend == "ring" and not c.dynamic_cp and c.distributed_optimizer]
    return nearest


def sanity() -> list[dict]:
    from longctx_moe.plan import layouts
    from longctx_moe.plan.cli import base_config, plan

    rows = []
    cache = os.path.join(ROOT, "runs/plan-cache")
    for name, gpus, seq, published, theirs, near in PUBLISHED:
        cfg = base_config(_model_path(name))
        spec, tokens = f"lognormal:{seq},0,{seq}", max(gpus * seq, 4 * 2**20)
        preferred = plan(cfg, gpus, "h100", spec, tokens, top=1, cache_dir=cache)
        every = layouts.candidates
        layouts.candidates = _only_nearest(every, near)
        try:
            ours = plan(cfg, gpus, "h100", spec, tokens, top=1, cache_dir=cache, memory_bytes=2**50)
        finally:
            layouts.candidates = every
        p_near = ours["fit"][0] if ours["fit"] else None
        p_pref = preferred["fit"][0] if preferred["fit"] else None
        h100 = preferred["gpu"].memory_bytes  # (ours ran with unbounded memory: the nearest at any size)
        row = {"model": name, "gpus": gpus, "seq": seq, "published_tflops": published, "their_layout": theirs,
               "nearest": p_near.layout.label() if p_near else None,
               "nearest_tflops": _tflops(p_near, gpus) if p_near else None,
               "nearest_peak_gib": p_near.peak / GIB if p_near else None,
               "nearest_fits": bool(p_near and p_near.peak <= h100),
               "preferred": p_pref.layout.label() if p_pref else None,
               "preferred_tflops": _tflops(p_pref, gpus) if p_pref else None,
               "preferred_peak_gib": p_pref.peak / GIB if p_pref else None,
               "nearest_time": p_near.time if p_near else None, "preferred_time": p_pref.time if p_pref else None}
        print(f"{name} {seq // 1024}K on {gpus}: published {published} TFLOP/s ({theirs}); nearest "
              f"{row['nearest']} {row['nearest_tflops'] or 0:.0f} TFLOP/s, {row['nearest_peak_gib'] or 0:.0f} GiB"
              f"{'' if row['nearest_fits'] else ' (does not fit)'}; preferred {row['preferred']} "
              f"{row['preferred_tflops'] or 0:.0f} TFLOP/s", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", default=["speed", "memory", "h200", "sanity"],
                   choices=["speed", "memory", "h200", "sanity"])
    every = sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(ROOT, "configs/models/*.json")))
    p.add_argument("--models", nargs="+", default=every)
    p.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 1024])
    p.add_argument("--rehearse-gpus", type=int, nargs="+", default=[16, 64, 256],
                   help="each model's memory check at the first of these where a layout fits")
    p.add_argument("--rehearse-top", type=int, default=3)
    p.add_argument("--rehearse-layers", type=int, default=None, help="shrink the models for the memory section")
    p.add_argument("--out")
    args = p.parse_args()
    out: dict = {"lengths": LENGTHS, "tokens_per_gpu": TOKENS_PER_GPU}
    if "speed" in args.sections:
        rows = out["speed"] = speed(args.models, args.gpus)
        at_1024 = [r for r in rows if r["gpus"] == 1024]
        if at_1024:
            out["plan_seconds_1024"] = max(r["cold_s"] for r in at_1024)
            out["plan_seconds_1024_warm"] = max(r["warm_s"] for r in at_1024)
        out["models_planned"] = sum(all(r["cold_s"] < ANSWER_S for r in rows if r["model"] == m) for m in args.models)
        out["models_with_a_layout"] = sum(all(r["best"] for r in rows if r["model"] == m) for m in args.models)
    if "memory" in args.sections:
        rows = out["memory"] = memory(args.models, args.rehearse_gpus, args.rehearse_top, args.rehearse_layers)
        out["mem_vs_rehearsal_max_rel_err"] = max((abs(r["rel_err"]) for r in rows), default=None)
    if "h200" in args.sections:
        out["h200"] = h200()
        out["h200_step_rel_err"] = out["h200"]["rel_err"]
    if "sanity" in args.sections:
        out["sanity"] = sanity()
    write_json(args.out, out)


if __name__ == "__main__":
    main()
