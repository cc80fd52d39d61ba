"""torch.compile applied to a built (and parallelized) model, block by block (`train.compile`).

Why: on a CPU whose memory bandwidth is a few GB/s per core, every eager elementwise op over a
[T, D] activation costs about a millisecond, and a block runs dozens of them (norms, q/k norms,
RoPE, casts, residuals, router softmax, SwiGLU) in forward and backward. Inductor fuses them into
a few loops. What it must not trace is kept eager with `torch.compiler.disable`:

- `attn.attn_fn`: the varlen kernels plan buckets on the host (data-dependent shapes), and the
  CP executors run collectives;
- `ffn.dispatcher`: expert row counts are data dependent (padding, all-to-all splits);
- `ffn.stats`: drops padding rows by boolean mask (data-dependent shapes).

Each remaining piece of a block has static shapes for a fixed row length, so it compiles once and
is reused by every block (parameters are graph inputs, not constants). Parameter names and the
state dict are unchanged (`nn.Module.compile` compiles in place), so checkpoints move freely
between compiled and eager runs. Apply after parallelize (it wraps the swapped-in attn_fn and
dispatcher), as torchtitan does.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every transformer block and the final norm in place; returns the model."""
    for block in model.layers:
        block.attn.attn_fn = torch.compiler.disable(block.attn.attn_fn)
        if block.is_moe:
            block.ffn.dispatcher = torch.compiler.disable(block.ffn.dispatcher)
            block.ffn.stats = torch.compiler.disable(block.ffn.stats)
        block.compile()
    model.norm.compile()
    return model
