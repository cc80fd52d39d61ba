"""RL log-prob pass: PolicyTrainer.compute_logprobs vs transformers' Qwen3-MoE, same weights.

The call an RL framework makes once per rollout batch (old log-probs), on long responses: by
default 2 sequences of 8192 tokens (prompt 1024 + response 7168, random token ids of a fixed
seed), the benchmark model of bench/train_throughput.py (hidden 512, 4 layers, 16 experts top-2,
8 query / 4 KV heads of 64, vocab 16384).

Our side: PolicyTrainer built from train_throughput's Config (fp32 parameters, bf16 autocast where
the CPU has native bf16, else float32; blocks compiled, our tuned malloc), every sequence in one micro-batch (`--micro-batch-tokens`
changes that), `compute_logprobs(batch)`; it scores every token, prompt included.

The HF side, as TRL's GRPO trainer and verl's actor compute log-probs today: Qwen3MoeForCausalLM
with our converted weights cast to our side's compute dtype (`model.to(torch.bfloat16)` where the
CPU has native bf16; no autocast), sdpa
attention, under torch.no_grad(): `model(input_ids [B, L], logits_to_keep=R + 1).logits[:, :-1]`
(TRL's `logits_to_keep`: only the response positions reach the LM head), then
`.float().log_softmax(-1).gather(-1, response ids)`. The sequences have equal lengths, so the
batch has no padding and no attention mask: HF's best case.

Each side runs in its own subprocess per round; rounds alternate which side goes first.
tokens/s is B * L over the median call time. Peak memory: the process's peak RSS (VmHWM) during
the timed calls minus its RSS after the model is built (both sides call malloc_trim there, so the
baseline is live memory only); the peak is reset after the warm-up calls, so torch.compile's
tracing is not counted (the warm-up peak is in the JSON as `*_warmup_peak_mem_mb`).

`max_abs_logprob_diff`: both sides in float32 without autocast (ours: train.autocast_dtype=none,
HF: float32 weights), one process, over the response tokens of `--diff-*` sized sequences
(default 2 x (128 + 896) = 1024 tokens each). The bf16 runs' disagreement at full length is
reported too (`bf16_max_abs_logprob_diff`, round 1).

`--breakdown` times the pieces of one call per side: embedding, blocks (of which the attention
kernel, from torch.profiler), LM head + log-prob, other (batch planning, packing, scatter).

    python bench/rl_logprobs.py --out bench/results/rl_logprobs.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/rl_logprobs.py`: bench/ would shadow the cp_attention package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import ctypes  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.bench_io import compute_dtype, write_json  # noqa: E402
from bench.train_throughput import MODEL, model_config  # noqa: E402
from longctx_moe.build import model_of  # noqa: E402
from longctx_moe.host import resident_mb  # noqa: E402

ROOT = _HERE.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2, help="sequences per call")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=7168)
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="our micro-batch token budget (0 = the whole batch in one, as HF's one forward)")
    # Two: compiled blocks are recompiled with dynamic shapes on the second call of a new shape.
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per side (compilation on ours)")
    p.add_argument("--steps", type=int, default=2, help="timed calls per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of both sides (0 = torch's default); 1 is steadier on a shared machine")
    p.add_argument("--diff-prompt-len", type=int, default=128)
    p.add_argument("--diff-response-len", type=int, default=896)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override of our side (HF reads only the architecture)")
    p.add_argument("--breakdown", action="store_true",
                   help="time embedding / blocks (attention kernel) / LM head + log-prob / other per side")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", choices=["ours", "hf", "diff"], help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------- shared by both sides


def make_batch(n: int, prompt: int, response: int, seed: int = 0):
    """(RolloutBatch, ids_BL int64 [B, L]): n sequences of random ids, prompt + response each."""
    from rl_hooks.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ids_BL = torch.randint(0, MODEL["vocab_size"], (n, prompt + response), generator=g)
    batch = RolloutBatch.from_sequences([r[:prompt].tolist() for r in ids_BL],
                                        [r[prompt:].tolist() for r in ids_BL])
    return batch, ids_BL


def ours_config(args, extra=()):
    return model_config([f"train.num_threads={args.threads}", "train.device=cpu",
                         *args.overrides, *extra])


def build_ours(cfg, args, batch):
    """-> call() returning the response log-probs [B, R] float32, and the trainer."""
    from rl_hooks.api import PolicyTrainer

    budget = args.micro_batch_tokens or batch.num_tokens
    policy = PolicyTrainer(cfg, micro_batch_tokens=budget)
    b = batch.num_seqs
    return (lambda: policy.compute_logprobs(batch).logprobs[batch.loss_mask].view(b, -1)), policy


def build_hf(ours_model, dtype):
    """Qwen3MoeForCausalLM (sdpa) with the weights of `ours_model`, cast to `dtype`, eval mode."""
    from transformers import Qwen3MoeForCausalLM

    from longctx_moe.hf.interop import to_hf_config, to_hf_state_dict

    hf_cfg = to_hf_config(ours_model.cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(hf_cfg)
    model.load_state_dict(to_hf_state_dict(ours_model))
    return model.to(dtype).eval()


def hf_logprobs(model, ids_BL: torch.Tensor, response: int) -> torch.Tensor:
    """TRL / verl style: [B, R] float32 log-probs of the last `response` tokens of each row."""
    with torch.no_grad():
        logits_BRV = model(input_ids=ids_BL, logits_to_keep=response + 1).logits[:, :-1]
        return logits_BRV.float().log_softmax(-1).gather(-1, ids_BL[:, -response:, None]).squeeze(-1)


def trim_and_reset_peak() -> float:
    """Return freed heap to the OS, reset the peak-RSS mark (VmHWM), and return RSS in MB."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    reset_peak()
    return resident_mb()


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ---------------------------------------------------------------------- workers


def worker(args) -> dict:
    """One side in this process: warm-up, timed calls, memory, optional breakdown."""
    from longctx_moe.host import configure_cpu

    batch, ids_BL = make_batch(args.batch, args.prompt_len, args.response_len)
    cfg = ours_config(args)
    if args.worker == "ours":
        call, policy = build_ours(cfg, args, batch)
    else:
        configure_cpu(args.threads, "default")  # flush denormals and threads, as ours; plain malloc
        torch.manual_seed(cfg.train.seed)  # the init build_runtime gives our side
        # HF's inference dtype: the weights cast to the dtype our side computes in.
        model = build_hf(model_of(cfg), compute_dtype().dtype)
        call = lambda: hf_logprobs(model, ids_BL, args.response_len)  # noqa: E731
    base = trim_and_reset_peak()
    for _ in range(args.warmup):
        call()
    warm_peak = peak_mb() - base
    reset_peak()
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        logp_BR = call()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    res = {"side": args.worker, "times": times, "cpu_times": cpu, "peak_mem_mb": peak_mb() - base,
           "warmup_peak_mem_mb": warm_peak, "baseline_mb": base,
           "mean_response_logprob": float(logp_BR.mean())}
    if args.dump:
        torch.save(logp_BR, args.dump)
    if args.breakdown:
        res["breakdown"] = (ours_breakdown(policy, batch, call) if args.worker == "ours"
                            else hf_breakdown(model, ids_BL, args.response_len, call))
    return res


def diff_worker(args) -> dict:
    """Float32, no autocast on both sides: max |ours - HF| over the response tokens."""
    batch, ids_BL = make_batch(args.batch, args.diff_prompt_len, args.diff_response_len, seed=1)
    cfg = ours_config(args, ["train.autocast_dtype=none"])
    call, policy = build_ours(cfg, args, batch)
    ours_BR = call()
    hf_BR = hf_logprobs(build_hf(policy.runtime.model, torch.float32), ids_BL, args.diff_response_len)
    return {"max_abs_logprob_diff": float((ours_BR - hf_BR).abs().max()),
            "mean_abs_logprob_diff": float((ours_BR - hf_BR).abs().mean())}


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _attention_kernel_s(call) -> float:
    """Attention kernel time in one profiled call: aten's flash attention ops (self time) and our
    C++ kernels (their named record_function ranges, which hold no other op)."""
    from torch.profiler import profile

    with profile() as prof:
        call()
    events = prof.key_averages()
    aten = sum(e.self_cpu_time_total for e in events if "flash_attention" in e.key)
    ours = sum(e.cpu_time_total for e in events
               if e.key in ("cp_attention::brgemm_attention_forward",
                            "cp_attention::amx_attention_backward"))
    return (aten + ours) / 1e6


def _split(total, embed, hidden, head, attn) -> dict[str, float]:
    return {"embedding": embed, "blocks": hidden - embed, "attention kernel": attn,
            "LM head + log-prob": head, "other": max(total - hidden - head, 0.0), "total": total}


def ours_breakdown(policy, batch, call) -> dict[str, float]:
    """Our pieces over the micro-batches compute_logprobs runs (planned the same way)."""
    from longctx_moe.model.losses import chunked_token_logprobs
    from rl_hooks.microbatch import build_micro_batch, plan_micro_batches

    d, model = policy.cfg.data, policy.runtime.model
    plan = plan_micro_batches(batch.seq_lengths(), 1, policy.budget, policy.pad_multiple,
                              d.cost_per_token, d.cost_per_token_pair)[0]
    parts = [0.0, 0.0, 0.0]  # embedding, embedding + blocks + final norm, LM head + log-prob
    with torch.no_grad(), policy.trainer.autocast():
        for seqs in plan:
            shard = policy.runtime.shard(build_micro_batch(batch, seqs, policy.pad_multiple).packed)
            t_embed = _timed(model.embed, shard.batch.tokens)[0]
            t_hidden, h_TD = _timed(model.hidden_states, shard.batch, shard.layout)
            t_head = _timed(chunked_token_logprobs, h_TD, model.output_weight(), shard.batch.labels,
                            model.ops.loss_chunk_tokens)[0]
            parts = [p + t for p, t in zip(parts, (t_embed, t_hidden, t_head), strict=True)]
    return _split(_timed(call)[0], *parts, _attention_kernel_s(call))


def hf_breakdown(model, ids_BL, response, call) -> dict[str, float]:
    with torch.no_grad():
        embed = _timed(lambda: model.model.embed_tokens(ids_BL))[0]
        hidden, h_BLD = _timed(lambda: model.model(input_ids=ids_BL).last_hidden_state)
        head = _timed(lambda: model.lm_head(h_BLD[:, -response - 1:-1]).float().log_softmax(-1)
                      .gather(-1, ids_BL[:, -response:, None]))[0]
    return _split(_timed(call)[0], embed, hidden, head, _attention_kernel_s(call))


# ---------------------------------------------------------------------- the driver


def run_worker(side: str, args, dump: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--batch", str(args.batch),
           "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--warmup", str(args.warmup),
           "--steps", str(args.steps), "--threads", str(args.threads),
           "--diff-prompt-len", str(args.diff_prompt_len), "--diff-response-len", str(args.diff_response_len)]
    cmd += [f"--set={kv}" for kv in args.overrides] + ["--breakdown"] * args.breakdown
    cmd += ["--dump", dump] if dump else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the {side} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(results: dict[str, list[dict]], args) -> dict:
    tokens = args.batch * (args.prompt_len + args.response_len)
    sides = {}
    for side, runs in results.items():
        per_round = [tokens / statistics.median(r["times"]) for r in runs]
        med = statistics.median(t for r in runs for t in r["times"])
        sides[side] = {"tokens_per_s": tokens / med, "median_call_s": med,
                       "tokens_per_s_per_round": per_round,
                       "spread": (max(per_round) - min(per_round)) / statistics.median(per_round),
                       "median_call_cpu_s": statistics.median(t for r in runs for t in r["cpu_times"]),
                       "peak_mem_mb": max(r["peak_mem_mb"] for r in runs),
                       "warmup_peak_mem_mb": max(r["warmup_peak_mem_mb"] for r in runs),
                       "mean_response_logprob": runs[0]["mean_response_logprob"], "call_times_s": [
                           t for r in runs for t in r["times"]]}
        if all("breakdown" in r for r in runs):
            sides[side]["breakdown"] = {k: statistics.median(r["breakdown"][k] for r in runs)
                                        for k in runs[0]["breakdown"]}
    ours, hf = sides["ours"], sides["hf"]
    return {"ours_tokens_per_s": ours["tokens_per_s"], "hf_tokens_per_s": hf["tokens_per_s"],
            "ratio": ours["tokens_per_s"] / hf["tokens_per_s"],
            "ours_peak_mem_mb": ours["peak_mem_mb"], "hf_peak_mem_mb": hf["peak_mem_mb"],
            "mem_ratio": ours["peak_mem_mb"] / hf["peak_mem_mb"],
            # Sides run back to back inside a round: the steadier comparison on a shared machine.
            "ratio_per_round": [statistics.median(h["times"]) / statistics.median(o["times"])
                                for o, h in zip(results["ours"], results["hf"], strict=True)],
            "ratio_cpu_time": hf["median_call_cpu_s"] / ours["median_call_cpu_s"],
            "ours_warmup_peak_mem_mb": ours["warmup_peak_mem_mb"],
            "hf_warmup_peak_mem_mb": hf["warmup_peak_mem_mb"], "rounds": args.rounds,
            "timed_calls_per_round": args.steps, "warmup_calls": args.warmup,
            "batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
            "tokens_per_call": tokens, "micro_batch_tokens": args.micro_batch_tokens or tokens,
            "model": MODEL, "overrides": args.overrides, "sides": sides}


def machine(threads: int) -> dict:
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpu_model": cpu, "cpu_count": os.cpu_count(),
            "threads": threads or torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def table(res: dict) -> str:
    s = res["sides"]
    o, h = s["ours"], s["hf"]
    rows = [("", "longctx-moe", "HF Qwen3-MoE", "ours / HF"),
            ("tokens/s (median)", f"{o['tokens_per_s']:.0f}", f"{h['tokens_per_s']:.0f}",
             f"{res['ratio']:.2f}x (target >= 2x)"),
            ("median call (s)", f"{o['median_call_s']:.2f}", f"{h['median_call_s']:.2f}", ""),
            ("tokens/s spread over rounds", f"{100 * o['spread']:.0f}%", f"{100 * h['spread']:.0f}%", ""),
            ("median call CPU time (s)", f"{o['median_call_cpu_s']:.2f}", f"{h['median_call_cpu_s']:.2f}",
             f"{res['ratio_cpu_time']:.2f}x"),
            ("peak memory (MB over post-build RSS)", f"{o['peak_mem_mb']:.0f}", f"{h['peak_mem_mb']:.0f}",
             f"{res['mem_ratio']:.2f} (target <= 0.5)"),
            ("warm-up peak (MB, incl. compile)", f"{o['warmup_peak_mem_mb']:.0f}", f"{h['warmup_peak_mem_mb']:.0f}", ""),
            ("mean response log-prob (bf16)", f"{o['mean_response_logprob']:.4f}",
             f"{h['mean_response_logprob']:.4f}", "")]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|---|---:|---:|---:|")
    return "\n".join(lines)


def breakdown_table(res: dict) -> str | None:
    s = res["sides"]
    if "breakdown" not in s["ours"] or "breakdown" not in s["hf"]:
        return None
    o, h = s["ours"]["breakdown"], s["hf"]["breakdown"]
    lines = ["| piece of one call (s) | longctx-moe | HF Qwen3-MoE | ours share | HF share |",
             "|---|---:|---:|---:|---:|"]
    for k in o:
        name = "  of which attention kernel" if k == "attention kernel" else k
        lines.append(f"| {name} | {o[k]:.2f} | {h[k]:.2f} | {100 * o[k] / o['total']:.0f}% | "
                     f"{100 * h[k] / h['total']:.0f}% |")
    return "\n".join(lines)


def run_rounds(args, tmp: str) -> tuple[dict[str, list[dict]], float]:
    """Interleaved rounds (the first side alternates); returns results and round 1's bf16 diff."""
    results: dict[str, list[dict]] = {"ours": [], "hf": []}
    dumps = {"ours": f"{tmp}/ours.pt", "hf": f"{tmp}/hf.pt"}
    for r in range(args.rounds):
        for side in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
            results[side].append(run_worker(side, args, dumps[side] if r == 0 else None))
            print(f"round {r + 1}/{args.rounds} {side}: call times "
                  f"{[round(t, 2) for t in results[side][-1]['times']]} s", flush=True)
    bf16 = float((torch.load(dumps["ours"]) - torch.load(dumps["hf"])).abs().max())
    return results, bf16


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        res = diff_worker(args) if args.worker == "diff" else worker(args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        results, bf16_diff = run_rounds(args, tmp)
    diff = run_worker("diff", args)
    res = summarize(results, args)
    res.update(max_abs_logprob_diff=diff["max_abs_logprob_diff"],
               mean_abs_logprob_diff=diff["mean_abs_logprob_diff"],
               diff_seq=f"{args.batch} x ({args.diff_prompt_len} + {args.diff_response_len}) tokens, float32",
               bf16_max_abs_logprob_diff=bf16_diff, machine=machine(args.threads),
               compute_dtype=compute_dtype().name,
               config=dataclasses.asdict(ours_config(args)))
    print(f"\n{args.batch} sequences x ({args.prompt_len} prompt + {args.response_len} response) tokens "
          f"per call, {res['machine']['threads']} thread(s), {res['machine']['cpu_model']}\n")
    print(table(res))
    print("\nours/HF tokens/s inside each round: " + ", ".join(f"{r:.2f}x" for r in res["ratio_per_round"]))
    print(f"max |log-prob ours - HF| over response tokens: {res['max_abs_logprob_diff']:.2e} in float32 "
          f"({res['diff_seq']}; mean {res['mean_abs_logprob_diff']:.2e}), "
          f"{bf16_diff:.2e} in the bf16 runs above")
    parts = breakdown_table(res)
    if parts:
        res["breakdown_table"] = parts
        print("\n" + parts)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
