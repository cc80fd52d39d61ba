"""How the model runs, apart from what it is: the `execution:` section of the training config, and
`Ops`, every implementation choice resolved once from that section and the device.

Model code never decides which kernel runs: it is handed an `Ops` (frozen) at construction and
each module takes its own choice as a constructor argument. Nothing below the trainer reads the
environment, a context variable or /proc to pick a path; what the device can do is asked here, once.

    ops = resolve(cfg.execution, Target.of(cfg.train, device))
    print("\\n".join(ops.lines()))          # one line per choice, with its reason
    model = Transformer(cfg.model, ops)

Each op has a torch path (the reference every other path is tested against) and may have a
Triton path (CUDA; CPU only under Triton's interpreter, for tests) and a C++ path (x86-64 CPUs with
AVX512-BF16, cp_attention's native extension). `execution.kernels` sets the family every op
follows; an op's own setting overrides it. A path the device cannot run is refused at start-up in
one line when asked for by name; under `auto` the op falls back to torch and the reason says why.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field

import torch

from cp_attention.kernels import BACKENDS as ATTENTION_BACKENDS
from cp_attention.kernels import AttnKernel
from longctx_moe.choices import check_choice

KERNEL_FAMILIES = ("auto", "torch", "triton", "cpp")
# The paths each op has besides torch.
OP_PATHS = {"norm": ("triton", "cpp"), "swiglu": ("triton", "cpp"), "rope": ("triton",),
            "logprobs": ("triton", "cpp"), "router": ("triton",), "permute": ("triton",),
            "attention_kernels": ("cpp",)}
GROUPED_GEMM = ("auto", "grouped_mm", "loop")
EXPERT_PRECISION = ("auto", "autocast", "param")
FP8 = ("none", "torch", "te")
FP8_RECIPES = ("tensor", "block", "delayed")
# float64 runs only where the interpreter runs it (tests): on a GPU the Triton kernels serve the
# dtypes they are tuned for, as the attention registry leaves float64 to its reference backend.
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The native extension's kernels (cp_attention.native) behind each op's C++ path.
_NATIVE = {"norm": ("rmsnorm",), "swiglu": ("swiglu",), "logprobs": ("logprobs",),
           "attention_kernels": ("attention_fwd", "attention_bwd")}


@dataclass
class ExecutionConfig:
    """The `execution:` section. Every key changes how the model computes, never what."""

    # varlen attention backend (cp_attention.kernels): auto | torch_cpu | reference |
    # torch_varlen | flex | flash_attn
    attention_backend: str = "auto"
    # The path every op below takes unless it names its own: auto (the device's fastest: Triton
    # on CUDA, C++ on an AVX512-BF16 CPU, torch elsewhere) | torch | triton | cpp
    kernels: str = "auto"
    norm: str = "auto"  # RMSNorm and residual add + RMSNorm: auto | torch | triton | cpp
    # SwiGLU's activation: auto | torch | triton (the experts and the dense MLPs) | cpp (the experts)
    swiglu: str = "auto"
    rope: str = "auto"  # rotary embedding of q and k: auto | torch | triton
    logprobs: str = "auto"  # the log-prob / entropy head's softmax work: auto | torch | triton | cpp
    router: str = "auto"  # scores + top-k + weights after the router GEMM: auto | torch | triton
    permute: str = "auto"  # MoE permute / un-permute + weighted sum: auto | torch | triton
    attention_kernels: str = "auto"  # CPU attention forward/backward: auto | torch (aten) | cpp
    grouped_gemm: str = "auto"  # expert GEMMs: auto | grouped_mm | loop
    # Dtype of the expert GEMMs under autocast: autocast (weights cast every forward) | param (the
    # weights' own dtype) | auto (autocast, except an explicit bf16 autocast on a device without
    # native bf16, where bf16 experts would run 20-30x slower)
    expert_precision: str = "auto"
    # FP8 GEMMs in the blocks (longctx_moe.model.fp8): none | torch (torch._scaled_mm; CUDA with
    # compute capability >= 8.9) | te (not built: refused)
    fp8: str = "none"
    # tensor (one scale per tensor) | block (DeepSeek-V3's 1 x 128 / 128 x 128 tiles; Hopper) |
    # delayed (TE's DelayedScaling over fp8_amax_history optimizer steps)
    fp8_recipe: str = "tensor"
    fp8_amax_history: int = 16
    # Cross-entropy over the vocabulary in chunks of this many tokens (bounds fp32 logits memory).
    loss_chunk_tokens: int = 1024
    # A log-prob head keeps a micro-batch's logits for its backward when they fit in this many
    # MiB instead of recomputing them (a quarter of the head's GEMM work); 0 always recomputes.
    loss_logits_cache_mb: int = 128
    # Each document's attention and expert rows computed as if alone in its micro-batch, so a
    # sequence's log-probs do not depend on its neighbours (cp_attention.kernels._buckets):
    # null (auto: on for an RL policy, rl_hooks.PolicyTrainer; off for `longctx-moe train`) |
    # true | false
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_choice("execution.attention_backend", self.attention_backend, ("auto", *ATTENTION_BACKENDS))
        check_choice("execution.kernels", self.kernels, KERNEL_FAMILIES)
        for op, paths in OP_PATHS.items():
            check_choice(f"execution.{op}", getattr(self, op), ("auto", "torch", *paths))
        check_choice("execution.grouped_gemm", self.grouped_gemm, GROUPED_GEMM)
        check_choice("execution.expert_precision", self.expert_precision, EXPERT_PRECISION)
        check_choice("execution.fp8", self.fp8, FP8)
        check_choice("execution.fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        for key in ("loss_chunk_tokens", "fp8_amax_history"):
            if getattr(self, key) < 1:
                raise ValueError(f"execution.{key}={getattr(self, key)} must be >= 1")
        if self.loss_logits_cache_mb < 0:
            raise ValueError(f"execution.loss_logits_cache_mb={self.loss_logits_cache_mb} must be >= 0 "
                             "(0: the log-prob head recomputes its logits in the backward)")
        # the recipe keys act only under fp8 (the history only under delayed scaling): refused
        # rather than ignored
        if self.fp8 == "none" and self.fp8_recipe != "tensor":
            raise ValueError(f"execution.fp8_recipe={self.fp8_recipe} scales FP8 GEMMs, and execution.fp8=none "
                             "runs none; set execution.fp8=torch or drop fp8_recipe")
        if self.fp8_recipe != "delayed" and self.fp8_amax_history != 16:
            raise ValueError(f"execution.fp8_amax_history={self.fp8_amax_history} is the history of "
                             "execution.fp8_recipe=delayed; set that or drop fp8_amax_history")


@dataclass(frozen=True)
class Target:
    """What the resolution needs to know of the run: the device type, the dtype matmuls run in,
    the parameters' dtype, whether the blocks are compiled, and the TP degree (FP8 widths)."""

    device: str = "cpu"
    compute_dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    compile: bool = False
    tp: int = 1

    @property
    def autocast(self) -> bool:
        return self.compute_dtype != self.param_dtype


@dataclass(frozen=True)
class Ops:
    """Every implementation choice of a run, resolved. `attention` carries the backend, the batch
    invariance and the CPU attention kernels to cp_attention; the op paths are "torch",
    "triton" or "cpp"; `reasons` says why each was chosen, in words."""

    attention: AttnKernel = AttnKernel("torch_cpu", native_forward=False, native_backward=False)
    norm: str = "torch"
    swiglu: str = "torch"
    rope: str = "torch"
    logprobs: str = "torch"
    router: str = "torch"
    permute: str = "torch"
    grouped_gemm: str = "auto"
    expert_precision: str = "autocast"
    fp8: str = "none"
    fp8_recipe: str = "tensor"
    fp8_amax_history: int = 16
    fp8_grouped: bool = False  # the experts' FP8 forward as one grouped GEMM (kernels/fp8_grouped.py)
    loss_chunk_tokens: int = 1024
    loss_logits_cache_mb: int = 128
    recompute: str = "none"  # train.recompute: none | selective | full (longctx_moe.model.recompute)
    device: str = "cpu"  # the device type the choices were made for
    reasons: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def batch_invariant(self) -> bool:
        """Each document computed as if alone: the attention kernel's choice, which the expert
        GEMMs' row padding follows."""
        return self.attention.batch_invariant

    def lines(self) -> list[str]:
        """One line per choice: `ops: <name> = <value> (<reason>)`."""
        why = dict(self.reasons)
        return [f"ops: {name} = {value} ({why[name]})" if name in why else f"ops: {name} = {value}"
                for name, value in self.as_dict().items()]

    def as_dict(self) -> dict:
        """The resolved values (what the start-up lines print)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("attention", "reasons")}
        a = self.attention
        return {"attention_backend": a.backend, "attention_kernels": "cpp" if a.native_forward else "torch",
                **out, "batch_invariant": a.batch_invariant}

    def replace(self, **changes) -> Ops:
        """A copy with some choices changed (tests and benchmarks compare paths in one process)."""
        attention = {k: changes.pop(k) for k in ("backend", "batch_invariant", "native_forward",
                                                 "native_backward") if k in changes}
        return dataclasses.replace(self, **changes, attention=dataclasses.replace(self.attention, **attention))


# ---------------------------------------------------------------- what the device can do


def triton_unavailable(target: Target) -> str | None:
    """None when the Triton kernels can run for `target`, else a cause-and-fix sentence."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'longctx-moe[triton]')"
    if target.device == "cpu" and not _triton_interpreting():
        return ("Triton kernels run on CUDA tensors; on CPU only under Triton's interpreter "
                "(TRITON_INTERPRET=1, for tests)")
    if target.device not in ("cpu", "cuda"):
        return f"Triton kernels run on CUDA tensors, not {target.device}"
    return None


def _triton_interpreting() -> bool:
    # Triton's own switch (read by triton itself): its interpreter runs kernels on CPU tensors.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def native_unavailable(op: str, target: Target) -> str | None:
    """None when the C++ kernels of `op` are built and self-checked for `target`, else why not."""
    if target.device != "cpu":
        return f"the C++ kernels run on CPU tensors, not {target.device}"
    from cp_attention import native

    for kernel in _NATIVE[op]:
        reason = native.unavailable_reason(kernel)
        if reason is not None:
            return reason
    return None


# ---------------------------------------------------------------- resolution


def _op_path(cfg: ExecutionConfig, op: str, target: Target) -> tuple[str, str]:
    """(path, reason) of one op; a named path the device cannot run raises ValueError."""
    setting, paths = getattr(cfg, op), OP_PATHS[op]
    source = f"execution.{op}={setting}"
    if setting == "auto":
        setting, source = cfg.kernels, f"execution.kernels={cfg.kernels}"
        if setting in ("triton", "cpp") and setting not in paths:
            return "torch", f"{source}, and {op} has no {setting} path"
    if setting == "torch":
        return "torch", source
    if setting == "auto":
        return _auto_path(op, paths, target)
    reason = _path_unavailable(setting, op, target)
    if reason is not None:
        key = f"execution.{op}" if getattr(cfg, op) != "auto" else "execution.kernels"
        raise ValueError(f"{key}={setting}: {reason}; use {key}=auto or torch")
    return setting, source


def _path_unavailable(path: str, op: str, target: Target) -> str | None:
    if path == "triton":
        return triton_unavailable(target)
    return native_unavailable(op, target)


def _auto_path(op: str, paths: tuple[str, ...], target: Target) -> tuple[str, str]:
    if target.compile and op in ("norm", "router", "rope"):
        # inside the compiled blocks inductor fuses these into Triton kernels of its own; an
        # extension call would break the graph
        return "torch", "auto: train.compile fuses it inside the compiled blocks"
    if target.device == "cuda" and "triton" in paths:
        reason = triton_unavailable(target)
        if reason is None and target.compute_dtype not in _TRITON_DTYPES:
            reason = f"the Triton kernels are not tuned for {target.compute_dtype}"
        return ("triton", "auto: CUDA with triton installed") if reason is None else ("torch", f"auto: {reason}")
    if target.device == "cpu" and "cpp" in paths:
        if target.compute_dtype == torch.float64:
            return "torch", "auto: float64 runs on torch (the exactness reference)"
        reason = native_unavailable(op, target)
        return ("cpp", "auto: the C++ kernel is built and self-checked on this CPU") if reason is None \
            else ("torch", f"auto: {reason}")
    return "torch", f"auto: no faster path for {op} on {target.device}"


def _attention(cfg: ExecutionConfig, target: Target, native: str) -> tuple[AttnKernel, str]:
    from cp_attention.kernels import resolve_backend

    try:
        name = resolve_backend(cfg.attention_backend, torch.device(target.device), target.compute_dtype)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"execution.attention_backend={cfg.attention_backend!r}: {e}") from None
    cpp = name == "torch_cpu" and native == "cpp"
    kernel = AttnKernel(name, batch_invariant=bool(cfg.batch_invariant), native_forward=cpp,
                        native_backward=cpp)
    why = f"execution.attention_backend={cfg.attention_backend} on {target.device} in {target.compute_dtype}"
    return kernel, why


def _expert_precision(cfg: ExecutionConfig, target: Target) -> tuple[str, str]:
    if cfg.expert_precision != "auto":
        return cfg.expert_precision, f"execution.expert_precision={cfg.expert_precision}"
    if target.autocast and target.compute_dtype == torch.bfloat16 and target.device == "cpu":
        from cp_attention.hardware import native_bf16

        native, why = native_bf16("cpu")
        if not native:
            return "param", f"auto: {why}; the experts stay in the weights' dtype"
    return "autocast", "auto: the experts compute in the run's compute dtype"


def _grouped_gemm(cfg: ExecutionConfig, target: Target) -> tuple[str, str]:
    works = _grouped_mm_runs(target)
    if cfg.grouped_gemm == "grouped_mm" and not works:
        raise ValueError(f"execution.grouped_gemm=grouped_mm cannot run {target.compute_dtype} on "
                         f"{target.device} (torch._grouped_mm runs fp32/bf16); use grouped_gemm=auto")
    if cfg.grouped_gemm != "auto":
        return cfg.grouped_gemm, f"execution.grouped_gemm={cfg.grouped_gemm}"
    if works:
        return "auto", "auto: torch._grouped_mm, one loop over experts where rows are not 16-byte aligned"
    return "loop", f"auto: torch._grouped_mm does not run {target.compute_dtype} on {target.device}"


def _grouped_mm_runs(target: Target) -> bool:
    """Whether torch._grouped_mm runs the run's GEMMs: probed on a device this process has; for a
    CUDA device it has not (a rehearsed GPU), torch's rule for Hopper and later: bf16."""
    from longctx_moe.model.grouped_gemm import grouped_mm_works

    if target.device == "cpu" or (target.device == "cuda" and torch.cuda.is_available()):
        return grouped_mm_works(target.device, target.compute_dtype)
    return hasattr(torch, "_grouped_mm") and target.compute_dtype == torch.bfloat16


def _fp8(cfg: ExecutionConfig, target: Target) -> str:
    from longctx_moe.kernels import fp8

    reason = fp8.unavailable_reason(cfg.fp8, target.device, target.tp, cfg.fp8_recipe)
    if reason is not None:
        raise ValueError(reason)
    return f"execution.fp8={cfg.fp8}" + (f", recipe {cfg.fp8_recipe}" if cfg.fp8 != "none" else "")


def _fp8_grouped(cfg: ExecutionConfig, target: Target) -> tuple[bool, str]:
    """Whether the experts' FP8 forward is one grouped call (torch's `_scaled_grouped_mm`): decided
    here for the run's GPU, not per call from a tensor's device."""
    from longctx_moe.kernels import fp8_grouped

    if cfg.fp8 == "none":
        return False, "execution.fp8=none"
    if cfg.fp8_recipe == "block":
        return False, "execution.fp8_recipe=block: one blockwise-scaled GEMM per expert"
    if target.compute_dtype != torch.bfloat16:
        return False, f"torch's grouped FP8 GEMM writes bf16, the run computes in {target.compute_dtype}"
    if target.device != "cuda":
        return False, f"torch's grouped FP8 GEMM runs on Hopper GPUs, not {target.device}"
    cap = torch.cuda.get_device_capability(target.device)
    if not fp8_grouped.runs_on(target.device, cap):
        return False, (f"torch {torch.__version__}'s grouped FP8 GEMM does not run on compute capability "
                       f"{cap[0]}.{cap[1]} (it needs Hopper, 9.x)")
    return True, "a Hopper GPU: torch._scaled_grouped_mm, one call per expert GEMM's forward"


def resolve(cfg: ExecutionConfig, target: Target, recompute: str = "none", rl: bool = False) -> Ops:
    """Every choice of `cfg` for `target` (and the activation recompute of train.recompute; `rl`:
    for an RL policy, where batch invariance defaults on), or ValueError with one line naming the
    key and the fix."""
    from longctx_moe.model.recompute import MODES

    check_choice("train.recompute", recompute, MODES)
    invariant = rl if cfg.batch_invariant is None else cfg.batch_invariant
    cfg = dataclasses.replace(cfg, batch_invariant=invariant)
    paths, reasons = {}, {}
    for op in OP_PATHS:
        paths[op], reasons[op] = _op_path(cfg, op, target)
    if recompute == "full" and paths["router"] == "triton":
        # The recomputation replays the forward's routes; the Triton router's replay path saves
        # other tensors than its forward, which checkpointing's recomputation must match.
        if cfg.router == "triton":
            raise ValueError("execution.router=triton cannot run train.recompute=full (its replay of the "
                             "forward's routes takes another path); use execution.router=auto or torch")
        paths["router"], reasons["router"] = "torch", "train.recompute=full replays the routes on the torch path"
    attention, reasons["attention_backend"] = _attention(cfg, target, paths.pop("attention_kernels"))
    reasons["attention_kernels"] = reasons.pop("attention_kernels")
    if attention.backend != "torch_cpu":
        reasons["attention_kernels"] = f"the {attention.backend} backend runs its own kernels"
    precision, reasons["expert_precision"] = _expert_precision(cfg, target)
    gemm, reasons["grouped_gemm"] = _grouped_gemm(cfg, target)
    reasons["fp8"] = _fp8(cfg, target)
    fp8_grouped, reasons["fp8_grouped"] = _fp8_grouped(cfg, target)
    reasons["batch_invariant"] = ("an RL policy's log-probs must not depend on their neighbours" if rl
                                  and invariant else "execution.batch_invariant")
    reasons["recompute"] = f"train.recompute={recompute}"
    return Ops(attention=attention, grouped_gemm=gemm, expert_precision=precision, fp8=cfg.fp8,
               fp8_recipe=cfg.fp8_recipe, fp8_amax_history=cfg.fp8_amax_history, fp8_grouped=fp8_grouped,
               loss_chunk_tokens=cfg.loss_chunk_tokens, loss_logits_cache_mb=cfg.loss_logits_cache_mb,
               recompute=recompute, device=target.device,
               reasons=tuple(reasons.items()),
               **paths)


_DEFAULTS: dict = {}


def default_ops(device: str = "cpu", batch_invariant: bool = False) -> Ops:
    """The ops of a default run on `device` with float32 parameters and the device's default
    compute dtype: what a model built without an explicit `Ops` gets (library use, tests)."""
    key = (device, batch_invariant)
    if key not in _DEFAULTS:
        from longctx_moe.precision import resolve_compute_dtype

        compute = resolve_compute_dtype("auto", torch.float32, device).dtype
        _DEFAULTS[key] = resolve(ExecutionConfig(batch_invariant=batch_invariant),
                                 Target(device, compute, torch.float32))
    return _DEFAULTS[key]


def torch_ops(**changes) -> Ops:
    """Every op on its torch path (the reference the other paths are tested against)."""
    return Ops().replace(**changes)


# The model.* keys that moved here: the config loader refuses them in one line naming the new key.
MOVED_MODEL_KEYS = ("attention_backend", "kernels", "grouped_gemm", "expert_precision", "fp8",
                    "fp8_recipe", "fp8_amax_history", "loss_chunk_tokens", "loss_logits_cache_mb")

__all__ = ["ExecutionConfig", "MOVED_MODEL_KEYS", "Ops", "Target", "default_ops", "resolve", "torch_ops"]
