"""Config loading: YAML, typed dotted overrides, one-line errors with suggestions, resolved copy."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from longctx_moe.config import ConfigError, load_config, write_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_and_typed_overrides(tmp_path):
    path = write(tmp_path, "model:\n  num_experts: 4\n  top_k: 1\noptim:\n  lr: 1e-3\n")
    cfg = load_config(path, ["model.num_experts=16", "model.qk_norm=false", "parallel.capacity_factor=null",
                             "parallel.hierarchical_sizes=[2, 2]", "optim.betas=[0.8, 0.99]",
                             "train.steps=7.0", "optim.grad_clip=1", "train.run_dir=runs/a:b"])
    assert cfg.model.num_experts == 16 and cfg.model.top_k == 1
    assert cfg.model.qk_norm is False and cfg.parallel.capacity_factor is None
    assert cfg.parallel.hierarchical_sizes == [2, 2] and cfg.optim.betas == [0.8, 0.99]
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)  # "1e-3" is a str to PyYAML
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.grad_clip == 1.0 and isinstance(cfg.optim.grad_clip, float)
    assert cfg.train.run_dir == "runs/a:b"
    # Later overrides win.
    assert load_config(path, ["model.top_k=2", "model.top_k=3"]).model.top_k == 3


@pytest.mark.parametrize("text, overrides, pattern", [
    ("model:\n  num_expert: 4\n", [], r"unknown config key 'model.num_expert'; did you mean 'model.num_experts'\?"),
    ("", ["optim.lrr=1"], r"'optim.lrr'; did you mean 'optim.lr'\?"),
    ("", ["modle.top_k=1"], r"'modle'; did you mean 'model'\?"),
    ("trian:\n  steps: 3\n", [], r"'trian'; did you mean 'train'\?"),
    ("", ["model.top_k=9"], r"model.top_k=9 exceeds model.num_experts=8"),
    ("", ["model.router_score=softmx"], r"model.router_score='softmx' is not"),
    ("", ["model.head_dim=31"], r"model.head_dim=31 must be even"),
    ("", ["parallel.cp_backend=rnig"], r"parallel.cp_backend='rnig' is not allowed; choose one of ring, ulysses, hierarchical; did you mean 'ring'\?"),
    ("", ["parallel.capacity_factor=0"], r"parallel.capacity_factor=0.0 must be > 0, or null for dropless"),
    ("", ["data.global_batch_tokens=100"], r"data.global_batch_tokens=100 must be >= data.micro_batch_tokens=2048"),
    ("", ["data.cost_per_token_pair=-1"], r"data.cost_per_token_pair=-1.0 must be >= 0"),
    ("", ["data.cost_b=0.1"], r"unknown config key 'data.cost_b'; known keys: .*cost_per_token_pair"),
    ("data:\n  cost_a: 1.0\n", [], r"unknown config key 'data.cost_a'; known keys: .*cost_per_token"),
    ("", ["train.nan_policy=ignore"], r"train.nan_policy='ignore' is not allowed; choose one of stop, skip"),
    ("", ["optim.lr=fast"], r"optim.lr: expected a number, got 'fast'"),
    ("", ["model.qk_norm=yes please"], r"model.qk_norm: expected true or false"),
    ("", ["train.steps=2.5"], r"train.steps: expected an integer, got 2.5"),
    ("", ["optim.betas=0.9"], r"optim.betas: expected a list"),
    ("", ["model.num_heads=6", "model.num_kv_heads=4"], r"model.num_heads=6 must be divisible by model.num_kv_heads=4"),
    ("", ["train.param_dtype=fp64"], r"set train.autocast_dtype=none"),
    ("", ["train.steps"], r"override 'train.steps' has no '='"),
    ("", ["model=3"], r"names a section"),
    ("model: [1, 2]\n", [], r"model: expected a mapping"),
    ("model:\n  top_k: 2\n   bad: indent\n", [], r"not valid YAML at line 3"),
    ("- just\n- a list\n", [], r"must hold a mapping of sections"),
])
def test_bad_config_gives_one_line_error(tmp_path, text, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(write(tmp_path, text), overrides)
    assert "\n" not in str(e.value)


def test_parallel_values_are_checked_by_their_owner_alone():
    # Load time and ParallelDims (programmatic use) run the same check: one message for one value.
    from longctx_moe.parallel.config import ParallelConfig
    from longctx_moe.parallel.dims import ParallelDims

    with pytest.raises(ConfigError) as at_load:
        load_config(None, ["parallel.drop_policy=prob"])
    with pytest.raises(ValueError) as at_dims:
        ParallelDims.from_config(ParallelConfig(drop_policy="prob"), 1)
    assert str(at_load.value) == str(at_dims.value)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.num_experts=16", "parallel.capacity_factor=1.25", "optim.betas=[0.9, 0.9]"])
    path = write_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(path) == cfg


def test_configs_in_repo_load():
    """Training configs load with load_config; an RL demo config (an `rl:` section beside the
    trainer's) with the demo's loader, which hands the rest to load_config's rules."""
    from rl_hooks.demo import load_demo_config

    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert paths, "configs/ holds the default run's YAML"
    for path in paths:
        if "rl" in yaml.safe_load(path.read_text()):
            load_demo_config(path)
        else:
            load_config(path)


def test_cli_prints_config_error_without_traceback(tmp_path):
    path = write(tmp_path, "model:\n  num_experts: 4\n")
    proc = subprocess.run([sys.executable, "-m", "longctx_moe.cli", "train", "--config", str(path),
                           "--set", "model.top_kk=2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown config key 'model.top_kk'; did you mean 'model.top_k'?"


def test_default_pair_cost_is_the_default_models_flop_ratio():
    # DataConfig's default cost_per_token_pair is derived in its comment from the default model:
    # attention FLOPs per causal pair over dense FLOPs per token (longctx_moe.model.flops).
    from data_packing.config import DataConfig
    from longctx_moe.model.config import ModelConfig
    from longctx_moe.model.flops import active_matmul_params, model_flops

    m = ModelConfig()
    pair = model_flops(m, [2]) - model_flops(m, [1]) * 2  # a 2-token doc has 3 pairs, two 1-token docs 2
    ratio = pair / (6 * active_matmul_params(m))
    assert DataConfig().cost_per_token_pair == pytest.approx(ratio, rel=0.01)
