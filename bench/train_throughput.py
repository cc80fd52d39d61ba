"""Training-step throughput: longctx-moe vs Hugging Face transformers' Qwen3-MoE, same tokens.

One full training step = forward + backward + gradient clipping + AdamW (torch, fused where
available) over `--rows` packed rows of `--seq-len` tokens of real documents (the Python standard
library, tokenized with a 16384-token BPE). Both sides: fp32 master weights, one compute dtype
(`--dtype`, default auto: bf16 autocast where the CPU has native bf16, float32 elsewhere),
the identical architecture (hidden 512, 4 layers, 16 experts top-2 of hidden 512, 8 query / 4 KV
heads of 64, vocab 16384) and the identical initial weights (ours converted with longctx_moe.hf.interop).

Our side runs as `longctx-moe train` would with `train.compile=true`: blocks compiled
(longctx_moe.compile), glibc malloc tuned to reuse freed memory (longctx_moe.host; HF gets it too
with `--hf-allocator tuned`). Both sides flush denormals.

HF gets the same packed row with position_ids restarting at every document: transformers builds a
block-diagonal causal mask from them for its sdpa attention (masking_utils.find_packed_sequence_
indices), so no document attends to another on either side. Labels are shifted to HF's convention
so both sides predict the same targets; the step-0 losses are printed as a check.

The machine is shared and noisy, so the sides are interleaved: each round runs ours and then HF
in fresh subprocesses (`--warmup` untimed steps, then `--steps` timed ones); tokens/s is real
tokens per step over the median step time of all rounds. Peak memory is the same measure on both
sides: the process's peak RSS (ru_maxrss) minus its RSS just before the model is built. MFU is
our model's FLOP count (longctx_moe.model.flops, attention over real document lengths) over the
median step time, against the peak of a matmul in the compute dtype measured in this run.

`--breakdown` profiles one more step per side and splits its time into the attention kernel (aten's
CPU flash op, which HF's sdpa also reaches, plus our AMX backward), GEMMs, the optimizer, casts
and the rest: where a lead comes from.

    python bench/train_throughput.py --out bench/results/train_throughput.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_io import DTYPE_CHOICES, compute_dtype, write_json  # noqa: E402
from longctx_moe.build import model_of  # noqa: E402
from longctx_moe.host import resident_mb  # noqa: E402

MODEL = dict(vocab_size=16384, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
             num_experts=16, top_k=2, expert_hidden_size=512, router_score="softmax", qk_norm=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT / "data" / "stdlib_bench16k"),
                   help="packed corpus (vocab 16384, seq-len 2048); built with longctx-pack if missing")
    p.add_argument("--rows", type=int, default=2, help="packed rows (micro-batches) per optimizer step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=4,
                   help="untimed steps per side: compilation, and oneDNN kernels for new GEMM shapes")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads of both sides (0 = torch's default); 1 is steadier on a shared machine")
    p.add_argument("--hf-allocator", choices=["default", "tuned"], default="default",
                   help="HF side's malloc: default (plain transformers + torch) or tuned (ours, longctx_moe.host)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override (repeatable; HF reads only the architecture), e.g. execution.expert_precision=autocast")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="compute dtype of both sides: auto = bf16 autocast where the CPU has native bf16, "
                        "float32 elsewhere (as train.autocast_dtype=auto)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--markdown", help="also write the table as Markdown here")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of our step")
    p.add_argument("--breakdown", action="store_true",
                   help="profile one more step per side and split its time into kernel categories "
                        "(attention kernel, GEMM, optimizer, casts and copies, other)")
    p.add_argument("--worker", choices=["ours", "hf"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------- shared by both sides


def ensure_corpus(path: str, seq_len: int) -> None:
    if (Path(path) / "metadata.json").is_file():
        return
    from data_packing.cli import main as pack_main

    print(f"building the benchmark corpus at {path} (once)", flush=True)
    pack_main(["--source", "stdlib", "--train-tokenizer", str(MODEL["vocab_size"]), "--seq-len", str(seq_len),
               "--max-docs", "1200", "--seed", "0", "--no-progress", "--output", path])


def step_batches(path: str, rows: int, steps: int) -> list[list]:
    """`steps` optimizer steps of `rows` packed rows each (the same on both sides)."""
    from data_packing.loader import PackedDataset, build_micro_batch

    ds = PackedDataset(path)
    order = sorted(range(len(ds)), key=lambda i: -int(ds.row(i)[1].sum()))  # fullest rows first
    need = rows * steps
    if len(order) < need:
        raise SystemExit(f"{path} has {len(order)} rows, fewer than --rows x steps = {need}; pack more documents")
    out = []
    for s in range(steps):
        picked = order[s * rows:(s + 1) * rows]
        out.append([build_micro_batch(ds, list(range(int(ds.row_doc_start[i]), int(ds.row_doc_start[i + 1]))), 1)
                    for i in picked])
    return out


def model_config(overrides=(), dtype: str = "auto"):
    from longctx_moe.config import load_config

    sets = [f"model.{k}={v}" for k, v in MODEL.items()]
    sets += ["optim.warmup_steps=0", "optim.lr=1e-4", "optim.grad_clip=1.0",
             f"train.autocast_dtype={compute_dtype(dtype).setting}", "train.compile=true"]
    return load_config(None, sets + list(overrides))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------- the two sides


def ours_runner(cfg, model):
    from longctx_moe.parallel.parallelize import parallelize
    from longctx_moe.trainer import Trainer

    runtime = parallelize(model, None, cfg.parallel)  # as `longctx-moe train` does (build_runtime)
    if cfg.train.compile:
        from longctx_moe.compile import apply_compile

        apply_compile(model)
    trainer = Trainer(cfg, runtime)
    return lambda batches: trainer.train_step(batches).ce_loss


def hf_runner(cfg, ours_model, compute):
    from transformers import Qwen3MoeForCausalLM

    from longctx_moe.hf.interop import to_hf_config, to_hf_state_dict

    hf_cfg = to_hf_config(cfg.model)
    hf_cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(hf_cfg)
    model.load_state_dict(to_hf_state_dict(ours_model))
    del ours_model
    model.train()
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay, fused=True)

    def step(batches):
        g = sum(mb.num_target_tokens() for mb in batches)
        total = 0.0
        for mb in batches:
            # HF shifts labels inside the loss: its label at t+1 is our label at t.
            labels = torch.cat([torch.tensor([-100]), mb.labels[:-1]])[None]
            with compute.context("cpu"):
                out = model(input_ids=mb.tokens[None], position_ids=mb.position_ids[None], labels=labels)
            n = mb.num_target_tokens()
            loss = out.loss * (n / g)  # HF's loss is a token mean over the micro-batch
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def worker(args) -> None:
    """One side in this process: print a JSON line with step times, losses and memory."""
    from longctx_moe.host import configure_cpu

    # Both sides flush denormals (they make AdamW crawl on x86). The malloc tuning is part of our
    # trainer (longctx_moe.host, applied by `longctx-moe train`); HF gets it with --hf-allocator tuned.
    configure_cpu(args.threads, "tuned" if args.worker == "ours" else args.hf_allocator)

    cfg = model_config(args.overrides, args.dtype)
    steps = step_batches(args.data, args.rows, args.warmup + args.steps)
    base = resident_mb()
    torch.manual_seed(0)
    model = model_of(cfg)
    run = ours_runner(cfg, model) if args.worker == "ours" else hf_runner(cfg, model, compute_dtype(args.dtype))
    times, cpu_times, losses = [], [], []
    for i, batches in enumerate(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(run(batches))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    if args.profile and args.worker == "ours":
        profile_step(run, steps[-1])
    breakdown = step_breakdown(run, steps[-1]) if args.breakdown else None
    tokens = [sum(int(mb.cu_seqlens[-1]) for mb in b) for b in steps[args.warmup:]]
    print("RESULT " + json.dumps({"side": args.worker, "times": times, "cpu_times": cpu_times, "tokens": tokens,
                                  "losses": losses, "breakdown": breakdown,
                                  "peak_mem_mb": peak_rss_mb() - base}), flush=True)


def profile_step(run, batches) -> None:
    from torch.profiler import profile

    with profile(record_shapes=False) as prof:
        run(batches)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)


# Kernel categories of --breakdown. "attention kernel" is aten's CPU flash op (HF's sdpa reaches it
# too) plus our AMX backward (cp_attention.kernels.amx_backward); GEMMs run near the machine's
# measured peak on both sides; the rest is what a trainer's own code decides.
CATEGORIES = ("attention kernel", "GEMM", "optimizer", "casts and copies", "other")
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"}


def _category(op: str) -> str:
    if "flash_attention" in op or "scaled_dot_product" in op or "attention_backward" in op:
        return "attention kernel"
    if op in _GEMM_OPS:
        return "GEMM"
    if "adam" in op.lower():
        return "optimizer"
    if op in ("aten::copy_", "aten::_to_copy", "aten::to"):
        return "casts and copies"
    return "other"


def step_breakdown(run, batches) -> dict[str, float]:
    """Self time (s) per category of one profiled step, plus its total."""
    from torch.profiler import profile

    with profile(record_shapes=False) as prof:
        run(batches)
    out = dict.fromkeys(CATEGORIES, 0.0)
    for e in prof.key_averages():
        out[_category(e.key)] += e.self_cpu_time_total / 1e6
    out["total"] = sum(out.values())
    return out


def breakdown_table(results: dict[str, list[dict]]) -> str | None:
    """Medians over rounds of each category, and each side's share of its own step."""
    if not all(r.get("breakdown") for runs in results.values() for r in runs):
        return None
    med = {side: {c: statistics.median(r["breakdown"][c] for r in runs) for c in (*CATEGORIES, "total")}
           for side, runs in results.items()}
    lines = ["| category (profiled step, s) | longctx-moe | HF Qwen3-MoE | ours share | HF share |",
             "|---|---:|---:|---:|---:|"]
    for c in (*CATEGORIES, "total"):
        o, h = med["ours"][c], med["hf"][c]
        lines.append(f"| {c} | {o:.3f} | {h:.3f} | {100 * o / med['ours']['total']:.0f}% | "
                     f"{100 * h / med['hf']['total']:.0f}% |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the driver


def run_side(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--data", args.data, "--rows", str(args.rows),
           "--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--threads", str(args.threads), "--hf-allocator", args.hf_allocator, "--dtype", args.dtype] + [f"--set={kv}" for kv in args.overrides]
    cmd += ["--profile"] * args.profile + ["--breakdown"] * args.breakdown
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if args.profile and side == "ours":
        print(proc.stderr[-12000:], file=sys.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the {side} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(results: dict[str, list[dict]], peak_tflops: float, flops_per_step: float, args) -> dict:
    out = {}
    for side, runs in results.items():
        times = [t for r in runs for t in r["times"]]
        tokens = runs[0]["tokens"]
        med = statistics.median(times)
        tokens_per_step = statistics.mean(tokens)
        out[side] = {"median_step_s": med, "tokens_per_s": tokens_per_step / med,
                     "mfu": flops_per_step / med / (peak_tflops * 1e12),
                     "peak_mem_mb": max(r["peak_mem_mb"] for r in runs),
                     "step0_loss": runs[0]["losses"][0], "step_times_s": times,
                     # CPU seconds of the process per step: with --threads 1 this is close to the
                     # wall time of a quiet machine, and far steadier than wall time on a busy one.
                     "median_step_cpu_s": statistics.median(t for r in runs for t in r["cpu_times"])}
    ours, hf = out["ours"], out["hf"]
    return {"ours_tokens_per_s": ours["tokens_per_s"], "hf_tokens_per_s": hf["tokens_per_s"],
            "ratio": ours["tokens_per_s"] / hf["tokens_per_s"], "ours_mfu": ours["mfu"], "hf_mfu": hf["mfu"],
            "ours_peak_mem_mb": ours["peak_mem_mb"], "hf_peak_mem_mb": hf["peak_mem_mb"],
            "ratio_cpu_time": hf["median_step_cpu_s"] / ours["median_step_cpu_s"],
            # Load on a shared machine shifts between rounds: the ratio inside each round (sides
            # run back to back) is the steadier comparison.
            "ratio_per_round": [statistics.median(h["times"]) / statistics.median(o["times"])
                                for o, h in zip(results["ours"], results["hf"], strict=True)],
            "compute_dtype": compute_dtype(args.dtype).name, "peak_tflops": peak_tflops, "tokens_per_step": statistics.mean(results["ours"][0]["tokens"]),
            "rows_per_step": args.rows, "seq_len": args.seq_len, "rounds": args.rounds,
            "timed_steps_per_round": args.steps, "threads": torch.get_num_threads(),
            "hf_allocator": args.hf_allocator,
            "torch": torch.__version__, "transformers": _hf_version(), "model": MODEL, "sides": out}


def _hf_version() -> str:
    import transformers

    return transformers.__version__


def table(res: dict) -> str:
    s = res["sides"]
    rows = [("", "longctx-moe", "HF Qwen3-MoE", "ours / HF"),
            ("tokens/s (median)", f"{s['ours']['tokens_per_s']:.0f}", f"{s['hf']['tokens_per_s']:.0f}", f"{res['ratio']:.2f}x"),
            ("median step (s)", f"{s['ours']['median_step_s']:.3f}", f"{s['hf']['median_step_s']:.3f}",
             f"{s['ours']['median_step_s'] / s['hf']['median_step_s']:.2f}"),
            ("median step CPU time (s)", f"{s['ours']['median_step_cpu_s']:.3f}", f"{s['hf']['median_step_cpu_s']:.3f}",
             f"{res['ratio_cpu_time']:.2f}x"),
            (f"MFU (vs measured {res['compute_dtype']} peak)", f"{100 * s['ours']['mfu']:.1f}%", f"{100 * s['hf']['mfu']:.1f}%", ""),
            ("peak memory (MB, RSS delta)", f"{s['ours']['peak_mem_mb']:.0f}", f"{s['hf']['peak_mem_mb']:.0f}",
             f"{s['ours']['peak_mem_mb'] / s['hf']['peak_mem_mb']:.2f}"),
            ("step-0 cross-entropy", f"{s['ours']['step0_loss']:.4f}", f"{s['hf']['step0_loss']:.4f}", "")]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|---|---:|---:|---:|")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from longctx_moe.metrics import measure_peak_tflops
    from longctx_moe.model.flops import model_flops

    if args.threads:
        torch.set_num_threads(args.threads)  # the peak is measured with the same threads
    ensure_corpus(args.data, args.seq_len)
    steps = step_batches(args.data, args.rows, args.warmup + args.steps)[args.warmup:]
    lengths = [[n for mb in b for n in mb.doc_lengths()] for b in steps]
    cfg = model_config(args.overrides, args.dtype)
    compute = compute_dtype(args.dtype)
    print(compute.describe().replace("train.autocast_dtype", "--dtype"), flush=True)
    flops_per_step = statistics.mean(model_flops(cfg.model, ls) for ls in lengths)
    peaks = []
    results: dict[str, list[dict]] = {"ours": [], "hf": []}
    for r in range(args.rounds):
        peaks.append(measure_peak_tflops(torch.device("cpu"), compute.dtype))
        for side in ("ours", "hf"):  # interleaved: both sides see the same machine load
            results[side].append(run_side(side, args))
            print(f"round {r + 1}/{args.rounds} {side}: step times {[round(t, 2) for t in results[side][-1]['times']]}",
                  flush=True)
    res = summarize(results, statistics.median(peaks), flops_per_step, args)
    res["peak_tflops_samples"] = peaks
    print(f"\n{args.rows} packed rows x {args.seq_len} tokens per step ({res['tokens_per_step']:.0f} real tokens), "
          f"{res['compute_dtype']} compute, fused AdamW; measured {res['compute_dtype']} peak "
          f"{res['peak_tflops']:.2f} TFLOP/s\n")
    print(table(res))
    print("\nours/HF tokens/s inside each round: " + ", ".join(f"{r:.2f}x" for r in res["ratio_per_round"]))
    parts = breakdown_table(results)
    if parts:
        res["breakdown_table"] = parts
        print("\n" + parts)
    write_json(args.out, res)
    if args.markdown:
        Path(args.markdown).write_text(table(res) + "\n" + (f"\n{parts}\n" if parts else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
