"""CUDA's autocast, for tensors on the `meta` device that stand for a GPU's.

torch has no autocast for `meta` (`torch.autocast("meta")` and `torch.is_autocast_enabled("meta")`
raise, and CUDA's autocast leaves meta tensors alone), so a rehearsal of a run with float32
masters and bf16 autocast would compute, and keep for the backward, float32 activations: twice
the memory of the GPU run. `meta_autocast(dtype)` gives the meta device the same rules for the
block: the program's own `torch.autocast(device_type, ...)`, `torch.is_autocast_enabled` and
`torch.get_autocast_dtype` calls (and activation checkpointing's, which restores the state in its
recomputation) answer for "meta" as CUDA's do, and within each of the program's meta autocast
regions a function mode casts the floating inputs of the ops on CUDA autocast's lower-precision
list to `dtype` above autograd, as autocast does, so the casts and the bf16 copies the backward
keeps are real ops on real (meta) tensors. The mode is entered by the region, not once around the
block: `loss.backward()` is itself a torch function, which a function mode handles with itself
switched off, so a mode entered outside the backward is off where activation checkpointing
recomputes a block; the region checkpointing opens for its recomputation brings its own. Regions
the program runs with autocast disabled (the router's float32 maths) are left alone. Every other
device keeps torch's own autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The ops of CUDA autocast's lower-precision list that this program calls (torch/csrc/autograd's
# autocast_mode.cpp, "lower_precision_fp" for CUDA), at the Python level where autocast casts.
_LOWER = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.baddbmm, torch.addmm, torch.einsum,
          F.scaled_dot_product_attention, torch.Tensor.matmul, torch.Tensor.__matmul__,
          torch.Tensor.mm, torch.Tensor.bmm}
if hasattr(torch, "_grouped_mm"):
    _LOWER.add(torch._grouped_mm)  # not on autocast's list: the program casts by hand, as here


class _State:
    def __init__(self, dtype: torch.dtype):
        self.stack = [False]
        self.dtype = dtype

    @property
    def on(self) -> bool:
        return self.stack[-1]


class _CastMode(TorchFunctionMode):
    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.state.on and func in _LOWER:
            args, kwargs = torch.utils._pytree.tree_map(self._cast, (args, kwargs))
        return func(*args, **kwargs)

    def _cast(self, x):
        if isinstance(x, torch.Tensor) and x.is_meta and x.is_floating_point() and x.dtype != self.state.dtype \
                and x.dtype != torch.float64:
            return x.to(self.state.dtype)
        return x


@contextlib.contextmanager
def _region(state: _State, enabled: bool) -> Iterator[None]:
    state.stack.append(enabled)
    try:
        with _CastMode(state):
            yield
    finally:
        state.stack.pop()


@contextlib.contextmanager
def meta_autocast(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """For the block: autocast on `meta` as on CUDA, to `dtype` where the program enables it."""
    state = _State(dtype)
    real_autocast, real_enabled, real_dtype = torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype
    real_available = torch.amp.is_autocast_available

    def autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type != "meta":
            return real_autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        return _region(state, bool(enabled))

    def is_enabled(device_type=None):
        if device_type == "meta":
            return state.on
        return real_enabled() if device_type is None else real_enabled(device_type)

    def get_dtype(device_type):
        return state.dtype if device_type == "meta" else real_dtype(device_type)

    def available(device_type):  # activation checkpointing asks before it restores the state
        return device_type == "meta" or real_available(device_type)

    with (mock.patch.object(torch, "autocast", autocast), mock.patch.object(torch.amp, "autocast", autocast),
          mock.patch.object(torch.amp, "is_autocast_available", available),
          mock.patch.object(torch, "is_autocast_enabled", is_enabled),
          mock.patch.object(torch, "get_autocast_dtype", get_dtype)):
        yield
