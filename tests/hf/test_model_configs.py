"""configs/models/: the published config.json of the large MoE models, read through the family
tables into a ModelConfig (no weights), built on the meta device and counted against the total
each model card states."""

import json
from pathlib import Path

import pytest
import torch

from longctx_moe.config import ConfigError, config_from_dict, load_config
from longctx_moe.hf.config_file import (
    fill_model_from_file,
    model_config_from_file,
    model_values_from_file,
)
from longctx_moe.hf.families import model_values
from longctx_moe.model import build_model

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"

# file -> (model_type, total parameters the model card states). DeepSeek-V3's 671B and GLM-4.5's
# 355B leave out the multi-token-prediction layer; gpt-oss-120b's card says 117B (116.8B).
PUBLISHED = {
    "qwen3-30b-a3b.json": ("qwen3_moe", 30.5e9),
    "qwen3-235b-a22b.json": ("qwen3_moe", 235e9),
    "deepseek-v3.json": ("deepseek_v3", 671e9),
    "gpt-oss-120b.json": ("gpt_oss", 116.8e9),
    "glm-4.5.json": ("glm4_moe", 355e9),
    "mixtral-8x22b.json": ("mixtral", 141e9),
}


def meta_parameter_count(cfg) -> int:
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def test_the_directory_holds_the_six_models():
    assert sorted(p.name for p in MODELS.glob("*.json")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_the_model_card(name):
    family, total = PUBLISHED[name]
    cfg = model_config_from_file(MODELS / name)
    assert cfg.hf_family == family
    count = meta_parameter_count(cfg)
    assert abs(count - total) / total < 0.02, f"{name}: {count / 1e9:.2f}B vs {total / 1e9:.1f}B published"


def test_family_features_are_read():
    ds = model_config_from_file(MODELS / "deepseek-v3.json")
    assert (ds.attention_type, ds.q_lora_rank, ds.kv_lora_rank, ds.first_k_dense) == ("mla", 1536, 512, 3)
    assert (ds.router_groups, ds.router_topk_groups, ds.routed_scaling_factor) == (8, 4, 2.5)
    assert ds.rope_scaling["type"] == "yarn" and ds.rope_scaling["factor"] == 40
    glm = model_config_from_file(MODELS / "glm-4.5.json")
    assert (glm.partial_rotary_factor, glm.qkv_bias, glm.qk_norm, glm.shared_expert_hidden_size) == (0.5, True, True, 1536)
    oss = model_config_from_file(MODELS / "gpt-oss-120b.json")
    assert (oss.sliding_window, oss.window_of(0), oss.window_of(1), oss.top_k) == (128, 128, None, 4)


def test_weight_format_is_set_aside_only_without_weights():
    # The published gpt-oss-120b stores MXFP4 experts: init_from's table refuses that storage,
    # the architecture alone reads the same with or without it.
    hf = json.loads((MODELS / "gpt-oss-120b.json").read_text())
    with pytest.raises(ConfigError, match="quantization_config"):
        model_values(hf)
    hf.pop("quantization_config")
    assert model_values(hf) == model_values_from_file(MODELS / "gpt-oss-120b.json")


def test_a_refused_setting_is_still_refused(tmp_path):
    hf = json.loads((MODELS / "mixtral-8x22b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "sliding_window": 4096}))
    with pytest.raises(ConfigError, match=r"train.model_config=.*sliding_window=4096"):
        model_values_from_file(tmp_path)


def test_fills_a_training_config():
    data = {"model": {"num_experts": 128}, "balance": {"aux_loss_coeff": 1e-3}}
    fill_model_from_file(data, str(MODELS / "qwen3-30b-a3b.json"))
    cfg = config_from_dict(data)
    assert (cfg.model.num_layers, cfg.model.num_experts, cfg.balance.aux_loss_coeff) == (48, 128, 1e-3)


def test_the_config_own_keys_win_and_init_from_is_refused():
    """train.model_config reads no weights: a key the config sets itself (a shrunk copy of the
    shapes) wins over the file's; with init_from, whose directory gives the architecture, refused."""
    path = str(MODELS / "qwen3-30b-a3b.json")
    cfg = load_config(None, [f"train.model_config={path}", "model.num_layers=2"])
    assert (cfg.model.num_layers, cfg.model.num_experts, cfg.model.hidden_size) == (2, 128, 2048)
    with pytest.raises(ConfigError, match="both set"):
        fill_model_from_file({"train": {"init_from": "/some/dir"}}, path)
    with pytest.raises(ConfigError, match="cannot read"):
        fill_model_from_file({}, str(MODELS / "no-such-model.json"))
