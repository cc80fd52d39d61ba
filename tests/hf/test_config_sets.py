"""model.* is exactly the architecture a Hugging Face config.json says: for every family, the
ModelConfig fields equal the model.* keys export writes (the family tables, inverted) and the keys
import (model_values) returns, and an exported config.json reads back as the same values. A field
added to ModelConfig without a mapping fails here, naming it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from longctx_moe.config import ConfigError, load_config
from longctx_moe.hf.config_file import model_values_from_file
from longctx_moe.hf.families import (
    COMMON_KEYS,
    COMPUTED,
    FAMILIES,
    FEATURE_DEFAULTS,
    OWN_KEYS,
    Family,
    hf_config,
    model_values,
)
from longctx_moe.model.config import ModelConfig
from tests.hf.families_cases import IDS, PARAMS
from tests.hf.families_cases import hf_config as family_case

FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def written_keys(fam: Family) -> set[str]:
    """The model.* keys `fam`'s export writes: copied to a config.json key (COMMON_KEYS and the
    family's keys), derived into several (derives), said by the model_type (the family's implied
    values, and the features it lacks at their "not there" value, which export checks), computed
    from other keys (COMPUTED), or written by code of their own (OWN_KEYS)."""
    return (set(COMMON_KEYS.values()) | set(fam.keys.values()) | set(fam.derives) | set(fam.implied)
            | set(FEATURE_DEFAULTS) | set(COMPUTED) | set(OWN_KEYS))


def _differences(fields: set[str], keys: set[str]) -> str:
    return f"fields without a mapping: {sorted(fields - keys)}; mapped non-fields: {sorted(keys - fields)}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_writes_every_model_field(family):
    keys = written_keys(FAMILIES[family])
    assert keys == FIELDS, _differences(FIELDS, keys)


def _cases():
    """(id, config.json dict): every family's test cases, made by transformers' config classes,
    and ModelConfig's defaults (Qwen3-MoE) as our export writes them."""
    yield "qwen3_moe-default", hf_config(ModelConfig()).to_dict()
    for case_id, (family, kwargs) in zip(IDS, PARAMS, strict=True):
        yield case_id, family_case(family, kwargs).to_dict()


@pytest.mark.parametrize("case_id,hf", list(_cases()), ids=[c for c, _ in _cases()])
def test_import_reads_every_model_field_and_export_writes_it_back(case_id, hf):
    values = model_values(hf)
    assert set(values) == FIELDS, _differences(FIELDS, set(values))
    cfg = ModelConfig(**values)
    assert cfg.hf_family == hf["model_type"]
    assert model_values(hf_config(cfg).to_dict()) == values  # every field, through config.json


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS.glob("*.json")))
def test_published_configs_give_every_model_field(name):
    values = model_values_from_file(MODELS / name)
    assert set(values) == FIELDS, _differences(FIELDS, set(values))
    hf = json.loads((MODELS / name).read_text())
    assert (values["init_std"], values["max_position_embeddings"]) == (hf["initializer_range"],
                                                                       hf["max_position_embeddings"])


def test_published_deepseek_v3_reads_transformers_default_rope_interleave():
    # its config.json leaves rope_interleave out; transformers' DeepseekV3Config says True
    assert "rope_interleave" not in json.loads((MODELS / "deepseek-v3.json").read_text())
    assert model_values_from_file(MODELS / "deepseek-v3.json")["rope_interleave"] is True


def test_init_std_and_max_position_embeddings_round_trip():
    cfg = ModelConfig(init_std=0.05, max_position_embeddings=4096)
    hf = hf_config(cfg).to_dict()
    assert (hf["initializer_range"], hf["max_position_embeddings"]) == (0.05, 4096)
    assert ModelConfig(**model_values(hf)) == cfg


def test_init_std_that_contradicts_config_json_is_refused(tmp_path):
    family, kwargs = PARAMS[IDS.index("mixtral-0")]  # initializer_range 0.2
    family_case(family, kwargs).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"config.json gives model.init_std=0.2 but the config sets "
                                          r"model.init_std=0.02") as e:
        load_config(None, [f"train.init_from={tmp_path}", "model.init_std=0.02"])
    assert "\n" not in str(e.value)
    assert load_config(None, [f"train.init_from={tmp_path}", "model.init_std=0.2"]).model.init_std == 0.2
    assert load_config(None, [f"train.init_from={tmp_path}"]).model.init_std == 0.2
