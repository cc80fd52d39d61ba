"""Soak: `make train`'s model on N local ranks, SIGKILLed again and again, against the same run
uninterrupted.

The interrupted run is relaunched after each kill (a fresh `longctx-moe train --nproc N`, which
resumes from `latest`). Kills come every ~`--kill-every` steps (uniform in 0.5-1.5x), at a point
drawn from:

- step:   a rank SIGKILLs itself as an optimizer step starts (tests/trainer/kill_entry.py's
          KILL_ENV "step": the runs start through that test-only entry);
- save:   a rank SIGKILLs itself while writing its file of a checkpoint ("save");
- prune:  rank 0 SIGKILLs itself while pruning an old step, after the new one is published and
          the old one's meta.json is gone ("prune");
- random: this program SIGKILLs a random rank at a random moment of a step (often inside the
          data loader or a collective).

Per kill: the newest published step when it died, the step the relaunch resumed from, the steps
redone. The goal: every relaunch resumes from the newest published step (0 steps lost beyond it),
and the final weights and optimizer state equal the uninterrupted run's bitwise. Peak RSS per
step (metrics.jsonl's peak_memory_mb, the busiest rank) is summarised by windows of steps.

    python bench/soak.py --steps 2000 --kill-every 150 --nproc 2 --out bench/results/soak.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.bench_io import write_json  # noqa: E402
from longctx_moe.checkpoint.reader import CheckpointReader  # noqa: E402
from longctx_moe.checkpoint.steps import step_dir_name  # noqa: E402
from tests.trainer.kill_entry import KILL_ENV, MODULE, RANK_FLAG  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("step", "save", "prune", "random")
KEEP = 2  # make train's checkpoint.keep_last


def train_cmd(run_dir: Path, args) -> list[str]:
    sets = [f"train.run_dir={run_dir}", f"data.path={args.data}", f"train.steps={args.steps}",
            f"checkpoint.every_steps={args.every}", f"checkpoint.keep_last={KEEP}", "logging.progress_bar=false",
            "logging.peak_tflops=1.0", *args.set]
    return [sys.executable, "-m", MODULE, "train", "--nproc", str(args.nproc),
            "--config", str(ROOT / "configs/tiny_cpu.yaml"), *[a for s in sets for a in ("--set", s)]]


def records(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "step" in r}


def published(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("_")[1]) if latest.exists() else 0


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rank_pids(launcher: int) -> list[int]:
    pids = []
    for pid in descendants(launcher):
        try:
            if RANK_FLAG.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def plan_kill(rng: random.Random, start: int, args) -> tuple[str, int, str | None]:
    """(kind, the step it aims at, the KILL_ENV value or None for a kill from outside)."""
    target = start + max(2, int(args.kill_every * rng.uniform(0.5, 1.5)))
    kind = rng.choice(KINDS)
    if kind in ("save", "prune"):
        target = -(-target // args.every) * args.every  # a step that saves
        if kind == "prune" and target - KEEP * args.every <= 0:
            kind = "save"  # nothing to prune yet
    if target >= args.steps:
        return "none", args.steps, None
    rank = rng.randrange(args.nproc)
    if kind == "save":
        return kind, target, f"save:{target}:{rank}"
    if kind == "prune":  # pruning step target - KEEP * every, done by rank 0 once target is published
        return kind, target, f"prune:{target - KEEP * args.every}:0"
    if kind == "step":
        return kind, target, f"step:{target}:{rank}"
    return kind, target, None


def run_segment(run_dir: Path, args, env_kill: str | None, kind: str, target: int, rng: random.Random) -> dict:
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    if env_kill:
        env[KILL_ENV] = env_kill
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    before = set(records(run_dir))
    proc = subprocess.Popen(train_cmd(run_dir, args), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    seen = {"published_at_kill": None}
    if kind == "random":
        while proc.poll() is None and max(records(run_dir), default=0) < target:
            time.sleep(0.2)
        time.sleep(rng.uniform(0, 1.0))  # about one step of make train's model
        seen["published_at_kill"] = published(run_dir)
        ranks = rank_pids(proc.pid)
        if ranks and proc.poll() is None:
            os.kill(rng.choice(ranks), signal.SIGKILL)
    out, _ = proc.communicate()
    log.write(out)
    log.close()
    resumed = re.search(r"resumed from \S+ at step (\d+)", out)
    return {"rc": proc.returncode, "resumed_from": int(resumed.group(1)) if resumed else 0,
            "last_step_logged": max(records(run_dir), default=0), "new_steps": sorted(set(records(run_dir)) - before),
            **seen}


def rss_windows(peaks: dict[int, float], width: int) -> list[dict]:
    out = []
    for lo in range(1, max(peaks, default=0) + 1, width):
        vals = [peaks[s] for s in range(lo, lo + width) if s in peaks]
        if vals:
            out.append({"steps": [lo, lo + width - 1], "peak_mb_max": round(max(vals), 1),
                        "peak_mb_median": round(sorted(vals)[len(vals) // 2], 1)})
    return out


def bitwise_equal(a: Path, b: Path) -> tuple[bool, int]:
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    if ra.keys() != rb.keys():
        return False, 0
    for key in ra.keys():
        shape = ra.global_shape(key)
        if not torch.equal(*(r.read(key, shape, (0,) * len(shape), shape) for r in (ra, rb))):
            return False, len(ra.keys())
    return True, len(ra.keys())


def soak(args, work: Path) -> dict:
    rng = random.Random(args.seed)
    run_dir = work / "soak"
    kills, peaks, start, t0 = [], {}, 0, time.perf_counter()
    while True:
        kind, target, env_kill = plan_kill(rng, start, args)
        seg = run_segment(run_dir, args, env_kill, kind, target, rng)
        peaks.update({s: r["peak_memory_mb"] for s, r in records(run_dir).items()})
        if kills:  # the previous kill, now that this relaunch says where it resumed
            prev = kills[-1]
            prev["resumed_from"] = seg["resumed_from"]
            prev["steps_redone"] = prev["last_step_logged"] - seg["resumed_from"]
            prev["lost_beyond_published"] = prev["published_at_kill"] - seg["resumed_from"]
        if seg["rc"] == 0:
            break
        if len(kills) > 4 * args.steps // args.kill_every + 8:
            raise RuntimeError(f"the soak run does not finish; see {run_dir.parent / 'soak.log'}")
        kills.append({"kind": kind, "aimed_at_step": target, "hook": env_kill, "rc": seg["rc"],
                      "last_step_logged": seg["last_step_logged"],
                      "published_at_kill": seg["published_at_kill"] or published(run_dir)})
        start = max(seg["last_step_logged"], start)
    return {"kills": kills, "peaks": peaks, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--kill-every", type=int, default=150)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--every", type=int, default=50, help="checkpoint.every_steps (make train's: 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=str(ROOT / "data/stdlib_tiny"), help="a packed corpus (make data)")
    p.add_argument("--work", default=str(ROOT / "runs/soak"), help="where both runs are written (replaced)")
    p.add_argument("--set", action="append", default=[], help="extra config overrides (both runs)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    work = Path(args.work)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    ref = subprocess.run(train_cmd(work / "whole", args), cwd=ROOT, capture_output=True, text=True)
    if ref.returncode != 0:
        raise SystemExit(f"soak: the uninterrupted run failed: {ref.stderr[-2000:]}")
    whole_seconds = time.perf_counter() - t0
    result = soak(args, work)
    final = step_dir_name(args.steps)
    equal, tensors = bitwise_equal(work / "whole" / "checkpoints" / final, work / "soak" / "checkpoints" / final)
    whole_peaks = {s: r["peak_memory_mb"] for s, r in records(work / "whole").items()}
    width = max(1, args.steps // 10)
    out = {"steps": args.steps, "nproc": args.nproc, "kill_every": args.kill_every, "every": args.every, "seed": args.seed,
           "kills": result["kills"], "final_bitwise_equal": equal, "tensors_compared": tensors,
           "max_lost_beyond_published": max((k.get("lost_beyond_published", 0) for k in result["kills"]), default=0),
           "steps_redone": [k.get("steps_redone") for k in result["kills"]],
           "seconds_whole": round(whole_seconds, 1), "seconds_soak": round(result["seconds"], 1),
           "rss_whole": rss_windows(whole_peaks, width), "rss_soak": rss_windows(result["peaks"], width)}
    print(f"{'kind':>6} {'aimed':>6} {'died at':>7} {'published':>9} {'resumed':>7} {'redone':>6} {'lost':>5}")
    for k in result["kills"]:
        print(f"{k['kind']:>6} {k['aimed_at_step']:>6} {k['last_step_logged']:>7} {k['published_at_kill']:>9} "
              f"{k.get('resumed_from', '-'):>7} {k.get('steps_redone', '-'):>6} {k.get('lost_beyond_published', '-'):>5}")
    print(f"final weights and optimizer state bitwise equal to the uninterrupted run: {equal} ({tensors} tensors)")
    print("peak RSS MB (max per window), whole vs soak:",
          [(w["steps"][0], w["peak_mb_max"]) for w in out["rss_whole"]], [(w["steps"][0], w["peak_mb_max"])
                                                                         for w in out["rss_soak"]])
    write_json(args.out, out)
    return 0 if equal and out["max_lost_beyond_published"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
