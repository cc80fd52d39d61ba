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
    (None, ["optim.lrr=1"], r"'optim.lrr'; did you mean 'optim.lr'\?"),
    (None, ["modle.top_k=1"], r"'modle'; did you mean 'model'\?"),
    ("trian:\n  steps: 3\n", [], r"'trian'; did you mean 'train'\?"),
    (None, ["model.top_k=9"], r"model.top_k=9 exceeds model.num_experts=8"),
    (None, ["model.router_score=softmx"], r"model.router_score='softmx' is not"),
    (None, ["model.head_dim=31"], r"model.head_dim=31 must be even"),
    (None, ["parallel.cp_backend=rnig"], r"parallel.cp_backend='rnig' is not allowed; choose one of ring, ulysses, hierarchical; did you mean 'ring'\?"),
    (None, ["parallel.capacity_factor=0"], r"parallel.capacity_factor=0.0 must be > 0, or null for dropless"),
    (None, ["data.global_batch_tokens=100"], r"data.global_batch_tokens=100 must be >= data.micro_batch_tokens=2048"),
    (None, ["data.cost_per_token_pair=-1"], r"data.cost_per_token_pair=-1.0 must be >= 0"),
    (None, ["train.host_heap_trim=-0.1"], r"train.host_heap_trim=-0.1 must be >= 0 \(0 = never trim\)"),
    (None, ["data.cost_b=0.1"], r"unknown config key 'data.cost_b'; known keys: .*cost_per_token_pair"),
    ("data:\n  cost_a: 1.0\n", [], r"unknown config key 'data.cost_a'; known keys: .*cost_per_token"),
    (None, ["train.nan_policy=ignore"], r"train.nan_policy='ignore' is not allowed; choose one of stop, skip"),
    (None, ["optim.lr=fast"], r"optim.lr: expected a number, got 'fast'"),
    (None, ["model.qk_norm=yes please"], r"model.qk_norm: expected true or false"),
    (None, ["train.steps=2.5"], r"train.steps: expected an integer, got 2.5"),
    (None, ["optim.betas=0.9"], r"optim.betas: expected a list"),
    (None, ["model.num_heads=6", "model.num_kv_heads=4"], r"model.num_heads=6 must be divisible by model.num_kv_heads=4"),
    (None, ["train.param_dtype=fp64", "train.autocast_dtype=bf16"], r"set train.autocast_dtype=none or auto"),
    (None, ["train.compile=true", "parallel.micro_batches_in_flight=2"], r"set one of them off"),
    (None, ["train.steps"], r"override 'train.steps' has no '='"),
    (None, ["model=3"], r"names a section"),
    ("model: [1, 2]\n", [], r"model: expected a mapping"),
    ("model:\n  top_k: 2\n   bad: indent\n", [], r"not valid YAML at line 3"),
    ("- just\n- a list\n", [], r"must hold a mapping of sections"),
    ("", [], r"holds no settings; add sections"),
    ("# only a comment\n", [], r"holds no settings; add sections"),
    ("optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", [], r"sets 'lr' twice in one section \(second at line 3\); keep one"),
    ("optim:\n  lr: 1.0e-3\noptim:\n  eps: 1.0e-8\n", [], r"sets 'optim' twice in one section \(second at line 3\)"),
    ("model:\n  top_k: 2\x00\n", [], r"non-printable character at offset 17 \(a binary file\?\)"),
    ("optim:\n  lr: .inf\n", [], r"optim.lr=inf is not a finite number; set a finite value"),
    (None, ["optim.lr=inf"], r"optim.lr=inf is not a finite number"),
    (None, ["optim.lr=nan"], r"optim.lr=nan must be > 0"),
    (None, ["optim.lr=-1"], r"optim.lr=-1.0 must be > 0"),
    (None, ["optim.eps=inf"], r"optim.eps=inf is not a finite number"),
    (None, ["optim.betas=[0.9, nan]"], r"optim.betas=\[0.9, nan\] must be two numbers in \[0, 1\)"),
    (None, ["parallel.capacity_factor=inf"], r"parallel.capacity_factor=inf is not a finite number"),
    (None, ["model.rope_theta=-inf"], r"model.rope_theta=-inf is not a finite number"),
])
def test_bad_config_gives_one_line_error(tmp_path, text, overrides, pattern):
    # text None: no file, defaults plus the overrides.
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(None if text is None else write(tmp_path, text), overrides)
    assert "\n" not in str(e.value)


def test_binary_config_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(bytes(range(128, 256)) * 4)  # not UTF-8
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(a binary file\?\); pass a YAML file"):
        load_config(path)


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
    trainer's) with the demo's loader, which hands the rest to load_config's rules. A verl
    TrainingWorker config (`engine_config`) is verl's format: verl's own loader reads it in
    tests/rl_hooks/test_verl_engine.py; here its `config` must name a training config that loads."""
    from rl_hooks.demo import load_demo_config

    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert paths, "configs/ holds the default run's YAML"
    for path in paths:
        data = yaml.safe_load(path.read_text())
        if "rl" in data:
            load_demo_config(path)
        elif "engine_config" in data:
            load_config(ROOT / data["engine_config"]["config"], data["engine_config"]["overrides"])
        else:
            load_config(path)


@pytest.mark.parametrize("text, overrides, message", [
    ("model:\n  num_experts: 4\n", ["model.top_kk=2"],
     "unknown config key 'model.top_kk'; did you mean 'model.top_k'?"),
    ("optim:\n  lr: 1.0\n  lr: 2.0\n", [],
     "config file '{path}' sets 'lr' twice in one section (second at line 3); keep one of them"),
    ("model:\n  num_experts: 4\n", ["optim.lr=inf"], "optim.lr=inf is not a finite number; set a finite value"),
])
@pytest.mark.slow
def test_cli_prints_config_error_without_traceback(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    sets = [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "longctx_moe.cli", "train", "--config", str(path), *sets],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: " + message.format(path=path)


def _flop_ratio(m):
    # Attention FLOPs of one causal pair over dense FLOPs of one token, from model_flops alone:
    # a 2-token document has 3 pairs, two 1-token documents 2.
    from longctx_moe.model.flops import active_matmul_params, model_flops

    return (model_flops(m, [2]) - model_flops(m, [1]) * 2) / (6 * active_matmul_params(m))


def test_default_pair_cost_is_the_default_models_flop_ratio():
    from data_packing.config import DataConfig
    from longctx_moe.model.config import ModelConfig

    assert DataConfig().cost_per_token_pair == pytest.approx(_flop_ratio(ModelConfig()), rel=0.01)


def test_pair_cost_follows_the_model_unless_given():
    # Not set: the loader's pair cost is this model's FLOP ratio (in cost_per_token units), so the
    # DP balance follows the model's attention share; set: taken as given.
    wide = ["model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=64"]
    cfg = load_config(None, wide)
    assert cfg.data.cost_per_token_pair == pytest.approx(_flop_ratio(cfg.model), rel=1e-12)
    assert cfg.data.cost_per_token_pair != pytest.approx(load_config(None).data.cost_per_token_pair, rel=0.1)
    doubled = load_config(None, [*wide, "data.cost_per_token=2"]).data.cost_per_token_pair
    assert doubled == pytest.approx(2 * cfg.data.cost_per_token_pair, rel=1e-12)
    assert load_config(None, [*wide, "data.cost_per_token_pair=0"]).data.cost_per_token_pair == 0


def test_each_section_is_validated_once_from_load_to_built_components(monkeypatch):
    # The loader checks each section as it makes it; the model and the mesh do not check again.
    from data_packing.config import DataConfig
    from longctx_moe.model import build_model
    from longctx_moe.model.config import ModelConfig
    from longctx_moe.parallel.config import ParallelConfig
    from longctx_moe.parallel.dims import ParallelDims

    calls = []
    for cls in (ModelConfig, ParallelConfig, DataConfig):
        real = cls.validate
        monkeypatch.setattr(cls, "validate", lambda self, real=real: calls.append(type(self).__name__) or real(self))
    cfg = load_config(None, [])
    build_model(cfg.model)
    ParallelDims.from_config(cfg.parallel, 1, cfg.model)
    assert sorted(calls) == ["DataConfig", "ModelConfig", "ParallelConfig"]


@pytest.mark.parametrize("key,value", [("aux_loss_type", "none"), ("aux_loss_coeff", 0.0), ("z_loss_coeff", 0.0),
                                       ("expert_bias_update_rate", 0.0)])
def test_balance_keys_under_model_are_refused_naming_their_section(tmp_path, key, value):
    want = rf"^model\.{key} is how training balances the experts, not part of the architecture: write it as balance\.{key}$"
    with pytest.raises(ConfigError, match=want):
        load_config(None, [f"model.{key}={value}"])
    with pytest.raises(ConfigError, match=want):
        load_config(write(tmp_path, f"model:\n  {key}: {value}\n"))
    bias = "model:\n  expert_bias: true\n" if key == "expert_bias_update_rate" else ""
    assert getattr(load_config(write(tmp_path, f"{bias}balance:\n  {key}: {value}\n")).balance, key) == value


def test_a_balance_setting_with_nothing_to_act_on_is_refused():
    with pytest.raises(ConfigError, match=r"^balance.expert_bias_update_rate=0.01 .* model.expert_bias=false"):
        load_config(None, ["balance.expert_bias_update_rate=0.01"])
    with pytest.raises(ConfigError, match=r"^balance.aux_loss_coeff=0.1 .* balance.aux_loss_type=none computes none"):
        load_config(None, ["balance.aux_loss_type=none", "balance.aux_loss_coeff=0.1"])
    load_config(None, ["model.expert_bias=true", "balance.expert_bias_update_rate=0.01"])  # acts: accepted
