"""Expert lending: an overloaded EP rank's hottest experts run part of their rows on lighter ranks.

A router that sends most tokens to a few experts (a fresh one on long documents does) makes the EP
ranks holding those experts process several times their share of rows: that rank's activations and
backward transients set the step's peak memory, and its compute sets the step's time. With
`parallel.ep_spare_slots = S > 0` every EP rank can host, per MoE layer and micro-batch, up to S
borrowed copies of other ranks' experts:

1. Every rank has the EP group's per-expert row counts ([R, E], host: the dispatcher's routing
   table, comm.RoutingCounts) and computes the same plan from them (`plan_lends`): while the
   busiest rank is above the balanced load ceil(total / R), its expert with the most rows still on
   it lends rows to the least-loaded rank with a free slot, as many as both sides allow.
2. Each expert's rows, numbered globally (source rank, then the source's own expert-sorted order),
   are split into contiguous pieces: the owner runs the first, each borrower the next
   (`split_pieces`). A source sends every row to the rank of the piece holding its number.
3. The lent experts' weights travel to their borrowers in one all-to-all; its autograd reverse
   brings their gradients back in the backward, where they add into the owner's gradient.

An expert's gradient is then the sum of its pieces' gradients and its outputs are computed by the
same weights, so results equal the run without lending up to the order of that sum. Nothing
persists: parameters, optimizer state and checkpoints keep the static placement (rank r owns
experts [rL, (r+1)L)), which is where this differs from placement schemes that move experts between
steps, such as DeepSeek's EPLB (redundant experts for inference).

A lend is made only if it moves at least `min_rows` rows: its weights cost as many values on the
wire as 3F rows of the model dim (gate, up and down: 3 D F), so below that balance is bought with
more traffic than the rows themselves carry. The dispatcher passes min_rows = 3F.

Legend: R EP ranks, E experts, L = E / R owned per rank, S spare slots per rank, B experts this rank
borrows (<= S), N this rank's kept assignments (sorted by expert), D model dim, F expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longctx_moe.parallel.comm import all_to_all_rows


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of `expert` (numbered over the whole EP group) run on EP rank `rank` as
    its local expert `slot` (owned experts 0..L-1, borrowed ones L.. in expert order)."""

    expert: int
    rank: int
    slot: int
    start: int
    stop: int


@dataclass
class LendingPlan:
    pieces: list[Piece]  # sorted by (rank, slot)
    borrowed: list[list[int]]  # per EP rank, the experts it borrows, in slot order (ascending ids)

    @property
    def lends(self) -> bool:
        return any(self.borrowed)

    def rank_rows(self, num_ranks: int) -> list[int]:
        """Rows each EP rank runs under this plan."""
        rows = [0] * num_ranks
        for p in self.pieces:
            rows[p.rank] += p.stop - p.start
        return rows


def plan_lends(load_E: list[int], num_ranks: int, spare_slots: int, min_rows: int
               ) -> dict[tuple[int, int], int]:
    """{(expert, borrower): rows} from the experts' total loads: a pure function of its arguments,
    so every rank of the group computes the same plan."""
    E = len(load_E)
    L = E // num_ranks
    owner = [e // L for e in range(E)]
    at_owner = list(load_E)  # rows each expert still runs on its owner
    rank_load = [sum(load_E[r * L:(r + 1) * L]) for r in range(num_ranks)]
    target = -(-sum(load_E) // num_ranks)
    used = [0] * num_ranks
    lends: dict[tuple[int, int], int] = {}
    for _ in range(num_ranks * spare_slots):
        busy = max(range(num_ranks), key=lambda r: (rank_load[r], -r))
        free = [r for r in range(num_ranks) if r != busy and used[r] < spare_slots]
        if rank_load[busy] <= target or not free:
            break
        light = min(free, key=lambda r: (rank_load[r], r))
        hot = max((e for e in range(E) if owner[e] == busy), key=lambda e: (at_owner[e], -e))
        rows = min(rank_load[busy] - target, target - rank_load[light], at_owner[hot])
        if rows < max(min_rows, 1):
            break
        used[light] += (hot, light) not in lends
        lends[(hot, light)] = lends.get((hot, light), 0) + rows
        at_owner[hot] -= rows
        rank_load[busy] -= rows
        rank_load[light] += rows
    return lends


def split_pieces(load_E: list[int], num_ranks: int, lends: dict[tuple[int, int], int]) -> LendingPlan:
    """Every expert's global row range cut into the owner's piece and then its borrowers' (in
    rank order)."""
    E = len(load_E)
    L = E // num_ranks
    borrowed = [sorted(e for (e, b) in lends if b == r) for r in range(num_ranks)]
    pieces = []
    for e in range(E):
        mine = sorted((b, rows) for (x, b), rows in lends.items() if x == e)
        start = load_E[e] - sum(rows for _, rows in mine)
        pieces.append(Piece(e, e // L, e % L, 0, start))
        for b, rows in mine:
            pieces.append(Piece(e, b, L + borrowed[b].index(e), start, start + rows))
            start += rows
    pieces.sort(key=lambda p: (p.rank, p.slot))
    return LendingPlan(pieces, borrowed)


def make_plan(counts_RE: torch.Tensor, spare_slots: int, min_rows: int) -> LendingPlan:
    """The plan for one MoE layer from every source rank's kept rows per expert ([R, E], host)."""
    load_E = counts_RE.sum(0).tolist()
    R = counts_RE.shape[0]
    return split_pieces(load_E, R, plan_lends(load_E, R, spare_slots, min_rows))


def _overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int]:
    return max(a0, b0), min(a1, b1)


def source_tables(plan: LendingPlan, counts_RE: torch.Tensor, me: int, num_ranks: int):
    """What this rank sends and receives under `plan`.

    Returns (order_N, send, recv_RS): order_N (int64) permutes this rank's expert-sorted
    assignments into send order (destination rank, then slot); send[r] rows go to rank r;
    recv_RS[s, j] rows arrive from rank s for this rank's slot j (owned, then borrowed)."""
    counts = counts_RE.tolist()
    E = len(counts[0])
    # Global number of this source's first row of each expert, and its offset among its own rows.
    before_E = counts_RE[:me].sum(0).tolist()
    offset_E = [0] * E
    for e in range(1, E):
        offset_E[e] = offset_E[e - 1] + counts[me][e - 1]
    parts, send = [], [0] * num_ranks
    slots = E // num_ranks + len(plan.borrowed[me])
    recv_RS = torch.zeros(num_ranks, slots, dtype=torch.int64)
    for p in plan.pieces:
        lo, hi = _overlap(before_E[p.expert], before_E[p.expert] + counts[me][p.expert], p.start, p.stop)
        if hi > lo:
            first = offset_E[p.expert] + lo - before_E[p.expert]
            parts.append(torch.arange(first, first + hi - lo))
            send[p.rank] += hi - lo
        if p.rank == me:
            begin = 0
            for s in range(num_ranks):
                lo, hi = _overlap(begin, begin + counts[s][p.expert], p.start, p.stop)
                recv_RS[s, p.slot] = max(hi - lo, 0)
                begin += counts[s][p.expert]
    order_N = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return order_N, send, recv_RS


def lend_weights(experts, plan: LendingPlan, me: int, group):
    """((w_gate_up [B, D, 2, F], w_down [B, F, D], and the biases where the experts have them),
    bytes this rank sent): the weights of the
    experts this rank borrows, received from their owners (autograd: their gradients go back to
    the owners' parameters). Every rank of the group calls it when the plan lends anything."""
    R = len(plan.borrowed)
    L = experts.num_local_experts
    params = experts.expert_params()  # the weights, and the biases where the experts have them
    lent, send = [], []
    for b in range(R):
        mine = [e - me * L for e in plan.borrowed[b] if e // L == me]
        lent += mine
        send.append(len(mine))
    recv = [sum(1 for e in plan.borrowed[me] if e // L == s) for s in range(R)]
    # A host list to the device without a stream sync (a blocking copy waits for the queue).
    idx = torch.tensor(lent, dtype=torch.int64).to(params[0].device, non_blocking=True)
    rows = torch.cat([p.index_select(0, idx).flatten(1) for p in params], 1)
    got = all_to_all_rows(rows, send, recv, group)
    pieces = got.split([p[0].numel() for p in params], 1)
    borrowed = tuple(g.reshape(-1, *p.shape[1:]) for g, p in zip(pieces, params, strict=True))
    return borrowed, rows.numel() * rows.element_size()  # every lent row goes to another rank
