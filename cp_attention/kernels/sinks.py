"""Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax
denominator and attends to nothing.

    out_THDv, lse_HT = add_sink(out_THDv, lse_HT, sink_H)       # after the LAST merge of a row
    dsink_H = sink_grad(dout_THDv, out_THDv, lse_HT, sink_H, dlse_HT=None)

A sink is a key with score sink_h and a zero value, so it is one more LSE term with out = 0:
lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'). It is added once per query row, after
every partial result of that row has been merged (on one device, or after the last ring step), so
a row split over CP chunks counts it exactly once. The kernels' backward then needs nothing new:
given the final (out', lse') it computes dS = P * (dP - rowsum(dout * out')) with P = exp(S - lse'),
which is exact with the sink in the denominator. The sink's own gradient:
d out'/d sink = -p_sink * out', d lse'/d sink = p_sink, p_sink = exp(sink - lse'), so
dsink_h = sum_t p_sink[h, t] * (dlse[h, t] - rowsum(dout * out')[t, h]).
Rows that see no key get out = 0 and lse = sink (not -inf): the sink takes all their weight.

Shape legend: T query tokens, H query heads, Dv value head dim.
"""

from __future__ import annotations

import torch


def check_sink(sink_H: torch.Tensor | None, heads: int) -> None:
    if sink_H is not None and (sink_H.dim() != 1 or sink_H.shape[0] != heads):
        raise ValueError(f"sink must be one logit per query head [{heads}]; got "
                         f"{tuple(sink_H.shape)} (shard it with the heads under TP / Ulysses)")


def add_sink(out_THDv: torch.Tensor, lse_HT: torch.Tensor, sink_H: torch.Tensor):
    """-> (out' [T, H, Dv] in out's dtype, lse' [H, T] in lse's dtype); computed in lse's dtype."""
    s_H1 = sink_H.detach().to(lse_HT.dtype)[:, None]
    lse2_HT = torch.logaddexp(lse_HT, s_H1)  # a -inf row (no key) becomes the sink itself
    scale_TH1 = torch.exp(lse_HT - lse2_HT).t()[..., None]
    return (out_THDv.to(lse_HT.dtype) * scale_TH1).to(out_THDv.dtype), lse2_HT


def sink_grad(dout_THDv, out_THDv, lse_HT, sink_H, dlse_HT=None) -> torch.Tensor:
    """d loss / d sink [H] in sink's dtype, for the final (out', lse') that add_sink returned."""
    acc = lse_HT.dtype
    p_HT = torch.exp(sink_H.detach().to(acc)[:, None] - lse_HT)
    delta_HT = (dout_THDv.to(acc) * out_THDv.to(acc)).sum(-1).t()
    if dlse_HT is not None:
        delta_HT = delta_HT - dlse_HT.to(acc)
    return -(p_HT * delta_HT).sum(1).to(sink_H.dtype)
