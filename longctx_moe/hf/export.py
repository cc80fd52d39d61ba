"""Hugging Face directories on disk (the model's family, model.hf_family): export a run's checkpoint.

`export_run` (the `longctx-moe export-hf RUN_DIR OUT` command) consolidates the per-rank model
states of one checkpoint step into the single-device model's state dict and writes

    OUT/model-00001-of-0000N.safetensors ...   one tensor per expert and projection (the names
    OUT/model.safetensors.index.json           hf.weights streams to engines), shards capped
    OUT/config.json                            hf.interop.to_hf_config of the run's model.*
                                               (the family's config class and architectures)
    OUT/tokenizer.json, tokenizer_config.json  the corpus tokenizer, when data.path has one

No process group is needed: the checkpoint's index records every piece's global shape and
offsets (longctx_moe.checkpoint), so each tensor is read whole whatever layout (TP, EP, world
size) wrote it.

Reading such a directory back (train.init_from) is longctx_moe.hf.load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from longctx_moe.checkpoint.errors import CheckpointError
from longctx_moe.checkpoint.reader import CheckpointReader
from longctx_moe.checkpoint.steps import find_resume_dir, step_dir_name
from longctx_moe.checkpoint.trainer_state import load_model_state, resume_expectations
from longctx_moe.config import Config, ConfigError, load_config
from longctx_moe.hf.interop import _check_supported, to_hf_config
from longctx_moe.model.config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------- consolidation


def checkpoint_step_dir(cfg: Config, run_dir: Path, step: int | None) -> Path:
    """The step directory to export: `latest` (with checkpoint/steps.py's fallback) or step N. A folder
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
    checkpoint/rank_file.py: size and sha256; the model config checked against meta.json)."""
    reader = CheckpointReader(step_dir, resume_expectations(cfg))
    out = {}
    for key in reader.keys("model."):
        shape = reader.global_shape(key)
        out[key[len("model."):]] = reader.read(key, shape, (0,) * len(shape), shape)
    return out


def load_consolidated_model(cfg: Config, step_dir: Path) -> torch.nn.Module:
    """Our single-device model (fp32, eval) holding the weights of checkpoint `step_dir`."""
    from longctx_moe.build import model_of

    model = model_of(cfg).float().eval()
    load_model_state(model, consolidated_state(cfg, step_dir), str(step_dir))
    return model


# ---------------------------------------------------------------------- writing


def write_safetensors(model: torch.nn.Module, out: Path, dtype: torch.dtype, shard_bytes: int) -> list[Path]:
    """HF-named shards of at most `shard_bytes` (an expert's three tensors stay together) and the
    index; hf.weights does the naming and bucketing, here on one rank (no gather)."""
    from safetensors.torch import save_file

    from longctx_moe.hf.weights import export_weights
    from longctx_moe.parallel.config import ParallelConfig
    from longctx_moe.parallel.dims import ParallelDims

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
    hf = to_hf_config(cfg)
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
    Raises ConfigError / CheckpointError (one line) or ValueError (a model its family lacks)."""
    run_dir, out = Path(run_dir), Path(out)
    # The run's config.yaml holds the resolved model.*; the directory it started from may be gone.
    cfg = load_config(run_dir / "config.yaml", ["train.init_from="])
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
