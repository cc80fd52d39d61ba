"""Merging partial attention results (out, lse) computed over disjoint key sets.

For one query row with partial results (o1, l1) over keys K1 and (o2, l2) over keys K2:
    lse = log(exp(l1) + exp(l2)) = max(l1, l2) + log1p(exp(-|l1 - l2|))
    out = o1 - sigmoid(l2 - l1) * (o1 - o2)
(the stable log-sigmoid form: never exponentiates a positive number). Rows that have seen no key
yet carry lse = -inf and out = 0; when both sides are -inf the difference is taken as 0, so the row
stays (0, -inf) without producing NaN, and a single -inf side gives the other side exactly.

Shapes: out_THD [T, H, D], lse_HT [H, T]. The accumulators are float32 for 16/32-bit inputs and
float64 for float64 inputs (`accumulate_dtype`).
"""

from __future__ import annotations

import torch

from cp_attention.kernels import accumulate_dtype


def new_accumulators(q_THD: torch.Tensor, head_dim_v: int | None = None):
    """Empty (out_THD zeros, lse_HT -inf) accumulators in accumulate_dtype(q.dtype)."""
    t, h, d = q_THD.shape
    dt = accumulate_dtype(q_THD.dtype)
    out = torch.zeros(t, h, head_dim_v or d, dtype=dt, device=q_THD.device)
    lse = torch.full((h, t), float("-inf"), dtype=dt, device=q_THD.device)
    return out, lse


def merge_(out_acc_THD: torch.Tensor, lse_acc_HT: torch.Tensor, out_THD: torch.Tensor,
           lse_HT: torch.Tensor) -> None:
    """In place: (out_acc, lse_acc) <- merge((out_acc, lse_acc), (out, lse)), in the acc dtype."""
    lse_b = lse_HT.to(lse_acc_HT.dtype)
    both_empty = torch.isneginf(lse_acc_HT) & torch.isneginf(lse_b)
    diff_HT = torch.where(both_empty, torch.zeros_like(lse_b), lse_b - lse_acc_HT)
    w_TH1 = torch.sigmoid(diff_HT).transpose(0, 1).unsqueeze(-1)
    out_acc_THD.sub_(w_TH1 * (out_acc_THD - out_THD.to(out_acc_THD.dtype)))
    lse_acc_HT.copy_(torch.maximum(lse_acc_HT, lse_b) + torch.log1p(torch.exp(-diff_HT.abs())))
