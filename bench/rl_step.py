"""RL policy-update step: PolicyTrainer vs TRL's GRPOTrainer, same weights, rollouts and optimizer.

One GRPO optimizer step = old log-probs + PPO-clip loss + backward + grad clip + AdamW, over fixed
rollouts: `--prompts` prompts (32-128 tokens) x `--group` completions (64-512 tokens), random ids
and rewards in [0, 1) of a fixed seed, on the benchmark model of bench/train_throughput.py at half
width (hidden 256, 4 layers, 16 experts top-2 of hidden 256, 4 query / 2 KV heads of 64, vocab
8192: Qwen3-MoE-expressible, the same weights on both sides through longctx_moe.hf.interop).

Our side: PolicyTrainer (fp32 master weights, bf16 autocast where the CPU has native bf16, else
float32; blocks compiled, tuned malloc),
`compute_logprobs` then `train_step(batch, make_loss(PolicyLossConfig("ppo", agg="token-mean")),
mini_batches=1)`, advantages from rewards by the "grpo" estimator.

TRL's side: GRPOTrainer with its defaults on CPU (bf16=True -> fp32 weights under bf16 autocast;
bf16=False where the CPU has no native bf16, as our side's dtype;
gradient checkpointing on, per_device_train_batch_size 8, its fused log-prob LM head with
entropies), loss_type "dapo" (its default: token sum over the generation batch's completion tokens
= our "token-mean"), scale_rewards "group" (= our "grpo"), beta 0, num_iterations 1, epsilon 0.2,
gradient_accumulation_steps = rollouts / 8, so the batch is one optimizer step as ours. TRL has
no API for scoring given completions without generating (a `rollout_func` still runs its
reward and bookkeeping per step), so `_generate_and_score_completions`, the method that returns
the padded training batch, is overridden to return the fixed rollouts in TRL's layout (prompts
left-padded, completions right-padded) with old log-probs from TRL's own
`_get_per_token_logps_and_entropies` (no grad, batch 8), as TRL computes them whenever it needs
them (num_iterations > 1, steps_per_generation > GA, vLLM). `trainer.train(max_steps=...)` runs
the steps: TRL's loop, clipping, optimizer and scheduler. `--trl-no-grad-ckpt` turns checkpointing
off.

Same optimizer on both: AdamW lr 1e-6 (TRL's default), betas (0.9, 0.999), eps 1e-8, weight
decay 0, grad clip 1.0; our router aux and z losses off (TRL adds none: output_router_logits off).

Each side runs in its own subprocess per round, rounds alternate which side goes first; tokens/s
is real tokens (prompt + completion) per step over the median step time. Peak memory: peak RSS
(VmHWM) during the timed steps minus RSS after build and malloc_trim, reset after the warm-up.

`loss_diff_fp32`: a third process builds both with float32 and no autocast and takes one step on
each: |policy loss ours - TRL| (with TRL fed our advantages; its own differ by its std eps 1e-4
vs our 1e-6, reported separately) and the relative pre-clip gradient-norm difference. On the first
step the ratio is exactly 1 on both sides, so the loss is -(token mean of the advantages): it checks
masking, advantages and normalisation; the gradient norm checks the model and the log-probs.

    python bench/rl_step.py --out bench/results/rl_step.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/rl_step.py`: bench/ would shadow the cp_attention package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from bench.bench_io import compute_dtype, write_json  # noqa: E402
from bench.rl_logprobs import machine, peak_mb, reset_peak, trim_and_reset_peak  # noqa: E402
from bench.train_throughput import MODEL, model_config  # noqa: E402

ROOT = _HERE.parent
TRL_MICRO_BATCH = 8  # TRL's default per_device_train_batch_size
EPS = 0.2  # PPO clip range, both sides (TRL's default epsilon)
# The benchmark model of train_throughput at half width (and half the vocabulary), so that TRL's
# step over 32 rollouts takes seconds, not minutes, on a 2-core CPU.
SMALL = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "expert_hidden_size": 256, "vocab_size": 8192}
VOCAB = SMALL["vocab_size"]
OPTIM = {"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--completion-len", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="our micro-batch token budget")
    # Two on ours: compiled blocks are recompiled with dynamic shapes on a new shape's second call.
    p.add_argument("--warmup", type=int, default=2, help="our untimed steps (compilation)")
    p.add_argument("--trl-warmup", type=int, default=1, help="TRL's untimed steps")
    p.add_argument("--steps", type=int, default=2, help="timed steps per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads of both sides (0 = torch's default)")
    p.add_argument("--trl-no-grad-ckpt", action="store_true", help="TRL without its default gradient checkpointing")
    p.add_argument("--check-prompts", type=int, default=2, help="prompts of the float32 loss check")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--worker", choices=["ours", "trl", "check"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------- shared by both sides


@dataclasses.dataclass
class Rollouts:
    prompts: list[list[int]]  # one per completion (a prompt repeated `group` times, consecutively)
    completions: list[list[int]]
    rewards: list[float]
    group: int

    @property
    def tokens(self) -> int:
        return sum(len(p) + len(c) for p, c in zip(self.prompts, self.completions, strict=True))


def make_rollouts(args, seed: int = 0) -> Rollouts:
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    ids = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    prompts, completions = [], []
    for _ in range(args.prompts):
        prompt = ids(rand(*args.prompt_len))
        for _ in range(args.group):
            prompts.append(prompt)
            completions.append(ids(rand(*args.completion_len)))
    rewards = torch.rand(len(prompts), generator=g).tolist()
    return Rollouts(prompts, completions, rewards, args.group)


def ours_config(args, extra=()):
    o = OPTIM
    return model_config([*(f"model.{k}={v}" for k, v in SMALL.items()), "train.device=cpu", f"train.num_threads={args.threads}", "balance.aux_loss_coeff=0",
                         "balance.z_loss_coeff=0", f"optim.lr={o['lr']}", f"optim.betas=[{o['betas'][0]}, {o['betas'][1]}]",
                         f"optim.eps={o['eps']}", f"optim.weight_decay={o['weight_decay']}",
                         f"optim.grad_clip={o['grad_clip']}", *extra])


# ---------------------------------------------------------------------- our side


def build_ours(cfg, args, ro: Rollouts):
    """-> (step() returning (old log-prob s, update s, metrics), the policy)."""
    from rl_hooks.api import PolicyTrainer
    from rl_hooks.batch import RolloutBatch
    from rl_hooks.losses import PolicyLossConfig, make_loss

    policy = PolicyTrainer(cfg, micro_batch_tokens=args.micro_batch_tokens, advantage_estimator="grpo")
    batch = RolloutBatch.from_sequences(ro.prompts, ro.completions, rewards=ro.rewards,
                                        group_ids=[i // ro.group for i in range(len(ro.prompts))])
    loss = make_loss(PolicyLossConfig(kind="ppo", agg="token-mean", eps_low=EPS, eps_high=EPS))

    def step():
        t0 = time.perf_counter()
        old = policy.compute_logprobs(batch).logprobs
        t1 = time.perf_counter()
        m = policy.train_step(dataclasses.replace(batch, old_logprobs=old), loss, mini_batches=1)
        return t1 - t0, time.perf_counter() - t1, m

    return step, policy


# ---------------------------------------------------------------------- TRL's side


def trl_tokenizer():
    """A word-level tokenizer over the model's vocabulary: GRPOTrainer needs one (pad id 0)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", eos_token="t1")


def trl_batch(ro: Rollouts, advantages: torch.Tensor) -> dict:
    """The dict `_generate_and_score_completions` returns: prompts left-padded, completions
    right-padded (pad id 0), advantages [B], num_items_in_batch = completion tokens."""
    from trl.trainer.utils import pad

    prompt_ids = pad([torch.tensor(p) for p in ro.prompts], padding_value=0, padding_side="left")
    prompt_mask = pad([torch.ones(len(p), dtype=torch.long) for p in ro.prompts], padding_value=0,
                      padding_side="left")
    completion_ids = pad([torch.tensor(c) for c in ro.completions], padding_value=0, padding_side="right")
    completion_mask = pad([torch.ones(len(c), dtype=torch.long) for c in ro.completions], padding_value=0,
                          padding_side="right")
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": completion_mask.sum()}


def trl_advantages(ro: Rollouts) -> torch.Tensor:
    """TRL's scale_rewards="group": (r - group mean) / (group std + 1e-4), std unbiased (nanstd)."""
    from trl.trainer.utils import nanstd

    r = torch.tensor(ro.rewards).view(-1, ro.group)
    mean = r.mean(1, keepdim=True)
    return ((r - mean) / (nanstd(r, dim=1).unsqueeze(1) + 1e-4)).flatten()


def build_trl(args, ro: Rollouts, model, bf16: bool, advantages: torch.Tensor, max_steps: int, out_dir: str):
    """A GRPOTrainer whose generation step returns the fixed rollouts; `times` collects per step
    the old-log-prob seconds, `losses` each micro-batch's loss, `logs` TRL's logged metrics."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    n = len(ro.prompts)
    record = {"old_s": [], "losses": [], "logs": [], "step_end": []}

    class FixedRolloutsGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = trl_batch(ro, advantages)
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
            with torch.no_grad():
                out["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, out["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size)[0]
            record["old_s"].append(time.perf_counter() - t0)
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            record["losses"].append(float(loss.detach()))
            return loss

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            record["step_end"].append(time.perf_counter())

        def on_step_end(self, *a, **k):
            record["step_end"].append(time.perf_counter())
            if len(record["step_end"]) == args.trl_warmup + 1:  # warm-up done: measure the timed steps only
                reset_peak()

        def on_log(self, _args, _state, _control, logs=None, **k):
            record["logs"].append(dict(logs or {}))

    cfg = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=TRL_MICRO_BATCH,
        gradient_accumulation_steps=n // TRL_MICRO_BATCH, num_generations=ro.group,
        max_completion_length=args.completion_len[1], loss_type="dapo", scale_rewards="group", beta=0.0,
        num_iterations=1, epsilon=EPS, learning_rate=OPTIM["lr"], adam_beta1=OPTIM["betas"][0],
        adam_beta2=OPTIM["betas"][1], adam_epsilon=OPTIM["eps"], weight_decay=OPTIM["weight_decay"],
        max_grad_norm=OPTIM["grad_clip"], bf16=bf16, use_cpu=True, max_steps=max_steps, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        gradient_checkpointing=not args.trl_no_grad_ckpt)
    data = Dataset.from_dict({"prompt": [f"t{i}" for i in range(n // ro.group)]})
    trainer = FixedRolloutsGRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                                       args=cfg, train_dataset=data, processing_class=trl_tokenizer(),
                                       callbacks=[Clock()])
    return trainer, record


def hf_model(ours_model):
    """Qwen3MoeForCausalLM (sdpa, fp32) with the weights of `ours_model`."""
    from transformers import Qwen3MoeForCausalLM

    from longctx_moe.hf.interop import to_hf_config, to_hf_state_dict

    hf_cfg = to_hf_config(ours_model.cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(hf_cfg)
    model.load_state_dict(to_hf_state_dict(ours_model))
    return model


# ---------------------------------------------------------------------- workers


def ours_worker(args, ro: Rollouts) -> dict:
    step, _ = build_ours(ours_config(args), args, ro)
    base = trim_and_reset_peak()
    for _ in range(args.warmup):
        step()
    reset_peak()
    old_s, upd_s = [], []
    for _ in range(args.steps):
        a, b, m = step()
        old_s.append(a)
        upd_s.append(b)
    return {"times": [a + b for a, b in zip(old_s, upd_s, strict=True)], "old_logprob_s": old_s,
            "update_s": upd_s, "peak_mem_mb": peak_mb() - base, "last_loss": m["policy_loss"]}


def trl_worker(args, ro: Rollouts) -> dict:
    from longctx_moe.build import model_of
    from longctx_moe.host import configure_cpu

    configure_cpu(args.threads, "default")  # flush denormals and threads, as ours; plain malloc
    cfg = ours_config(args)
    torch.manual_seed(cfg.train.seed)  # the init build_runtime gives our side
    model = hf_model(model_of(cfg))
    with tempfile.TemporaryDirectory() as tmp:
        # TRL's bf16=True where the CPU has native bf16 (its CPU default), as our side's auto.
        bf16 = compute_dtype().autocast == torch.bfloat16
        trainer, rec = build_trl(args, ro, model, bf16, trl_advantages(ro), args.trl_warmup + args.steps, tmp)
        base = trim_and_reset_peak()
        trainer.train()
    ends = rec["step_end"]
    times = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)][args.trl_warmup:]
    old = rec["old_s"][args.trl_warmup:]
    return {"times": times, "old_logprob_s": old, "update_s": [t - o for t, o in zip(times, old, strict=True)],
            "peak_mem_mb": peak_mb() - base, "last_loss": sum(rec["losses"][-len(ro.prompts) // TRL_MICRO_BATCH:])}


def check_worker(args, ro: Rollouts) -> dict:
    """Float32, no autocast on both sides: one step each from the same weights."""
    from rl_hooks.advantages import compute_advantages

    step, policy = build_ours(ours_config(args, ["train.autocast_dtype=none", "train.compile=false"]), args, ro)
    start = hf_model(policy.runtime.model).state_dict()  # before our step changes the weights
    m = step()[2]
    groups = torch.arange(len(ro.prompts)) // ro.group
    ours_adv = compute_advantages(torch.tensor(ro.rewards), groups, "grpo")
    res = {"ours_loss": m["policy_loss"], "ours_grad_norm": m["grad_norm"]}
    with tempfile.TemporaryDirectory() as tmp:
        for name, adv in (("trl", ours_adv), ("trl_own_adv", trl_advantages(ro))):
            model = hf_model(policy.runtime.model)
            model.load_state_dict(start)
            trainer, rec = build_trl(args, ro, model, False, adv, 1, tmp)
            trainer.train()
            res[f"{name}_loss"] = sum(rec["losses"])
            res[f"{name}_grad_norm"] = next(float(x["grad_norm"]) for x in rec["logs"] if "grad_norm" in x)
    res["loss_diff_fp32"] = abs(res["ours_loss"] - res["trl_loss"])
    res["grad_norm_rel_diff_fp32"] = abs(res["ours_grad_norm"] - res["trl_grad_norm"]) / res["trl_grad_norm"]
    res["loss_diff_trl_own_advantages"] = abs(res["ours_loss"] - res["trl_own_adv_loss"])
    return res


# ---------------------------------------------------------------------- the driver


def run_worker(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--prompts", str(args.prompts), "--group", str(args.group),
           "--prompt-len", *map(str, args.prompt_len), "--completion-len", *map(str, args.completion_len),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--warmup", str(args.warmup),
           "--trl-warmup", str(args.trl_warmup), "--steps", str(args.steps), "--threads", str(args.threads),
           "--check-prompts", str(args.check_prompts)] + ["--trl-no-grad-ckpt"] * args.trl_no_grad_ckpt
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the {side} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarize(results: dict[str, list[dict]], tokens: int, args) -> dict:
    sides = {}
    for side, runs in results.items():
        med = statistics.median(t for r in runs for t in r["times"])
        per_round = [tokens / statistics.median(r["times"]) for r in runs]
        sides[side] = {"tokens_per_s": tokens / med, "median_step_s": med,
                       "median_old_logprob_s": statistics.median(t for r in runs for t in r["old_logprob_s"]),
                       "median_update_s": statistics.median(t for r in runs for t in r["update_s"]),
                       "tokens_per_s_per_round": per_round,
                       "spread": (max(per_round) - min(per_round)) / statistics.median(per_round),
                       "peak_mem_mb": max(r["peak_mem_mb"] for r in runs),
                       "step_times_s": [t for r in runs for t in r["times"]]}
    o, t = sides["ours"], sides["trl"]
    return {"ours_tokens_per_s": o["tokens_per_s"], "trl_tokens_per_s": t["tokens_per_s"],
            "ratio": o["tokens_per_s"] / t["tokens_per_s"],
            # Sides run back to back inside a round: the steadier comparison on a shared machine.
            "ratio_per_round": [statistics.median(b["times"]) / statistics.median(a["times"])
                                for a, b in zip(results["ours"], results["trl"], strict=True)],
            # TRL skips the old-log-prob pass when num_iterations == 1 and generation is aligned
            # with the optimizer step (it reuses the current log-probs, detached): its update alone.
            "ratio_vs_trl_update_only": t["median_update_s"] / o["median_step_s"],
            "ours_peak_mem_mb": o["peak_mem_mb"], "trl_peak_mem_mb": t["peak_mem_mb"],
            "rounds": args.rounds, "timed_steps_per_round": args.steps, "tokens_per_step": tokens,
            "sides": sides}


def table(res: dict) -> str:
    o, t = res["sides"]["ours"], res["sides"]["trl"]
    rows = [("", "longctx-moe PolicyTrainer", "TRL GRPOTrainer", "ours / TRL"),
            ("tokens/s (median step)", f"{o['tokens_per_s']:.0f}", f"{t['tokens_per_s']:.0f}",
             f"{res['ratio']:.2f}x (target >= 3x)"),
            ("median step (s)", f"{o['median_step_s']:.2f}", f"{t['median_step_s']:.2f}", ""),
            ("  old log-probs (s)", f"{o['median_old_logprob_s']:.2f}", f"{t['median_old_logprob_s']:.2f}", ""),
            ("  loss + backward + optimizer (s)", f"{o['median_update_s']:.2f}", f"{t['median_update_s']:.2f}",
             f"{t['median_update_s'] / o['median_update_s']:.2f}x"),
            ("tokens/s spread over rounds", f"{100 * o['spread']:.0f}%", f"{100 * t['spread']:.0f}%", ""),
            ("peak memory (MB over post-build RSS)", f"{o['peak_mem_mb']:.0f}", f"{t['peak_mem_mb']:.0f}",
             f"{o['peak_mem_mb'] / t['peak_mem_mb']:.2f}")]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|---|---:|---:|---:|")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_warmup < 1 or args.steps < 1 or (args.prompts * args.group) % TRL_MICRO_BATCH:
        raise SystemExit(f"--trl-warmup and --steps must be >= 1 and --prompts x --group a multiple of "
                         f"{TRL_MICRO_BATCH} (TRL's micro-batch)")
    warnings.filterwarnings("ignore")
    if args.worker:
        if args.worker == "check":
            args.prompts = args.check_prompts
        ro = make_rollouts(args)
        res = {"ours": ours_worker, "trl": trl_worker, "check": check_worker}[args.worker](args, ro)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    tokens = make_rollouts(args).tokens
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for r in range(args.rounds):
        for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
            results[side].append(run_worker(side, args))
            print(f"round {r + 1}/{args.rounds} {side}: step times "
                  f"{[round(t, 2) for t in results[side][-1]['times']]} s", flush=True)
    check = run_worker("check", args)
    res = summarize(results, tokens, args)
    res.update(loss_diff_fp32=check["loss_diff_fp32"], check=check, compute_dtype=compute_dtype().name, machine=machine(args.threads),
               load_avg=os.getloadavg(), args=vars(args), model={**MODEL, **SMALL},
               config=dataclasses.asdict(ours_config(args)),
               trl_settings={"loss_type": "dapo", "scale_rewards": "group", "beta": 0.0, "num_iterations": 1,
                             "epsilon": EPS, "per_device_train_batch_size": TRL_MICRO_BATCH,
                             "gradient_accumulation_steps": args.prompts * args.group // TRL_MICRO_BATCH,
                             "bf16": compute_dtype().autocast == torch.bfloat16, "gradient_checkpointing": not args.trl_no_grad_ckpt}, optim=OPTIM)
    print(f"\n{args.prompts} prompts x {args.group} completions, {tokens} tokens per step, "
          f"{res['machine']['threads']} thread(s), {res['machine']['cpu_model']}\n")
    print(table(res))
    print("\nours/TRL tokens/s inside each round: " + ", ".join(f"{r:.2f}x" for r in res["ratio_per_round"]))
    print(f"vs TRL's update alone (no old-log-prob pass): {res['ratio_vs_trl_update_only']:.2f}x")
    print(f"float32 step 1 ({args.check_prompts} x {args.group} rollouts): policy loss ours "
          f"{check['ours_loss']:.9f}, TRL {check['trl_loss']:.9f}, |diff| {check['loss_diff_fp32']:.2e}; "
          f"grad norm rel diff {check['grad_norm_rel_diff_fp32']:.2e}; with TRL's own advantages "
          f"(std eps 1e-4) |diff| {check['loss_diff_trl_own_advantages']:.2e}")
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
