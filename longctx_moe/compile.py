"""torch.compile applied to a built (and parallelized) model, block by block (`train.compile`).

Why: on a CPU whose memory bandwidth is a few GB/s per core, every eager elementwise op over a
[T, D] activation costs about a millisecond, and a block runs dozens of them (norms, q/k norms,
RoPE, casts, residuals, router softmax, SwiGLU) in forward and backward. Inductor fuses them into
a few loops. What it must not trace is marked `torch.compiler.disable` where it is defined:

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

from torch import nn


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every transformer block and the final norm in place; returns the model."""
    for block in model.layers:
        block.compile()
    model.norm.compile()
    return model
