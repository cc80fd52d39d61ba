"""Activation recompute: trade compute for memory at long context (`train.recompute`).

    none       every activation is kept for the backward
    selective  the experts' SwiGLU is recomputed in the backward: its saved tensors (the [M, 2F]
               gate/up projections, M = tokens x top-k; `none` already recomputes silu and the
               activation from them) are the largest per-token activations of an MoE block, and
               recomputing them costs two grouped GEMMs.
               The attention core is not recomputed: a flash-style kernel saves only q, k, v, its
               output and the logsumexp, and all but the logsumexp are kept anyway as inputs of the
               projections around it, so recomputing it would cost a whole attention forward (the
               dominant cost at long context) for no memory. Measured on one 32K-token document
               (bench/long_context.py's model): both forms peaked at 5.1 GiB (none: 6.2 GiB), with
               the core recomputed at 0.83x the tokens/s of none, without it at 0.97x.
    full       whole blocks are recomputed: only each block's input is kept

Routes are held fixed in a recomputed block: the first forward records every token's experts and
the recomputation replays them (DocLayout's router replay), so a top-k tie that rounding could
flip in bf16 cannot send a token to other experts in the backward than in the forward. Recompute
is exact: gradients equal the run without it (float64, tests/model/test_recompute.py).

Non-reentrant `torch.utils.checkpoint` recomputes through saved-tensor hooks, so outputs of any
structure (a block's MoE statistics) and inputs without gradients (the layout) pass through, and
collectives inside (CP executors, EP all-to-alls) run again in the backward in the same order on
every rank (the backward visits blocks in the same reverse order everywhere).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def recompute_call(fn, *args):
    """fn(*args), its activations recomputed in the backward instead of kept."""
    return checkpoint(fn, *args, use_reentrant=False)


class BlockRecompute:
    """One block call under full recompute: records the routes of the first forward and replays
    them in the recomputation (a new object per call: it holds that call's routes)."""

    def __init__(self, block):
        self.block, self.routes_TK = block, None

    def __call__(self, x_TD: torch.Tensor, layout, replay_TK: torch.Tensor | None):
        if self.routes_TK is not None:  # the recomputation: the experts the forward chose
            replay_TK = self.routes_TK
        *out, stats = self.block(x_TD, layout, replay_TK)  # the stream and the branch (Block)
        if stats is not None and self.routes_TK is None:
            self.routes_TK = stats.topk_idx_TK.detach()
        return *out, stats
