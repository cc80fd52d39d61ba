"""The types the CP planner (plan.py) and document placement (placement.py) share: the cost
model, the causal area of a query range, and RingLayout, a placement over a ring with its schedule.

Legend: P ring size, Z ring tokens per rank, L local tokens of a rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cp_attention.schedule import Piece, StepSpec, chunk_rows, diagonal_step, ring_step
from cp_attention.window_schedule import window_diagonal, window_ring
from data_packing.balance import token_pair_cost


@dataclass(frozen=True)
class CostModel:
    """Planned cost of a piece: per_token_pair * causal attention area (query-key pairs) +
    per_token * physical tokens: the same two terms as the loader's DataConfig.cost_per_token_pair
    and cost_per_token. The default weighs attention only; per_token also weighs the dense
    work of the tokens a rank holds (in these units, 1 / DataConfig.cost_per_token_pair)."""

    per_token_pair: float = 1.0
    per_token: float = 0.0

    def cost(self, area: float, tokens: int) -> float:
        return token_pair_cost(tokens, area, self.per_token, self.per_token_pair)


def causal_area(lo: int, hi: int, length: int) -> int:
    """Query-key pairs of queries at positions [lo, hi) of a causal doc with `length` real tokens."""
    hi = min(hi, length)
    if hi <= lo:
        return 0
    return (hi * (hi + 1) - lo * (lo + 1)) // 2


@dataclass
class RingLayout:
    """Placement over a ring of `size` ranks and its schedule.

    index[r]: int64 [L_r] physical positions held by ring rank r, in local order.
    pieces[r]: the contiguous pieces of that layout. zigzag_tokens: Z (same on every rank).
    """

    size: int
    index: list[torch.Tensor]
    pieces: list[list[Piece]]
    zigzag_tokens: int
    _steps: dict = field(default_factory=dict, repr=False)

    def step(self, rank: int, t: int, device: torch.device | str = "cpu"
             ) -> tuple[StepSpec, StepSpec | None]:
        """Kernel calls of ring step t on `rank` (causal). The ring runs towards lower ranks: at
        step t the rank holds the block of rank s = (rank + t) % size. t == 0: (local queries x
        local keys, None). t > 0: (queries x half A of block s, queries x half B or None).
        Cached per device, so a GPU run copies each cu_seqlens to the device once."""
        key = (rank, t, str(device))
        if key not in self._steps:
            src = (rank + t) % self.size
            if t == 0:
                specs = (diagonal_step(self.pieces[rank], True), None)
            else:
                specs = ring_step(self.pieces[rank], self.pieces[src], rank, src)
            self._steps[key] = tuple(s.to(device) if s is not None else None for s in specs)
        return self._steps[key]

    def window_step(self, rank: int, t: int, window: int, device: torch.device | str = "cpu"
                    ) -> tuple[list[StepSpec], list[StepSpec]]:
        """Kernel calls of ring step t on `rank` under a sliding window of `window` keys, as lists
        (a step may need several calls, see window_schedule.py): t == 0: (local calls, []);
        t > 0: (calls against half A, calls against half B). Cached like step()."""
        key = (rank, t, str(device), window)
        if key not in self._steps:
            src = (rank + t) % self.size
            if t == 0:
                specs = (window_diagonal(self.pieces[rank], rank, self.size, window), [])
            else:
                specs = window_ring(self.pieces[rank], self.pieces[src], rank, src, self.size,
                                    window)
            self._steps[key] = tuple([s.to(device) for s in x] for x in specs)
        return self._steps[key]

    def chunk_rows(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [Z/2] local rows of half A (first chunks) and half B (second chunks)."""
        return chunk_rows(self.pieces[rank])

    def traffic(self, rank: int, kv_heads: int, head_dim: int, itemsize: int,
                acc_itemsize: int, head_dim_v: int | None = None) -> dict[str, tuple[int, int]]:
        """(bytes, messages) ring rank `rank` sends per layer, by kind. Every message carries one
        half block [Z/2, Hkv, D + Dv] (K | V, or dK | dV; Dv = head_dim_v, default D). Half A goes round the whole ring (P-1 messages per pass);
        half B only travels to the ranks below its owner: forward and backward KV, P - rank
        messages (none from rank 0); dK/dV accumulators of B, P - 1 - rank messages."""
        p, z = self.size, self.zigzag_tokens
        if p == 1 or z == 0:
            return {k: (0, 0) for k in ("ring_fwd_kv", "ring_bwd_kv", "ring_bwd_dkv")}
        half = z // 2 * kv_heads * (head_dim + (head_dim if head_dim_v is None else head_dim_v))
        kv_msgs = (p - 1) + (p - rank if rank >= 1 else 0)
        dkv_msgs = (p - 1) + (p - 1 - rank)
        return {"ring_fwd_kv": (kv_msgs * half * itemsize, kv_msgs),
                "ring_bwd_kv": (kv_msgs * half * itemsize, kv_msgs),
                "ring_bwd_dkv": (dkv_msgs * half * acc_itemsize, dkv_msgs)}
