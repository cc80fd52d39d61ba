"""Test helpers: a stand-in experts module, an unsharded, loop-based MoE reference, and the
concatenation of micro-batches into one packed row (the global-batch reference).

Legend: T tokens, D model dim, F expert hidden, E experts, K top-k, L experts held by one rank.
The stand-in has GroupedExperts' call signature, `experts(x_MD, tokens_per_local_expert_L)`, and
holds its weights as [L, ...] slices of the full [E, ...] tensors, as EP sharding does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from data_packing.batch import PackedBatch


class LoopExperts(nn.Module):
    """SwiGLU-free two-layer experts y = silu(x @ w1[e]) @ w2[e], looped (works in float64)."""

    def __init__(self, w1_EDF: torch.Tensor, w2_EFD: torch.Tensor, offset: int, count: int):
        super().__init__()
        self.w1_LDF = nn.Parameter(w1_EDF[offset:offset + count].clone())
        self.w2_LFD = nn.Parameter(w2_EFD[offset:offset + count].clone())
        self.num_local_experts, self.expert_offset = count, offset

    def forward(self, x_MD: torch.Tensor, tokens_per_local_expert_L: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_local_expert_L.tolist()
        assert len(counts) == self.num_local_experts and sum(counts) == x_MD.shape[0]
        outs, start = [], 0
        for e, n in enumerate(counts):
            h = torch.nn.functional.silu(x_MD[start:start + n] @ self.w1_LDF[e])
            outs.append(h @ self.w2_LFD[e])
            start += n
        return torch.cat(outs) if outs else x_MD[:0]


def kept_assignments(idx_TK, weight_TK, num_experts, capacity_factor, policy):
    """Reference capacity rule on one rank's tokens: set of kept (t, k), by plain Python loops."""
    T, K = idx_TK.shape
    pairs = [(t, k) for t in range(T) for k in range(K)]
    if capacity_factor is None:
        return set(pairs)
    cap = math.ceil(capacity_factor * T * K / num_experts)
    kept = set()
    for e in range(num_experts):
        mine = [(t, k) for t, k in pairs if int(idx_TK[t, k]) == e]
        if policy == "probs":
            # highest weight first; ties: earlier assignment first (stable sort)
            mine = sorted(mine, key=lambda p: -float(weight_TK[p]))
        kept.update(mine[:cap])
    return kept


def reference_moe(x_TD, idx_TK, weight_TK, w1_EDF, w2_EFD, kept):
    """y[t] = sum over kept (t, k) of weight[t, k] * expert_{idx[t, k]}(x[t])."""
    rows = []
    for t in range(x_TD.shape[0]):
        y = x_TD.new_zeros(x_TD.shape[1])
        for k in range(idx_TK.shape[1]):
            if (t, k) in kept:
                e = int(idx_TK[t, k])
                y = y + weight_TK[t, k] * (torch.nn.functional.silu(x_TD[t] @ w1_EDF[e]) @ w2_EFD[e])
        rows.append(y)
    return torch.stack(rows) if rows else x_TD[:0]


def concat_batches(batches: list[PackedBatch]) -> PackedBatch:
    """The micro-batches as one packed row (documents never attend across rows or documents,
    so every token's output is unchanged): the reference of one global-batch statistic."""
    cat = lambda name: torch.cat([getattr(b, name) for b in batches])

    def cu(name, end):  # each row's bounds shifted by the rows before it (real or physical)
        offsets = torch.tensor([0] + [end(b) for b in batches]).cumsum(0).tolist()
        return torch.cat([getattr(batches[0], name)[:1]] + [
            getattr(b, name)[1:] + o for b, o in zip(batches, offsets, strict=False)])

    return PackedBatch(tokens=cat("tokens"), labels=cat("labels"),
                       cu_seqlens=cu("cu_seqlens", lambda b: int(b.cu_seqlens[-1])),
                       cu_seqlens_padded=cu("cu_seqlens_padded", lambda b: b.num_tokens),
                       position_ids=cat("position_ids"), max_seqlen=max(b.max_seqlen for b in batches))
