"""Benchmark: `longctx-pack` at corpus scale: peak memory and throughput from 10M to 1B tokens.

Measured in one run, each packer in its own subprocess (peak RSS from `os.wait4`, the kernel's
high-water mark of that process; summed over its worker processes when --workers > 1):
- pre-tokenized JSONL (`--ids-key`) of 10M, 100M and 1B tokens with a heavy-tailed length mix
  (lognormal body, median ~150 tokens, documents up to 4M tokens): peak RSS and tokens/s, with
  --workers 1 (one process, so wait4's peak is exact), of the default run (shard count picked
  by --memory-budget) and of a run with --num-shards chosen by hand (one shard per ~50M tokens);
  plus the 1B input with default --workers (all cores; peak PSS summed over the processes);
- text JSONL tokenized end to end with --workers 2 against --workers 1 (`workers_speedup`).

Inputs are generated with numpy and cached under --cache-dir (a few GB for 1B tokens).

    python bench/packing_scale.py --out bench/results/packing_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 32000
SIZES = {"10m": 10_000_000, "100m": 100_000_000, "1b": 1_000_000_000}
TOKENS_PER_HAND_SHARD = 50_000_000
WORDS = ("the of and to in is that for it with as was on be by this are from at or an def return "
         "self import class while yield lambda data model token packing shard memory budget rope "
         "λ 数据 é über naïve").split()


def doc_lengths(total: int, seed: int) -> np.ndarray:
    """Heavy-tailed document lengths summing to exactly `total`: lognormal (median ~150 tokens,
    mean ~800) capped at 4M, the last one trimmed."""
    rng = np.random.default_rng(seed)
    out, have = [], 0
    while have < total:
        n = np.clip(rng.lognormal(5.0, 1.8, 1 << 16).astype(np.int64), 1, 4_000_000)
        out.append(n)
        have += int(n.sum())
    lens = np.concatenate(out)
    cum = np.cumsum(lens)
    k = int(np.searchsorted(cum, total))
    lens = lens[:k + 1].copy()
    lens[-1] -= int(cum[k]) - total
    return lens[lens > 0]


def write_ids_jsonl(path: str, total: int, seed: int = 0) -> None:
    """{"ids": [...]} per line; ids uniform in [0, VOCAB)."""
    if os.path.exists(path):
        return
    table = np.array([str(i) for i in range(VOCAB)], dtype=object)
    rng = np.random.default_rng(seed + 1)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for n in doc_lengths(total, seed).tolist():
            f.write('{"ids": [' + ",".join(table[rng.integers(0, VOCAB, n)]) + "]}\n")
    os.replace(tmp, path)


def write_text_jsonl(path: str, total_words: int, seed: int = 0) -> None:
    if os.path.exists(path):
        return
    words = np.array(WORDS, dtype=object)
    rng = np.random.default_rng(seed + 2)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for n in doc_lengths(total_words, seed + 3).tolist():
            f.write(json.dumps({"text": " ".join(words[rng.integers(0, len(words), n)])},
                               ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def text_tokenizer(cache: str, text_path: str) -> str:
    """A byte-level BPE trained on the first documents of the text input (once)."""
    path = os.path.join(cache, "text_tokenizer.json")
    if not os.path.exists(path):
        sys.path.insert(0, REPO)
        from data_packing.tokenizer import train_bpe

        with open(text_path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line, _ in zip(f, range(2000), strict=False)]
        train_bpe(texts, 4096).save(path)
    return path


def _tree_pss(pid: int) -> int:
    """Proportional set size of a process and its descendants (forked workers share pages with
    their parent; PSS counts a shared page once in total), 0 once it is gone."""
    try:
        import psutil

        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
        return sum(q.memory_full_info().pss for q in procs if q.is_running())
    except Exception:  # noqa: BLE001 - the tree changes while we look; psutil may be absent
        return 0


def run_packer(args: list[str]) -> dict:
    """Run longctx-pack in a subprocess; its wall time, exact peak RSS of the main process
    (wait4), the sampled peak PSS of its whole process tree (covers worker processes) and the
    machine's load average before and after (the machine is shared)."""
    cmd = [sys.executable, "-m", "data_packing", "--no-progress"] + args
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak_tree, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak_tree[0] = max(peak_tree[0], _tree_pss(proc.pid))
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    th.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return {"seconds": wall, "rss_mb": usage.ru_maxrss / 1024,  # ru_maxrss is in KiB on Linux
            "cpu_seconds": usage.ru_utime + usage.ru_stime,  # interpreter start and workers included
            "tree_pss_mb": peak_tree[0] / 2**20, "stdout": out.decode(),
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def pack_once(inp: str, out: str, extra: list[str]) -> dict:
    subprocess.run(["rm", "-rf", out], check=True)
    res = run_packer(["--source", inp, "--output", out] + extra)
    meta = json.load(open(os.path.join(out, "metadata.json")))
    timing = json.load(open(os.path.join(out, "run_stats.json")))["timing"]
    run_s = timing["seconds_total"]
    tokens = meta["stats"]["tokens_in"]
    # tokens_per_s: over the run itself (inputs opened to metadata.json written); wall_tokens_per_s
    # also counts the interpreter's start and imports (~1 s, a constant that flatters large inputs)
    # tokens_per_cpu_s: tokens per second of the run's CPU time (user + system, its worker
    # processes included, interpreter start excluded): what the run costs, whatever else the
    # shared machine was doing meanwhile
    res.update(tokens=tokens, tokens_per_s=tokens / run_s, wall_tokens_per_s=tokens / res["seconds"],
               tokens_per_cpu_s=tokens / timing["cpu_seconds_total"], shards=len(meta["shards"]))
    res.pop("stdout")
    subprocess.run(["rm", "-rf", out], check=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default="/tmp/longctx_pack_scale")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--text-words", type=int, default=8_000_000, help="words of the text input")
    p.add_argument("--rounds", type=int, default=1, help="repeat each measurement (median, spread)")
    p.add_argument("--generate-only", action="store_true")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    os.makedirs(a.cache_dir, exist_ok=True)
    inputs = {s: os.path.join(a.cache_dir, f"ids_{s}.jsonl") for s in a.sizes}
    text = os.path.join(a.cache_dir, "text.jsonl")
    for s in a.sizes:
        write_ids_jsonl(inputs[s], SIZES[s])
    write_text_jsonl(text, a.text_words)
    tok = text_tokenizer(a.cache_dir, text)
    if a.generate_only:
        return 0
    return measure(a, inputs, text, tok)


def _summary(runs: list[dict]) -> dict:
    """Median of each number over rounds, with its min and max."""
    out = {}
    for k in ("seconds", "rss_mb", "tree_pss_mb", "tokens_per_s", "wall_tokens_per_s",
              "tokens_per_cpu_s", "cpu_seconds", "load_before", "load_after"):
        vals = sorted(r[k] for r in runs if k in r)
        if vals:
            out[k] = float(np.median(vals))
            out[f"{k}_min"], out[f"{k}_max"] = vals[0], vals[-1]
    out["tokens"], out["shards"], out["rounds"] = runs[0].get("tokens"), runs[0].get("shards"), len(runs)
    return out


def configs(a, inputs: dict, text: str, tok: str) -> list[tuple[str, str, list[str]]]:
    """(name, input, arguments) of every measured run."""
    ids = ["--ids-key", "ids", "--vocab-size", str(VOCAB), "--seq-len", str(a.seq_len)]
    out = []
    for s in a.sizes:
        hand = max(1, SIZES[s] // TOKENS_PER_HAND_SHARD)
        out.append((f"{s}_default", inputs[s], ids + ["--workers", "1"]))
        out.append((f"{s}_hand_shards", inputs[s], ids + ["--workers", "1", "--num-shards", str(hand)]))
    if "1b" in a.sizes:  # the same 1B input with every core (--workers defaults to all)
        out.append(("1b_default_all_workers", inputs["1b"], ids))
    text_args = ["--tokenizer", tok, "--seq-len", str(a.seq_len)]
    out += [(f"text_workers_{n}", text, text_args + ["--workers", str(n)]) for n in (1, 2)]
    return out


def measure(a, inputs: dict, text: str, tok: str) -> int:
    """Every config once per round, rounds interleaved, so a busy spell of the shared machine
    hits all configs alike; medians and spreads over rounds."""
    out_dir = os.path.join(a.cache_dir, "out")
    runs: dict[str, list[dict]] = {}
    for rnd in range(a.rounds):
        for name, inp, args in configs(a, inputs, text, tok):
            r = pack_once(inp, out_dir, args)
            runs.setdefault(name, []).append(r)
            print(f"round {rnd} {name:<24} shards {r['shards']:>3}  peak RSS {r['rss_mb']:6.0f} MB  "
                  f"tree PSS {r['tree_pss_mb']:6.0f} MB  {r['tokens_per_s'] / 1e6:6.2f} M tokens/s  "
                  f"{r['tokens_per_cpu_s'] / 1e6:6.2f} M tokens/CPU-s  ({r['seconds']:.1f} s, load "
                  f"{r['load_before']:.1f})", flush=True)
    d = {name: _summary(rs) for name, rs in runs.items()}
    result = {"machine": machine(), "seq_len": a.seq_len, "runs": d}
    for s in a.sizes:
        result[f"rss_mb_{s}"] = round(d[f"{s}_default"]["rss_mb"], 1)
        result[f"tokens_per_s_{s}"] = round(d[f"{s}_default"]["tokens_per_s"], 1)
    speedups = sorted(w2["tokens_per_s"] / w1["tokens_per_s"]
                      for w1, w2 in zip(runs["text_workers_1"], runs["text_workers_2"], strict=True))
    result["workers_speedup"] = round(float(np.median(speedups)), 3)  # paired per round
    result["workers_speedup_min"], result["workers_speedup_max"] = speedups[0], speedups[-1]
    result["workers_cpu_overhead"] = round(d["text_workers_2"]["cpu_seconds"]
                                           / d["text_workers_1"]["cpu_seconds"], 3)
    if "1b" in a.sizes and "10m" in a.sizes:
        result["rss_ratio_1b_over_10m"] = round(result["rss_mb_1b"] / result["rss_mb_10m"], 3)
        result["tokens_per_s_ratio_1b_over_10m"] = round(
            result["tokens_per_s_1b"] / result["tokens_per_s_10m"], 3)
        result["tokens_per_cpu_s_ratio_1b_over_10m"] = round(
            d["1b_default"]["tokens_per_cpu_s"] / d["10m_default"]["tokens_per_cpu_s"], 3)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def machine() -> str:
    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores {model}, {mem:.0f} GiB"


if __name__ == "__main__":
    sys.exit(main())
