"""Communication for the CP executors, with accounting.

- CommStats: bytes and messages this rank sent, in total and per kind ("ring_fwd_kv",
  "ring_bwd_kv", "ring_bwd_dkv", "a2a_fwd", "a2a_bwd"); tests check them against formulas.
- post_p2p: one batch of isend/irecv (dist.batch_isend_irecv) to/from group ranks; returns the
  requests to wait on later, so the caller computes while the transfer runs.
- scatter_heads / gather_heads: the Ulysses all-to-all (sequence-sharded, all heads <-> all tokens
  of the group, a 1/P share of the heads), autograd-capable, uneven token counts per rank allowed.
  gloo implements all_to_all_single with uneven splits, so no p2p emulation is needed.

Groups are always passed in; ranks inside a group are group ranks (converted to global ranks for
the p2p peers). Legend: L local tokens, S tokens of the whole group, H heads, D head dim.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes and messages sent by this rank (receives are not counted: every byte is sent once)."""

    bytes_sent: int = 0
    messages_sent: int = 0
    by_kind: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def record(self, kind: str, nbytes: int, messages: int) -> None:
        self.bytes_sent += nbytes
        self.messages_sent += messages
        self.by_kind[kind][0] += nbytes
        self.by_kind[kind][1] += messages

    def bytes(self, kind: str) -> int:
        return self.by_kind[kind][0] if kind in self.by_kind else 0

    def messages(self, kind: str) -> int:
        return self.by_kind[kind][1] if kind in self.by_kind else 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def post_p2p(ops: list[tuple[bool, torch.Tensor, int, int, str]], group,
             stats: CommStats | None) -> list:
    """Post (is_send, tensor, peer group rank, tag, kind) operations as one batch of isend/irecv;
    returns the requests (wait on them later, keeping the tensors alive until then)."""
    p2p = []
    for is_send, tensor, peer, tag, kind in ops:
        op = dist.isend if is_send else dist.irecv
        p2p.append(dist.P2POp(op, tensor, dist.get_global_rank(group, peer), group, tag))
        if is_send and stats is not None:
            stats.record(kind, _nbytes(tensor), 1)
    return dist.batch_isend_irecv(p2p) if p2p else []


def wait_all(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group,
                stats: CommStats | None, kind: str) -> torch.Tensor:
    """all_to_all_single along dim 0 with uneven counts (rows)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv_counts, send_counts, group=group)
    if stats is not None:
        rank = dist.get_rank(group)
        row = x.element_size() * math.prod(x.shape[1:])
        peers = [c for j, c in enumerate(send_counts) if j != rank and c > 0]
        stats.record(kind, sum(peers) * row, len(peers))
    return out


def _scatter_heads(x_LHD, counts, group, stats, kind):
    size = len(counts)
    n, h, d = x_LHD.shape
    x_PLhD = x_LHD.reshape(n, size, h // size, d).transpose(0, 1)
    return _all_to_all(x_PLhD.reshape(size * n, h // size, d), [n] * size, counts, group,
                       stats, kind)


def _gather_heads(y_ShD, counts, group, stats, kind):
    size, rank = len(counts), dist.get_rank(group)
    _, hp, d = y_ShD.shape
    n = counts[rank]
    x = _all_to_all(y_ShD, counts, [n] * size, group, stats, kind)
    return x.reshape(size, n, hp, d).transpose(0, 1).reshape(n, size * hp, d)


class _ScatterHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_LHD, counts, group, stats):
        ctx.args = (counts, group, stats)
        return _scatter_heads(x_LHD, counts, group, stats, "a2a_fwd")

    @staticmethod
    def backward(ctx, dy_ShD):
        counts, group, stats = ctx.args
        return _gather_heads(dy_ShD, counts, group, stats, "a2a_bwd"), None, None, None


class _GatherHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ShD, counts, group, stats):
        ctx.args = (counts, group, stats)
        return _gather_heads(y_ShD, counts, group, stats, "a2a_fwd")

    @staticmethod
    def backward(ctx, dx_LHD):
        counts, group, stats = ctx.args
        return _scatter_heads(dx_LHD, counts, group, stats, "a2a_bwd"), None, None, None


def scatter_heads(x_LHD: torch.Tensor, counts: list[int], group,
                  stats: CommStats | None = None) -> torch.Tensor:
    """[L_r, H, D] on group rank r -> [sum(counts), H/P, D]: every rank's tokens (in rank order),
    heads [r*H/P, (r+1)*H/P). counts[j] = L_j for every group rank j; H % P == 0."""
    return _ScatterHeads.apply(x_LHD, list(counts), group, stats)


def gather_heads(y_ShD: torch.Tensor, counts: list[int], group,
                 stats: CommStats | None = None) -> torch.Tensor:
    """Inverse of scatter_heads: [sum(counts), H/P, D] -> [L_r, H, D]."""
    return _GatherHeads.apply(y_ShD, list(counts), group, stats)
