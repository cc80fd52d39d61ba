"""From a RolloutBatch to the micro-batches each data-parallel rank runs.

Every rank holds the same RolloutBatch and makes the same plan (pure, deterministic): sequences
are assigned whole to DP ranks x M micro-batches of at most `budget` padded tokens, balanced by
an attention-aware cost (data_packing's balancer), M the same on every rank. A micro-batch
without sequences becomes pad_multiple padding tokens without targets (sequence parallelism
splits them over TP), so every rank runs the same number of forwards (the expert all-to-alls
and CP collectives line up).

Alignment (rl_hooks/batch.py): the value at rollout token t is scored by the model's output at
the position holding token t-1. A micro-batch is a PackedBatch whose label at the physical
position p of token t-1 is token t, for every t that is not the first of its sequence, so the
forward computes exactly the log-probs of the rollout tokens, and `target_src` maps each physical
position p to the rollout token it scores (-1: none). `token_src` maps p to the rollout token
that sits there (router replay routes are per input token).

Legend: T rollout tokens, P physical tokens of a micro-batch, S sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data_packing.balance import balance_step, doc_cost
from data_packing.batch import IGNORE_INDEX, PackedBatch, pack_documents, pad_to
from rl_hooks.batch import RolloutBatch


@dataclass
class MicroBatch:
    """One micro-batch of a RolloutBatch as one DP rank runs it."""

    packed: PackedBatch
    seqs: list[int]  # rollout sequence indices, in packed order
    target_src_P: torch.Tensor  # int64 [P]: rollout token scored at position p, -1 where none
    token_src_P: torch.Tensor  # int64 [P]: rollout token at position p, -1 at padding


def plan_micro_batches(lengths: list[int], dp_size: int, budget: int, pad_multiple: int,
                       cost_per_token: float, cost_per_token_pair: float) -> list[list[list[int]]]:
    """plan[r][m] = the sequence indices (ascending) of DP rank r's m-th micro-batch; every rank
    gets the same number of micro-batches, some possibly empty."""
    sizes = np.asarray([pad_to(n, pad_multiple) for n in lengths], dtype=np.int64)
    if sizes.size and sizes.max() > budget:
        longest = int(np.argmax(sizes))
        raise ValueError(f"sequence {longest} has {lengths[longest]} tokens (padded "
                         f"{int(sizes[longest])}) > the micro-batch token budget {budget}; raise "
                         "micro_batch_tokens (or use more CP ranks: each holds a 1/cp share)")
    costs = doc_cost(sizes, cost_per_token, cost_per_token_pair)
    # The balancer wants at least one sequence per micro-batch: hand it zero-size stand-ins for
    # the micro-batches that would be empty, then drop them.
    n_real, pad_docs = len(lengths), 0
    while True:
        try:
            step = balance_step(np.concatenate([sizes, np.zeros(pad_docs, np.int64)]),
                                np.concatenate([costs, np.zeros(pad_docs)]), dp_size, budget)
            break
        except ValueError as e:
            if "would be empty" not in str(e):
                raise
            pad_docs += dp_size
    return [[[i for i in micro if i < n_real] for micro in rank] for rank in step.micro]




def build_micro_batch(batch: RolloutBatch, seqs: list[int], pad_multiple: int) -> MicroBatch:
    """Pack `seqs` of `batch` into one PackedBatch (each sequence padded to `pad_multiple`;
    data_packing.batch.pack_documents, whose stand-in batch an empty `seqs` gives).

    Labels: the next token of every token but the last of its sequence, so every rollout token but
    a sequence's first is scored, loss tokens or not: log-prob and training passes then run the
    same computation (the first mini-batch's ratio is exactly 1)."""
    cu = batch.cu_seqlens.tolist()
    spans = [(cu[s], cu[s + 1]) for s in seqs]
    tokens = [batch.tokens[a:b] for a, b in spans]
    labels = [torch.cat([t[1:], t.new_full((1,), IGNORE_INDEX)]) for t in tokens]
    packed = pack_documents(tokens, labels, pad_multiple)
    target_src_P = torch.full((packed.num_tokens,), -1, dtype=torch.int64)
    token_src_P = torch.full_like(target_src_P, -1)
    for start, (a, b) in zip(packed.cu_seqlens_padded[:-1].tolist(), spans, strict=True):
        token_src_P[start:start + b - a] = torch.arange(a, b)
        target_src_P[start:start + b - a - 1] = torch.arange(a + 1, b)  # t scored at t - 1
    return MicroBatch(packed, list(seqs), target_src_P, token_src_P)


def replay_routes(batch: RolloutBatch, mb: MicroBatch) -> torch.Tensor | None:
    """int64 [P, L, K] routes to replay at each position (-1 at padding), or None."""
    if batch.routed_experts is None:
        return None
    src = mb.token_src_P
    routes = batch.routed_experts[src.clamp_min(0)].long()
    return torch.where((src >= 0)[:, None, None], routes, torch.full_like(routes, -1))
