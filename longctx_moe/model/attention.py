"""Grouped-query attention over packed documents, and the per-micro-batch document layout.

Padding choice: PackedBatch documents may be padded (cu_seqlens real, cu_seqlens_padded physical).
We hand the varlen kernel cu_q = cu_k = every real-document boundary interleaved with every
padding-run boundary, so each padding run is a segment of its own: padding never attends to a real
token and is never attended to, and the kernel needs no mask. Padding outputs are finite garbage
that no loss reads (their labels are -100 and the MoE statistics skip them).

Shapes: T physical tokens, N documents, S attention segments (documents + padding runs),
H query heads, G kv heads, R head dim, D model dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cp_attention.kernels import AttnKernel
from data_packing.batch import PackedBatch
from longctx_moe.compile import eager_only
from longctx_moe.execution import Ops
from longctx_moe.kernels import triton_ops
from longctx_moe.model.config import ModelConfig
from longctx_moe.model.layers import RMSNorm, apply_rope, rope_cos_sin
from longctx_moe.model.rope import RopeSpec, apply_partial_rope, rope_tables


@dataclass(frozen=True)
class DocLayout:
    """Everything the layers need to know about one micro-batch's documents, complete when built
    (doc_layout; a re-layout is a new value, dataclasses.replace). Only the RoPE cache fills in."""

    position_ids_T: torch.Tensor  # int64 [T]
    # int32 [S+1]: documents and padding runs, each its own segment, on the tokens' device: what
    # the attention kernels take (cp_attention.kernels: cu_q / cu_k live on q's device).
    cu_attn_S: torch.Tensor
    cu_attn_host_S: torch.Tensor  # the same bounds on the host, for planning (the same tensor on CPU)
    max_attn: int  # host int: the longest segment
    doc_id_T: torch.Tensor  # int64 [T]: document index, -1 at padding
    num_docs: int
    real_mask_T: torch.Tensor | None  # bool [T]; None when the micro-batch has no padding
    rope: dict = field(default_factory=dict)  # (head_dim, theta, dtype) -> (cos_TR, sin_TR)
    # How the layers talk to other ranks for this micro-batch; both None on one device. The
    # parallel runtime builds them into each micro-batch's layout (the CP group and plan differ
    # per call).
    # attend(q_THR, k_TGR, v_TGR, backend) -> out_THR replaces the local varlen kernel;
    # reduce_stats sums no-grad MoE statistics over the ranks that split these tokens.
    attend: Callable[..., torch.Tensor] | None = None
    reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Router replay: int [T, L_moe, K] experts to force per token and MoE layer (-1: route live).
    replay_TLK: torch.Tensor | None = None
    # With two micro-batches in flight, this one's turn (parallel/interleave.py's Turn): the MoE
    # layer hands it to the dispatcher, whose all-to-all waits let the other one compute.
    in_flight: Any = None
    # False when nobody reads the routers' aux and z losses (scoring log-probs): the MoE layers
    # then skip them, and with them their reductions over the ranks that split the tokens.
    balance_losses: bool = True

    def rope_tables(self, spec, dtype: torch.dtype):
        """cos, sin [T, R] of a RoPE variant (longctx_moe.model.rope.RopeSpec), cached."""
        key = (spec, dtype)
        if key not in self.rope:
            cos, sin = rope_tables(self.position_ids_T, spec)
            self.rope[key] = (cos.to(dtype), sin.to(dtype))
        return self.rope[key]

    def rope_cos_sin(self, head_dim: int, theta: float, dtype: torch.dtype):
        key = (head_dim, theta, dtype)
        if key not in self.rope:
            cos, sin = rope_cos_sin(self.position_ids_T, head_dim, theta)
            self.rope[key] = (cos.to(dtype), sin.to(dtype))
        return self.rope[key]


def doc_layout(batch: PackedBatch, *, doc_id_T: torch.Tensor | None = None, num_docs: int | None = None,
               attend: Callable[..., torch.Tensor] | None = None,
               reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None,
               replay_TLK: torch.Tensor | None = None) -> DocLayout:
    """The DocLayout of a PackedBatch, planned on its host bounds: nothing is read back from the
    device. The segment bounds and the document ids reach the tokens' device with one copy each;
    the real-token mask is computed there. `doc_id_T` (int64 [T], host) and `num_docs`: a CP
    shard's documents as numbered in the whole micro-batch (per-document statistics then sum one
    document's pieces across the group), else this batch's own; `attend`, `reduce_stats`,
    `replay_TLK`: see DocLayout."""
    dev = batch.tokens.device
    bounds_S = _segment_bounds(batch)
    seg_lens_S = bounds_S.diff()
    shard = doc_id_T is not None  # a CP shard: its pieces keep the micro-batch's document ids
    if not shard:
        doc_id_T, num_docs = batch.document_ids(), batch.num_docs
    own_T = doc_id_T.to(dev, non_blocking=True)
    masked = shard or _has_padding(batch)
    return DocLayout(
        position_ids_T=batch.position_ids,
        cu_attn_S=bounds_S.to(dev, non_blocking=True),
        cu_attn_host_S=bounds_S,
        max_attn=int(seg_lens_S.max()) if seg_lens_S.numel() else 0,
        doc_id_T=own_T,
        num_docs=num_docs,
        real_mask_T=(own_T >= 0) if masked else None,
        attend=attend, reduce_stats=reduce_stats, replay_TLK=replay_TLK,
    )


def _segment_bounds(batch: PackedBatch) -> torch.Tensor:
    """int32 [S+1] on the host: every document's start and real end, and the batch's end, sorted
    and without repeats, so each padding run is a segment of its own."""
    cu, cup = batch.cu_seqlens.long(), batch.cu_seqlens_padded.long()
    ends_N = cup[:-1] + cu.diff()
    return torch.unique(torch.cat([cup, ends_N, torch.tensor([batch.num_tokens])])).to(torch.int32)


def _has_padding(batch: PackedBatch) -> bool:
    """Any padding in the batch: a slot longer than its document, or tokens past the last slot."""
    cu, cup = batch.cu_seqlens, batch.cu_seqlens_padded
    return bool((cu.diff() != cup.diff()).any()) or int(cup[-1]) != batch.num_tokens


# Kept out of torch.compile: the varlen kernels plan buckets on the host (data-dependent shapes),
# and the context-parallel executors run collectives.
@eager_only
def attend(q_THR, k_TGR, v_TGR, layout: DocLayout, backend: AttnKernel, window: int | None = None,
           sink_H: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention inside each document of `layout`: out_THRv (input dtype); `window` a
    sliding window, `sink_H` [H] attention-sink logits (cp_attention.kernels.sinks), `scale`
    the softmax scale (default head_dim^-0.5)."""
    extras = {k: v for k, v in (("window", window), ("sink", sink_H), ("scale", scale))
              if v is not None}
    if layout.attend is not None:
        return layout.attend(q_THR, k_TGR, v_TGR, backend, **extras)
    from cp_attention.kernels import varlen_attention

    cu = layout.cu_attn_S
    out_THR, _lse_HT = varlen_attention(q_THR, k_TGR, v_TGR, cu, cu, layout.max_attn,
                                        layout.max_attn, causal=True, backend=backend, **extras)
    return out_THR


class Attention(nn.Module):
    """GQA self-attention with optional q/k RMSNorm and RoPE from position_ids. The norm runs per
    head (Qwen3: weight [R]) or over the whole projection (OLMoE: weight [H R] and [G R], one
    mean of squares per token); q, k and v may carry biases (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, ops: Ops | None = None):
        super().__init__()
        ops = Ops() if ops is None else ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        d, bias = cfg.hidden_size, cfg.qkv_bias
        self.wq = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=cfg.attention_out_bias)
        self._init_family_features(cfg, layer_idx)
        self.norm_full_width = cfg.qk_norm_scope == "full"
        q_width, k_width = ((cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
                            if self.norm_full_width else (cfg.head_dim, cfg.head_dim))
        self.q_norm = RMSNorm(q_width, cfg.norm_eps, ops.norm) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.norm_eps, ops.norm) if cfg.qk_norm else None
        self.backend = ops.attention  # an AttnKernel: backend, batch invariance, C++ kernels
        self.rope_impl = ops.rope  # torch | triton (q and k in one launch: kernels/triton_rope.py)

    def _init_family_features(self, cfg: ModelConfig, layer_idx: int) -> None:
        """Sinks (gpt-oss), this layer's sliding window, and a RoPE variant (partial rotary,
        YaRN); None / absent where the config asks for none, so plain models are unchanged."""
        self.window = cfg.window_of(layer_idx)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None
        plain = cfg.partial_rotary_factor == 1.0 and cfg.rope_scaling is None
        self.rope_spec = None if plain else RopeSpec.from_config(
            cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def _rotate(self, q_THR, k_TGR, layout: DocLayout):
        if self.rope_spec is None:
            cos_TR, sin_TR = layout.rope_cos_sin(self.head_dim, self.rope_theta, q_THR.dtype)
        else:
            cos_TR, sin_TR = layout.rope_tables(self.rope_spec, q_THR.dtype)
        if self.rope_impl == "triton":
            return triton_ops().rope(q_THR, k_TGR, cos_TR, sin_TR)
        if self.rope_spec is None:
            return apply_rope(q_THR, cos_TR, sin_TR), apply_rope(k_TGR, cos_TR, sin_TR)
        return apply_partial_rope(q_THR, cos_TR, sin_TR), apply_partial_rope(k_TGR, cos_TR, sin_TR)

    def _project(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_THR, k_TGR, v_TGR after the q/k norm (before RoPE)."""
        t = x_TD.shape[0]
        q_TX, k_TY, v_TY = self.wq(x_TD), self.wk(x_TD), self.wv(x_TD)
        if self.q_norm is not None and self.norm_full_width:
            q_TX, k_TY = self.q_norm(q_TX), self.k_norm(k_TY)
        # Head counts come from the weights so TP (which shards wq/wk/wv by heads) needs no edit here.
        q_THR, k_TGR = q_TX.view(t, -1, self.head_dim), k_TY.view(t, -1, self.head_dim)
        if self.q_norm is not None and not self.norm_full_width:
            q_THR, k_TGR = self.q_norm(q_THR), self.k_norm(k_TGR)
        return q_THR, k_TGR, v_TY.view(t, -1, self.head_dim)

    def forward(self, x_TD: torch.Tensor, layout: DocLayout) -> torch.Tensor:
        q_THR, k_TGR, v_TGR = self._project(x_TD)
        q_THR, k_TGR = self._rotate(q_THR, k_TGR, layout)
        out_THR = attend(q_THR, k_TGR, v_TGR, layout, self.backend, self.window, self.sinks)
        return self.wo(out_THR.reshape(x_TD.shape[0], -1))
