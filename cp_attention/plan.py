"""CP planner: place the tokens of one packed micro-batch on the context-parallel ranks (pure, no
communication, runs on one process).

API
    plan = plan_cp(cu_seqlens, cu_seqlens_padded, cp_size,
                   cost_model=CostModel(per_token_pair, per_token), placement="auto",
                   max_imbalance=1.03, hierarchical_sizes=None) -> CPPlan
    plan.shard(x_T..., rank) -> x_L...          rank's local tokens, in its local order
    plan.unshard([x_L... per rank]) -> x_T...   inverse (positions owned by no rank are zero)
    plan.local_cu_seqlens[rank]                 int32 [n+1], piece boundaries of the local layout
    plan.ring                                   RingLayout: pieces, index, step(rank, t) (the
                                                ring schedule), traffic(rank, ...) (bytes/messages)
    plan.planned_imbalance                      max/mean of the planned per-rank cost
    plan.ring_bytes_per_rank(h_kv, d, itemsize, backward=False)   mean over ranks, one layer

Placement (ring of size P; for hierarchical [inner, outer] the ring is the outer axis, and each
outer rank's layout is cut into `inner` contiguous token ranges):
- a document placed *zigzag* has its padded slot cut into 2P equal chunks; ring rank r takes chunks
  r and 2P-1-r, which gives every rank the same causal attention area;
- a document placed *whole* lives on one rank; its KV never enters the ring.
"auto" places documents whole, largest cost first, on the least-loaded rank (LPT), and moves the
largest whole documents to zigzag until the planned imbalance is at most `max_imbalance`.
"zigzag" places every document zigzag (the plain per-document zigzag peer).

Local layout of ring rank r: its zigzag pieces (doc order, 2C tokens each: chunk r then chunk
2P-1-r) followed by its whole documents (doc order). Padding sits at the end of each slot, so the
real tokens of every piece form a prefix of the piece. The zigzag prefix has the same length Z on
every rank: that prefix is the KV block that circulates (as two halves, see cp_attention/ring.py).

The cost model and RingLayout live in cp_attention/layout.py, shared with placement.py.

Legend: T physical tokens, N documents, P ring size, C = slot/(2P) chunk length, Z ring tokens
per rank, L local tokens of a rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cp_attention.layout import CostModel, RingLayout
from cp_attention.placement import place_documents
from cp_attention.schedule import Piece, StepSpec, full_sequence_step


@dataclass
class CPPlan:
    """Where every physical token of a micro-batch lives on the CP ranks (see module docstring)."""

    cp_size: int
    hierarchical_sizes: tuple[int, int]  # (inner, outer); plain plan: (1, cp_size)
    num_tokens: int
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    ring: RingLayout
    rank_index: list[torch.Tensor]  # per CP rank: int64 [L_r] physical positions
    local_cu_seqlens: list[torch.Tensor]  # per CP rank: int32 piece boundaries in local order
    rank_cost: list[float]  # per ring rank, planned cost
    zigzag_docs: list[int]
    _full_step: StepSpec | None = field(default=None, repr=False)
    _index_on: dict = field(default_factory=dict, repr=False)  # (rank, device) -> rank_index there

    @property
    def planned_imbalance(self) -> float:
        mean = sum(self.rank_cost) / len(self.rank_cost)
        return max(self.rank_cost) / mean if mean > 0 else 1.0

    def local_tokens(self, rank: int) -> int:
        return int(self.rank_index[rank].numel())

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """x [T, ...] in physical order -> [L_rank, ...] in rank's local order."""
        if x.shape[0] != self.num_tokens:
            raise ValueError(f"shard: x has {x.shape[0]} tokens but the plan was made for {self.num_tokens}")
        return x.index_select(0, self.index_on(rank, x.device))

    def index_on(self, rank: int, device: torch.device) -> torch.Tensor:
        """rank_index[rank] on `device`, copied there once per plan (every per-token tensor of
        the micro-batch is sharded with it)."""
        key = (rank, str(device))
        if key not in self._index_on:
            self._index_on[key] = self.rank_index[rank].to(device, non_blocking=True)
        return self._index_on[key]

    def unshard(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of shard: [L_r, ...] for every rank -> [T, ...]; unowned positions are zero."""
        if len(locals_) != self.cp_size:
            raise ValueError(f"unshard: got {len(locals_)} shards for cp_size={self.cp_size}")
        first = locals_[0]
        out = first.new_zeros((self.num_tokens, *first.shape[1:]))
        for r, x in enumerate(locals_):
            out.index_copy_(0, self.index_on(r, x.device), x)
        return out

    def full_sequence_step(self) -> StepSpec:
        """Kernel call over all owned tokens in physical order (used by Ulysses)."""
        if self._full_step is None:
            self._full_step = full_sequence_step(self.cu_seqlens, self.cu_seqlens_padded)
        return self._full_step

    def ring_bytes_per_rank(self, num_kv_heads: int, head_dim: int, itemsize: int,
                            backward: bool = False, acc_itemsize: int | None = None,
                            head_dim_v: int | None = None) -> float:
        """Mean over the ring ranks of the bytes one rank sends per layer (RingLayout.traffic);
        backward=True adds the backward pass (KV again, dK/dV in the accumulator dtype)."""
        kinds = ("ring_fwd_kv", "ring_bwd_kv", "ring_bwd_dkv") if backward else ("ring_fwd_kv",)
        total = 0
        for r in range(self.ring.size):
            tr = self.ring.traffic(r, num_kv_heads, head_dim, itemsize,
                                   acc_itemsize or max(itemsize, 4), head_dim_v)
            total += sum(tr[k][0] for k in kinds)
        return total / self.ring.size


def plan_cp(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int,
            cost_model: CostModel | None = None, placement: str = "auto",
            max_imbalance: float = 1.03, hierarchical_sizes: list[int] | None = None,
            num_tokens: int | None = None) -> CPPlan:
    """Plan one micro-batch. cu_seqlens / cu_seqlens_padded: int [N+1] (PackedBatch); num_tokens:
    physical length T (default cu_seqlens_padded[-1]; positions past the last slot are unowned)."""
    cost_model = cost_model or CostModel()
    cu, cu_pad = _check_cu(cu_seqlens, cu_seqlens_padded)
    inner, outer = _check_sizes(cp_size, hierarchical_sizes)
    total = int(cu_pad[-1]) if num_tokens is None else int(num_tokens)
    if total < int(cu_pad[-1]):
        raise ValueError(f"num_tokens={total} < cu_seqlens_padded[-1]={int(cu_pad[-1])}")
    ring, costs, zz = place_documents(cu, cu_pad, outer, cost_model, placement, max_imbalance)
    rank_index, local_cu = _split_inner(ring, inner)
    return CPPlan(cp_size, (inner, outer), total, cu, cu_pad, ring, rank_index, local_cu,
                  costs, zz)


def _check_cu(cu: torch.Tensor, cu_pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.as_tensor(cu).to("cpu", torch.int64)
    cu_pad = torch.as_tensor(cu_pad).to("cpu", torch.int64)
    if cu.dim() != 1 or cu.shape != cu_pad.shape or cu.numel() < 1:
        raise ValueError(f"plan_cp: cu_seqlens {tuple(cu.shape)} and cu_seqlens_padded "
                         f"{tuple(cu_pad.shape)} must be 1-D of the same length N+1 >= 1")
    if int(cu[0]) != 0 or int(cu_pad[0]) != 0:
        raise ValueError("plan_cp: cu_seqlens and cu_seqlens_padded must start at 0")
    lens, slots = cu.diff(), cu_pad.diff()
    bad = ((lens < 0) | (lens > slots)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"plan_cp: document {i} has length {int(lens[i])} but its padded slot is "
                         f"{int(slots[i])}: every document must fit its slot (0 <= len <= slot)")
    return cu, cu_pad


def _check_sizes(cp_size: int, sizes: list[int] | None) -> tuple[int, int]:
    if cp_size < 1:
        raise ValueError(f"plan_cp: cp_size={cp_size} must be >= 1")
    if sizes is None:
        return 1, cp_size
    if len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp_size:
        raise ValueError(f"plan_cp: hierarchical_sizes={list(sizes)} must be [inner, outer] with "
                         f"inner * outer == cp_size={cp_size}")
    return int(sizes[0]), int(sizes[1])


def _split_inner(ring: RingLayout, inner: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """CP rank = outer * inner_size + inner: each ring rank's layout is cut into `inner`
    contiguous ranges (sizes differ by at most one token)."""
    rank_index, local_cu = [], []
    for o in range(ring.size):
        idx = ring.index[o]
        bounds = [idx.numel() * i // inner for i in range(inner + 1)]
        for i in range(inner):
            rank_index.append(idx[bounds[i]:bounds[i + 1]])
            local_cu.append(_local_cu(ring.pieces[o], bounds[i], bounds[i + 1]))
    return rank_index, local_cu


def _local_cu(pieces: list[Piece], lo: int, hi: int) -> torch.Tensor:
    """int32 boundaries of the pieces (physical, padding included) clipped to the local range
    [lo, hi), relative to lo. Real tokens are a prefix of each piece (Piece.real)."""
    cu = [0]
    for p in pieces:
        a, b = max(p.local_start, lo), min(p.local_start + p.length, hi)
        if b > a:
            cu.append(cu[-1] + b - a)
    return torch.tensor(cu, dtype=torch.int32)
