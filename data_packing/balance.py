"""Token-budget micro-batching that balances an estimated compute cost across DP ranks.

One optimizer step's documents (sizes = physical, padded lengths) are split into
dp_size x M micro-batches, M the same on every rank and as small as the token budget allows.
Cost of a document of padded length L: per_token * L + per_token_pair * L * (L + 1) / 2, the
second term counting the causal query-key pairs of its attention (DataConfig explains the units).

Longest-processing-time first with a capacity constraint: documents, most expensive first, go to
the micro-batch with the lowest cost that still has room; then whole micro-batches go, most
expensive first, to the rank with the lowest total among those that still need one. Documents
are never split, so labels never cross a document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class StepAssignment:
    """micro[r][m]: positions (into the step's document list) of rank r's m-th micro-batch."""

    micro: list[list[list[int]]]
    rank_cost: np.ndarray  # float64 [dp_size]
    micro_cost: np.ndarray  # float64 [dp_size * M]

    @property
    def rank_max_over_mean(self) -> float:
        return float(self.rank_cost.max() / self.rank_cost.mean()) if self.rank_cost.mean() else 1.0

    @property
    def micro_max_over_mean(self) -> float:
        return float(self.micro_cost.max() / self.micro_cost.mean()) if self.micro_cost.mean() else 1.0


def token_pair_cost(tokens, pairs, per_token, per_pair):
    """per_token * tokens + per_pair * pairs: the one cost shape of the project's planners (this
    loader's balance, the CP planner's pieces, the Dynamic-CP scheduler's seconds, the model's
    training FLOPs, the layout planner): work linear in the tokens a rank holds (GEMMs) plus work
    per query-key pair of attention. Scalars or arrays; each caller states its units."""
    return per_token * tokens + per_pair * pairs


def causal_pairs(length):
    """Query-key pairs (key <= query) of causal attention over `length` tokens: L * (L + 1) / 2."""
    return length * (length + 1) / 2


def doc_cost(padded_len: np.ndarray, per_token: float, per_token_pair: float) -> np.ndarray:
    """float64 [N]: per_token * L + per_token_pair * L * (L + 1) / 2 (causal pairs)."""
    length = np.asarray(padded_len, dtype=np.float64)
    return token_pair_cost(length, causal_pairs(length), per_token, per_token_pair)


def _fill_bins(sizes: np.ndarray, costs: np.ndarray, n_bins: int, budget: int):
    """Capacity-constrained LPT into n_bins; None if some document finds no room."""
    order = np.lexsort((np.arange(len(sizes)), -sizes, -costs))
    load = np.zeros(n_bins, dtype=np.int64)
    cost = np.zeros(n_bins, dtype=np.float64)
    members: list[list[int]] = [[] for _ in range(n_bins)]
    for rank_in_order, i in enumerate(order.tolist()):
        if rank_in_order < n_bins:  # seed every bin with one document: none stays empty
            b = rank_in_order
        else:
            room = load + sizes[i] <= budget
            if not room.any():
                return None
            b = int(np.argmin(np.where(room, cost, np.inf)))
        load[b] += sizes[i]
        cost[b] += costs[i]
        members[b].append(i)
    return members, cost


def _bins_to_ranks(cost: np.ndarray, dp_size: int, per_rank: int) -> list[list[int]]:
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    total = np.zeros(dp_size)
    for b in np.argsort(-cost, kind="stable").tolist():
        open_ranks = [r for r in range(dp_size) if len(ranks[r]) < per_rank]
        r = min(open_ranks, key=lambda q: (total[q], q))
        ranks[r].append(b)
        total[r] += cost[b]
    return ranks


def balance_step(sizes: np.ndarray, costs: np.ndarray, dp_size: int, budget: int) -> StepAssignment:
    """Split one step's documents into dp_size ranks x M micro-batches of <= budget tokens.

    sizes: int [N] padded lengths (each <= budget); costs: float [N]. Raises ValueError when the
    documents cannot give every micro-batch at least one document.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    n, total = len(sizes), int(sizes.sum())
    if n and sizes.max() > budget:
        raise ValueError(f"a document of {int(sizes.max())} tokens exceeds the micro-batch budget "
                         f"{budget}; raise data.micro_batch_tokens or repack with a smaller --seq-len")
    per_rank = max(1, math.ceil(total / (dp_size * budget)))
    while True:
        if n < dp_size * per_rank:
            raise ValueError(
                f"a step has {n} documents ({total} tokens) for {dp_size} DP ranks x {per_rank} "
                f"micro-batches of <= {budget} tokens, so some micro-batch would be empty; raise "
                "data.global_batch_tokens or data.micro_batch_tokens, or use fewer DP ranks")
        filled = _fill_bins(sizes, costs, dp_size * per_rank, budget)
        if filled is not None:
            break
        per_rank += 1  # the budget, not the count, was binding: one more micro-batch per rank
    members, cost = filled
    ranks = _bins_to_ranks(cost, dp_size, per_rank)
    micro = [[sorted(members[b]) for b in bins] for bins in ranks]
    rank_cost = np.asarray([sum(cost[b] for b in bins) for bins in ranks])
    return StepAssignment(micro, rank_cost, cost)
