"""Reading a Hugging Face Qwen3-MoE directory into our model (`train.init_from`): its config.json
checked against model.*, its safetensors read (per-expert or transformers 5's fused expert names)
and converted to our single-device state dict."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from longctx_moe.config import ConfigError
from longctx_moe.hf.interop import _check_supported, from_hf_state_dict
from longctx_moe.model.config import ModelConfig

# config.json key -> model.* key, for the architecture check of train.init_from.
_HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
            "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
            "num_experts": "num_experts", "num_experts_per_tok": "top_k",
            "moe_intermediate_size": "expert_hidden_size", "norm_topk_prob": "router_renormalize",
            "tie_word_embeddings": "tie_embeddings", "rms_norm_eps": "norm_eps"}


def _hf_value(hf: dict, key: str):
    """config.json's value of model.`key` in our terms (None when absent: HF's default)."""
    if key == "rope_theta":
        return (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    if key == "first_k_dense":
        layers = hf.get("mlp_only_layers") or []
        return len(layers) if layers == list(range(len(layers))) else f"mlp_only_layers={layers}"
    if key == "num_experts":  # the HF hub's name; transformers 5 saves `num_local_experts`
        return hf.get("num_experts", hf.get("num_local_experts"))
    if key == "head_dim" and hf.get("head_dim") is None:
        return hf.get("hidden_size", 0) // max(1, hf.get("num_attention_heads", 1))
    return hf.get({v: k for k, v in _HF_KEYS.items()}.get(key, key))


def check_hf_config(hf_dir: Path, cfg: ModelConfig) -> None:
    """config.json must describe model.*'s architecture; one line naming the first key that differs."""
    where = f"train.init_from='{hf_dir}'"
    try:
        hf = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{where} has no readable config.json; point it at a Qwen3-MoE directory "
                          "(config.json + *.safetensors), e.g. one written by longctx-moe export-hf") from None
    if hf.get("model_type") != "qwen3_moe":
        raise ConfigError(f"{where} holds model_type={hf.get('model_type')!r}, not 'qwen3_moe'; only "
                          "Qwen3-MoE weights can initialise this model")
    keys = [*_HF_KEYS.values(), "rope_theta", "first_k_dense"]
    keys += ["dense_hidden_size"] if cfg.first_k_dense else []
    for key in keys:
        have = hf.get("intermediate_size") if key == "dense_hidden_size" else _hf_value(hf, key)
        want = getattr(cfg, key)
        if have is not None and have != want and not (isinstance(want, float) and abs(have - want) <= 1e-12 * abs(want)):
            raise ConfigError(f"{where} has {key}={have!r} in config.json but model.{key}={want!r}; "
                              f"set model.{key}={have!r} (or init from a matching directory)")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{where} has decoder_sparse_step={hf['decoder_sparse_step']} (MoE every "
                          "k-th layer), which this model cannot express; use a checkpoint with 1")


def _read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"train.init_from='{hf_dir}' holds no *.safetensors file; export one with "
                          "longctx-moe export-hf or point it at a Hugging Face model directory")
    sd = {}
    for path in files:
        try:
            sd.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"train.init_from: '{path}' is not a readable safetensors file ({e}); "
                              "re-download or re-export it") from None
    return sd


def _fuse_experts(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert names (`experts.{e}.gate_proj.weight` [F, D], up_proj, down_proj [D, F]) ->
    transformers 5's fused `experts.gate_up_proj` [E, 2F, D] and `experts.down_proj` [E, D, F]."""
    for i in range(cfg.first_k_dense, cfg.num_layers):
        base = f"model.layers.{i}.mlp.experts"
        if f"{base}.0.gate_proj.weight" not in sd:
            continue  # already fused (or missing: from_hf_state_dict names it)
        try:
            gate_up = [torch.cat([sd.pop(f"{base}.{e}.gate_proj.weight"), sd.pop(f"{base}.{e}.up_proj.weight")])
                       for e in range(cfg.num_experts)]
            down = [sd.pop(f"{base}.{e}.down_proj.weight") for e in range(cfg.num_experts)]
        except KeyError as e:
            raise ConfigError(f"train.init_from: tensor {e} is missing; the directory does not hold "
                              f"model.num_experts={cfg.num_experts} experts per layer") from None
        sd[f"{base}.gate_up_proj"], sd[f"{base}.down_proj"] = torch.stack(gate_up), torch.stack(down)
    return sd


def load_hf_weights(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our single-device state dict from a Qwen3-MoE safetensors directory (either expert naming)."""
    hf_dir = Path(hf_dir)
    try:
        _check_supported(cfg)
    except ValueError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    check_hf_config(hf_dir, cfg)
    sd = _fuse_experts(_read_safetensors(hf_dir), cfg)
    if cfg.tie_embeddings:
        sd.setdefault("lm_head.weight", sd.get("model.embed_tokens.weight"))
    try:
        return from_hf_state_dict(sd, cfg)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"train.init_from='{hf_dir}': {e}") from None
