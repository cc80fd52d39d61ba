"""Backend names, availability checks and lazy loading (GPU packages are imported only here,
through their one adapter module, and only when asked for)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

BACKENDS = ("torch_cpu", "reference", "torch_varlen", "flex", "flash_attn")
_MODULES = {"torch_cpu": "torch_cpu", "reference": "_reference_backend",
            "torch_varlen": "torch_varlen", "flex": "flex", "flash_attn": "flash_attn"}
_CUDA_PREFERENCE = ("flash_attn", "torch_varlen", "flex")


@dataclass(frozen=True)
class AttnKernel:
    """How attention runs, decided once by the caller (longctx_moe.execution resolves it at
    start-up): `backend` a BACKENDS name or "auto"; `batch_invariant` puts every document in a
    bucket of its own, so its output does not depend on its neighbours (see _buckets);
    `native_forward` / `native_backward` let torch_cpu run our C++ kernels where they serve the
    call (bf16 causal self-attention) and are built. A plain backend name passed where an
    AttnKernel is taken means AttnKernel(name): not invariant, C++ kernels where built."""

    backend: str = "auto"
    batch_invariant: bool = False
    native_forward: bool = True
    native_backward: bool = True


def as_kernel(backend: str | AttnKernel) -> AttnKernel:
    return backend if isinstance(backend, AttnKernel) else AttnKernel(backend)


def load_backend(name: str):
    """The adapter module of a resolved backend (exposes forward / backward)."""
    return importlib.import_module(f"{__package__}.{_MODULES[name]}")


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    """None when `name` can run on `device`, else a short cause-and-fix sentence."""
    if name in ("torch_cpu", "reference"):
        if name == "torch_cpu" and device.type != "cpu":
            return f"torch_cpu runs on CPU tensors, not {device.type}; use backend='auto'"
        return None
    return load_backend(name).unavailable_reason(device)


def _auto_cuda(device: torch.device, dtype: torch.dtype | None) -> str:
    # The flash kernels take fp16/bf16 only; flex also runs float32; float64 has only the reference.
    if dtype == torch.float64:
        return "reference"
    prefs = _CUDA_PREFERENCE if dtype in (None, torch.float16, torch.bfloat16) else ("flex",)
    for cand in prefs:
        if _unavailable_reason(cand, device) is None:
            return cand
    return "reference"


def resolve_backend(name: str, device, dtype: torch.dtype | None = None) -> str:
    """Turn "auto" or a backend name into a backend that can run on `device` (and `dtype`, when
    given, for "auto"), or raise a one-line error naming the cause and the fix."""
    device = torch.device(device)
    if name == "auto":
        return "torch_cpu" if device.type == "cpu" else _auto_cuda(device, dtype)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {('auto',) + BACKENDS}")
    reason = _unavailable_reason(name, device)
    if reason is not None:
        raise RuntimeError(f"attention backend {name!r} is unavailable: {reason}")
    return name


def check_window_support(name: str, device: torch.device) -> None:
    """Raise a one-line error when backend `name` cannot run sliding-window attention here (a
    window it cannot apply is refused, never ignored). Every backend's module may define
    window_unsupported_reason(device); those that do not support windows everywhere."""
    reason_fn = getattr(load_backend(name), "window_unsupported_reason", None)
    reason = reason_fn(torch.device(device)) if reason_fn is not None else None
    if reason is not None:
        raise RuntimeError(f"attention backend {name!r} cannot apply a sliding window: {reason}")


def offset_backend(name: str, device: torch.device) -> str:
    """The backend that runs a call with an offset alignment (attn_forward(offset=)) for resolved
    backend `name`: itself when its module sets TAKES_OFFSET, else flex (a torch path) where flex
    runs and takes the window; otherwise a one-line error (never a silently misaligned mask)."""
    if getattr(load_backend(name), "TAKES_OFFSET", False):
        return name
    device = torch.device(device)
    if _unavailable_reason("flex", device) is None:
        return "flex"
    raise RuntimeError(f"attention backend {name!r} cannot move its causal/window alignment "
                       "(offset, needed by sliding windows under ring CP) and flex is unavailable "
                       f"on {device.type}; use attention_backend=flex or parallel.cp_backend=ulysses")
