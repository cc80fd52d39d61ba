"""Context parallelism for one micro-batch: plan it, keep this rank's tokens, build their layout.

Every rank of a CP group holds the same (unsharded) PackedBatch. `shard_for_cp` plans it on its
host bounds (`cp_attention.plan.plan_cp`, pure, identical on every rank; nothing is read back
from the device) and returns this rank's tokens as a local PackedBatch whose "documents" are the
plan's local pieces (real tokens are a prefix of each piece, so padding stays masked), with a
DocLayout whose `attend` runs the group's executor (ring / Ulysses / hierarchical) over this plan.
The unchanged model runs on it. Position ids come from the full batch, so RoPE sees true
positions; labels too, so the local CE sum is exact and the sum over the CP group is the
micro-batch's.

Router statistics stay exact: the layout's document ids are global to the micro-batch (with its
document count), and its `reduce_stats` sums the no-grad counts over the group, so each rank's
aux / z loss is its share of the micro-batch's value and the shares sum to it.

The group is an argument (`CPGroup`), not bound at set-up: the same model runs one micro-batch on
the full CP group and the next on a smaller one.
Legend: T tokens of the full micro-batch, L this rank's tokens, H heads, R head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from data_packing.batch import PackedBatch
from longctx_moe.model.attention import DocLayout, doc_layout


@dataclass(frozen=True)
class CPGroup:
    """The ranks that split one micro-batch's tokens, and how their attention talks.

    `group` spans them all (ring / Ulysses attention, router statistics); hierarchical attention
    runs all-to-all over `inner` (size sizes[0], inside a node) and the ring over `outer` (size
    sizes[1]). size 1: no CP."""

    size: int
    rank: int
    backend: str = "ring"  # ring | ulysses | hierarchical
    group: Any = None
    inner: Any = None
    outer: Any = None
    sizes: tuple[int, int] | None = None  # (inner, outer) for the hierarchical backend

    def __post_init__(self):
        # Callers hand `group` straight to collectives that read None as "nothing to talk to".
        if self.size == 1 and self.group is not None:
            raise ValueError("a one-rank CPGroup takes group=None (use NO_CP): there is no one to talk to")

    @property
    def hierarchical(self) -> bool:
        return self.backend == "hierarchical"


NO_CP = CPGroup(size=1, rank=0)


def shard_batch(batch: PackedBatch, plan, rank: int) -> PackedBatch:
    """This CP rank's tokens of `batch` as a PackedBatch of the plan's local pieces: the token
    tensors stay on their device, the local bounds are computed on the host from the host mask."""
    loc = lambda x: None if x is None else plan.shard(x, rank)
    real_L = plan.shard(batch.real_token_mask(), rank)
    bounds = plan.local_cu_seqlens[rank].tolist()
    pairs = zip(bounds[:-1], bounds[1:], strict=True)
    real_per_piece = torch.tensor([int(real_L[a:b].sum()) for a, b in pairs], dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), real_per_piece.cumsum(0)])
    return PackedBatch(tokens=loc(batch.tokens), labels=loc(batch.labels),
                       cu_seqlens=cu.to(torch.int32),
                       cu_seqlens_padded=torch.tensor(bounds, dtype=torch.int32),
                       position_ids=loc(batch.position_ids),
                       max_seqlen=int(real_per_piece.max()) if real_per_piece.numel() else 0,
                       loss_weight=loc(batch.loss_weight))


class CPAttend:
    """`DocLayout.attend` under CP: (q_LHR, k_LGR, v_LGR, backend) -> out_LHR through the
    group's executor, over the plan of this micro-batch."""

    def __init__(self, plan, cp: CPGroup):
        self.plan, self.cp = plan, cp

    def __call__(self, q_LHR, k_LGR, v_LGR, backend: str, window: int | None = None,
                 sink=None, scale: float | None = None) -> torch.Tensor:
        from cp_attention.ring import ring_attention
        from cp_attention.ulysses import hierarchical_attention, ulysses_attention

        plan, cp = self.plan, self.cp
        if q_LHR.shape[0] != plan.local_tokens(cp.rank):
            raise RuntimeError(f"CP attention got {q_LHR.shape[0]} tokens but this rank's plan holds "
                               f"{plan.local_tokens(cp.rank)}; run the model on the shard the "
                               "runtime made (runtime.shard), not on the full batch")
        extras = dict(backend=backend, window=window, sink=sink, scale=scale)
        if cp.backend == "ring":
            out, _ = ring_attention(q_LHR, k_LGR, v_LGR, plan, cp.group, **extras)
        elif cp.backend == "ulysses":
            out, _ = ulysses_attention(q_LHR, k_LGR, v_LGR, plan, cp.group, **extras)
        else:
            out, _ = hierarchical_attention(q_LHR, k_LGR, v_LGR, plan, cp.inner, cp.outer,
                                            **extras)
        return out


def shard_for_cp(batch: PackedBatch, cp: CPGroup, reduce_stats=None,
                 replay_TLK: torch.Tensor | None = None) -> tuple[PackedBatch, DocLayout, Any]:
    """(this rank's local batch, its layout, the plan) of `batch` split over `cp` (size > 1).

    The layout's document ids and count are the whole micro-batch's, so per-document statistics
    sum one document's pieces across the group (with `reduce_stats`); `replay_TLK` (int
    [T, L_moe, K] of the whole micro-batch) is sharded with the tokens."""
    from cp_attention.plan import plan_cp

    plan = plan_cp(batch.cu_seqlens, batch.cu_seqlens_padded, cp.size,
                   hierarchical_sizes=list(cp.sizes) if cp.hierarchical else None,
                   num_tokens=batch.num_tokens)
    local = shard_batch(batch, plan, cp.rank)
    replay = None if replay_TLK is None else plan.shard(
        replay_TLK.to(batch.tokens.device, non_blocking=True), cp.rank)
    layout = doc_layout(local, doc_id_T=plan.shard(batch.document_ids(), cp.rank),
                        num_docs=batch.num_docs, attend=CPAttend(plan, cp),
                        reduce_stats=reduce_stats, replay_TLK=replay)
    return local, layout, plan
