"""The LM head's logits kept from a log-prob forward for its backward (execution.loss_logits_cache_mb).

A log-prob head's backward needs each chunk's logits again. Recomputing them costs one more
[C, D] x [D, V] product per chunk, a quarter of the head's GEMM work; keeping them costs N x V
values of the compute dtype. Both the torch head (model.losses) and the Triton head
(triton_logprobs) keep them when they fit in the budget; the recomputed logits are the kept ones
bit for bit, so the choice changes speed and memory, never a result.
"""

from __future__ import annotations

import torch


def keeps_logits(ctx, n: int, v: int, cdtype: torch.dtype, keep_bytes: int) -> bool:
    """Whether the forward of an autograd Function keeps its N x V logits: only when a gradient
    of h or W is wanted and they fit in keep_bytes."""
    return any(ctx.needs_input_grad[:2]) and n * v * torch.finfo(cdtype).bits // 8 <= keep_bytes


def kept_logits(kept: list, i: int) -> torch.Tensor | None:
    """Chunk i's kept logits, handed over once: a backward may write its gradient over them, so a
    second backward through a retained graph finds None and recomputes them."""
    if i >= len(kept):
        return None
    z_CV, kept[i] = kept[i], None
    return z_CV
