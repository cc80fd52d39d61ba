"""Every parallel layout of a model on N GPUs that the configuration accepts.

A candidate is a choice of TP (with sequence parallelism when TP > 1), CP and its backend (ring,
Ulysses, hierarchical with a node-sized all-to-all inside), EP, ETP, Dynamic-CP, the recompute
mode, the distributed optimizer and the precision (PRECISIONS: fp32 or bf16 parameters, FP8
GEMMs, AdamW on the device or on the host); DP and EDP follow from the world. Each candidate
becomes the Config a user would write, and the program's own checks judge it: the config's
validation, `build.check_layout`, and the execution choices resolved for the rehearsed CUDA GPU
(with the model built on meta where FP8 is on, as the trainer's start-up does). A candidate they
refuse is dropped with its one-line reason, never proposed.

Two precision combinations the program refuses are not enumerated, to keep the walk short:
bf16 parameters with FP8 (validate: the FP8 layers quantize from fp32 weights; not among
PRECISIONS) and FP8 with TP > 1 (kernels/fp8.unavailable_reason, asked for a Hopper GPU).
judge() refuses both all the same where a caller builds one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator

import torch

from longctx_moe.build import check_layout
from longctx_moe.config import Config, ConfigError, validate
from longctx_moe.execution import ExecutionConfig
from longctx_moe.model.recompute import MODES as RECOMPUTE_MODES
from longctx_moe.rehearsal.gpus import GPU, GPUS, as_cuda_device

# (train.param_dtype, FP8 GEMMs, where AdamW steps) by the name --precision takes; not bf16 with
# FP8, which validate refuses (the FP8 layers quantize from fp32 weights)
PRECISIONS = {
    "fp32": ("fp32", False, "device"),
    "fp32+fp8": ("fp32", True, "device"),
    "bf16": ("bf16", False, "device"),
    "fp32+host": ("fp32", False, "host"),
    "fp32+fp8+host": ("fp32", True, "host"),
    "bf16+host": ("bf16", False, "host"),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    cp_backend: str  # ring | ulysses | hierarchical
    cp_inner: int  # all-to-all size of hierarchical CP (cp otherwise)
    ep: int
    etp: int
    dynamic_cp: bool
    recompute: str
    distributed_optimizer: bool
    world: int
    param_dtype: str = "fp32"  # train.param_dtype: fp32 | bf16
    fp8: bool = False  # execution.fp8=torch (the tensor recipe)
    optimizer: str = "device"  # where AdamW steps: device | host (optim.offload=cpu)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.ep * self.etp)

    @property
    def sequence_parallel(self) -> bool:
        """TP runs with sequence parallelism wherever there is TP (config_of)."""
        return self.tp > 1

    @property
    def model_parallel(self) -> int:
        """Ways one layer's weights are split on a rank (attention's TP times the experts' EP x ETP
        over the attention's): what more memory per GPU lets a layout give up."""
        return self.tp * self.cp * self.ep * self.etp

    def label(self) -> str:
        cp = f"cp{self.cp}"
        if self.cp > 1:
            cp += {"ring": "r", "ulysses": "u"}.get(self.cp_backend, f"h{self.cp_inner}")
        precision = (f"{' bf16' if self.param_dtype == 'bf16' else ''}{' fp8' if self.fp8 else ''}"
                     f"{' hostadam' if self.optimizer == 'host' else ''}")
        return (f"tp{self.tp} {cp}{'+dyn' if self.dynamic_cp else ''} dp{self.dp} ep{self.ep} "
                f"etp{self.etp} rc={self.recompute}{' dopt' if self.distributed_optimizer else ''}{precision}")

    @property
    def precision(self) -> str:
        """The name of the layout's precision in PRECISIONS (what --precision takes)."""
        return (f"{self.param_dtype}{'+fp8' if self.fp8 else ''}"
                f"{'+host' if self.optimizer == 'host' else ''}")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "dp": self.dp, "edp": self.edp, "precision": self.precision}


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def precisions_of(spec: str) -> list[str]:
    """The precision names of `--precision` ("all", or a comma list of PRECISIONS' names), or
    ValueError in one line."""
    if spec == "all":
        return list(PRECISIONS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names:
        raise ValueError(f"--precision {spec!r}: {', '.join(unknown) or 'no name'} is not one of "
                         f"{', '.join(PRECISIONS)} (or all); bf16 with fp8 is refused by the configuration")
    return names


@functools.cache
def _fp8_refused(tp: int) -> bool:
    """Whether the program refuses FP8 GEMMs at TP degree `tp` on a Hopper GPU (its own rule)."""
    from longctx_moe.kernels import fp8

    with as_cuda_device(GPUS["h100"]):
        return fp8.unavailable_reason("torch", "cuda", tp) is not None


def _precisions(tp: int, names: list[str]) -> list[tuple[str, bool, str]]:
    """(param dtype, FP8, optimizer) of `names` that the program can run at TP `tp`."""
    out = []
    for name in names:
        dtype, fp8, optimizer = PRECISIONS[name]
        if fp8 and _fp8_refused(tp):
            continue
        out.append((dtype, fp8, optimizer))
    return out


def candidates(world: int, num_experts: int, gpus_per_node: int = 8, precision: str = "all") -> Iterator[Layout]:
    """Every combination worth judging: TP inside a node (its collectives run every layer), CP and
    EP degrees dividing the world, ETP a power of two inside a node, and each precision of
    `precision` (precisions_of) the program can run at the layout's TP."""
    names = precisions_of(precision)
    for tp in [t for t in _powers(gpus_per_node) if world % t == 0]:
        kinds = _precisions(tp, names)
        for cp in [c for c in _divisors(world // tp) if c & (c - 1) == 0]:
            backends = [("ring", cp)] if cp == 1 else [("ring", cp), ("ulysses", cp)] + [
                ("hierarchical", i) for i in _powers(gpus_per_node // tp) if 1 < i < cp]
            for backend, inner in backends:
                for ep in [e for e in _divisors(max(num_experts, 1)) if world % e == 0]:
                    for etp in [t for t in _powers(gpus_per_node) if world % (t * ep) == 0]:
                        for dyn in (False, True) if world // tp > 1 else (False,):
                            for rc in RECOMPUTE_MODES:
                                for dopt in (False, True) if world > 1 else (False,):
                                    for dtype, fp8, optimizer in kinds:
                                        yield Layout(tp, cp, backend, inner, ep, etp, dyn, rc, dopt, world,
                                                     dtype, fp8, optimizer)


def config_of(base: Config, layout: Layout, max_tokens_per_rank: int = 0) -> Config:
    """`base` with `layout`'s parallel section, recompute mode and precision: the config a user
    would run. FP8 runs the tensor recipe (the one timing.py prices; the base's FP8 settings are
    replaced, as its parallel section is)."""
    p = dataclasses.replace(
        base.parallel, tp=layout.tp, sequence_parallel=layout.sequence_parallel, cp=layout.cp, dp=-1,
        ep=layout.ep, etp=layout.etp, cp_backend=layout.cp_backend,
        hierarchical_sizes=[layout.cp_inner, layout.cp // layout.cp_inner]
        if layout.cp_backend == "hierarchical" else None,
        dynamic_cp=layout.dynamic_cp, max_cp=0,
        max_tokens_per_rank=max_tokens_per_rank if layout.dynamic_cp else 0,
        distributed_optimizer=layout.distributed_optimizer)
    defaults = ExecutionConfig()
    execution = dataclasses.replace(base.execution, fp8="torch" if layout.fp8 else "none",
                                    fp8_recipe=defaults.fp8_recipe, fp8_amax_history=defaults.fp8_amax_history)
    return dataclasses.replace(
        base, parallel=p, execution=execution,
        train=dataclasses.replace(base.train, recompute=layout.recompute, param_dtype=layout.param_dtype),
        optim=dataclasses.replace(base.optim, offload="cpu" if layout.optimizer == "host" else "none"))


def judge(base: Config, layout: Layout, gpu: GPU | None = None) -> str | None:
    """None when the configuration accepts `layout` on `gpu` (default an H100), else its
    one-line reason."""
    try:
        cfg = config_of(base, layout)
        validate(cfg)
        check_layout(cfg, layout.world, table=False)
        _check_ops(cfg, gpu or GPUS["h100"])
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def _check_ops(cfg: Config, gpu: GPU) -> None:
    """The trainer's start-up checks of the execution choices (build.resolve_ops), for the
    rehearsed CUDA GPU: the choices resolved there, and with FP8 on the model built on meta
    (FP8 refuses widths its GEMMs cannot take). ValueError in one line."""
    from longctx_moe.rehearsal.fake_world import cuda_ops

    with as_cuda_device(gpu):
        ops = cuda_ops(cfg)
    if ops.fp8 != "none":
        reason = _fp8_model_refusal(cfg.model, ops)
        if reason:
            raise ValueError(reason)


_FP8_MODELS: dict[tuple[str, str], str] = {}  # (model, ops) -> its build's refusal, "" if none


def _fp8_model_refusal(model, ops) -> str:
    """Why building `model` with FP8 `ops` on meta fails ("" if it builds): once per model and
    ops, since the walk judges thousands of layouts of one model."""
    from longctx_moe.model import Transformer

    key = (json.dumps(dataclasses.asdict(model), sort_keys=True, default=str), repr(ops))
    if key not in _FP8_MODELS:
        try:
            with torch.device("meta"):
                Transformer(model, ops)
            _FP8_MODELS[key] = ""
        except ValueError as e:
            _FP8_MODELS[key] = str(e)
    return _FP8_MODELS[key]


def accepted(base: Config, world: int, gpus_per_node: int = 8,
             precision: str = "all") -> tuple[list[Layout], dict[str, int]]:
    """(the layouts the configuration accepts, refusal reason -> how many candidates it refused)."""
    ok, refused = [], {}
    for layout in candidates(world, base.model.num_experts, gpus_per_node, precision):
        reason = judge(base, layout)
        if reason is None:
            ok.append(layout)
        else:
            refused[reason] = refused.get(reason, 0) + 1
    return ok, refused
