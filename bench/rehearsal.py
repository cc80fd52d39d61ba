"""Benchmark: the cluster rehearsal (`longctx-moe rehearse`) of the published MoE models at the
sizes people RL-train them, on this CPU: will each rank fit its GPU, and is the rehearsal true?

Sections (`--sections`, default all):
  runs    the ten rehearsals of configs/rehearsal/ (one rank each by default, `--ranks ends` for
          the first and the last), each a `longctx-moe rehearse` subprocess at 32K tokens per GPU
          of RL-like lengths (lognormal, median 1,500, sigma 1.2, up to the micro-batch): per
          rank the peak device memory split by category, the modeled step time, traffic; per run
          the wall minutes and the largest resident set of its processes.
  truth   the tiny config on 2 and 4 gloo ranks for real against its rehearsal
          (longctx_moe.rehearsal.truth): `mem_ratio_cpu`, real over rehearsed peak bytes, the
          worst of the ranks.
  faults  the planted faults of longctx_moe.rehearsal.faults inside a shrunk Qwen3-30B-A3B step
          on 8 ranks: `planted_faults_caught` of `planted_faults`.

JSON keys: models_rehearsed (runs that completed, of `runs_total`), peak_gib ("model@world" ->
the largest rank's peak GiB), fits_h100, max_rehearsal_minutes (wall), max_rehearsal_cpu_minutes
(what a run costs one core, robust to a shared machine), max_host_rss_gib,
mem_ratio_cpu, planted_faults_caught, planted_faults, and each run's reports under `runs`.

    python bench/rehearsal.py --out runs/bench/rehearsal.json
    python bench/rehearsal.py --sections runs --only qwen3-30b-a3b@8 deepseek-v3@256
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_io import host_info, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
# (model, world, config): the layouts are in each config's header
RUNS = [
    ("qwen3-30b-a3b", 8, "configs/rehearsal/qwen3-30b-a3b.yaml"),
    ("qwen3-30b-a3b", 16, "configs/rehearsal/qwen3-30b-a3b-16.yaml"),
    ("qwen3-235b-a22b", 64, "configs/rehearsal/qwen3-235b-a22b-64.yaml"),
    ("qwen3-235b-a22b", 128, "configs/rehearsal/qwen3-235b-a22b-128.yaml"),
    ("deepseek-v3", 256, "configs/rehearsal/deepseek-v3.yaml"),
    ("deepseek-v3", 1024, "configs/rehearsal/deepseek-v3-1024.yaml"),
    ("gpt-oss-120b", 16, "configs/rehearsal/gpt-oss-120b-16.yaml"),
    ("glm-4.5", 128, "configs/rehearsal/glm-4.5-128.yaml"),
    ("mixtral-8x22b", 32, "configs/rehearsal/mixtral-8x22b-32.yaml"),
]
TOKENS_PER_GPU = 32768
# (layout name, world, config overrides of configs/tiny_cpu.yaml) for the truth section
TRUTH_LAYOUTS = [
    ("ep2xcp2", 2, ["parallel.ep=2", "parallel.cp=2"]),
    ("tp2xdp2", 4, ["parallel.tp=2"]),
    ("ep2xcp2xdp2", 4, ["parallel.ep=2", "parallel.cp=2"]),
]

# Run as a child so that its RUSAGE_CHILDREN holds only this rehearsal's processes (the CLI and
# the rank processes it spawns and waits for): ru_maxrss is then their largest resident set.
# Its CPU seconds are what the run costs a core (a rehearsal is one busy core): the wall minutes of
# a shared machine count the neighbours too.
_MEASURED = ("import resource, subprocess, sys\n"
             "r = subprocess.run(sys.argv[1:])\n"
             "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
             "print(u.ru_utime + u.ru_stime, file=sys.stderr)\n"
             "print(u.ru_maxrss, file=sys.stderr)\n"
             "sys.exit(r.returncode)\n")


def _rehearse(config: str, world: int, ranks: list[int], gpu: str, timeout: float) -> dict:
    """One `longctx-moe rehearse` run: its reports, minutes, largest RSS, status and error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        tokens = _tokens(config)
        cmd = [sys.executable, "-m", "longctx_moe.cli", "rehearse", "--config", config, "--world", str(world),
               "--gpu", gpu, "--tokens", str(tokens), "--lengths", f"lognormal:1500,1.2,{tokens}", "--out", out,
               *[a for r in ranks for a in ("--rank", str(r))]]
        t0 = time.monotonic()
        # a session of its own, so that a timeout stops the rank processes the command spawned too
        proc = subprocess.Popen([sys.executable, "-c", _MEASURED, *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"status": "timeout", "minutes": (time.monotonic() - t0) / 60, "error": f"over {timeout:.0f} s"}
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        minutes = (time.monotonic() - t0) / 60
        lines = done.stderr.strip().splitlines()
        rss_gib = int(lines[-1]) * 1024 / GIB if lines and lines[-1].isdigit() else float("nan")
        cpu_minutes = float(lines[-2]) / 60 if len(lines) > 1 else float("nan")
        result = {"minutes": minutes, "cpu_minutes": cpu_minutes, "host_rss_gib": rss_gib, "stdout": done.stdout}
        if done.returncode in (0, 1) and os.path.exists(out):  # 1: a rank does not fit its GPU
            with open(out) as f:
                result.update(status="ok", reports=json.load(f)["ranks"])
        else:
            result.update(status="failed", error="\n".join(lines[:-2])[-3000:])
        return result


def _tokens(config: str) -> int:
    """The tokens of the config's micro-batch, which its CP group shares: TOKENS_PER_GPU x cp in
    the configs of RUNS."""
    from longctx_moe.config import load_config

    cfg = load_config(os.path.join(ROOT, config), [])
    return cfg.data.micro_batch_tokens


def section_runs(args) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    chosen = [(m, w, c) for m, w, c in RUNS if not args.only or f"{m}@{w}" in args.only]

    def one(run) -> dict:
        model, world, config = run
        ranks = [0, world - 1] if args.ranks == "ends" else [0]
        got = _rehearse(config, world, ranks, args.gpu, args.timeout)
        got.update(name=f"{model}@{world}", model=model, world=world, config=config)
        print(_run_line(got), flush=True)
        return got

    # a rehearsal is one busy core (meta ops cost Python time, not arithmetic): `--jobs` run at once
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(one, chosen))
    if args.update:  # the earlier result's other runs stay; the ones rerun here replace theirs
        with open(args.update) as f:
            earlier = [r for r in json.load(f).get("runs", []) if r["name"] not in {x["name"] for x in runs}]
        order = [f"{m}@{w}" for m, w, _ in RUNS]
        runs = sorted(earlier + runs, key=lambda r: order.index(r["name"]))
    peak = {r["name"]: max(x["peak_bytes"] for x in r["reports"]) / GIB for r in runs if r["status"] == "ok"}
    ok = [r for r in runs if r["status"] == "ok"]
    return {"runs": runs, "models_rehearsed": len(ok), "runs_total": len(runs), "peak_gib": peak,
            "fits_h100": {r["name"]: all(x["fits"] for x in r["reports"]) for r in ok},
            "max_rehearsal_minutes": max((r["minutes"] for r in runs), default=0.0),
            "max_rehearsal_cpu_minutes": max((r.get("cpu_minutes", 0.0) for r in runs), default=0.0),
            "max_host_rss_gib": max((r.get("host_rss_gib", 0.0) for r in runs), default=0.0)}


def _run_line(r: dict) -> str:
    head = (f"{r['name']:<22} {r['status']:<7} {r['minutes']:5.1f} min ({r.get('cpu_minutes', float('nan')):4.1f} "
            f"CPU) {r.get('host_rss_gib', float('nan')):5.2f} GiB RSS")
    if r["status"] != "ok":
        return head + "  " + (r.get("error") or "").splitlines()[-1:][0] if r.get("error") else head
    parts = []
    for rep in r["reports"]:
        s = rep["peak_split"]
        parts.append(f"rank {rep['rank']}: peak {rep['peak_bytes'] / GIB:.1f} GiB (params {s['parameters'] / GIB:.1f}, "
                     f"grads {s['gradients'] / GIB:.1f}, optim {s['optimizer state'] / GIB:.1f}, "
                     f"act {s['activations'] / GIB:.1f}, comm {s['communication buffers'] / GIB:.1f}, "
                     f"rest {s['rest'] / GIB:.1f}) "
                     f"step {rep['step_seconds']['total_s']:.2f} s {'fits' if rep['fits'] else 'DOES NOT FIT'}")
    return head + "\n    " + "\n    ".join(parts)


def section_truth(args) -> dict:
    from longctx_moe.config import load_config
    from longctx_moe.rehearsal.truth import memory_truth

    rows, worst = {}, None
    for name, world, sets in TRUTH_LAYOUTS:
        cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"),
                          [*sets, "data.micro_batch_tokens=1024", "data.global_batch_tokens=8192"])
        truth = memory_truth(cfg, world, [300, 500, 200, 24])
        rows[name] = truth.as_dict()
        ratio = truth.worst_ratio()
        worst = ratio if worst is None or abs(ratio - 1) > abs(worst - 1) else worst
        print(f"truth {name} on {world}: real / rehearsed = {ratio:.3f} (worst rank)", flush=True)
    return {"truth": rows, "mem_ratio_cpu": worst}


def section_faults(args) -> dict:
    from longctx_moe.config import load_config
    from longctx_moe.rehearsal.faults import PLANTS, rehearse_planted
    from longctx_moe.rehearsal.gpus import GPUS

    cfg = load_config(os.path.join(ROOT, "configs/rehearsal/qwen3-30b-a3b.yaml"),
                      ["model.num_layers=2", "data.micro_batch_tokens=4096", "data.global_batch_tokens=32768"])
    lines = {}
    for plant in PLANTS:
        lines[plant] = rehearse_planted(cfg, 8, [0, 3], plant, GPUS[args.gpu], [2500, 1000, 596])
        print(f"planted {plant}: {lines[plant] or 'NOT CAUGHT'}", flush=True)
    return {"planted_faults": len(PLANTS), "planted_faults_caught": sum(v is not None for v in lines.values()),
            "fault_lines": lines}


SECTIONS = {"faults": section_faults, "truth": section_truth, "runs": section_runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--only", nargs="+", metavar="MODEL@WORLD", help="runs to rehearse (default: all ten)")
    p.add_argument("--ranks", choices=("first", "ends"), default="first")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per rehearsal run")
    p.add_argument("--jobs", type=int, default=1, help="rehearsals run at once (each takes one core)")
    p.add_argument("--update", metavar="FILE", help="an earlier --out of the runs section: its runs "
                   "that this call does not rerun are kept (redo some runs of the hour-long section)")
    p.add_argument("--out")
    args = p.parse_args()
    known = {f"{m}@{w}" for m, w, _ in RUNS}
    if args.only and set(args.only) - known:
        p.error(f"--only {sorted(set(args.only) - known)}: not among {sorted(known)}")
    result = {"host": host_info(), "gpu": args.gpu, "tokens_per_gpu": TOKENS_PER_GPU}
    if args.update:
        with open(args.update) as f:  # the other sections' keys stay too
            result.update({k: v for k, v in json.load(f).items() if k not in ("host", "runs")})
    for name in args.sections:
        result.update(SECTIONS[name](args))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
