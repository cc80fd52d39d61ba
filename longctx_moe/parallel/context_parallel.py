"""Context parallelism applied to a built Transformer, through cp_attention's planner and executors.

Every CP rank of a DP replica receives the same (unsharded) PackedBatch. The model's forward is
wrapped: it plans the micro-batch (`cp_attention.plan.plan_cp`, pure, identical on every rank),
keeps this rank's tokens as a local PackedBatch whose "documents" are the plan's local pieces
(real tokens are a prefix of each piece, so padding stays masked), and runs the unchanged model
on it. Each attention's `attn_fn` is swapped for the configured executor (ring / ulysses /
hierarchical), which reads the plan of the current forward. Position ids come from the full
batch, so RoPE sees true positions; labels too, so the local CE sum is exact and the trainer's
sum over DP x CP gives the global loss.

Router statistics are exact too: each MoE layer's `reduce_stats` sums its counts over the CP
group (grad_reduce.stats_reducer), and `model.layout_fn` gives every local token the global id
of its document in the micro-batch (and the micro-batch's document count), so each rank's
aux / z loss is its share of the micro-batch's value and the shares sum to it over CP.
Legend: T tokens of the full micro-batch, L this rank's tokens, H heads, R head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from data_packing.batch import PackedBatch
from longctx_moe.model.attention import DocLayout, doc_layout
from longctx_moe.parallel.grad_reduce import stats_reducer


class _CPState:
    """The plan of the forward in flight, shared by the wrapped forward and the attn_fns, and
    this rank's global document ids (int64 [L], -1 at padding) and the micro-batch's doc count."""

    plan = None
    doc_id_L: torch.Tensor | None = None
    num_docs = 0


def global_doc_layout(state: _CPState, local: PackedBatch) -> DocLayout:
    """`Transformer.layout_fn` under CP: the local layout, with document ids and count of the
    whole micro-batch, so the per-document aux loss sums one document's pieces across CP."""
    layout = doc_layout(local)
    if state.doc_id_L is None or state.doc_id_L.shape[0] != local.num_tokens:
        raise RuntimeError("CP layout got tokens that the current plan does not describe: under "
                           "CP call model(batch) (it shards the batch)")
    layout.doc_id_T, layout.num_docs = state.doc_id_L, state.num_docs
    layout.real_mask_T = state.doc_id_L >= 0
    return layout


def shard_batch(batch: PackedBatch, plan, rank: int) -> PackedBatch:
    """This CP rank's tokens of `batch` as a PackedBatch of the plan's local pieces."""
    loc = lambda x: None if x is None else plan.shard(x, rank)
    real_L = plan.shard(batch.real_token_mask(), rank).cpu()
    bounds = plan.local_cu_seqlens[rank].tolist()
    pairs = zip(bounds[:-1], bounds[1:], strict=True)
    real_per_piece = torch.tensor([int(real_L[a:b].sum()) for a, b in pairs], dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), real_per_piece.cumsum(0)])
    cu_pad = torch.tensor(bounds, dtype=torch.int64)
    return PackedBatch(tokens=loc(batch.tokens), labels=loc(batch.labels),
                       cu_seqlens=cu.to(torch.int32).to(batch.tokens.device),
                       cu_seqlens_padded=cu_pad.to(torch.int32).to(batch.tokens.device),
                       position_ids=loc(batch.position_ids),
                       max_seqlen=int(real_per_piece.max()) if real_per_piece.numel() else 0,
                       loss_weight=loc(batch.loss_weight))


class CPAttention:
    """`Attention.attn_fn` under CP: (q_LHR, k_LGR, v_LGR, layout) -> out_LHR via the executor."""

    def __init__(self, state: _CPState, dims, backend: str = "auto"):
        self.state, self.dims, self.backend = state, dims, backend

    def __call__(self, q_LHR, k_LGR, v_LGR, layout) -> torch.Tensor:
        from cp_attention.ring import ring_attention
        from cp_attention.ulysses import hierarchical_attention, ulysses_attention

        plan, dims, kw = self.state.plan, self.dims, {"backend": self.backend}
        if plan is None or q_LHR.shape[0] != plan.local_tokens(dims.rank_in("cp")):
            raise RuntimeError("CP attention got tokens that the current plan does not describe: "
                               "under CP call model(batch) (it shards the batch), not "
                               "model.logits / hidden_states on a full batch")
        if dims.cp_backend == "ring":
            out, _ = ring_attention(q_LHR, k_LGR, v_LGR, plan, dims.group("cp"), **kw)
        elif dims.cp_backend == "ulysses":
            out, _ = ulysses_attention(q_LHR, k_LGR, v_LGR, plan, dims.group("cp"), **kw)
        else:
            out, _ = hierarchical_attention(q_LHR, k_LGR, v_LGR, plan, dims.group("cp_inner"),
                                            dims.group("cp_outer"), **kw)
        return out


def apply_context_parallel(model: nn.Module, dims) -> None:
    """Swap every attention's attn_fn for the CP executor, wrap model.forward to shard, and make
    the MoE statistics global to the micro-batch (layout_fn, reduce_stats over cp)."""
    from cp_attention.plan import plan_cp

    state = _CPState()
    for block in model.layers:
        backend = getattr(block.attn.attn_fn, "backend", "auto")
        block.attn.attn_fn = CPAttention(state, dims, backend)
    for layer in model.moe_layers():
        layer.reduce_stats = stats_reducer(dims)
    model.layout_fn = lambda local: global_doc_layout(state, local)
    sizes = [dims.cp_inner, dims.cp_outer] if dims.hierarchical else None
    cp_rank, full_forward = dims.rank_in("cp"), model.forward

    def forward(batch: PackedBatch):
        state.plan = plan_cp(batch.cu_seqlens, batch.cu_seqlens_padded, dims.cp,
                             hierarchical_sizes=sizes, num_tokens=batch.num_tokens)
        full = doc_layout(batch)
        state.doc_id_L, state.num_docs = state.plan.shard(full.doc_id_T, cp_rank), full.num_docs
        return full_forward(shard_batch(batch, state.plan, cp_rank))

    model.forward = forward  # instance attribute: nn.Module.__call__ dispatches to it
