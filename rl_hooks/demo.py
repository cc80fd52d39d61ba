"""The end-to-end GRPO demo: a tiny MoE learns to reverse digit strings on a CPU, sampling with a
real rollout engine (HFSampler) that gets the policy's weights through push_weights every step.

    longctx-moe rl --config configs/grpo_tiny.yaml [--set rl.grpo.steps=50 ...]
    python examples/grpo_digits.py             # the same

The task: the prompt is BOS, 2-6 digits, "="; the answer is the digits reversed, then EOS
(variable length); the reward is 1 for an exact match (EOS included), else 0. The tokenizer is
character level: PAD, BOS, EOS, "=", the ten digits.

1. Warm-start: maximum likelihood of the answers through the same `PolicyTrainer.train_step`,
   with a user loss (`nll_loss`, -mean log p of answer tokens; loss_mask covers the answer only),
   until the sampled reward first reaches `rl.warmstart.target_reward` (low: RL does the rest).
   This is the supervised path with the least code: the policy's own packing and optimizer, no
   second data pipeline.
2. A frozen copy of the warm-started policy is the reference of the KL metric (and penalty).
3. GRPO steps: G samples per prompt from the sampler (with its log-probs and routes), exact-match
   rewards, group-normalised advantages (the trainer's "grpo" estimator from rewards + group
   ids), PPO clip-higher with truncated IS on exp(old - rollout), router replay (R3) of the
   sampler's routes, then the new weights pushed to the sampler.

Everything lands in `train.run_dir`: metrics.jsonl (one line per warm-start evaluation and per
GRPO step), the PNG of reward, KL, clip fraction and log-prob gap, summary.json and the resolved
config. Per GRPO step, on the step's response tokens: `reward_mean` of its samples (before the
update); `kl`, k3 of the sampling policy against the reference; `logprob_gap_mean` / `_max`,
|trainer - sampler| log-prob on the same weights (float32 both: ~1e-7, so TIS weights are ~1 and
correct sampling, not precision); `route_agreement`, the share of (token, MoE layer) pairs where
the sampler's experts are the trainer's; `clip_frac` and `replay_route_agreement` from
train_step (means over its mini-batches); timings of sampling, scoring + update, and the push.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from longctx_moe.config import (
    Config,
    ConfigError,
    _build,
    _parse_override,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_yaml,
)
from rl_hooks.batch import RolloutBatch
from rl_hooks.losses import (
    LossInputs,
    LossOutput,
    Normalizers,
    PolicyLossConfig,
    kl_estimate,
    make_loss,
)

# ---------------------------------------------------------------------------------- config


# Router replay in the update: the sampler's routes (R3), the trainer's own recorded on the same
# weights, or none (live routing).
REPLAY = ("sampler", "recorded", "none")


@dataclass
class TaskConfig:
    min_digits: int = 2
    max_digits: int = 6


@dataclass
class WarmStartConfig:
    lr: float = 1e-3
    batch_size: int = 64  # (prompt, answer) pairs per optimizer step
    max_steps: int = 400
    eval_every: int = 10  # optimizer steps between reward evaluations
    target_reward: float = 0.1  # stop at the first evaluation with a mean reward >= this


@dataclass
class GRPOConfig:
    steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8  # samples per prompt (G)
    lr: float = 1e-3
    temperature: float = 1.0
    mini_batches: int = 4  # optimizer steps per GRPO step (the later ones are off-policy: clipping)
    epochs: int = 1
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float = 2.0
    kl_coef: float = 0.0  # the KL to the reference is always measured; > 0 also penalises it
    replay: str = "sampler"  # see REPLAY
    max_new_tokens: int = 8


@dataclass
class DemoConfig:
    """The `rl:` section of the demo's YAML (the other sections are the trainer's Config)."""

    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval_prompts: int = 256  # prompts sampled to measure the reward after warm-start and at the end
    seed: int = 0
    plot_file: str = "grpo_digits.png"  # in train.run_dir; "" = no plot

    def validate(self) -> None:
        """Raise ConfigError (one line naming the key) for the first invalid value."""
        t, w, g = self.task, self.warmstart, self.grpo
        positive = {"warmstart.lr": w.lr, "warmstart.batch_size": w.batch_size,
                    "warmstart.eval_every": w.eval_every, "grpo.lr": g.lr,
                    "grpo.prompts_per_step": g.prompts_per_step, "grpo.epochs": g.epochs,
                    "grpo.temperature": g.temperature, "eval_prompts": self.eval_prompts}
        checks = [(v > 0, f"rl.{k}={v} must be > 0") for k, v in positive.items()]
        checks += [
            (w.max_steps >= 0 and g.steps >= 0,
             "rl.warmstart.max_steps and rl.grpo.steps must be >= 0"),
            (1 <= t.min_digits <= t.max_digits,
             "rl.task.min_digits must be in [1, rl.task.max_digits]"),
            (g.group_size >= 2,
             "rl.grpo.group_size must be >= 2 (advantages compare a prompt's samples)"),
            (g.replay in REPLAY, f"rl.grpo.replay={g.replay!r}: choose one of {', '.join(REPLAY)}"),
            (1 <= g.mini_batches <= g.prompts_per_step * g.group_size,
             "rl.grpo.mini_batches must be in [1, rl.grpo.prompts_per_step * rl.grpo.group_size]"),
            (g.max_new_tokens > t.max_digits,
             "rl.grpo.max_new_tokens must be > rl.task.max_digits (room for the answer and EOS)")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def load_demo_config(path: str | Path,
                     overrides: list[str] | None = None) -> tuple[Config, DemoConfig]:
    """The trainer's Config (every section but `rl:`) and the DemoConfig, with dotted overrides
    (`rl.grpo.steps=5` goes to the demo's, anything else to the trainer's)."""
    data = load_yaml(path)
    rl_data = data.pop("rl", None) or {}
    overrides = list(overrides or [])
    apply_overrides(data, [o for o in overrides if not o.startswith("rl.")])
    for item in (o.removeprefix("rl.") for o in overrides if o.startswith("rl.")):
        key, value = _parse_override(item)
        node = rl_data
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[key.split(".")[-1]] = value
    cfg = config_from_dict(data)
    rl = _build(DemoConfig, rl_data, "rl.")
    rl.validate()
    if cfg.model.vocab_size < len(VOCAB):
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is below the task's "
                          f"{len(VOCAB)} tokens; raise it")
    return cfg, rl


# ---------------------------------------------------------------------------------- the task

VOCAB = ["<pad>", "<bos>", "<eos>", "=", *"0123456789"]
PAD, BOS, EOS, SEP = 0, 1, 2, 3


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def decode(tokens: list[int]) -> str:
    return "".join(VOCAB[t] if len(VOCAB[t]) == 1 else "" for t in tokens if t < len(VOCAB))


class DigitReversal:
    """Prompts BOS d1..dn "=" and answers dn..d1 EOS, n uniform in [min_digits, max_digits]."""

    def __init__(self, cfg: TaskConfig, seed: int):
        self.cfg, self.gen = cfg, torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> tuple[list[list[int]], list[list[int]]]:
        prompts, answers = [], []
        for _ in range(n):
            k = int(torch.randint(self.cfg.min_digits, self.cfg.max_digits + 1, (),
                                  generator=self.gen))
            digits = "".join(str(int(d)) for d in torch.randint(0, 10, (k,), generator=self.gen))
            prompts.append([BOS, *encode(digits), SEP])
            answers.append([*encode(digits[::-1]), EOS])
        return prompts, answers

    @staticmethod
    def reward(response: list[int], answer: list[int]) -> float:
        return float(response == answer)


def _rewards(rollouts, answers: list[list[int]]) -> list[float]:
    return [DigitReversal.reward(r.tokens, a) for r, a in zip(rollouts, answers, strict=True)]


def nll_loss(inp: LossInputs, norm: Normalizers) -> LossOutput:
    """The warm-start's loss: -log p of each answer token, token mean over the mini-batch."""
    nll = -inp.logprobs.sum()
    return LossOutput(nll / max(norm.num_tokens, 1), {"nll": nll.detach().double()})


# ---------------------------------------------------------------------------------- the run


class GRPODemo:
    """The demo's state: the policy, its frozen reference (after warm-start), the sampler."""

    def __init__(self, cfg: Config, rl: DemoConfig):
        from rl_hooks.api import PolicyTrainer
        from rl_hooks.sampler import HFSampler

        self.cfg, self.rl = cfg, rl
        self.run_dir = Path(cfg.train.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if rl.plot_file:
            _require_matplotlib()
        self.policy = PolicyTrainer(cfg)
        self.reference = None
        self.sampler = HFSampler(cfg.model, eos_id=EOS, pad_id=PAD)
        self.task = DigitReversal(rl.task, rl.seed)
        torch.manual_seed(rl.seed)  # the sampler's draws (PolicyTrainer re-seeds for its init)
        g = rl.grpo
        self.loss = make_loss(PolicyLossConfig(kind="ppo", eps_low=g.eps_low, eps_high=g.eps_high,
                                               tis_cap=g.tis_cap, kl_coef=g.kl_coef, kl_type="k3"))
        self.records: list[dict] = []
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.metrics_path.unlink(missing_ok=True)  # a fresh run, not appended to an old one
        self.push()
        data = {**config_to_dict(cfg), "rl": dataclasses.asdict(rl)}
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    def push(self) -> dict[str, float]:
        """The policy's weights to the sampler, float32 (the sampler's dtype: exact copies)."""
        return self.policy.push_weights(self.sampler.load_bucket, dtype=torch.float32)

    def log(self, record: dict) -> None:
        self.records.append(record)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def evaluate(self, n: int) -> float:
        """Mean exact-match reward of n fresh prompts, one sample each at the GRPO temperature."""
        prompts, answers = self.task.sample(n)
        rollouts = self.sampler.generate(prompts, self.rl.grpo.max_new_tokens,
                                         temperature=self.rl.grpo.temperature)
        return sum(_rewards(rollouts, answers)) / n

    def warm_start(self) -> float:
        """Supervised steps until the sampled reward reaches the target; returns that reward."""
        w, t0 = self.rl.warmstart, time.perf_counter()
        reward = self.evaluate(self.rl.eval_prompts)
        for step in range(1, w.max_steps + 1):
            if reward >= w.target_reward:
                break
            prompts, answers = self.task.sample(w.batch_size)
            zeros = [[0.0] * len(a) for a in answers]
            # nll_loss reads neither: zeros spare train_step an advantage and old-log-prob pass.
            batch = RolloutBatch.from_sequences(prompts, answers, advantages=zeros,
                                                old_logprobs=zeros)
            m = self.policy.train_step(batch, nll_loss, lr=w.lr)
            if step % w.eval_every == 0 or step == w.max_steps:
                self.push()
                reward = self.evaluate(self.rl.eval_prompts)
                self.log({"phase": "warmstart", "step": step, "reward_mean": reward,
                          "nll": m["nll"], "elapsed_s": time.perf_counter() - t0})
                print(f"warm-start step {step}: nll {m['nll']:.3f}, reward {reward:.3f}",
                      flush=True)
        self.reference = self._frozen_copy()
        return reward

    def _frozen_copy(self):
        from rl_hooks.api import PolicyTrainer

        with torch.random.fork_rng():  # building re-seeds torch for its init; keep our draws
            reference = PolicyTrainer(self.cfg)
        reference.runtime.model.load_state_dict(self.policy.runtime.model.state_dict())
        reference.runtime.model.requires_grad_(False)
        return reference

    def step(self, step: int) -> dict:
        """One GRPO step: sample, score, update, push. Returns its metrics record."""
        g, t0 = self.rl.grpo, time.perf_counter()
        prompts, answers = self.task.sample(g.prompts_per_step)
        prompts = [p for p in prompts for _ in range(g.group_size)]
        answers = [a for a in answers for _ in range(g.group_size)]
        rollouts = self.sampler.generate(prompts, g.max_new_tokens, temperature=g.temperature)
        rewards = _rewards(rollouts, answers)
        batch = RolloutBatch.from_sequences(
            prompts, [r.tokens for r in rollouts], rollout_logprobs=[r.logprobs for r in rollouts],
            rewards=rewards, group_ids=[i // g.group_size for i in range(len(prompts))])
        t_sample = time.perf_counter()
        batch, record = self._score(batch, torch.cat([r.routed_experts for r in rollouts]))
        metrics = self.policy.train_step(batch, self.loss, mini_batches=g.mini_batches,
                                         epochs=g.epochs, lr=g.lr, temperature=g.temperature)
        t_train = time.perf_counter()
        push = self.push()
        t_end = time.perf_counter()
        record = {"phase": "grpo", "step": step, "reward_mean": sum(rewards) / len(rewards),
                  **record, "clip_frac": metrics["clip_frac"], "loss": metrics["loss"],
                  "grad_norm": metrics["grad_norm"],
                  "replay_route_agreement": metrics.get("route_agreement"),
                  "response_len_mean": sum(len(r.tokens) for r in rollouts) / len(rollouts),
                  "pushed_tensors": push["tensors"], "pushed_bytes": push["bytes"],
                  "sample_s": t_sample - t0, "train_s": t_train - t_sample,
                  "push_s": t_end - t_train, "step_time_s": t_end - t0}
        self.log(record)
        return record

    def _score(self, batch: RolloutBatch, sampler_routes_TLK: torch.Tensor):
        """Old log-probs (and the trainer's routes), reference log-probs, the routes to replay;
        the trainer-vs-sampler gap and route agreement on the same weights."""
        g = self.rl.grpo
        old = self.policy.compute_logprobs(batch, g.temperature, record_routes=True,
                                           mini_batches=g.mini_batches)
        ref = self.reference.compute_logprobs(batch, g.temperature, mini_batches=g.mini_batches)
        mask = batch.loss_mask
        gap = (old.logprobs - batch.rollout_logprobs)[mask].abs()
        kl = kl_estimate(old.logprobs[mask].double(), ref.logprobs[mask].double(), "k3")
        # Per (token, MoE layer) the sampler routed (all but each sequence's last token): the
        # same set of experts as the trainer's live routing on the same weights.
        known = (sampler_routes_TLK >= 0).all(-1)
        same = (sampler_routes_TLK.sort(-1).values == old.routes.sort(-1).values).all(-1)
        agree = float(same[known].float().mean()) if bool(known.any()) else None
        replay = {"sampler": sampler_routes_TLK, "recorded": old.routes, "none": None}[g.replay]
        batch = dataclasses.replace(batch, old_logprobs=old.logprobs, ref_logprobs=ref.logprobs,
                                    routed_experts=replay)
        return batch, {"kl": float(kl.mean()), "logprob_gap_mean": float(gap.mean()),
                       "logprob_gap_max": float(gap.max()),
                       "route_agreement": agree}

    def finish(self, summary: dict) -> dict:
        """Write the plot and the summary (also returned)."""
        if self.rl.plot_file:
            summary["plot"] = str(plot(self.records, self.run_dir / self.rl.plot_file,
                                       summary.get("warmstart_reward")))
        summary["metrics"] = str(self.metrics_path)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return summary


def run(cfg: Config, rl: DemoConfig) -> dict:
    """Warm-start, then rl.grpo.steps GRPO steps; returns the summary (rewards, times, files)."""
    t0 = time.perf_counter()
    demo = GRPODemo(cfg, rl)
    warm = demo.warm_start()
    t_warm = time.perf_counter()
    for step in range(1, rl.grpo.steps + 1):
        r = demo.step(step)
        print(f"grpo step {step}: reward {r['reward_mean']:.3f}, kl {r['kl']:.4f}, clip "
              f"{r['clip_frac']:.3f}, gap {r['logprob_gap_mean']:.1e}/{r['logprob_gap_max']:.1e}, "
              f"{r['step_time_s']:.2f} s", flush=True)
    final = demo.evaluate(rl.eval_prompts)
    steps = [r for r in demo.records if r["phase"] == "grpo"]
    summary = {"warmstart_reward": warm, "final_reward": final, "grpo_steps": len(steps),
               "warmstart_s": t_warm - t0, "grpo_s": time.perf_counter() - t_warm,
               "total_s": time.perf_counter() - t0,
               "first_step_logprob_gap_mean": steps[0]["logprob_gap_mean"] if steps else None,
               "first_step_logprob_gap_max": steps[0]["logprob_gap_max"] if steps else None}
    return demo.finish(summary)


# ---------------------------------------------------------------------------------- plot


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("the demo's plot needs matplotlib: pip install matplotlib (or the dev "
                          "extra), or set rl.plot_file=''") from None


def plot(records: list[dict], path: Path, warmstart_reward: float | None) -> Path:
    """Reward, KL, clip fraction and trainer-vs-sampler log-prob gap per GRPO step (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if r["phase"] == "grpo"]
    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels = [("reward_mean", "mean reward", "linear"), ("kl", "KL to reference (k3)", "linear"),
              ("clip_frac", "clip fraction", "linear"),
              ("logprob_gap_mean", "|trainer - sampler| log-prob", "log")]
    for ax, (key, title, scale) in zip(axes.flat, panels, strict=True):
        ax.plot(x, [r[key] for r in steps], label="mean" if key.startswith("logprob") else None)
        ax.set_title(title)
        ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    axes[1, 1].plot(x, [r["logprob_gap_max"] for r in steps], label="max")
    axes[1, 1].legend()
    if warmstart_reward is not None:
        axes[0, 0].axhline(warmstart_reward, ls="--", c="gray", label="after warm-start")
        axes[0, 0].legend()
    for ax in axes[1]:
        ax.set_xlabel("GRPO step")
    fig.suptitle("GRPO on digit reversal (tiny MoE, HF Qwen3-MoE sampler)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="longctx-moe rl", description="GRPO demo: digit reversal.")
    p.add_argument("--config", required=True, help="YAML file, e.g. configs/grpo_tiny.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, repeatable: --set rl.grpo.steps=20 --set optim.lr=1e-3")
    args = p.parse_args(argv)
    try:
        summary = run(*load_demo_config(args.config, args.overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0
