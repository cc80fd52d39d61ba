"""Dynamic-CP's document exchange (longctx_moe.parallel.dynamic_cp): every rank receives exactly
the documents its runs hold and no other, each from one rank of the replica that loaded it; and
`reschedule` on gloo gives every rank of DP2 x CP2, pure DP4 and DP4 x CP2 blocks the slot
batches that packing the plan's documents in one process gives (token ids, labels, positions and
loss weights bitwise), also when only some replicas carry loss weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cp_attention.dynamic import schedule
from cp_attention.dynamic_cost import DynamicCPCost
from data_packing.batch import pad_multiple
from longctx_moe.parallel.config import ParallelConfig
from longctx_moe.parallel.dims import Axis, ParallelDims
from longctx_moe.parallel.dynamic_cp import (
    Document,
    DynamicCP,
    documents,
    needed_documents,
    pack_slot,
    routes,
)
from tests.launcher import run_distributed
from tests.model.helpers import packed_batch

COST = DynamicCPCost(a=1e-6, b=1e-9, kv_bytes_per_token=1e3, bandwidth=1e9, overlap=0.5)
CAPACITY = 12
# (world, cp, max_cp): DP2 x CP2, pure DP4 (cp 1), DP4 x CP2 (each replica's two CP ranks share
# the sending)
LAYOUTS = [(4, 2, 4), (4, 1, 4), (8, 2, 8)]


def test_routes_deliver_each_needed_document_once_from_its_owner():
    rng = np.random.default_rng(0)
    for _ in range(300):
        cp, dp = (int(x) for x in rng.choice([1, 2, 4], 2))
        block = dp * cp
        max_cp = int(rng.choice([s for s in (1, 2, 4, 8, 16) if s <= block]))
        capacity = int(rng.integers(4, 40))
        n = int(rng.integers(1, 40))
        lengths = rng.integers(1, capacity * max_cp - 2 * max_cp + 2, n).tolist()
        owner = np.repeat(np.arange(dp), rng.multinomial(n, [1 / dp] * dp)).tolist()
        plan = schedule(lengths, block, max_cp, capacity, COST)
        needs = needed_documents(plan, block)
        assert needs == [sorted(i for _, seqs in plan.assignment(r) for i in seqs)
                         for r in range(block)]
        tables = [routes(needs, owner, me, cp) for me in range(block)]
        moved = gathered = 0
        for me, (send, recv) in enumerate(tables):
            replica = me // cp
            assert all(send[q] == tables[q][1][me] for q in range(block)), "send != expected"
            got = [i for src in recv for i in src]
            held = [i for i in needs[me] if owner[i] == replica]
            assert sorted(got + held) == needs[me]  # every needed document, once
            assert all(owner[i] == p // cp != replica and p % cp == me % cp
                       for p, src in enumerate(recv) for i in src)
            assert all(owner[i] == replica for dest in send for i in dest)
            moved += sum(lengths[i] for i in got)
            gathered += sum(n for n, o in zip(lengths, owner, strict=True) if o != replica)
        assert moved <= gathered  # an all-gather over dp moves every other replica's documents


def test_plan_capacity_holds_for_the_runtime_batches():
    """The scheduler pads as the runtime packs: every run's batch, padded to pad_multiple of its
    size (TP and sequence parallelism included), holds at most capacity tokens per rank."""
    rng = np.random.default_rng(1)
    for tp, sp in ((1, False), (4, False), (2, True), (4, True)):
        for _ in range(40):
            lengths = rng.integers(1, 200, int(rng.integers(1, 30))).tolist()
            plan = schedule(lengths, 8, 8, 64, COST, tp=tp, sequence_parallel=sp)
            for run in (r for slot in plan.slots for r in slot if r.seq_indices):
                docs = [Document(*(torch.zeros(lengths[i], dtype=torch.int64),) * 3, None)
                        for i in run.seq_indices]
                batch = pack_slot(docs, pad_multiple(run.size, tp, sp))
                assert batch.tokens.numel() // run.size <= 64, (tp, sp, run)


def _replicas(dp: int, seed: int):
    """dp replicas x 2 micro-batches of documents of 1 to 40 tokens; replica 0 carries loss
    weights, the others none (the flag must be agreed over the block)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    out = []
    for d in range(dp):
        mbs = []
        for _ in range(2):
            lens = rng.choice([1, 3, 7, 13, 25, 40], int(rng.integers(1, 4))).tolist()
            mb = packed_batch(lens, 64, pad_multiple=8, generator=gen)
            if d == 0:
                mb = dataclasses.replace(mb, loss_weight=torch.rand(mb.tokens.numel(),
                                                                    generator=gen))
            mbs.append(mb)
        out.append(mbs)
    return out


def _fields(batch):
    """The batch's tensors; no loss weight reads as 1 on real tokens, 0 on padding (what
    pack_slot gives a document without weights in a weighted batch)."""
    weight = batch.loss_weight
    if weight is None:
        weight = torch.zeros(batch.tokens.numel())
        for start, n in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.doc_lengths(), strict=True):
            weight[start:start + n] = 1.0
    return (batch.tokens, batch.labels, batch.position_ids, batch.cu_seqlens,
            batch.cu_seqlens_padded, weight)


def _worker(rank, world, cp, max_cp, steps):
    dims = ParallelDims.from_config(ParallelConfig(cp=cp, dynamic_cp=True, max_cp=max_cp), world)
    dims.build_groups(rank)
    dyn = DynamicCP(dims, CAPACITY, COST, max_cp, "ring")
    out = []
    for replicas in steps:
        slots, sizes = dyn.reschedule(replicas[dims.rank_in(Axis.DP)])
        out.append(([_fields(s.batch) for s in slots], [(s.cp.size, s.cp.rank) for s in slots],
                    sizes))
    return dims.rank_in(Axis.DP_CP), out


@pytest.mark.slow
def test_reschedule_moves_exactly_the_plan_documents():
    for world, cp, max_cp in LAYOUTS:
        steps = [_replicas(world // cp, seed) for seed in range(3)]
        results = run_distributed(_worker, world, args=(cp, max_cp, steps), timeout=300)
        for me, per_step in results:
            for replicas, (got, groups, sizes) in zip(steps, per_step, strict=True):
                docs = [d for replica in replicas for d in documents(replica)]
                plan = schedule([d.tokens.numel() for d in docs], world, max_cp, CAPACITY, COST)
                assert sizes == plan.cp_sizes_used
                want = [pack_slot([docs[i] for i in seqs], pad_multiple(run.size, 1))
                        for run, seqs in plan.assignment(me)]
                assert groups == [(run.size, me - run.first_rank) for run, _ in plan.assignment(me)]
                assert len(got) == len(want)
                for g, w in zip(got, want, strict=True):
                    for a, b in zip(g, _fields(w), strict=True):
                        assert torch.equal(a, b), (world, cp, me)
