"""The GRPO demo's plumbing on a tiny budget (learning itself is the long run, in docs): metrics
written, the sampler holds the trainer's weights after every push, rewards in [0, 1], the plot,
and the `longctx-moe rl` command with its config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from longctx_moe.cli import main as cli_main  # noqa: E402
from rl_hooks.demo import GRPODemo, load_demo_config, run  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny.yaml"
TINY = ["rl.warmstart.max_steps=2", "rl.warmstart.eval_every=2", "rl.warmstart.target_reward=1.0",
        "rl.grpo.steps=3", "rl.grpo.prompts_per_step=3", "rl.grpo.group_size=4",
        "rl.grpo.mini_batches=2", "rl.eval_prompts=8"]


def _sampler_holds_policy_weights(demo: GRPODemo) -> bool:
    return all(torch.equal(demo.sampler.weight(name), tensor)
               for bucket in demo.policy.export_weights(1 << 20, torch.float32)
               for name, tensor in bucket)


def test_steps_push_weights_and_log_metrics(tmp_path):
    demo = GRPODemo(*load_demo_config(CONFIG, [*TINY, f"train.run_dir={tmp_path}"]))
    assert _sampler_holds_policy_weights(demo)
    warm = demo.warm_start()
    assert 0.0 <= warm <= 1.0 and demo.reference is not None
    spec = demo.policy.weights_spec(torch.float32)
    for step in range(1, 4):
        before = {n: p.detach().clone() for n, p in demo.policy.runtime.model.named_parameters()}
        record = demo.step(step)
        changed = any(not torch.equal(before[n], p)
                      for n, p in demo.policy.runtime.model.named_parameters())
        # The update changed the trainer, and the push brought every tensor to the sampler.
        assert changed and _sampler_holds_policy_weights(demo)
        assert record["pushed_tensors"] == len(spec)
        assert 0.0 <= record["reward_mean"] <= 1.0
        assert 0.0 <= record["clip_frac"] <= 1.0 and record["kl"] >= 0.0
    first = next(r for r in demo.records if r["phase"] == "grpo")
    # Same weights on both sides at the first step, float32: a mean < 1e-3
    # (measured ~2e-7; a missing or stale push shows as > 1e-2).
    assert first["logprob_gap_mean"] < 1e-3 and first["route_agreement"] > 0.9
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines] == ["warmstart", "grpo", "grpo", "grpo"]
    keys = {"reward_mean", "kl", "clip_frac", "logprob_gap_mean", "logprob_gap_max",
            "route_agreement", "step_time_s"}
    assert all(keys <= r.keys() for r in lines[1:])
    summary = demo.finish({"warmstart_reward": warm})
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_runs_the_demo_and_refuses_bad_keys(tmp_path, capsys):
    items = [*TINY, "rl.grpo.steps=1", f"train.run_dir={tmp_path}"]
    sets = [x for item in items for x in ("--set", item)]
    assert cli_main(["rl", "--config", str(CONFIG), *sets]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["grpo_steps"] == 1 and 0.0 <= summary["final_reward"] <= 1.0
    assert (tmp_path / "grpo_digits.png").is_file() and (tmp_path / "config.yaml").is_file()
    assert cli_main(["rl", "--config", str(CONFIG), "--set", "rl.grpo.group_size=1"]) == 2
    assert "rl.grpo.group_size must be >= 2" in capsys.readouterr().err
    assert cli_main(["rl", "--config", str(CONFIG), "--set", "rl.grpo.stpes=3"]) == 2
    assert "did you mean 'rl.grpo.steps'" in capsys.readouterr().err


def test_run_returns_the_summary(tmp_path):
    cfg, rl = load_demo_config(CONFIG, [*TINY, "rl.grpo.steps=1", "rl.plot_file=",
                                        f"train.run_dir={tmp_path}"])
    summary = run(cfg, rl)
    assert "plot" not in summary and summary["first_step_logprob_gap_mean"] < 1e-3
