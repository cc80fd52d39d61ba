"""Dynamic-CP execution: one step's documents rescheduled onto power-of-two CP sub-groups.

With `parallel.dynamic_cp`, every DP replica still loads its own micro-batches; the trainer then
calls `reschedule` once per optimizer step (collective over dp_cp):

1. each replica's documents (token ids, labels, positions, loss weights: no activations) are
   all-gathered over `dp`, so every rank of the DP x CP block holds the step's documents (CP
   peers of a replica hold the same ones already);
2. every rank runs the same deterministic scheduler (cp_attention.dynamic.schedule) on their
   lengths: each document gets the smallest power-of-two CP size whose share fits
   `max_tokens_per_rank`, runs of ranks are balanced by a cost model of compute (with the
   attention tile efficiency), ring traffic and ring-step latency (DynamicCPCost),
   and every rank gets the same number of slots;
3. each rank builds one PackedBatch per slot from its run's documents (padded for that run's
   size) with the CPGroup of that run (ParallelDims.dynamic_group), or a one-token batch
   without targets where it is idle, so the expert all-to-alls line up.

The trainer runs the slots like micro-batches. The loss stays the token-mean of the whole global
batch (G counts every target once; each document runs on exactly one run), gradients reduce once
per step over dp_cp as with static CP, and router statistics are summed over the run's group.

Legend: N documents of the step, P physical tokens of a slot's batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_packing.batch import IGNORE_INDEX, PackedBatch, pad_multiple
from longctx_moe.parallel.comm import all_gather_rows, gather_sizes
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


def gather_documents(docs: list[Document], group) -> list[Document]:
    """Every rank's documents of `group`, in rank order (collective; identity for None)."""
    if group is None:
        return docs
    lengths = torch.tensor([d.tokens.numel() for d in docs], dtype=torch.int64)
    weighted = any(d.weight is not None for d in docs)
    rows = [torch.stack([d.tokens.cpu(), d.labels.cpu(), d.positions.cpu()], 1) for d in docs]
    rows_N3 = torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)
    all_lengths = _gather_var(lengths, group)
    all_rows = _gather_var(rows_N3, group)
    all_weights = None
    if weighted:
        w = torch.cat([d.weight.cpu().to(torch.float64) if d.weight is not None
                       else torch.ones(d.tokens.numel(), dtype=torch.float64) for d in docs])
        all_weights = _gather_var(w, group)
    out = []
    for r, lens in enumerate(all_lengths):
        offset = 0
        for n in lens.tolist():
            block = all_rows[r][offset:offset + n]
            weight = None if all_weights is None else all_weights[r][offset:offset + n].float()
            out.append(Document(block[:, 0], block[:, 1], block[:, 2], weight))
            offset += n
    return out


def _gather_var(x: torch.Tensor, group) -> list[torch.Tensor]:
    """all_gather of tensors whose first dimension differs per rank; one tensor per rank."""
    sizes = gather_sizes(x.shape[0], group)
    return list(all_gather_rows(x, sizes, group).split(sizes))


def pack_documents(docs: list[Document], multiple: int) -> PackedBatch:
    """One PackedBatch of `docs`, each padded to `multiple`; a one-token batch without targets
    when `docs` is empty (an idle rank still runs the step's collectives)."""
    if not docs:
        one = torch.zeros(1, dtype=torch.int64)
        return PackedBatch(tokens=one, labels=torch.full_like(one, IGNORE_INDEX),
                           cu_seqlens=torch.zeros(1, dtype=torch.int32),
                           cu_seqlens_padded=torch.zeros(1, dtype=torch.int32),
                           position_ids=torch.zeros_like(one), max_seqlen=0)
    lens = [d.tokens.numel() for d in docs]
    slots = [-(-n // multiple) * multiple for n in lens]

    def padded(values, fill):
        return torch.cat([torch.cat([v, v.new_full((s - v.numel(),), fill)])
                          for v, s in zip(values, slots, strict=True)])

    weighted = any(d.weight is not None for d in docs)
    weight = None
    if weighted:
        weight = padded([d.weight if d.weight is not None else torch.ones(d.tokens.numel())
                         for d in docs], 0.0)
    return PackedBatch(tokens=padded([d.tokens for d in docs], 0),
                       labels=padded([d.labels for d in docs], IGNORE_INDEX),
                       cu_seqlens=torch.tensor([0, *lens]).cumsum(0).to(torch.int32),
                       cu_seqlens_padded=torch.tensor([0, *slots]).cumsum(0).to(torch.int32),
                       position_ids=padded([d.positions for d in docs], 0),
                       max_seqlen=max(lens), loss_weight=weight)


class DynamicCP:
    """Reschedules each step's documents onto the Dynamic-CP sub-groups of the DP x CP block."""

    def __init__(self, dims, capacity_tokens: int, cost, max_cp: int, backend: str):
        self.dims, self.capacity, self.cost = dims, capacity_tokens, cost
        self.max_cp, self.backend = max_cp, backend
        self.block = dims.dp * dims.cp

    def reschedule(self, micro_batches: list[PackedBatch]) -> tuple[list[Slot], dict[int, int]]:
        """This rank's slots for the step and the histogram {CP size: documents} (collective)."""
        docs = gather_documents(documents(micro_batches), self.dims.group_or_none(Axis.DP))
        plan = self.plan([d.tokens.numel() for d in docs])
        slots = [Slot(pack_documents([docs[i] for i in seqs], multiple), cp)
                 for seqs, multiple, cp in self.my_runs(plan)]
        return slots, dict(plan.cp_sizes_used)

    def plan(self, lengths: list[int], capacity: int | None = None):
        """The schedule of sequences of these lengths on the block (pure, the same on every rank);
        `capacity`: tokens per rank and slot (default parallel.max_tokens_per_rank)."""
        from cp_attention.dynamic import schedule

        try:
            return schedule(lengths, self.block, self.max_cp, capacity or self.capacity, self.cost,
                            tp=self.dims.tp)
        except ValueError as e:  # a sequence no sub-group can hold: name the keys to change
            raise ValueError(f"Dynamic-CP: {e}") from None

    def my_runs(self, plan) -> list[tuple[tuple[int, ...], int, CPGroup]]:
        """For every slot of `plan`, what this rank runs: (sequence indices, padding multiple of
        the run's size, the run's CPGroup); no sequences where the rank idles."""
        me = self.dims.rank_in(Axis.DP_CP)
        sp = self.dims.config is not None and self.dims.config.sequence_parallel
        return [(seqs, pad_multiple(run.size, self.dims.tp, sp),
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
