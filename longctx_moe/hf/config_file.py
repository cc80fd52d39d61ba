"""A model's architecture from a Hugging Face config.json alone, without its weights.

    read_config_file        the config.json dict of a file, or of a directory holding one
    model_values_from_file  its model.* values through the family tables (hf/families.py)
    model_config_from_file  its ModelConfig
    fill_model_from_file    `train.model_config`: fill the architecture keys of a training
                            config's model.* that it does not set itself, with no weights read (configs/models/ holds the published
                            config.json of the large MoE models people train)

Reading the architecture only, the keys that say how a checkpoint stores its weights
(WEIGHT_FORMAT_KEYS) do not apply and are set aside by name; every other setting the family
tables refuse is refused here the same way. `train.init_from`, which reads the weights, still
refuses a storage it cannot read.
"""

from __future__ import annotations

import json
from pathlib import Path

from longctx_moe.config import ConfigError
from longctx_moe.hf.families import model_values
from longctx_moe.model.config import ModelConfig

# config.json keys describing the stored weights (gpt-oss's MXFP4 experts, DeepSeek-V3's FP8
# blocks), not the model: the architecture is the same whatever they say.
WEIGHT_FORMAT_KEYS = ("quantization_config",)


def read_config_file(path: str | Path, key: str = "train.model_config") -> dict:
    """The dict of the JSON file `path` (or of `path`/config.json for a directory); ConfigError
    naming `key` when it cannot be read."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}='{path}': cannot read '{file}' ({e}); point it at a Hugging Face "
                          "config.json, e.g. configs/models/qwen3-30b-a3b.json") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}='{path}': '{file}' holds a JSON {type(data).__name__}, not the object "
                          "of a Hugging Face config.json")
    return data


def architecture_of(hf: dict) -> dict:
    """`hf` without its weight-format keys (WEIGHT_FORMAT_KEYS)."""
    return {k: v for k, v in hf.items() if k not in WEIGHT_FORMAT_KEYS}


def model_values_from_file(path: str | Path, key: str = "train.model_config") -> dict:
    """model.* values of the config.json at `path`; ConfigError (one line, naming the HF key) for
    a family or setting the model cannot express."""
    try:
        return model_values(architecture_of(read_config_file(path, key)))
    except ConfigError as e:
        raise ConfigError(f"{key}='{path}': {e}") from None


def model_config_from_file(path: str | Path, **overrides) -> ModelConfig:
    """The ModelConfig of the config.json at `path`; `overrides` set further model.* keys (e.g.
    num_layers=2 for a shrunk copy of the same shapes)."""
    values = {**model_values_from_file(path), **overrides}
    try:
        return ModelConfig(**values)
    except ValueError as e:
        raise ConfigError(f"train.model_config='{path}': {e}") from None


def fill_model_from_file(data: dict, path: str) -> None:
    """Fill data["model"]'s architecture keys from the config.json at `path`, in place. A key the
    config (YAML or --set) gives itself wins: no weights are read, so `model.num_layers=2` makes a
    shrunk copy of the same shapes (tests, quick rehearsals). With train.init_from also set, the
    directory's own config.json is the architecture: refused."""
    if (data.get("train") or {}).get("init_from"):
        raise ConfigError(f"train.model_config='{path}' and train.init_from are both set; init_from's "
                          "config.json already gives the architecture: drop train.model_config")
    model = data.get("model") or {}
    data["model"] = {**model_values_from_file(path), **model}
