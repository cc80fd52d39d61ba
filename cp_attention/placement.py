"""Document placement for the CP planner: which documents go zigzag, which stay whole, and where.

`place_documents` is called by `plan_cp` (see cp_attention/plan.py for the layout it produces).
Costs are exact per rank: a zigzag document gives rank r the causal area of its real tokens in
chunks r and 2P-1-r (padding excluded), a whole document its full causal area.
"""

from __future__ import annotations

import torch

from cp_attention.layout import CostModel, RingLayout, causal_area
from cp_attention.schedule import Piece

PLACEMENTS = ("auto", "zigzag")


def zigzag_rank_cost(length: int, slot: int, p: int, r: int, cm: CostModel) -> float:
    """Planned cost of ring rank r's two chunks of a zigzag document (real length, padded slot)."""
    c = slot // (2 * p)
    area = causal_area(r * c, (r + 1) * c, length)
    area += causal_area((2 * p - 1 - r) * c, (2 * p - r) * c, length)
    return cm.cost(area, 2 * c)


def whole_cost(length: int, slot: int, cm: CostModel) -> float:
    return cm.cost(causal_area(0, length, length), slot)


def place_documents(cu: torch.Tensor, cu_pad: torch.Tensor, p: int, cm: CostModel,
                    placement: str, max_imbalance: float) -> tuple[RingLayout, list[float], list[int]]:
    """-> (layout over a ring of p ranks, planned cost per rank, indices of zigzag documents)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"plan_cp: placement={placement!r} is not one of {PLACEMENTS}")
    lens, slots = cu.diff().tolist(), cu_pad.diff().tolist()
    docs = [i for i, s in enumerate(slots) if s > 0]
    if p == 1:
        zigzag: set[int] = set()
    elif placement == "zigzag":
        zigzag = set(docs)
        _check_divisible(zigzag, slots, p)
    else:
        zigzag = _choose_zigzag(docs, lens, slots, p, cm, max_imbalance)
    owner, costs = _assign_whole(docs, zigzag, lens, slots, p, cm)
    layout = _build_layout(docs, zigzag, owner, lens, slots, cu_pad.tolist(), p)
    return layout, costs, sorted(zigzag)


def _check_divisible(zigzag: set[int], slots: list[int], p: int) -> None:
    for i in sorted(zigzag):
        if slots[i] % (2 * p):
            raise ValueError(
                f"plan_cp: document {i} must be split over {p} ranks but its padded slot "
                f"({slots[i]} tokens) is not a multiple of 2*cp={2 * p}: pad every document to a "
                f"multiple of {2 * p} (PackedBatch.cu_seqlens_padded)")


def _assign_whole(docs, zigzag, lens, slots, p, cm) -> tuple[dict[int, int], list[float]]:
    """LPT: whole documents by decreasing cost (ties: lower index) onto the least-loaded rank."""
    loads = [0.0] * p
    for i in zigzag:
        for r in range(p):
            loads[r] += zigzag_rank_cost(lens[i], slots[i], p, r, cm)
    whole = sorted((i for i in docs if i not in zigzag),
                   key=lambda i: (-whole_cost(lens[i], slots[i], cm), i))
    owner = {}
    for i in whole:
        r = min(range(p), key=lambda q: (loads[q], q))
        owner[i] = r
        loads[r] += whole_cost(lens[i], slots[i], cm)
    return owner, loads


def _imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _choose_zigzag(docs, lens, slots, p, cm, max_imbalance) -> set[int]:
    """Move the costliest whole documents to zigzag until the LPT placement of the rest is within
    max_imbalance. A document whose slot is not a multiple of 2P stays whole; if it alone exceeds
    the per-rank budget no placement can honour the target: an error names the numbers."""
    zigzag: set[int] = set()
    candidates = sorted(docs, key=lambda i: (-whole_cost(lens[i], slots[i], cm), i))
    total = sum(whole_cost(lens[i], slots[i], cm) for i in docs)
    for i in candidates:
        _, loads = _assign_whole(docs, zigzag, lens, slots, p, cm)
        if _imbalance(loads) <= max_imbalance:
            break
        if slots[i] % (2 * p) == 0:
            zigzag.add(i)
        elif whole_cost(lens[i], slots[i], cm) > max_imbalance * total / p:
            _check_divisible({i}, slots, p)
    return zigzag


def _build_layout(docs, zigzag, owner, lens, slots, starts, p) -> RingLayout:
    pieces: list[list[Piece]] = [[] for _ in range(p)]
    index: list[list[torch.Tensor]] = [[] for _ in range(p)]
    fill = [0] * p
    for i in docs:
        if i not in zigzag:
            continue
        c = slots[i] // (2 * p)
        for r in range(p):
            lo, hi = starts[i] + r * c, starts[i] + (2 * p - 1 - r) * c
            real = max(0, min(lens[i] - r * c, c)) + max(0, min(lens[i] - (2 * p - 1 - r) * c, c))
            pieces[r].append(Piece(i, fill[r], 2 * c, real, True, lo))
            index[r] += [torch.arange(lo, lo + c), torch.arange(hi, hi + c)]
            fill[r] += 2 * c
    z = fill[0]
    for i in docs:
        if i in zigzag:
            continue
        r = owner[i]
        pieces[r].append(Piece(i, fill[r], slots[i], lens[i], False, starts[i]))
        index[r].append(torch.arange(starts[i], starts[i] + slots[i]))
        fill[r] += slots[i]
    idx = [torch.cat(x) if x else torch.zeros(0, dtype=torch.int64) for x in index]
    return RingLayout(p, idx, pieces, z)
