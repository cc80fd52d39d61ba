"""Measurements on this machine for bench/dynamic_cp.py: the cost model's constants
(--calibrate: GEMM and causal-attention throughput, gloo p2p latency and bandwidth) and the real
trainer's wall-clock with static CP against Dynamic-CP on 4 gloo ranks (--measure). The plans and
tables live in dynamic_cp.py; this file only times things.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from cp_attention.dynamic_cost import DynamicCPCost, fit_attention_efficiency

ROOT = Path(__file__).resolve().parent.parent
CURVE_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _best_seconds(fn, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up (first-call kernel selection and
    allocation): on a machine shared with other jobs the slower calls time their load, not
    this machine."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def attention_curve(dtype, lengths=CURVE_LENGTHS, heads: int = 4, head_dim: int = 128,
                    tokens: int = 8192, repeats: int = 3, fit: bool = True) -> dict:
    """Causal SDPA forward + backward FLOP/s at tile lengths L (batch max(1, tokens // L)
    sequences of L, the FlashAttention benchmarks' fixed-token layout), counted as
    DynamicCPCost.from_model does (3 x 4 x heads x head_dim FLOPs per causal pair, L^2/2 pairs),
    and (fit) the fit of eff(L) = L / (L + n_half) to them (fit_attention_efficiency)."""
    import torch
    import torch.nn.functional as F

    seconds, flops = [], []
    for n in lengths:
        batch = max(1, tokens // n)
        q, k, v = (torch.randn(batch, heads, n, head_dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))

        def step(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        t = _best_seconds(step, repeats)
        seconds.append(t)
        flops.append(3 * 4 * heads * head_dim * n * n / 2 * batch / t)
    out = {"lengths": list(lengths), "seconds": seconds, "flops_per_s": flops, "heads": heads,
           "head_dim": head_dim, "tokens_per_call": tokens}
    if fit:
        out["fit_flops_per_s"], out["fit_half_tokens"] = fit_attention_efficiency(lengths, flops)
    return out


def _p2p_worker(rank: int, world: int, sizes: list[tuple[int, int]]) -> list[list[float]]:
    """Round trips (send, then receive the echo) of each (bytes, rounds); the first two rounds of
    each size set up the connection and are not timed."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes, rounds in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        rtts = []
        for i in range(rounds + 2):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 2:
                rtts.append(time.perf_counter() - t0)
        out.append(rtts)
    return out


def p2p_latency_bandwidth(small: int = 64, big: int = 8 << 20, small_rounds: int = 300,
                          big_rounds: int = 15) -> dict:
    """gloo send/recv between 2 local processes: latency = 10th percentile of the round trips
    of a `small`-byte message / 2 (one ring step's p2p exchange); bandwidth = 2 * big / the 10th
    percentile of its round trips. A low percentile, not the median: on a shared machine the
    slow round trips wait for other jobs' time slices (medians kept in the result)."""
    from tests.launcher import run_distributed

    rtt_small, rtt_big = run_distributed(_p2p_worker, 2, args=([(small, small_rounds),
                                                                (big, big_rounds)],),
                                         timeout=300)[0]
    return {"latency_s": float(np.percentile(rtt_small, 10)) / 2, "small_bytes": small,
            "small_rtt_p10_p50_p90_s": [float(np.percentile(rtt_small, q)) for q in (10, 50, 90)],
            "bytes_per_s": 2 * big / float(np.percentile(rtt_big, 10)), "big_bytes": big,
            "big_rtt_p10_p50_p90_s": [float(np.percentile(rtt_big, q)) for q in (10, 50, 90)]}


def calibrate(model: dict) -> dict:
    """GEMM and attention throughput and gloo p2p latency and bandwidth here, and the
    DynamicCPCost constants of `model` (DynamicCPCost.from_model keywords) they give."""
    import torch

    from bench.bench_io import compute_dtype
    from longctx_moe.metrics import measure_peak_tflops

    # The dtype a run here computes in (train.autocast_dtype=auto: bf16 where the CPU has native
    # bf16, float32 elsewhere); the other dtype's GEMM is measured too, time-bounded, for the table.
    dtype = compute_dtype().dtype
    gemm = {str(d).split(".")[1]: measure_peak_tflops(torch.device("cpu"), d) * 1e12
            for d in (torch.float32, torch.bfloat16)}
    attn_dtype = str(dtype).split(".")[1]
    attn = attention_curve(dtype)
    p2p = p2p_latency_bandwidth()
    cost = DynamicCPCost.from_model(**model, flops_per_s=gemm[attn_dtype],
                                    attention_flops_per_s=attn["fit_flops_per_s"],
                                    bandwidth=p2p["bytes_per_s"], ring_latency=p2p["latency_s"],
                                    attn_half_tokens=attn["fit_half_tokens"])
    return {"gemm_flops_per_s": gemm, "attention_dtype": attn_dtype,
            "attention": attn, "p2p": p2p, "threads": torch.get_num_threads(),
            "constants": dataclasses.asdict(cost)}


def _pack_long_corpus(root: Path, out: Path) -> None:
    """The stdlib corpus packed at 8192 tokens per row (documents up to 8192: a mix that needs
    CP 1 to 4 at 2048 tokens per rank), with the tokenizer of `make data`."""
    import subprocess

    if (out / "metadata.json").is_file():
        return
    tok = root / "data" / "stdlib_tiny" / "tokenizer.json"
    if not tok.is_file():
        raise SystemExit("--measure needs the bundled corpus: run `make data` first")
    subprocess.run([sys.executable, "-m", "data_packing.cli", "--source", "stdlib",
                    "--tokenizer", str(tok), "--seq-len", "8192", "--max-docs", "400", "--seed",
                    "0", "--output", str(out)], check=True, cwd=root, stdout=subprocess.DEVNULL)


def _train_steps(root: Path, data: Path, run_dir: Path, sets: list[str], steps: int) -> list[dict]:
    import subprocess

    argv = [sys.executable, "-m", "longctx_moe.cli", "train", "--config", "configs/tiny_cpu.yaml",
            "--nproc", "4", "--set", f"data.path={data}", "--set", f"train.run_dir={run_dir}",
            "--set", f"train.steps={steps}", "--set", "data.global_batch_tokens=16384",
            "--set", "data.micro_batch_tokens=8192", "--set", "logging.progress_bar=false",
            "--set", "checkpoint.save_final=false", "--set", "checkpoint.every_steps=0",
            "--set", "parallel.cp=4"] + [x for s in sets for x in ("--set", s)]
    subprocess.run(argv, check=True, cwd=root, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def measure_wallclock(rounds: int = 2, steps: int = 8, warmup: int = 2) -> dict:
    """Static CP=4 vs Dynamic-CP (max CP 4, 2048 tokens per rank) training the tiny config on 4
    gloo ranks here, alternating the two per round; median step time over the steps after
    `warmup` of every round, and the spread of the per-round medians."""
    import tempfile

    root = ROOT
    tmp = Path(tempfile.mkdtemp(prefix="dcp_measure_"))
    data = tmp / "stdlib_8k"
    _pack_long_corpus(root, data)
    sides = {"static": [], "dynamic": ["parallel.dynamic_cp=true",
                                       "parallel.max_tokens_per_rank=2048"]}
    per_round: dict[str, list[float]] = {k: [] for k in sides}
    sizes: dict[str, int] = {}
    for r in range(rounds):
        for name, sets in sides.items():
            recs = _train_steps(root, data, tmp / f"{name}{r}", sets, steps)[warmup:]
            per_round[name].append(statistics.median(x["step_time_s"] for x in recs))
            for x in recs:
                for size, n in (x.get("cp_sizes") or {}).items():
                    sizes[size] = sizes.get(size, 0) + n
    med = {k: statistics.median(v) for k, v in per_round.items()}
    return {"static_step_s": med["static"], "dynamic_step_s": med["dynamic"],
            "speedup": med["static"] / med["dynamic"], "rounds": per_round,
            "dynamic_cp_sizes": sizes, "steps_per_round": steps, "warmup_steps": warmup,
            "setting": "tiny_cpu config, 4 gloo ranks on this machine, 16384 tokens per step, "
                       "stdlib packed at 8192 tokens, static cp=4 vs dynamic max_cp=4 with "
                       "2048 tokens per rank"}


def print_calibration(cal: dict) -> None:
    gemm = ", ".join(f"{k} {v / 1e12:.3f}" for k, v in cal["gemm_flops_per_s"].items())
    attn, p2p, c = cal["attention"], cal["p2p"], cal["constants"]
    curve = ", ".join(f"{n}: {f / 1e12:.3f}" for n, f in zip(attn["lengths"], attn["flops_per_s"],
                                                              strict=True))
    print(f"measured ({cal['threads']} threads): GEMM {gemm} TFLOP/s; causal attention fwd+bwd "
          f"({cal['attention_dtype']}) TFLOP/s by tile length {{{curve}}} -> long-tile "
          f"{attn['fit_flops_per_s'] / 1e12:.3f} TFLOP/s, n_half {attn['fit_half_tokens']:.0f} "
          f"tokens; gloo p2p {p2p['bytes_per_s'] / 1e9:.2f} GB/s, {p2p['small_bytes']} B one-way "
          f"latency {p2p['latency_s'] * 1e6:.0f} us -> a = {c['a']:.3g} s/token, b = "
          f"{c['b']:.3g} s/token^2, {c['kv_bytes_per_token'] / 1e3:.0f} KB/token, ring step "
          f"{c['ring_step_seconds'] * 1e3:.2f} ms per run rank")
