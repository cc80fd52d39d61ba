"""Triton kernels for the steps of a GPU step spent outside GEMMs and attention, and the one
setting that selects them (`model.kernels`).

This package is the Triton adapter: `triton` is imported only by its kernel modules
(`triton_*.py`), and those are imported only through `ops()`, lazily, once a call site has
decided to use them. Each kernel has a torch fallback, which is the code path the model runs
without this package:

| kernel | Triton module | torch path |
|---|---|---|
| MoE permute / unpermute (per-expert padded rows) | triton_permute | moe.LocalDispatcher |
| router scores + top-k + weights | triton_router | moe.Router |
| log-prob + entropy statistics per vocabulary chunk | triton_logprobs | losses._LinearLogProbs |
| RMSNorm, and residual add + RMSNorm | triton_rmsnorm | layers._RMSNormFn |

CPU-side modules live here too, outside `model.kernels`: three C++ (AVX512) kernels that the torch
path uses on CPUs where cp_attention's builder builds its kernels (as it uses the C++ attention
kernels), each with an environment switch to turn it off - `cpu_logprobs`, the log-prob head's
softmax work on bf16 logits (`LONGCTX_CPU_LOGPROBS=0`); `cpu_rmsnorm`, RMSNorm in one pass per
row each way (`LONGCTX_CPU_RMSNORM=0`); `cpu_swiglu`, the experts' SwiGLU activation in one pass
each way (`LONGCTX_CPU_SWIGLU=0`) - and `logits_cache`, the rule by which both log-prob heads keep
their forward's logits for the backward (`model.loss_logits_cache_mb`).

`model.kernels`: "torch" never uses them; "triton" always does (refused at start-up where it
cannot run: without the package, or on CPU outside the interpreter); "auto" uses them for CUDA
tensors of a dtype the kernels are tuned for when the package is installed, torch elsewhere.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import SimpleNamespace

import torch

KERNEL_CHOICES = ("auto", "torch", "triton")
# float64 runs only where the interpreter runs it (tests); on a GPU "auto" leaves it to torch, as
# the attention registry leaves float64 to its reference backend.
_AUTO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True under Triton's interpreter, which runs kernels on CPU tensors with numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(device) -> str | None:
    """None when the Triton kernels can run on `device`, else a cause-and-fix sentence."""
    device = torch.device(device)
    if not _installed():
        return ("the triton package is not installed (pip install 'longctx-moe[triton]'); "
                "use model.kernels=auto or torch")
    if device.type == "cpu" and not interpreting():
        return ("Triton kernels run on CUDA tensors; on CPU only under Triton's interpreter "
                "(TRITON_INTERPRET=1, for tests); use model.kernels=auto or torch")
    if device.type not in ("cpu", "cuda"):
        return f"Triton kernels run on CUDA tensors, not {device.type}; use model.kernels=torch"
    return None


def check_kernels(setting: str, device) -> None:
    """Raise a one-line ValueError when `setting` cannot run on `device` (start-up check)."""
    if setting not in KERNEL_CHOICES:
        raise ValueError(f"model.kernels={setting!r} is not allowed; choose one of "
                         f"{', '.join(KERNEL_CHOICES)}")
    reason = unavailable_reason(device) if setting == "triton" else None
    if reason is not None:
        raise ValueError(f"model.kernels='triton': {reason}")


def use_triton(setting: str, x: torch.Tensor) -> bool:
    """Whether the call on tensor `x` runs the Triton kernel under `setting`."""
    # Inside torch.compile (train.compile traces the blocks) inductor fuses the norms, residuals and
    # router maths into Triton kernels of its own; ours serve eager mode and what compile leaves
    # out (MoE dispatch, the loss head).
    if setting == "torch" or torch.compiler.is_compiling():
        return False
    if setting == "auto":
        return x.is_cuda and x.dtype in _AUTO_DTYPES and _installed()
    check_kernels(setting, x.device)  # "triton", or a bad value: refuse with the same line
    return True


@functools.cache
def ops() -> SimpleNamespace:
    """The Triton entry points (imports triton on first call)."""
    mods = {name: importlib.import_module(f"{__package__}.triton_{name}")
            for name in ("permute", "router", "logprobs", "rmsnorm")}
    return SimpleNamespace(
        permute=mods["permute"].permute, unpermute=mods["permute"].unpermute,
        router_topk=mods["router"].router_topk,
        linear_logprobs=mods["logprobs"].linear_logprobs,
        rmsnorm=mods["rmsnorm"].rmsnorm, add_rmsnorm=mods["rmsnorm"].add_rmsnorm,
    )


__all__ = ["KERNEL_CHOICES", "check_kernels", "interpreting", "ops", "unavailable_reason",
           "use_triton"]
