"""Dynamic-CP execution: one step's documents rescheduled onto power-of-two CP sub-groups.

With `parallel.dynamic_cp`, every DP replica still loads its own micro-batches; the trainer then
calls `reschedule` once per optimizer step (collective over dp_cp):

1. the lengths of each replica's documents are all-gathered over `dp` (a few bytes per
   document), so every rank of the DP x CP block knows the step's documents and their owners;
2. every rank runs the same deterministic scheduler (cp_attention.dynamic.schedule) on them:
   each document gets the smallest power-of-two CP size whose share fits
   `max_tokens_per_rank`, runs of ranks are balanced by a cost model of compute (with the
   attention tile efficiency), CP traffic and ring-step latency (DynamicCPCost), and every rank
   gets the same number of slots;
3. one all-to-all over dp_cp moves each document (token ids, labels, positions, loss weights: no
   activations) to the ranks of its run that do not hold it: a rank of the owner replica sends
   it, the one at the receiver's CP position, so a replica's CP ranks share the sending
   (`routes`). Ranks of the owner replica already hold it. Each rank receives only what it runs;
4. each rank builds one PackedBatch per slot from its run's documents (padded for that run's
   size) with the CPGroup of that run (ParallelDims.dynamic_group), or a batch of padding
   without targets where it is idle, so the expert all-to-alls line up.

The trainer runs the slots like micro-batches. The loss stays the token-mean of the whole global
batch (G counts every target once; each document runs on exactly one run), gradients reduce once
per step over dp_cp as with static CP, and router statistics are summed over the run's group.

Block positions: rank b of the dp_cp group is CP rank b % cp of DP replica b // cp (the dims'
grid orders DP before CP). Legend: N documents of the step, B block ranks, P physical tokens of
a slot's batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cp_attention.dynamic_cost import padded_length
from data_packing.batch import PackedBatch, pack_documents, pad_multiple
from longctx_moe.parallel.comm import host_collective
from longctx_moe.parallel.context_parallel import NO_CP, CPGroup
from longctx_moe.parallel.dims import Axis


@dataclass
class Document:
    """One document of a step: its real tokens only (no padding)."""

    tokens: torch.Tensor  # int64 [n]
    labels: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n]
    weight: torch.Tensor | None  # float32 [n]


@dataclass
class Slot:
    """What this rank runs in one slot of the schedule."""

    batch: PackedBatch
    cp: CPGroup


def documents(micro_batches: list[PackedBatch]) -> list[Document]:
    """The documents of these micro-batches, in order, without their padding."""
    docs = []
    for mb in micro_batches:
        starts = mb.cu_seqlens_padded[:-1].tolist()
        for start, n in zip(starts, mb.doc_lengths(), strict=True):
            piece = slice(start, start + n)
            weight = None if mb.loss_weight is None else mb.loss_weight[piece]
            docs.append(Document(mb.tokens[piece], mb.labels[piece], mb.position_ids[piece], weight))
    return docs


def step_lengths(docs: list[Document], group) -> tuple[list[int], list[int], bool]:
    """(lengths [N], owner replica [N], any document weighted) of the step's documents, every
    replica's in DP rank order (collective over the DP `group`; None: this replica alone). On
    the host: a few bytes, and the scheduler reads them there (no device sync)."""
    weighted = any(d.weight is not None for d in docs)
    mine = [int(weighted)] + [d.tokens.numel() for d in docs]
    if group is None:
        return mine[1:], [0] * len(docs), weighted
    parts = _gather_host(torch.tensor(mine, dtype=torch.int64), group)
    lengths, owner = [], []
    for replica, part in enumerate(parts):
        values = part.tolist()
        weighted = weighted or bool(values[0])
        lengths += values[1:]
        owner += [replica] * (len(values) - 1)
    return lengths, owner, weighted


@host_collective
def _gather_host(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's host vector `x` (its length differs per rank), in rank order: two host
    all-gathers, by design (gloo beside NCCL on a GPU run: a few bytes, read on the host)."""
    size = dist.get_world_size(group)
    n = torch.tensor([x.numel()], dtype=torch.int64)
    counts = [torch.empty_like(n) for _ in range(size)]
    dist.all_gather(counts, n, group=group)
    sizes = [int(c) for c in counts]
    parts = [x.new_empty(max(sizes)) for _ in range(size)]
    dist.all_gather(parts, torch.cat([x, x.new_zeros(max(sizes) - x.numel())]), group=group)
    return [part[:n] for part, n in zip(parts, sizes, strict=True)]


def needed_documents(plan, block: int) -> list[list[int]]:
    """For every block position, the documents its runs hold over all slots (ascending)."""
    needs: list[list[int]] = [[] for _ in range(block)]
    for runs in plan.slots:
        for run in runs:
            for r in run.ranks:
                needs[r] += run.seq_indices
    return [sorted(n) for n in needs]


def routes(needs: list[list[int]], owner: list[int], me: int,
           cp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(send[q], recv[p]): the documents block position `me` sends to each position q and
    receives from each position p. A position needs its runs' documents; those of its own replica
    it holds; any other comes from the owner replica's rank at the receiver's CP position."""
    replica, cp_rank = divmod(me, cp)
    send = [[i for i in needed if owner[i] == replica] if q % cp == cp_rank and q // cp != replica
            else [] for q, needed in enumerate(needs)]
    recv = [[] for _ in needs]
    for i in needs[me]:
        if owner[i] != replica:
            recv[owner[i] * cp + cp_rank].append(i)
    return send, recv


def _rows(doc: Document, weighted: bool) -> torch.Tensor:
    """int64 [n, 3 or 4]: tokens, labels, positions and the loss weight's float64 bits."""
    cols = [doc.tokens, doc.labels, doc.positions]
    if weighted:
        w = doc.weight if doc.weight is not None else torch.ones(doc.tokens.numel())
        cols.append(w.to(torch.float64).view(torch.int64))
    return torch.stack([c.cpu() for c in cols], 1)


def exchange_documents(mine: list[Document], lengths: list[int], owner: list[int], weighted: bool,
                       needs: list[list[int]], me: int, cp: int, group,
                       device="cpu") -> dict[int, Document]:
    """The documents block position `me` needs (index -> Document): its replica's from `mine`,
    the others by one all-to-all over the dp_cp `group` (every rank calls it with the same
    lengths, owners and needs; None: one replica, nothing to move)."""
    replica = me // cp
    first = owner.index(replica) if mine else 0
    have = {i: mine[i - first] for i in needs[me] if owner[i] == replica}
    if group is None:
        return have
    send, recv = routes(needs, owner, me, cp)
    cols = 4 if weighted else 3
    out_rows = [_rows(mine[i - first], weighted) for dest in send for i in dest]
    buf = torch.cat(out_rows) if out_rows else torch.zeros(0, cols, dtype=torch.int64)
    recv_splits = [sum(lengths[i] for i in src) for src in recv]
    got = buf.new_empty(sum(recv_splits), cols, device=device)
    dist.all_to_all_single(got, buf.to(device, non_blocking=True), recv_splits,
                           [sum(lengths[i] for i in dest) for dest in send], group=group)
    got, offset = got.cpu(), 0
    for src in recv:
        for i in src:
            block = got[offset:offset + lengths[i]]
            weight = block[:, 3].contiguous().view(torch.float64).float() if weighted else None
            have[i] = Document(block[:, 0], block[:, 1], block[:, 2], weight)
            offset += lengths[i]
    return have


def pack_slot(docs: list[Document], multiple: int) -> PackedBatch:
    """One PackedBatch of `docs`, each padded to `multiple` (data_packing.batch.pack_documents;
    the stand-in batch when `docs` is empty)."""
    return pack_documents([d.tokens for d in docs], [d.labels for d in docs], multiple,
                          positions=[d.positions for d in docs], weights=[d.weight for d in docs])


class DynamicCP:
    """Reschedules each step's documents onto the Dynamic-CP sub-groups of the DP x CP block."""

    def __init__(self, dims, capacity_tokens: int, cost, max_cp: int, backend: str,
                 sequence_parallel: bool = False):
        self.dims, self.capacity, self.cost = dims, capacity_tokens, cost
        self.max_cp, self.backend = max_cp, backend
        self._sequence_parallel = sequence_parallel
        self.block = dims.dp * dims.cp

    def reschedule(self, micro_batches: list[PackedBatch],
                   device="cpu") -> tuple[list[Slot], dict[int, int]]:
        """This rank's slots for the step and the histogram {CP size: documents} (collective
        over dp_cp). The micro-batches' bounds and the lengths stay on the host (gloo carries
        the lengths); the documents travel on `device` (NCCL bandwidth on a GPU) and are read
        back once, to pack the slots on the host like the loader's batches."""
        mine = documents(micro_batches)
        lengths, owner, weighted = step_lengths(mine, self.dims.group_or_none(Axis.DP))
        plan = self.plan(lengths)
        docs = exchange_documents(
            mine, lengths, owner, weighted, needed_documents(plan, self.block),
            self.dims.rank_in(Axis.DP_CP), self.dims.cp,
            self.dims.group_or_none(Axis.DP_CP) if self.dims.dp > 1 else None, device)
        slots = [Slot(pack_slot([docs[i] for i in seqs], multiple), cp)
                 for seqs, multiple, cp in self.my_runs(plan)]
        return slots, dict(plan.cp_sizes_used)

    def check_longest(self, longest: int, where: str) -> None:
        """Refuse at start-up a document that no run can hold (every step holding it would stop
        there): its share of the largest run, padded as the runtime pads it, over capacity."""
        share = padded_length(longest, self.max_cp, self.dims.tp,
                              self._sequence_parallel) // self.max_cp
        if share > self.capacity:
            raise ValueError(
                f"{where} holds a document of {longest} tokens: {share} per rank on the largest "
                f"Dynamic-CP run (max_cp={self.max_cp}), over the {self.capacity} tokens one rank "
                "holds (parallel.max_tokens_per_rank, else data.micro_batch_tokens); raise "
                "parallel.max_tokens_per_rank or parallel.max_cp, or repack with a smaller "
                "--seq-len")

    def plan(self, lengths: list[int], capacity: int | None = None):
        """The schedule of sequences of these lengths on the block (pure, the same on every rank);
        `capacity`: tokens per rank and slot (default parallel.max_tokens_per_rank)."""
        from cp_attention.dynamic import schedule

        try:
            return schedule(lengths, self.block, self.max_cp, capacity or self.capacity, self.cost,
                            tp=self.dims.tp, sequence_parallel=self._sequence_parallel)
        except ValueError as e:  # a sequence no sub-group can hold: name the keys to change
            raise ValueError(f"Dynamic-CP: {e}") from None

    def my_runs(self, plan) -> list[tuple[tuple[int, ...], int, CPGroup]]:
        """For every slot of `plan`, what this rank runs: (sequence indices, padding multiple of
        the run's size, the run's CPGroup); no sequences where the rank idles."""
        me = self.dims.rank_in(Axis.DP_CP)
        return [(seqs, pad_multiple(run.size, self.dims.tp, self._sequence_parallel),
                 self._cp_group(run.size, me - run.first_rank))
                for run, seqs in plan.assignment(me)]

    def _cp_group(self, size: int, rank: int) -> CPGroup:
        """The CPGroup of this rank's run. Hierarchical: a run no larger than cp_inner is one
        all-to-all group (Ulysses); a larger one is whole cp_inner groups (aligned, inner
        fastest) joined by a ring of every cp_inner-th rank."""
        if size == 1:
            return NO_CP
        group, pos = self.dims.dynamic_group(size)
        assert pos == rank, (pos, rank)  # the plan's runs are the dims' aligned runs
        if self.backend != "hierarchical":
            return CPGroup(size=size, rank=rank, backend=self.backend, group=group)
        inner = self.dims.cp_inner
        if size <= inner:
            return CPGroup(size=size, rank=rank, backend="ulysses", group=group)
        inner_group, outer_group = self.dims.dynamic_hierarchical_groups(size)
        return CPGroup(size=size, rank=rank, backend="hierarchical", group=group,
                       inner=inner_group, outer=outer_group, sizes=(inner, size // inner))
