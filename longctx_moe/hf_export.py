"""Hugging Face Qwen3-MoE directories on disk: export a run's checkpoint, and read one back.

`export_run` (the `longctx-moe export-hf RUN_DIR OUT` command) consolidates the per-rank model
states of one checkpoint step into the single-device model's state dict and writes

    OUT/model-00001-of-0000N.safetensors ...   one tensor per expert and projection (the names
    OUT/model.safetensors.index.json           rl_hooks.export streams to engines), shards capped
    OUT/config.json                            hf_interop.to_hf_config of the run's model.*
    OUT/tokenizer.json, tokenizer_config.json  the corpus tokenizer, when data.path has one

No process group is needed: the checkpoint's index records every piece's global shape and
offsets (longctx_moe.checkpoint), so each tensor is read whole whatever layout (TP, EP, world
size) wrote it.

`load_hf_weights` (train.init_from) reads such a directory, or one saved by transformers 5 with
fused experts, into our state dict after checking its config.json against model.*.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from longctx_moe.checkpoint import (
    CheckpointError,
    find_resume_dir,
    load_model_state,
    step_dir_name,
)
from longctx_moe.checkpoint_reader import CheckpointReader
from longctx_moe.config import Config, ConfigError, load_config
from longctx_moe.hf_interop import _check_supported, from_hf_state_dict, to_hf_config
from longctx_moe.model.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------- consolidation


def checkpoint_step_dir(cfg: Config, run_dir: Path, step: int | None) -> Path:
    """The step directory to export: `latest` (with checkpoint.py's fallback) or step N. A folder
    of step directories itself (rl_hooks' PolicyTrainer.save) is its own checkpoint directory."""
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    if not cfg.checkpoint.dir and not ckpt_dir.is_dir() and any(run_dir.glob("step_*")):
        ckpt_dir = run_dir
    if step is None:
        found = find_resume_dir(ckpt_dir, "auto")
        if found is None:
            raise CheckpointError(f"'{ckpt_dir}' holds no checkpoint; train the run first or pass the run "
                                  "directory that has one")
        return found
    path = ckpt_dir / step_dir_name(step)
    if not path.is_dir():
        have = sorted(p.name for p in ckpt_dir.glob("step_*"))
        raise CheckpointError(f"'{path}' does not exist; pick --step from {', '.join(have) or 'nothing (no steps)'}")
    return path


def consolidated_state(cfg: Config, step_dir: Path) -> dict[str, torch.Tensor]:
    """The single-device model's state dict from checkpoint `step_dir`, whatever layout wrote
    it: every tensor read whole from the pieces its index records (each rank file verified by
    checkpoint.py: size and sha256; the model config checked against meta.json)."""
    from longctx_moe.train import resume_expectations

    reader = CheckpointReader(step_dir, resume_expectations(cfg))
    out = {}
    for key in reader.keys("model."):
        shape = reader.global_shape(key)
        out[key[len("model."):]] = reader.read(key, shape, (0,) * len(shape), shape)
    return out


def load_consolidated_model(cfg: Config, step_dir: Path) -> torch.nn.Module:
    """Our single-device model (fp32, eval) holding the weights of checkpoint `step_dir`."""
    from longctx_moe.model import build_model

    model = build_model(cfg.model).float().eval()
    load_model_state(model, consolidated_state(cfg, step_dir), str(step_dir))
    return model


# ---------------------------------------------------------------------- writing


def write_safetensors(model: torch.nn.Module, out: Path, dtype: torch.dtype, shard_bytes: int) -> list[Path]:
    """HF-named shards of at most `shard_bytes` (an expert's three tensors stay together) and the
    index; rl_hooks.export does the naming and bucketing, here on one rank (no gather)."""
    from safetensors.torch import save_file

    from longctx_moe.parallel.config import ParallelConfig
    from longctx_moe.parallel.dims import ParallelDims
    from rl_hooks.export import export_weights

    dims = ParallelDims.from_config(ParallelConfig(), 1)
    dims.build_groups(0)
    for stale in [*out.glob("model-*-of-*.safetensors"), out / INDEX, out / "model.safetensors"]:
        stale.unlink(missing_ok=True)  # a previous export's shards would be loaded alongside
    try:
        buckets = list(export_weights(model, dims, shard_bytes, dtype))
    except ValueError as e:
        raise ConfigError(f"{str(e).split(';')[0]} (the shard size cap); raise --max-shard-size") from None
    files, weight_map, total = [], {}, 0
    for i, bucket in enumerate(buckets):
        path = out / f"model-{i + 1:05d}-of-{len(buckets):05d}.safetensors"
        save_file(dict(bucket), str(path), metadata={"format": "pt"})
        for name, t in bucket:
            weight_map[name] = path.name
            total += t.numel() * t.element_size()
        files.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def write_config_json(cfg: ModelConfig, out: Path, dtype: torch.dtype) -> None:
    hf = to_hf_config(cfg)  # RoPE has no trained length limit: HF's default max_position_embeddings
    hf.architectures = ["Qwen3MoeForCausalLM"]
    hf.dtype = dtype
    hf.save_pretrained(out)


def write_tokenizer(data_path: Path, out: Path) -> str:
    """Copy the corpus' `tokenizers` JSON and a minimal tokenizer_config.json (transformers loads
    it as a PreTrainedTokenizerFast); returns what was done, for the command's report."""
    from data_packing.tokenizer import EOS_TOKEN, PAD_TOKEN

    src = data_path / "tokenizer.json"
    if not src.is_file():
        return f"no tokenizer written: '{src}' does not exist"
    shutil.copyfile(src, out / "tokenizer.json")
    added = {t.get("content") for t in json.loads(src.read_text()).get("added_tokens", [])}
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config.update({k: v for k, v in (("eos_token", EOS_TOKEN), ("pad_token", PAD_TOKEN)) if v in added})
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return f"tokenizer: copied '{src}' (PreTrainedTokenizerFast, {', '.join(sorted(config)[:-1]) or 'no special tokens'})"


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, dtype: str = "fp32",
               shard_bytes: int = 2 * 10**9) -> list[str]:
    """Write the HF directory `out` from run `run_dir`'s checkpoint; returns report lines.
    Raises ConfigError / CheckpointError (one line) or ValueError (a model Qwen3-MoE lacks)."""
    run_dir, out = Path(run_dir), Path(out)
    cfg = load_config(run_dir / "config.yaml")
    _check_supported(cfg.model)  # before reading gigabytes of checkpoint
    step_dir = checkpoint_step_dir(cfg, run_dir, step)
    model = load_consolidated_model(cfg, step_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = write_safetensors(model, out, DTYPES[dtype], shard_bytes)
    write_config_json(cfg.model, out, DTYPES[dtype])
    return [f"exported {step_dir} ({dtype}) to {out}: {len(files)} safetensors shard(s), config.json",
            write_tokenizer(_data_dir(cfg.data.path, run_dir), out)]


def _data_dir(path: str, run_dir: Path) -> Path:
    """data.path as the run wrote it: absolute, relative to the config's own folder, or (as a
    `make train` run from the repository root writes it) relative to the working directory."""
    beside = run_dir / path
    return beside if not Path(path).is_absolute() and (beside / "tokenizer.json").is_file() else Path(path)


# ---------------------------------------------------------------------- reading (train.init_from)

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
