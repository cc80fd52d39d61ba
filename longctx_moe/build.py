"""Building a run: the layout, data and backend checks, the parallelized model and its runtime,
and the loader. Every check fails at start-up with one line naming the key and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from data_packing.batch import pad_multiple
from longctx_moe.checkpoint.errors import agree
from longctx_moe.config import Config, ConfigError
from longctx_moe.precision import PARAM_DTYPES as _PARAM_DTYPES
from longctx_moe.process import RunContext


def check_data_against_model(cfg: Config) -> dict:
    """Read the packed corpus' metadata; the vocabulary must fit the model's embedding."""
    from data_packing.loader import read_metadata

    if not (Path(cfg.data.path) / "metadata.json").is_file():
        raise ConfigError(f"data.path='{cfg.data.path}' has no metadata.json; run `make data` "
                          "(or longctx-pack --output DIR) and set data.path=DIR")
    try:
        meta = read_metadata(cfg.data.path)
    except ValueError as e:
        raise ConfigError(f"data.path: {e}") from None
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"the corpus at data.path has vocab_size={meta['vocab_size']} > model.vocab_size="
                          f"{cfg.model.vocab_size}; set model.vocab_size={meta['vocab_size']}")
    return meta


def check_layout(cfg: Config, world_size: int, table: bool = True):
    """The parallel layout on `world_size` ranks (ParallelDims, no groups yet) or a ConfigError;
    `table=False`: the same rules, returning only the degrees (no group table: cheap enough to
    judge thousands of layouts)."""
    from longctx_moe.parallel.dims import ParallelDims, layout_degrees

    try:
        if not table:
            return layout_degrees(cfg.parallel, world_size, cfg.model, cfg.balance)
        return ParallelDims.from_config(cfg.parallel, world_size, cfg.model, cfg.balance)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_dims(cfg: Config, ctx: RunContext):
    dims = check_layout(cfg, ctx.world_size)
    dims.build_groups(ctx.rank)
    return dims


def target_of(cfg: Config, device: torch.device):
    """What the execution choices are resolved against: the device, the run's compute and
    parameter dtypes, compilation and the TP degree."""
    from longctx_moe.execution import Target
    from longctx_moe.precision import resolve_compute_dtype

    param_dtype = _PARAM_DTYPES[cfg.train.param_dtype]
    compute = resolve_compute_dtype(cfg.train.autocast_dtype, param_dtype, device).dtype
    return Target(torch.device(device).type, compute, param_dtype, cfg.train.compile, cfg.parallel.tp)


def resolve_ops(cfg: Config, device: torch.device, rl: bool = False):
    """The run's Ops (longctx_moe.execution; `rl`: for an RL policy): a choice the device cannot
    honour fails at start-up with one line, not at the first forward; so do model widths FP8
    GEMMs cannot take."""
    from longctx_moe.execution import resolve

    try:
        ops = resolve(cfg.execution, target_of(cfg, device), cfg.train.recompute, rl)
        if ops.fp8 != "none":  # refused by building the model on meta
            from longctx_moe.model import Transformer

            with torch.device("meta"):
                Transformer(cfg.model, ops)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return ops


def model_of(cfg: Config, device: torch.device | str = "cpu", meta: bool = False):
    """`cfg`'s single-device model with the ops resolved for `device` and its balance settings:
    randomly initialised (deterministic under torch.manual_seed), or on `meta` without weights for
    a loader to fill. Library callers that build from a Config go through here, so that no
    execution.* or train.recompute setting is accepted and then ignored."""
    from longctx_moe.model import Transformer, build_model

    ops = resolve_ops(cfg, torch.device(device))
    if meta:
        with torch.device("meta"):
            return Transformer(cfg.model, ops, cfg.balance)
    return build_model(cfg.model, ops, cfg.balance)


def build_runtime(cfg: Config, dims: Any, device: torch.device, ops: Any = None):
    """Build the single-device model with the run's Ops (resolved here unless given), apply the
    parallel layout (also on one rank: the capacity and drop policy of the dispatcher, the
    global-batch aux loss) and return its runtime."""
    from longctx_moe.model import build_model
    from longctx_moe.precision import cast_params

    ops = resolve_ops(cfg, device) if ops is None else ops
    torch.manual_seed(cfg.train.seed)  # same init on every rank: replicas start identical
    dtype = _PARAM_DTYPES[cfg.train.param_dtype]
    if cfg.train.init_from:  # each rank reads only its slices into a model built on meta
        from longctx_moe.hf.load import load_hf_sharded
        from longctx_moe.model import Transformer

        with torch.device("meta"):
            model = cast_params(Transformer(cfg.model, ops, cfg.balance), dtype)
        runtime = _parallelize(cfg, model, dims)
        load_hf_sharded(model, cfg.train.init_from, device)
    else:
        model = cast_params(build_model(cfg.model, ops, cfg.balance).to(device=device), dtype)
        runtime = _parallelize(cfg, model, dims)
    if cfg.train.compile:
        from longctx_moe.compile import apply_compile

        apply_compile(model)
    return runtime


def _parallelize(cfg: Config, model: Any, dims: Any, counts: Any = None):
    """`counts`: where routing counts come from (the device by default; parallelize)."""
    from longctx_moe.parallel.parallelize import parallelize

    try:
        return parallelize(model, dims, cfg.parallel, cfg.data.micro_batch_tokens, counts)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_loader(cfg: Config, dims: Any):
    from data_packing.loader import build_step_loader

    layout = pad_multiple(cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel)
    try:
        return build_step_loader(cfg.data, dims.rank_in("dp", dims.rank or 0), dims.size("dp"), layout)
    except ValueError as e:  # the loader's messages name the data.* key and the fix
        raise ConfigError(str(e)) from None


def check_dynamic_cp_fits(cfg: Config, runtime: Any, loader: Any) -> None:
    """Under Dynamic-CP, the corpus's longest document must fit the largest run."""
    if runtime.dynamic is not None:
        try:
            runtime.dynamic.check_longest(int(loader.ds.doc_lengths.max()), cfg.data.path)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def start_up(cfg: Config, ctx: RunContext) -> tuple[Any, Any]:
    """(runtime, loader): the layout, data and backend checks, the model and the loader.
    Collective: a problem on any rank stops every rank with the same one-line ConfigError."""
    built, error = None, None
    try:
        dims = build_dims(cfg, ctx)
        check_data_against_model(cfg)
        built = build_runtime(cfg, dims, ctx.device), build_loader(cfg, dims)
        check_dynamic_cp_fits(cfg, *built)
    except ConfigError as e:
        error = str(e)
    agree(error, cls=ConfigError)
    return built
