"""torch.compile applied to a built (and parallelized) model, block by block (`train.compile`).

Why: on a CPU whose memory bandwidth is a few GB/s per core, every eager elementwise op over a
[T, D] activation costs about a millisecond, and a block runs dozens of them (norms, q/k norms,
RoPE, casts, residuals, router softmax, SwiGLU) in forward and backward. Inductor fuses them into
a few loops. What it must not trace is marked `eager_only` (torch.compiler.disable, applied
lazily; see below) where it is defined:

- `attention.attend`: the varlen kernels plan buckets on the host (data-dependent shapes), and
  the CP executors run collectives;
- `MoE.dispatch`: expert row counts are data dependent (padding, all-to-all splits);
- `MoE.stats`: drops padding rows by boolean mask (data-dependent shapes).

Each remaining piece of a block has static shapes for a fixed row length, so it compiles once and
is reused by every block (parameters are graph inputs, not constants). Parameter names and the
state dict are unchanged (`nn.Module.compile` compiles in place), so checkpoints move freely
between compiled and eager runs. Apply after parallelize (TP's hooks and EP's expert slices
are then part of what is compiled), as torchtitan does.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

_DYNAMO = "torch._dynamo"


def eager_only(fn: Callable) -> Callable:
    """`torch.compiler.disable(fn)`, without importing torch._dynamo when the module is imported.

    Why: `torch.compiler.disable` imports dynamo, ~2 s of CPU in every process (a 4-rank run on
    2 cores waits ~4 s longer for its first step), and only compiled runs need it. Until dynamo
    is loaded nothing can be compiling, so the wrapper calls `fn` directly; from then on it calls
    `torch.compiler.disable(fn)`. Dynamo never inlines the wrapper (it carries dynamo's disable
    mark): it breaks the graph there and calls it eagerly, as it would a disabled function."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _DYNAMO not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True
    return call


def _skip_eager_only_frames() -> None:
    """Dynamo need not trace the wrappers' own frames (one code object for all of them): it
    would find nothing to compile there. `skip_code` is private; without it they are traced."""
    from torch._dynamo import eval_frame

    skip = getattr(eval_frame, "skip_code", None)
    if skip is not None:
        skip(eager_only(lambda: None).__code__)


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every transformer block and the final norm in place; returns the model."""
    _skip_eager_only_frames()
    for block in model.layers:
        block.compile()
    model.norm.compile()
    return model
