"""The run configuration: nested dataclasses, YAML loading, dotted overrides, validation.

`Config` assembles the components' own configs (model, balance, execution, data, parallel, owned
by their packages) with the trainer's (optim, train, checkpoint, logging, defined here). Every
user-facing problem raises `ConfigError` with a one-line message naming the key, the cause and the
fix; the CLI prints it without a traceback.

    cfg = load_config("configs/tiny_cpu.yaml", ["model.num_experts=16", "train.steps=10"])
    write_config(cfg, run_dir / "config.yaml")
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from data_packing.config import DataConfig
from longctx_moe.choices import check_choice
from longctx_moe.execution import MOVED_MODEL_KEYS as EXECUTION_KEYS
from longctx_moe.execution import ExecutionConfig
from longctx_moe.host import ALLOCATOR_MODES, HOST_TUNING
from longctx_moe.model.config import BalanceConfig, ModelConfig
from longctx_moe.model.flops import pair_cost_ratio
from longctx_moe.model.recompute import MODES as RECOMPUTE_MODES
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.precision import AUTOCAST_CHOICES


class ConfigError(ValueError):
    """A bad configuration: the message is one line that names the key and the fix."""


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate, reached at the end of warmup
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at train.steps
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | linear | constant (all after a linear warmup)
    weight_decay: float = 0.1  # applied to matrices only (not norms, biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    impl: str = "auto"  # auto | fused | foreach | for_loop: torch AdamW implementation
    offload: str = "none"  # none | cpu: AdamW state and masters in host memory, stepped there


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # What the model holds: fp32 (the master weights) | fp64 (tests) | bf16 (linear and expert
    # weights; fp32 masters in the optimizer, sharded with parallel.distributed_optimizer)
    param_dtype: str = "fp32"
    # Compute dtype: auto (bf16 where the device has native bf16, else the parameters' dtype;
    # longctx_moe.precision) | bf16 | fp16 | none
    autocast_dtype: str = "auto"
    nan_policy: str = "stop"  # stop | skip: what a non-finite loss or grad norm does
    # intra-op CPU threads per rank; 0 = cores // local ranks where the host is tuned (host_tuning),
    # torch's own count elsewhere
    num_threads: int = 0
    # torch.compile each block (longctx_moe.compile): fuses the elementwise ops; the first steps
    # pay the compilation (cached on disk by inductor for later runs).
    compile: bool = False
    # Activation recompute (longctx_moe.model.recompute): none | selective (the experts' SwiGLU
    # recomputed in the backward) | full (whole blocks); routes stay fixed.
    recompute: str = "none"
    # glibc malloc (longctx_moe.host): tuned (freed blocks up to 32 MiB reused: speed) | lean
    # (blocks above 1 MiB returned on free: memory, for long context and CP ranks) | default
    # (glibc's own) | auto (tuned where the host is tuned, glibc's own elsewhere)
    host_allocator: str = "auto"
    # Process-wide CPU settings (longctx_moe.host: denormals, threads, malloc, oneDNN's caches):
    # full | none | auto (full for `longctx-moe train`, none for a PolicyTrainer inside an RL
    # framework's process, which then changes only what train.num_threads / host_allocator name)
    host_tuning: str = "auto"
    # Hand the heap's free pages back to the OS (glibc malloc_trim) after a step whose resident set
    # grew by more than this fraction since the last trim; bounds the creep of a long CPU run as
    # new lengths land in new heap holes (longctx_moe.host.HeapTrim). 0 = never.
    host_heap_trim: float = 0.1
    run_dir: str = "runs/default"
    # A Hugging Face directory of a supported MoE family (longctx-moe export-hf, or a download)
    # whose weights start the run; its config.json fills model.* (longctx_moe.hf.families), each
    # rank reading only its slices. A checkpoint to resume wins.
    init_from: str = ""
    # A Hugging Face config.json (a file, or a directory holding one) whose architecture fills
    # model.* without weights (longctx_moe.hf.config_file), e.g. configs/models/qwen3-30b-a3b.json:
    # random weights of a published shape. Not with init_from, whose own config.json gives it.
    model_config: str = ""
    # A collective that waits longer than this (a peer crashed or hangs) raises instead of
    # blocking forever; covers the slowest checkpoint save or load of one rank.
    process_group_timeout_s: float = 600.0


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" = <train.run_dir>/checkpoints
    every_steps: int = 0  # 0 = only the final checkpoint
    keep_last: int = 2  # older step directories are deleted; 0 keeps all
    save_final: bool = True
    resume: str = "auto"  # auto (latest in dir if any) | none | <path of a step directory>
    # Write the rank files on a background thread after a CPU copy of the state; the step is
    # published at the first step boundary after every rank's write (the next save and the end
    # of training wait for it).
    async_save: bool = False


@dataclass
class LoggingConfig:
    log_every: int = 1  # write a metrics.jsonl line every N steps (the last step always)
    progress_bar: bool = True
    # Per-rank peak for MFU; 0 = measure once (well under a second) in the run's compute dtype
    peak_tflops: float = 0.0
    metrics_file: str = "metrics.jsonl"  # relative to train.run_dir
    tensorboard: bool = False  # also write TensorBoard events into train.run_dir/tensorboard


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# Closed sets of string values of the sections defined here. The model, balance, execution, data
# and parallel sections check their own (their `validate()`, run when each is made, _build).
CHOICES: dict[str, tuple[str, ...]] = {
    "optim.schedule": ("cosine", "linear", "constant"), "optim.offload": ("none", "cpu"),
    "optim.impl": ("auto", "fused", "foreach", "for_loop"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.param_dtype": ("fp32", "fp64", "bf16"),
    "train.autocast_dtype": AUTOCAST_CHOICES,
    "train.nan_policy": ("stop", "skip"), "train.recompute": RECOMPUTE_MODES,
    "train.host_allocator": ALLOCATOR_MODES,
    "train.host_tuning": HOST_TUNING,
}

# ---------------------------------------------------------------- building from dicts


@functools.cache  # every --set walks its path again: uncached, 3/4 of load_config's time
def _field_types(cls: type) -> types.MappingProxyType:
    # The dataclasses' string annotations (`from __future__ import annotations`), resolved; shared
    return types.MappingProxyType(typing.get_type_hints(cls))


# Keys that left model.* (which holds the architecture alone): old key -> the section holding it
# now; each section with the reason, in words, that the key is not architecture.
MOVED_MODEL_KEYS = {**dict.fromkeys(EXECUTION_KEYS, "execution"),
                    **dict.fromkeys((f.name for f in dataclasses.fields(BalanceConfig)), "balance")}
_MOVED_BECAUSE = {"execution": "a choice of how the model runs, not of what it is",
                  "balance": "how training balances the experts, not part of the architecture"}


def _unknown_key(prefix: str, name: str, options: list[str]) -> ConfigError:
    if prefix == "model." and name in MOVED_MODEL_KEYS:
        section = MOVED_MODEL_KEYS[name]
        return ConfigError(f"model.{name} is {_MOVED_BECAUSE[section]}: write it as {section}.{name}")
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    hint = f"did you mean '{prefix}{close[0]}'?" if close else f"known keys: {', '.join(options)}"
    return ConfigError(f"unknown config key '{prefix}{name}'; {hint}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value to the annotated type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _coerce(key, value, args[0])
    if value is None:
        raise ConfigError(f"{key}: null is not allowed; give a {_type_name(tp)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list like [1, 2], got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, recursing into nested dataclasses."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in data.items():
        if name not in hints:
            raise _unknown_key(prefix, str(name), names)
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, tp)
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own check: the message names `<section>.<key>` already
        raise ConfigError(str(e)) from None


def config_from_dict(data: dict) -> Config:
    """Build and validate a Config from a nested mapping (unknown keys are errors).

    data.cost_per_token_pair, when not given, is derived from the model (see _derive_pair_cost)."""
    cfg = _build(Config, data, "")
    validate(cfg)
    if "cost_per_token_pair" not in (data.get("data") or {}):
        cfg.data.cost_per_token_pair = _derive_pair_cost(cfg)
    return cfg


def _derive_pair_cost(cfg: Config) -> float:
    # The loader balances ranks by cost_per_token * L + cost_per_token_pair * causal pairs. With
    # the pair term at the model's FLOP ratio the balance follows the training FLOPs of this
    # model; a fixed default is right for one model only (DataConfig's 6.2e-4: the default one).
    # Scaled by cost_per_token, which sets the unit.
    return cfg.data.cost_per_token * pair_cost_ratio(cfg.model)


# ---------------------------------------------------------------- overrides


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' has no '='; write it as key=value, e.g. model.top_k=2")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # a plain string such as a path with ':' in it
    return key, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set dotted keys (`model.num_experts=16`) in the nested mapping `data`, in order.

    Values are parsed as YAML scalars/lists (`true`, `null`, `[2, 2]`, `1e-3`) and coerced to the
    field's type when the Config is built; unknown keys are reported there with a suggestion.
    """
    for item in overrides:
        key, value = _parse_override(item)
        _check_path(key)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return data


def _check_path(key: str) -> None:
    """Report an unknown dotted key early, with a suggestion at the level that is wrong."""
    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"override '{key}': '{'.'.join(parts[:i])}' is a value, not a section")
        hints = _field_types(cls)
        if part not in hints:
            prefix = ".".join(parts[:i]) + "." if i else ""
            raise _unknown_key(prefix, part, list(hints))
        cls = hints[part]
    if dataclasses.is_dataclass(cls):
        raise ConfigError(f"override '{key}' names a section; set one of its keys, e.g. {key}.{dataclasses.fields(cls)[0].name}=...")


# ---------------------------------------------------------------- files


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int):
        super().__init__(key, line)
        self.key, self.line = key, line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently,
    so a second `lr:` would override the first without a word)."""


def _unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise _DuplicateKey(key, key_node.start_mark.line + 1)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (a binary file?); pass a YAML file, "
                          "e.g. configs/tiny_cpu.yaml") from None


def load_yaml(path: str | Path) -> dict:
    """The mapping of sections in the YAML file `path`; ConfigError for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file, e.g. configs/tiny_cpu.yaml")
    try:
        data = yaml.load(_read_text(path), Loader=_StrictLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"config file '{path}' sets '{e.key}' twice in one section (second at line "
                          f"{e.line}); keep one of them") from None
    except yaml.reader.ReaderError as e:  # a control character such as NUL
        raise ConfigError(f"config file '{path}' holds a non-printable character at offset {e.position} "
                          "(a binary file?); pass a YAML text file, e.g. configs/tiny_cpu.yaml") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}; fix the syntax there") from None
    if data is None:
        raise ConfigError(f"config file '{path}' holds no settings; add sections (model:, data:, ...), "
                          "e.g. start from configs/tiny_cpu.yaml")
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections (model:, data:, ...), got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or start from defaults when `path` is None), apply overrides, validate."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(data, list(overrides or []))
    model_config = (data.get("train") or {}).get("model_config")
    if model_config:  # a config.json alone: the architecture keys of model.*, no weights
        from longctx_moe.hf.config_file import fill_model_from_file

        fill_model_from_file(data, model_config)
    init_from = (data.get("train") or {}).get("init_from")
    if init_from:  # a Hugging Face directory: its config.json fills the architecture keys of model.*
        from longctx_moe.hf.load import fill_model_from_hf

        fill_model_from_hf(data, init_from)
    return config_from_dict(data)


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def write_config(cfg: Config, path: str | Path, notes: list[str] | None = None) -> Path:
    """Write the resolved config as YAML (atomically: temp file + rename); `notes` (the run's
    resolved ops) follow as comments: what the device made of the config, which a rerun resolves
    again on its own device."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    comments = "".join(f"# {line}\n" for line in notes or [])
    tmp.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False) + comments)
    tmp.replace(path)
    return path


# ---------------------------------------------------------------- validation


def _check_choices(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        try:
            check_choice(key, getattr(getattr(cfg, section), name), allowed)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_trainer(cfg: Config) -> None:
    o, t = cfg.optim, cfg.train
    _require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
             f"optim.betas={o.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    _require(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(t.param_dtype != "fp64" or t.autocast_dtype in ("none", "auto"),
             f"train.param_dtype=fp64 with train.autocast_dtype={t.autocast_dtype} would compute in low precision; "
             "set train.autocast_dtype=none or auto")
    # bf16 weights without autocast would run norms and softmax in bf16; under fp16 autocast
    # they would be cast bf16 -> fp16 (a narrower range) on every matmul.
    _require(t.param_dtype != "bf16" or t.autocast_dtype in ("auto", "bf16"),
             f"train.param_dtype=bf16 with train.autocast_dtype={t.autocast_dtype}: bf16 parameters "
             "compute under bf16 autocast; set train.autocast_dtype=bf16 (or auto)")
    _require(t.param_dtype != "bf16" or cfg.execution.fp8 == "none",
             f"train.param_dtype=bf16 with execution.fp8={cfg.execution.fp8}: the FP8 layers quantize "
             "from float32 weights; set train.param_dtype=fp32 or execution.fp8=none")
    _require(not (t.compile and cfg.parallel.micro_batches_in_flight == 2),
             "train.compile=true with parallel.micro_batches_in_flight=2: compiled blocks are not run from "
             "two threads here; set one of them off")
    _require(t.host_heap_trim >= 0, f"train.host_heap_trim={t.host_heap_trim} must be >= 0 (0 = never trim)")
    _require(t.num_threads >= 0, f"train.num_threads={t.num_threads} must be >= 0 (0 = automatic)")
    _require(0 < t.process_group_timeout_s < float("inf"),
             f"train.process_group_timeout_s={t.process_group_timeout_s} must be a number of seconds > 0, e.g. 600")
    _require(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps must be >= 0 (0 = only at the end)")
    _require(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last must be >= 0 (0 keeps all)")
    _require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every} must be >= 1")
    _require(cfg.logging.peak_tflops >= 0, "logging.peak_tflops must be >= 0 (0 = measure)")
    _require(not cfg.logging.tensorboard or importlib.util.find_spec("tensorboard") is not None,
             "logging.tensorboard needs the tensorboard package: pip install tensorboard "
             "(or set logging.tensorboard=false)")


def _check_balance(cfg: Config) -> None:
    """A balance setting with nothing to act on is refused, not ignored."""
    b, default = cfg.balance, type(cfg.balance)()
    _require(cfg.model.expert_bias or b.expert_bias_update_rate == default.expert_bias_update_rate,
             f"balance.expert_bias_update_rate={b.expert_bias_update_rate} moves the aux-loss-free expert bias, "
             "and model.expert_bias=false has none; set model.expert_bias=true or drop the rate")
    _require(b.aux_loss_type != "none" or b.aux_loss_coeff == default.aux_loss_coeff,
             f"balance.aux_loss_coeff={b.aux_loss_coeff} scales the aux loss, and balance.aux_loss_type=none "
             "computes none; set aux_loss_type=seq or switch, or drop the coefficient")


def _float_fields(node: Any, prefix: str = ""):
    """(dotted key, value) of every float setting, lists included, in declaration order."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if isinstance(value, float):
            yield f"{prefix}{f.name}", value
        elif isinstance(value, list):
            yield from ((f"{prefix}{f.name}", v) for v in value if isinstance(v, float))
        elif hasattr(type(value), "__dataclass_fields__"):  # a section (the planner validates thousands)
            yield from _float_fields(value, f"{prefix}{f.name}.")


def _check_finite(cfg: Config) -> None:
    # No setting means anything at inf or nan: an lr of inf passes "> 0" and trains to nan on the
    # first step. Runs after the sections' own checks, whose messages name the valid range.
    for key, value in _float_fields(cfg):
        _require(math.isfinite(value), f"{key}={value} is not a finite number; set a finite value")


def validate(cfg: Config) -> None:
    """Raise ConfigError (one line) for the first invalid value. The model, balance, execution,
    data and parallel sections checked their own when they were made (_build)."""
    _check_choices(cfg)
    _check_trainer(cfg)
    _check_balance(cfg)
    _check_finite(cfg)
