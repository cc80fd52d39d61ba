"""Expert-parallel token dispatchers: all-to-all and all-gather over the EP group.

Legend: T local tokens, D model dim, K top-k, E experts in total, R ranks in the EP group,
L = E / R experts held per rank (rank r holds experts [r*L, (r+1)*L)), N kept (token, expert)
assignments of this rank, M rows this rank's experts process, G tokens gathered over the group.

Contract (docs/ARCHITECTURE.md):
    dispatcher(x_TD, topk_idx_TK, topk_weight_TK, experts) -> y_TD
    y[t] = sum_k topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t])   (dropped assignments add 0)
where `experts(x_MD, tokens_per_local_expert_L) -> y_MD` runs this rank's L experts on rows sorted
by local expert (`tokens_per_local_expert_L`: int64 [L] on x's device, sums to M). Experts that
say `wants_rows` (model.experts.GroupedExperts under FP8) are also given `rows=`, the same counts as
host ints, so that no expert GEMM reads them back from the device.

Dropless by default. With `capacity_factor`, each expert keeps at most
ceil(capacity_factor * T * K / E) assignments *from each source rank* (decided on the owner of the
tokens, before any communication, as Megatron-Core does); `drop_policy` "probs" keeps the highest
weights, "position" the earliest tokens. Both dispatchers give identical results. The routing on
one rank (assignments, drops, the sort by expert, the combine) is routing.py's.

Communication hidden behind compute (`overlap`, parallel.moe_overlap): the all-to-all dispatcher
runs in three stages, dispatch (tokens out, asynchronously) / experts / combine (outputs back).
Called with `shared` (the MoE layer's shared expert), it computes shared(x_TD) while the tokens
travel and returns routed + shared; in the backward the shared expert's backward runs while the
tokens' gradients travel back (comm.start_all_to_all_rows). The arithmetic is the same as the
synchronous path, so the results are bitwise equal. The combine all-to-all stays synchronous:
within one micro-batch nothing independent is left to compute by then. With two micro-batches in
flight (parallel.micro_batches_in_flight=2, interleave.py) the call is given the micro-batch's
`turn`: both all-to-alls are then asynchronous and the other micro-batch computes while they
travel.

TP without sequence parallelism: TP peers hold the same tokens. With `tp_group`, each peer
dispatches one contiguous chunk of them and the outputs are all-gathered back (Megatron-Core's
approach), so experts see each token once and expert gradients need no 1/tp correction; capacity
then applies per chunk. Under sequence parallelism each TP rank already holds its own tokens (the
same chunk) and the MoE layer runs on them alone (sequence_parallel.py): the dispatcher gets no
`tp_group`, and capacity applies per rank's own tokens, which is the same per-chunk rule.

ETP > 1 (`etp_group`): each rank of the etp group holds a slice of the hidden units of the same
experts (expert_parallel.shard_expert_hidden). Tokens are still dispatched once, by one rank, as
above; after the EP all-to-all the rows of the ETP peers are all-gathered, every peer runs its
slice on all of them, and the partial outputs of each row are summed back on the peer that
received it (Megatron-Core: all-gather, experts, reduce-scatter over ETP; `experts_over_etp`).
So every expert slice sees each token once and the forward sum is complete. Any etp works with
any tp: ETP peers hold distinct tokens (their dispatched chunks, or different CP / DP shares).
Capacity and drops are decided before any communication, as without ETP.

Host values: the only data-dependent ones are routing counts, and they reach the host once per
MoE layer and forward, through the dispatcher's `counts` (comm.RoutingCounts): every rank's kept
assignments per expert (and token count) gathered over the EP and ETP groups into one table and
read back with one copy. The splits, the rows per expert, the capacity's kept count, lending's
plan, the all-gather's sizes and the rows per expert the experts loop by (FP8) are all computed
on the host from it, and the host tables sent back to the device go without a stream sync
(non_blocking). Nothing is read where nothing needs
it: one rank, dropless, without ETP reads no count (the grouped GEMM takes them on the device), except
for FP8 experts, which loop by host counts: model.moe.LocalDispatcher reads them through the same
seam, once per layer forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longctx_moe.choices import check_choice
from longctx_moe.kernels.fp8 import BLOCK
from longctx_moe.parallel.comm import (
    RouteTable,
    RoutingCounts,
    all_gather_rows,
    all_to_all_rows,
    gather_replicated,
    gather_route_table,
    make_codec,
    split_replicated,
    start_all_to_all_rows,
)
from longctx_moe.parallel.config import DROP_POLICIES, check_capacity_factor
from longctx_moe.parallel.dims import Axis
from longctx_moe.parallel.expert_lending import lend_weights, make_plan, source_tables
from longctx_moe.parallel.interleave import Turn
from longctx_moe.parallel.routing import (
    Assignments,
    Routing,
    assign,
    check_inputs,
    combine,
    expert_capacity,
    inverse_permutation,
    sort_kept,
)


def route(topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor, num_experts: int,
          capacity_factor: float | None = None, drop_policy: str = "probs",
          counts: RoutingCounts | None = None) -> Routing:
    """Flatten top-k choices into assignments sorted by expert, applying the capacity if any;
    the kept count is then read through `counts` (RoutingCounts() by default)."""
    T, K = topk_idx_TK.shape
    cap = None if capacity_factor is None else expert_capacity(T, K, num_experts, capacity_factor)
    a = assign(topk_idx_TK, topk_weight_TK, num_experts, cap, drop_policy)
    if cap is None:
        return sort_kept(a, T * K)
    table = (counts or RoutingCounts()).read(gather_route_table(_table_row(a, T)),
                                             RouteTable(num_experts, T, K, cap))
    return sort_kept(a, int(table[0, 0, :num_experts].sum()))


def _table_row(a: Assignments, num_tokens: int) -> torch.Tensor:
    """This rank's row of the RouteTable (int64 [E + 1]), on the device: no host value copied."""
    return torch.cat([a.counts_E, a.counts_E.new_full((1,), num_tokens)])


class _EPDispatcher:
    """Shared set-up: the EP group, expert ownership, capacity, the checks on `experts`, and
    `counts` (comm.RoutingCounts, the default: read from the device), through which the routing
    counts reach the host."""

    def __init__(self, num_experts: int, group=None, capacity_factor: float | None = None,
                 drop_policy: str = "probs", tp_group=None, etp_group=None,
                 counts: RoutingCounts | None = None):
        self.group, self.tp_group, self.etp_group = group, tp_group, etp_group
        self.counts = RoutingCounts() if counts is None else counts
        self.ep_size = 1 if group is None else dist.get_world_size(group)
        self.ep_rank = 0 if group is None else dist.get_rank(group)
        self.etp_rank = 0 if etp_group is None else dist.get_rank(etp_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size "
                             f"{self.ep_size}; choose ep dividing the number of experts")
        check_choice("parallel.drop_policy", drop_policy, DROP_POLICIES)
        check_capacity_factor(capacity_factor)
        self.num_experts, self.local_experts = num_experts, num_experts // self.ep_size
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.wire_bytes = 0  # payload bytes this rank sent to other ranks in the last forward

    # Whether __call__ computes `shared` while tokens travel (MoE passes it only then).
    overlaps_shared = False

    def take_step_rows(self) -> list[int] | None:
        """Rows each EP rank ran since the last call under expert lending; None where this
        dispatcher does not lend (AllToAllDispatcher counts them)."""
        return None

    def __call__(self, x_TD, topk_idx_TK, topk_weight_TK, experts, shared=None, turn: Turn | None = None):
        """y_TD (+ shared(x_TD) when `shared` is given); with `tp_group`, each TP peer
        dispatches only its chunk of the (replicated) tokens and the outputs are gathered back,
        so no expert runs a token twice. `turn`: the micro-batch's Turn when two are in flight."""
        side = None if shared is None else (lambda: shared(x_TD))
        turn = turn if turn is not None and turn.active else None
        if self.tp_group is None:  # one TP rank, or SP: the tokens are this rank's own
            y_TD, side_TD = self._dispatch(x_TD, topk_idx_TK, topk_weight_TK, experts, side, turn)
        else:
            T, g = x_TD.shape[0], self.tp_group
            idx_NK = split_replicated(topk_idx_TK, g).detach()
            y_ND, side_TD = self._dispatch(split_replicated(x_TD, g), idx_NK,
                                           split_replicated(topk_weight_TK, g), experts, side, turn)
            y_TD = gather_replicated(y_ND, T, g)
        # The same sum, in the same order, as MoE's `routed + shared` without overlap.
        return y_TD if side_TD is None else y_TD + side_TD

    def _route(self, x_TD, topk_idx_TK, topk_weight_TK, experts) -> tuple[Routing, torch.Tensor | None]:
        """(routing, the RouteTable [P, R, E + 1] on the host, or None where nothing needs host
        counts: one rank, dropless, without ETP)."""
        check_inputs(x_TD, topk_idx_TK, topk_weight_TK)
        held = getattr(experts, "num_local_experts", self.local_experts)
        if held != self.local_experts:
            raise ValueError(f"experts holds {held} experts but EP={self.ep_size} over "
                             f"{self.num_experts} experts gives {self.local_experts} per rank; "
                             "shard the experts with the same EP size")
        (T, K), E = topk_idx_TK.shape, self.num_experts
        cap = None if self.capacity_factor is None else expert_capacity(T, K, E, self.capacity_factor)
        a = assign(topk_idx_TK, topk_weight_TK, E, cap, self.drop_policy)
        if self.ep_size == 1 and self.etp_group is None and cap is None:
            return sort_kept(a, T * K), None
        table = self.counts.read(gather_route_table(_table_row(a, T), self.group, self.etp_group),
                                 RouteTable(E, T, K, cap))
        return sort_kept(a, int(table[self.etp_rank, self.ep_rank, :E].sum())), table

    def _own_columns(self, table: torch.Tensor) -> torch.Tensor:
        """[P, R, L]: the table's columns of this rank's experts (the same on every ETP peer)."""
        lo = self.ep_rank * self.local_experts
        return table[:, :, lo:lo + self.local_experts]

    def _remote_rows(self, splits: list[int]) -> int:
        return sum(n for r, n in enumerate(splits) if r != self.ep_rank)

    def _experts(self, experts, x_MD, counts_L, table, rows_L: torch.Tensor | None, **kw):
        """experts(x_MD, counts_L), over the ETP peers when the experts' hidden units are split
        (every peer's rows per local expert from the host `table`). `rows_L`: counts_L on the
        host (None where no table was read). `kw`: x_fp8, the rows' FP8 form (never over ETP:
        see AllToAllDispatcher._token_codec)."""
        if self.etp_group is None:
            return experts(x_MD, counts_L, **host_rows(experts, rows_L), **kw)
        return experts_over_etp(experts, x_MD, self._own_columns(table).sum(1), self.etp_group)

    def _local_rows(self, table: torch.Tensor | None) -> torch.Tensor | None:
        """On one EP rank, this rank's kept assignments per expert (routing.counts_E) from the
        host `table`; None where none was read."""
        return None if table is None else table[self.etp_rank, self.ep_rank, :self.num_experts]


def host_rows(experts, rows_L: torch.Tensor | None) -> dict:
    """{"rows": rows_L as host ints} for experts that want them (`wants_rows`: they loop by them
    instead of reading the device counts back), else {} (the plain experts(x, counts) contract)."""
    if rows_L is None or not getattr(experts, "wants_rows", False):
        return {}
    return {"rows": rows_L.tolist()}


def _call(side):
    return None if side is None else side()


def experts_over_etp(experts, x_MD, counts_PL, group):
    """experts(x_MD, counts_PL[me]) for experts whose hidden units are split over the ETP
    `group`: every peer's rows (each peer's sorted by local expert) are gathered, this peer's
    units run on all of them, and each row's partial outputs are summed back on the peer that
    holds the row. `counts_PL` (int64 [P, L], host): every peer's rows per local expert.

    P peers, G rows gathered (peer-major, then local expert), M = this peer's rows."""
    sizes = counts_PL.sum(1).tolist()
    dev = x_MD.device
    if max(sizes) == 0:  # every peer knows: no row collective follows, the experts still run
        # (their weight layout is a collective over the peers)
        me = counts_PL[dist.get_rank(group)]
        return experts(x_MD, me.to(dev, non_blocking=True), **host_rows(experts, me))
    P, L, M = len(sizes), counts_PL.shape[1], x_MD.shape[0]
    x_GD = all_gather_rows(x_MD, sizes, group)  # backward: the partial gradients summed
    expert_G = torch.arange(L).repeat(P).repeat_interleave(counts_PL.flatten())
    # Host tables to the device without a stream sync (a blocking copy waits for the queue).
    order_G = torch.argsort(expert_G, stable=True).to(dev, non_blocking=True)
    rows_L = counts_PL.sum(0)
    y_GD = experts(x_GD.index_select(0, order_G), rows_L.to(dev, non_blocking=True),
                   **host_rows(experts, rows_L))
    y_GD = y_GD.index_select(0, inverse_permutation(order_G))
    # Reduce-scatter with uneven sizes: peer p's rows go to p, which sums the P partials.
    y_PMD = all_to_all_rows(y_GD, sizes, [M] * P, group)
    return y_PMD.view(P, M, y_GD.shape[1]).sum(0)


class AllToAllDispatcher(_EPDispatcher):
    """Permute by expert, all-to-all with split sizes, sort by local expert, experts(), and back.

    `dispatch_dtype` compresses the payloads: "bf16" both ways; "fp8" sends the tokens as e4m3
    with per-token scales and brings the outputs back in bf16 (see comm.py for the bound); to
    experts under execution.fp8_recipe=block, with a scale per 128 features, and the experts' first
    GEMM takes the e4m3 rows as they arrived (`_token_codec`).
    `overlap`: the tokens' all-to-all is asynchronous and hides the shared expert (module doc).
    `spare_slots` > 0: overloaded ranks lend rows of their hottest experts to lighter ranks, which
    borrow the weights for the call (expert_lending.py), in lends of at least `min_lend_rows`
    rows (default 3F); `rank_rows` then records the rows each EP rank ran in the last forward.
    """

    def __init__(self, num_experts: int, group=None, capacity_factor: float | None = None,
                 drop_policy: str = "probs", dispatch_dtype: str = "none", tp_group=None,
                 overlap: bool = False, etp_group=None, spare_slots: int = 0,
                 min_lend_rows: int | None = None, counts: RoutingCounts | None = None):
        super().__init__(num_experts, group, capacity_factor, drop_policy, tp_group, etp_group, counts)
        self.codec = make_codec(dispatch_dtype)
        self.block_codec = make_codec(dispatch_dtype, run=BLOCK) if dispatch_dtype == "fp8" else None
        self.combine_codec = self.codec.grad()
        self.overlap = overlap
        self.overlaps_shared = overlap and self.ep_size > 1
        if spare_slots and (self.ep_size == 1 or etp_group is not None):
            raise ValueError(f"parallel.ep_spare_slots={spare_slots} lends experts between EP ranks; "
                             "it needs ep > 1 and etp = 1 (set ep_spare_slots=0)")
        self.spare_slots = spare_slots
        self.min_lend_rows = min_lend_rows  # None: 3F, the rows worth one expert's weights
        self.rank_rows: list[int] | None = None
        self.step_rows: list[int] | None = None  # rank_rows summed until take_step_rows()

    def _dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, experts, side=None, turn: Turn | None = None):
        """(routed y_TD, side() or None): dispatch / experts / combine."""
        routing, table = self._route(x_TD, topk_idx_TK, topk_weight_TK, experts)
        if self.ep_size == 1:
            self.wire_bytes = 0
            x_ND = x_TD.index_select(0, routing.token_N)
            y_ND = self._experts(experts, x_ND, routing.counts_E, table, self._local_rows(table))
            return combine(y_ND, routing, x_TD.shape[0]), _call(side)
        borrowed, lent_bytes = None, 0
        if self.spare_slots:
            routing, send, recv_RS, borrowed, lent_bytes = self._lend(routing, table, experts)
        else:
            send_RS, recv_RS = self._split_table(table)
            send = send_RS.sum(1).tolist()
        recv = recv_RS.sum(1).tolist()
        x_ND = x_TD.index_select(0, routing.token_N)
        codec = self._token_codec(experts)
        x_MD, side_TD, payload = self._send_tokens(x_ND, send, recv, side, turn, codec)
        y_MD = self._run_experts(x_MD, recv_RS, experts, table, borrowed, payload)
        y_ND = self._send_back(y_MD, recv, send, turn)
        D, dtype = x_TD.shape[1], x_TD.dtype
        self.wire_bytes = (self._remote_rows(send) * codec.wire_bytes_per_row(D, dtype)
                           + self._remote_rows(recv) * self.combine_codec.wire_bytes_per_row(D, dtype)
                           + lent_bytes)
        if side_TD is None:  # synchronous: the side work runs where it would without EP, after
            side_TD = _call(side)
        return combine(y_ND, routing, x_TD.shape[0]), side_TD

    def _lend(self, routing: Routing, table: torch.Tensor, experts):
        """(routing in send order, send splits, recv table [R, L + B], borrowed weights or None,
        weight bytes sent): the lending plan of expert_lending.py for this layer's counts (the
        host `table`; etp = 1 under lending)."""
        counts_RE = table[0, :, :self.num_experts]
        min_rows = 3 * experts.w_down.shape[1] if self.min_lend_rows is None else self.min_lend_rows
        plan = make_plan(counts_RE, self.spare_slots, min_rows)
        order_N, send, recv_RS = source_tables(plan, counts_RE, self.ep_rank, self.ep_size)
        self.rank_rows = plan.rank_rows(self.ep_size)
        self.step_rows = [a + b for a, b in zip(self.step_rows or [0] * self.ep_size, self.rank_rows,
                                                strict=True)]
        if not plan.lends:  # every rank knows: no weight moves, rows go to their owners
            return routing, send, recv_RS, None, 0
        order_N = order_N.to(routing.token_N.device, non_blocking=True)
        routing = Routing(routing.token_N[order_N], routing.expert_N[order_N],
                          routing.weight_N[order_N], routing.counts_E)
        borrowed, sent_bytes = lend_weights(experts, plan, self.ep_rank, self.group)
        return routing, send, recv_RS, borrowed, sent_bytes

    def take_step_rows(self) -> list[int] | None:
        """Rows each EP rank ran under lending since the last call (None without lending)."""
        rows, self.step_rows = self.step_rows, None
        return rows

    def _split_table(self, table: torch.Tensor):
        """(send_RL, recv_RL) int64 host tables from the RouteTable: row r of send is what I send
        rank r's experts, row s of recv what rank s sends mine."""
        send_RL = table[self.etp_rank, self.ep_rank, :self.num_experts].view(self.ep_size, self.local_experts)
        return send_RL, self._own_columns(table)[self.etp_rank]

    def _token_codec(self, experts):
        """The tokens' codec for this call. Under execution.fp8_recipe=block the fp8 codec scales
        runs of 128 features, the experts' own activation tiles: their first GEMM then takes the
        rows as they arrive (FP8 values and scales), without decoding and quantising them again.
        Not over ETP, whose peers gather the decoded rows again."""
        if self.block_codec is not None and getattr(experts, "fp8", None) == "block" and self.etp_group is None:
            return self.block_codec
        return self.codec

    def _send_tokens(self, x_ND, send, recv, side, turn: Turn | None, codec):
        """Dispatch stage: (rows for my experts x_MD, side() if it ran while they travelled, the
        received FP8 payload where the experts read it, else None). With another micro-batch in
        flight (a `turn`, interleave.py) the all-to-all is asynchronous even without side work:
        the other micro-batch computes while it travels."""
        receipt = [] if codec is self.block_codec else None  # self.codec is never the block one
        overlap_side = self.overlap and side is not None
        if not (overlap_side or turn is not None):
            x_MD, side_TD = all_to_all_rows(x_ND, send, recv, self.group, codec, receipt), None
        else:
            in_flight = start_all_to_all_rows(x_ND, send, recv, self.group, codec, turn, receipt)
            side_TD = side() if overlap_side else None
            x_MD = in_flight.wait()
        return x_MD, side_TD, (receipt[0] if receipt else None)

    def _send_back(self, y_MD, recv, send, turn: Turn | None):
        """Combine stage's all-to-all (asynchronous with another micro-batch in flight)."""
        if turn is not None:
            return start_all_to_all_rows(y_MD, recv, send, self.group, self.combine_codec, turn).wait()
        return all_to_all_rows(y_MD, recv, send, self.group, self.combine_codec)

    def _run_experts(self, x_MD, recv_RS, experts, table, borrowed=None, payload=None):
        """Experts stage: rows arrive grouped by source rank, then local slot (owned experts, then
        borrowed ones); experts() wants them slot-major, and the combine all-to-all wants them
        back in arrival order. `payload`: the rows' FP8 wire form, handed to the experts too."""
        R, S = recv_RS.shape
        slot_M = torch.arange(S).repeat(R).repeat_interleave(recv_RS.flatten())
        # Host tables to the device without a stream sync (a blocking copy waits for the queue).
        order_M = torch.argsort(slot_M, stable=True).to(x_MD.device, non_blocking=True)
        rows_S = recv_RS.sum(0)
        counts_S = rows_S.to(x_MD.device, non_blocking=True)
        x_MD = x_MD.index_select(0, order_M)
        kw = {} if payload is None else {
            "x_fp8": self.block_codec.tiles(payload.index_select(0, order_M), x_MD.shape[1])}
        if borrowed is None:
            y_MD = self._experts(experts, x_MD, counts_S, table, rows_S, **kw)
        else:  # etp = 1 here (the constructor refuses lending over ETP)
            y_MD = experts(x_MD, counts_S, borrowed, **host_rows(experts, rows_S), **kw)
        return y_MD.index_select(0, inverse_permutation(order_M))


class AllGatherDispatcher(_EPDispatcher):
    """All-gather every token of the EP group, run the local experts, reduce-scatter the outputs.

    Simpler and latency-friendly for few tokens; sends R-1 copies of every token, so it loses to
    the all-to-all once top-k * R is small relative to R (see bench/moe_dispatch.py).
    """

    def _dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, experts, side=None, turn: Turn | None = None):
        """(routed y_TD, side() or None); the side work runs after the routed experts. The
        all-gather is synchronous: `turn` has no wait to hand over at."""
        return self._gather_dispatch(x_TD, topk_idx_TK, topk_weight_TK, experts), _call(side)

    def _gather_dispatch(self, x_TD, topk_idx_TK, topk_weight_TK, experts):
        routing, table = self._route(x_TD, topk_idx_TK, topk_weight_TK, experts)
        if self.ep_size == 1:
            self.wire_bytes = 0
            x_ND = x_TD.index_select(0, routing.token_N)
            y_ND = self._experts(experts, x_ND, routing.counts_E, table, self._local_rows(table))
            return combine(y_ND, routing, x_TD.shape[0])
        T, R = x_TD.shape[0], self.ep_size
        group_RE1 = table[self.etp_rank]  # this EP group's rows: kept per expert, then tokens
        sizes = group_RE1[:, -1].tolist()
        if max(sizes) == 0:  # the whole group is empty (every rank knows: no collective follows)
            self.wire_bytes = 0
            if self.etp_group is not None:  # ETP peers outside this EP group may hold rows
                empty = torch.zeros(self.local_experts, dtype=torch.int64)
                y_0D = self._experts(experts, x_TD[:0], empty.to(x_TD.device), table, empty)
                return x_TD * 0 + y_0D.sum() * 0
            return x_TD * 0
        x_GD = all_gather_rows(x_TD, sizes, self.group)
        mine, rows_L = self._local_assignments(routing, sizes, group_RE1)
        y_ND = self._experts(experts, x_GD.index_select(0, mine.token_N), mine.counts_E, table, rows_L)
        part_GD = combine(y_ND, mine, x_GD.shape[0])
        # Reduce-scatter with uneven sizes: slice r goes to rank r, which sums R partials.
        y_RTD = all_to_all_rows(part_GD, sizes, [T] * R, self.group)
        row = x_TD.shape[1] * x_TD.element_size()
        self.wire_bytes = (R - 1) * max(sizes) * row + (sum(sizes) - T) * row
        return y_RTD.view(R, T, x_TD.shape[1]).sum(0)

    def _local_assignments(self, routing: Routing, sizes: list[int],
                           group_RE1: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """(every rank's kept assignments to this rank's experts, sorted by local expert; their
        count per local expert on the host): how many each rank sends and how many are this
        rank's come from the host table `group_RE1`."""
        E, L = self.num_experts, self.local_experts
        offset = sum(sizes[: self.ep_rank])
        ids_N2 = torch.stack([routing.token_N + offset, routing.expert_N], dim=1)
        n_sizes = group_RE1[:, :E].sum(1).tolist()  # kept assignments of each rank
        ids_A2 = all_gather_rows(ids_N2, n_sizes, self.group)
        w_A = all_gather_rows(routing.weight_N.unsqueeze(1), n_sizes, self.group).squeeze(1)
        local_A = ids_A2[:, 1] - self.ep_rank * L
        # Mine first, sorted by local expert (ties in gathered order), the others after them.
        key_A = torch.where((local_A >= 0) & (local_A < L), local_A, L)
        rows_L = group_RE1[:, self.ep_rank * L:(self.ep_rank + 1) * L].sum(0)
        order = torch.argsort(key_A, stable=True)[: int(rows_L.sum())]
        return Routing(ids_A2[order, 0], local_A[order], w_A[order],
                       rows_L.to(local_A.device, non_blocking=True)), rows_L


def build_dispatcher(dims, cfg, num_experts: int, permute: str = "torch",
                     counts: RoutingCounts | None = None):
    """The dispatcher `cfg` (ParallelConfig) asks for, over `dims`' EP group, reading its routing
    counts through `counts` (comm.RoutingCounts by default).

    Dropless on one rank without TP or ETP there is nothing to route across ranks: the model's own
    LocalDispatcher (sort by expert, one batched combine) computes the same sum faster, with the
    model's `permute` path (Ops.permute: it may run in Triton); it reads no count."""
    group = dims.group_or_none(Axis.EP)
    # TP peers split their shared tokens; under SP each already holds only its own.
    tp_group = None if cfg.sequence_parallel else dims.group_or_none(Axis.TP)
    etp_group = dims.group_or_none(Axis.ETP)  # ETP peers split the experts' hidden units
    if cfg.dispatcher == "allgather" and cfg.dispatch_dtype != "none":
        raise ValueError(f"dispatch_dtype={cfg.dispatch_dtype!r} compresses the all-to-all "
                         "only; use dispatcher=alltoall or dispatch_dtype=none")
    if group is None and tp_group is None and etp_group is None and cfg.capacity_factor is None:
        from longctx_moe.model.moe import LocalDispatcher

        return LocalDispatcher(permute, counts)
    if cfg.dispatcher == "allgather":
        return AllGatherDispatcher(num_experts, group, cfg.capacity_factor, cfg.drop_policy,
                                   tp_group, etp_group, counts)
    return AllToAllDispatcher(num_experts, group, cfg.capacity_factor, cfg.drop_policy,
                              cfg.dispatch_dtype, tp_group, cfg.moe_overlap, etp_group,
                              cfg.ep_spare_slots, counts=counts)
